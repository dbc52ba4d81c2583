"""File size and accuracy of each TFLite quantization mode on digits (sizes, not timings).

Trains a 64-128-64-10 MLP on scikit-learn's digits (1437 train / 360 test), exports it with
every `kp.export_tflite` quantization mode, and reports per mode: file bytes, gzip bytes, test
accuracy in the TFLite interpreter, and argmax agreement with the Keras model. Also prints
`kp.compression_report` totals for the Keras model before and after 80 % magnitude pruning of
its kernels (numpy, one-shot) to show what gzip sees.

    KERAS_BACKEND=tensorflow python -m benchmarks.export_sizes [--json PATH]

Not a `bench_*` script: there is no timing here, so no ABBA and no ratio to a baseline.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_perf as kp  # noqa: E402

from . import _harness  # noqa: E402

digits = _harness.digits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON to PATH")
    args = p.parse_args()

    keras.utils.set_random_seed(0)
    (x, y), (xv, yv) = digits()
    model = _harness.mlp([128, 64], optimizer=keras.optimizers.Adam(1e-3))
    model.fit(x, y, batch_size=64, epochs=30, verbose=0)
    logits = model.predict(xv, verbose=0)
    keras_acc = float(np.mean(logits.argmax(1) == yv))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in (None, "dynamic", "float16", "int8"):
            path = os.path.join(tmp, f"m_{mode}.tflite")
            data = x[:200] if mode == "int8" else None
            report = kp.export_tflite(model, path, mode, representative_data=data)
            out = kp.tflite_predict(path, xv)
            with open(path, "rb") as f:
                gz = len(gzip.compress(f.read(), compresslevel=9, mtime=0))
            rows.append(
                {
                    "quantization": str(mode),
                    "io": f"{report['input_dtype']}/{report['output_dtype']}",
                    "bytes": report["bytes"],
                    "gzip_bytes": gz,
                    "accuracy": float(np.mean(out.argmax(1) == yv)),
                    "agreement": float(np.mean(out.argmax(1) == logits.argmax(1))),
                }
            )

    before = kp.compression_report(model)["total"]
    for layer in model.layers:
        w = keras.ops.convert_to_numpy(layer.kernel.value).copy()
        w[np.abs(w) < np.quantile(np.abs(w), 0.8)] = 0.0
        layer.kernel.assign(w)
    after = kp.compression_report(model)["total"]
    pruned_acc = float(np.mean(model.predict(xv, verbose=0).argmax(1) == yv))

    print(
        f"backend {keras.backend.backend()}, keras {keras.__version__}, "
        f"Keras test accuracy {keras_acc:.4f}, params {before['params']}"
    )
    print(f"{'mode':>8} {'in/out':>15} {'bytes':>8} {'gzip':>8} {'accuracy':>9} {'agree':>7}")
    for r in rows:
        print(
            f"{r['quantization']:>8} {r['io']:>15} {r['bytes']:>8} {r['gzip_bytes']:>8} "
            f"{r['accuracy']:>9.4f} {r['agreement']:>7.4f}"
        )
    for name, t in (("dense", before), ("pruned 80%", after)):
        print(
            f"compression_report {name:>10}: params {t['params']} nonzero {t['nonzero']} "
            f"bytes {t['bytes']} gzip {t['gzip_bytes']} (x{t['compression_ratio']:.2f})"
        )
    print(f"accuracy after one-shot 80% pruning (no fine-tuning): {pruned_acc:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "keras_accuracy": keras_acc,
                    "modes": rows,
                    "dense": before,
                    "pruned": after,
                    "pruned_accuracy": pruned_acc,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
