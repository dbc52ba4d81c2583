"""ONNX int8 from quantization-aware training against post-training quantization, on a model
where post-training quantization loses accuracy.

Claim (docs/export.md "ONNX", docs/BENCHMARKS.md "Inference"): on digits (1437 train / 360
held-out 8x8 images), the small CNN of `bench_qat` (Conv 4 -BN-ReLU, Conv 8 -ReLU, MaxPool,
Dense 16 -ReLU, Dense 10; the smallest model of the QAT study on which 4-bit post-training
quantization loses accuracy), trained `EPOCHS` epochs, then:

- post-training (PTQ) ONNX files of the float model, calibrated on 200 training images:
  `kp.export_onnx(..., "int8")` (8-bit weights per channel) and, with ONNX Runtime's
  `quantize_static` on the same pre-processed graph, 4-bit weights (`QuantType.QInt4`, per
  channel and per tensor; uint8 activations). `export_onnx` has no 4-bit mode (the API takes
  a `quantization` name only), hence ORT's own call here;
- `kp.quantize_aware(model, weight_bits=4)` (per channel, and per tensor), fine-tuned `EPOCHS`
  epochs (Adam 3e-4), exported by `kp.export_onnx(qat, path, "int8")` from its learned
  ranges (its 4-bit weights stored as int8);
- the control: the float model trained as many epochs again, and its 4-bit PTQ file (the QAT
  rows had that much more training).

Accuracy of each ONNX file in ONNX Runtime, mean and min-max over 3 seeds (1 with `--quick`).
Target: QAT 4-bit file >= PTQ 4-bit file (same granularity), on the mean and on every seed.

Run:

    KERAS_BACKEND=tensorflow python -m benchmarks.bench_onnx_qat [--quick | --smoke] [--json out.json]
"""

from __future__ import annotations

import os
import tempfile

import keras
import numpy as np

import keras_perf as kp
from keras_perf.export import _onnx_export, _onnx_quantize

from ._harness import accuracy_row, digits, finish, parse_args
from .bench_qat import BATCH, EPOCHS, FINE_TUNE_LR, accuracy, cnn, compile_

CALIBRATION = 200


def ptq_4bit(float_path, out, x, per_channel):
    """ONNX Runtime's static quantization of `float_path` with 4-bit weights (QDQ)."""
    from onnxruntime import quantization as q

    prepared = out + ".prepared.onnx"
    _onnx_quantize.pre_process(float_path, prepared)
    with _onnx_export.quiet_logs():
        q.quantize_static(
            prepared,
            out,
            _onnx_quantize.CalibrationReader([x], ["image"]),
            quant_format=q.QuantFormat.QDQ,
            per_channel=per_channel,
            activation_type=q.QuantType.QUInt8,
            weight_type=q.QuantType.QInt4,
        )
    return out


def file_accuracy(path, xv, yv):
    return accuracy(kp.onnx_predict(path, xv), yv)


def ptq_rows(model, x, xv, yv, tmp, prefix=""):
    acc = {}
    fp = os.path.join(tmp, "float.onnx")
    kp.export_onnx(model, fp)
    acc[f"{prefix}float (ONNX file)"] = file_accuracy(fp, xv, yv)
    if not prefix:
        p8 = os.path.join(tmp, "ptq8.onnx")
        kp.export_onnx(model, p8, "int8", representative_data=x[:CALIBRATION])
        acc["PTQ w8a8 per channel (kp.export_onnx)"] = file_accuracy(p8, xv, yv)
    for per_channel, name in ((True, "per channel"), (False, "per tensor")):
        path = ptq_4bit(fp, os.path.join(tmp, "ptq4.onnx"), x[:CALIBRATION], per_channel)
        acc[f"{prefix}PTQ w4a8 {name} (ORT QInt4)"] = file_accuracy(path, xv, yv)
    return acc


def one_seed(x, y, xv, yv, seed, epochs, tmp):
    model = compile_(cnn(keras.layers, seed))
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    acc = ptq_rows(model, x, xv, yv, tmp)
    for per_channel, name in ((True, "per channel"), (False, "per tensor")):
        keras.utils.set_random_seed(seed)
        qat = kp.quantize_aware(model, weight_bits=4, per_channel=per_channel)
        qat = compile_(qat, FINE_TUNE_LR)
        qat.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
        path = os.path.join(tmp, "qat.onnx")
        kp.export_onnx(qat, path, "int8")
        acc[f"QAT w4a8 {name} (Keras)"] = accuracy(qat.predict(xv, verbose=0), yv)
        acc[f"QAT w4a8 {name} (kp.export_onnx int8 file)"] = file_accuracy(path, xv, yv)
    keras.utils.set_random_seed(seed)
    more = compile_(keras.models.clone_model(model), FINE_TUNE_LR)
    more.set_weights(model.get_weights())
    more.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    acc.update(ptq_rows(more, x, xv, yv, tmp, prefix=f"control (+{epochs} epochs) "))
    return acc


def main():
    args = parse_args(__doc__.splitlines()[0])
    (x, y), (xv, yv) = digits()
    x, xv = x.reshape(-1, 8, 8, 1), xv.reshape(-1, 8, 8, 1)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    seeds = [0] if args.quick else [0, 1, 2]
    epochs = 1 if args.smoke else 2 if args.quick else EPOCHS
    if args.smoke:  # CI: 1 epoch on 512 training images (16 steps), the same rows
        x, y = x[:512], y[:512]
    table: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            acc = one_seed(x, y, xv, yv, seed, epochs, tmp)
            print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in acc.items()), flush=True)
            for k, v in acc.items():
                table.setdefault(k, []).append(v)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    float_mean = float(np.mean(table["float (ONNX file)"]))
    rows = []
    for k, v in table.items():
        target, note = "report", ""
        if k.startswith("QAT") and "file" in k:
            kind = "w4a8 " + k.split("w4a8 ")[1].split(" (")[0] + " (ORT QInt4)"
            ptq, control = table["PTQ " + kind], table[f"control (+{epochs} epochs) PTQ " + kind]
            wins = sum(a >= b for a, b in zip(v, ptq))
            target = ">= PTQ w4a8 (same granularity), every seed"
            note = (
                f"vs PTQ: {np.mean(v) - np.mean(ptq):+.4f}, >= on {wins}/{len(v)} seeds; "
                f"vs the control's PTQ: {np.mean(v) - np.mean(control):+.4f}; "
            )
        note += f"accuracy mean (min-max); vs float {np.mean(v) - float_mean:+.4f}"
        rows.append(accuracy_row(f"digits accuracy: {k}", v, target, note))
    finish(rows, args)


if __name__ == "__main__":
    main()
