"""Quantization-aware training: step time against float, and accuracy on digits.

Claims (docs/quantization.md):
1. One compiled train step of the `kp.quantize_aware` model vs the float model's, alternated
   step by step (a small CNN on the 8x8 digits, batch 32): target <= 1.5x.
2. Accuracy on digits (360 held-out images) of the same CNN: float; Keras'
   `model.quantize("int8")` and `"int4"` (post-training, weights only); TFLite post-training
   int8 (`kp.export_tflite(..., "int8")` calibrated on 200 training images, run by the
   interpreter); ours at 8 and 4 weight bits after fine-tuning for the same epochs as the
   float model was trained, run by Keras and (8 bits) by the interpreter from the int8 file.
   Mean and min-max over seeds (3 seeds, 1 with `--quick`).

Run:

    KERAS_BACKEND=tensorflow python benchmarks/bench_qat.py [--quick] [--json out.json]
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras  # noqa: E402
import numpy as np  # noqa: E402
from _harness import digits, finish, interleaved, one_step, parse_args, row  # noqa: E402

import keras_perf as kp  # noqa: E402

BATCH = 32
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 1), name="image")
    h = keras.layers.Conv2D(16, 3, padding="same")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


def compile_(model, lr=1e-3):
    model.compile(keras.optimizers.Adam(lr), LOSS, metrics=["accuracy"])
    return model


def accuracy(pred, y):
    return float((np.asarray(pred).argmax(1) == y).mean())


def step_time(x, y, steps):
    xb, yb = x[:BATCH], y[:BATCH]
    plain = compile_(cnn(0))
    qat = compile_(kp.quantize_aware(cnn(0)))
    for m in (plain, qat):
        m.fit(xb, yb, epochs=1, verbose=0)
    res = interleaved(one_step(plain, xb, yb), one_step(qat, xb, yb), steps)
    return row(
        "QAT step / float step (CNN, batch 32)",
        res,
        "<= 1.5",
        note=f"float step {res['step_ms']:.2f} ms",
    )


def accuracy_rows(x, y, xv, yv, seeds, epochs):
    table = {}
    for seed in seeds:
        model = compile_(cnn(seed))
        model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
        acc = {"float": accuracy(model.predict(xv, verbose=0), yv)}
        for mode in ("int8", "int4"):
            ptq = keras.models.clone_model(model)
            ptq.set_weights(model.get_weights())
            try:
                with warnings.catch_warnings():  # "Layer Flatten has no `quantize`"...
                    warnings.simplefilter("ignore", UserWarning)
                    ptq.quantize(mode)
                acc[f"keras quantize('{mode}')"] = accuracy(ptq.predict(xv, verbose=0), yv)
            except Exception as e:  # not every backend/Keras version has every mode
                print(f"keras quantize({mode!r}) failed: {type(e).__name__}: {e}")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ptq.tflite")
            kp.export_tflite(model, path, "int8", representative_data=x[:200])
            acc["tflite post-training int8"] = accuracy(kp.tflite_predict(path, xv), yv)
            for bits in (8, 4):
                qat = compile_(kp.quantize_aware(model, weight_bits=bits), lr=3e-4)
                qat.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
                acc[f"ours QAT w{bits}a8 (keras)"] = accuracy(qat.predict(xv, verbose=0), yv)
                if bits == 8:
                    qpath = os.path.join(tmp, "qat.tflite")
                    kp.export_tflite(qat, qpath, "int8")
                    acc["ours QAT w8a8 (tflite int8)"] = accuracy(kp.tflite_predict(qpath, xv), yv)
        for k, v in acc.items():
            table.setdefault(k, []).append(v)
    rows = []
    for k, v in table.items():
        rows.append(
            {
                "claim": f"digits accuracy: {k}",
                "backend": keras.backend.backend(),
                "wall_ratio": round(float(np.mean(v)), 4),
                "cpu_ratio": None,
                "wall_spread": [round(min(v), 4), round(max(v), 4)],
                "cpu_spread": [],
                "repeats": len(v),
                "target": "report",
                "note": "accuracy (mean, min-max over seeds)",
            }
        )
    return rows


def main():
    args = parse_args(__doc__.splitlines()[0])
    (x, y), (xv, yv) = digits()
    x, xv = x.reshape(-1, 8, 8, 1), xv.reshape(-1, 8, 8, 1)
    rows = [step_time(x, y, 100 if args.quick else 600)]
    seeds = [0] if args.quick else [0, 1, 2]
    rows += accuracy_rows(x, y, xv, yv, seeds, epochs=2 if args.quick else 10)
    finish(rows, args)


if __name__ == "__main__":
    main()
