"""Inference: ONNX int8 against ONNX float (and Keras), shrink + int8, and int8 accuracy.

Claims (docs/export.md "ONNX", docs/BENCHMARKS.md "Inference"):
1. The CNN of the issue (Conv 64 - Conv 64 - MaxPool - Conv 128 - GlobalAveragePooling -
   Dense 10, ReLU, 32x32x3 inputs): ONNX Runtime int8 (`kp.export_onnx(..., "int8")`, QDQ,
   per channel) against the float ONNX file, per call at batch 64 (target >= 1.5x, i.e. a
   time ratio <= 0.67) and at batch 1 (>= 1.3x, <= 0.77).
2. The same CNN with half of every Conv's filters removed (`kp.shrink` after zeroing them, as
   channel pruning leaves them) exported int8, against the original float file at batch 64:
   target >= 3x (<= 0.33).
3. Keras `predict_on_batch` against the float file (reference rows, no target; not in
   `--quick`, where the report's table gives Keras' latency).
4. Where TensorFlow is installed (every backend: TFLite files are converted in a TensorFlow
   child process on JAX and torch): TFLite int8 (`kp.export_tflite(..., "int8",
   int8_io=False)`, calibrated) against TFLite float, per call at batch 64 and 1 (reference
   rows, no target), both on `os.cpu_count()` interpreter threads.
5. Accuracy on digits (1437 train / 360 held out) of an MLP 64-64-32-10 trained 20 epochs:
   float, ONNX int8 (calibrated on 200 training images), ONNX int8 from `kp.quantize_aware`
   (fine-tuned 2 epochs; learned ranges). Target: int8 within 1 point of float (a ratio
   >= 0.99 of float's accuracy). The report's table (every format, latency and accuracy on the
   360 held-out images) is printed for the float MLP and for the QAT one.
Without `--quick`, MobileNetV2 (alpha 0.35, 96x96, random weights, no download) is timed too
(claims 1 and 4 without targets; Keras' latency only in the report's table).

Timing: ONNX Runtime sessions with thread spinning off (`session.intra_op.allow_spinning =
"0"`), all cores; each unit of work is a block of calls (10 at batch 1, 2 at batch 64);
baseline and candidate alternate A B B A with a 50 ms pause between blocks, `REPEATS` times;
the median ratio of wall and of process CPU time. The absolute per-call latencies come from
`kp.inference_report` (p50/p90), printed before the ratios.

Run:

    KERAS_BACKEND=torch python -m benchmarks.bench_inference [--quick | --smoke] [--json out.json]
"""

from __future__ import annotations

import os
import tempfile
import time

import keras
import numpy as np

import keras_perf as kp
from keras_perf.export import _onnx_session
from keras_perf.export import _tflite_lib as _tflite
from keras_perf.export._inference_report import available_formats
from keras_perf.export._onnx_predict import feeds

from ._harness import digits, finish, mlp, parse_args, row, summarize, timed

PAUSE = 0.05


def cnn(seed=0, width=1.0):
    keras.utils.set_random_seed(seed)
    c = [int(64 * width), int(64 * width), int(128 * width)]
    inp = keras.Input((32, 32, 3), name="image")
    h = keras.layers.Conv2D(c[0], 3, padding="same", activation="relu")(inp)
    h = keras.layers.Conv2D(c[1], 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(c[2], 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


def halved(model):
    """`model` with the first half of every Conv's filters zeroed (kernel, bias and the next
    layer's input slice), then `kp.shrink`: what channel pruning at 50 % leaves."""
    layers = [la for la in model.layers if la.weights]
    for conv, nxt in zip(layers, layers[1:]):
        if not isinstance(conv, keras.layers.Conv2D):
            continue
        drop = np.arange(conv.filters // 2)
        k, b = (keras.ops.convert_to_numpy(w).copy() for w in (conv.kernel, conv.bias))
        k[..., drop], b[drop] = 0.0, 0.0
        conv.kernel.assign(k)
        conv.bias.assign(b)
        k2 = keras.ops.convert_to_numpy(nxt.kernel).copy()
        if k2.ndim == 4:
            k2[:, :, drop, :] = 0.0
        else:
            k2[drop, :] = 0.0
        nxt.kernel.assign(k2)
    return kp.shrink(model)


def block(sess, x, calls):
    f = feeds(sess, x)

    def run():
        for _ in range(calls):
            sess.run(None, f)

    return run


def tflite_block(content, x, calls):
    """`calls` invocations of a float-in TFLite interpreter on `x` (tensors set once)."""
    interp = _tflite.interpreter(content, num_threads=os.cpu_count(), allocate=False)
    inp = interp.get_input_details()[0]
    interp.resize_tensor_input(inp["index"], list(x.shape), strict=False)
    interp.allocate_tensors()
    interp.set_tensor(inp["index"], x.astype(inp["dtype"]))

    def run():
        for _ in range(calls):
            interp.invoke()

    return run


def tflite_files(model, x, tmp, name):
    """{"float": bytes, "int8": bytes} of `model`'s TFLite files, or {} without TensorFlow."""
    if "tflite" not in available_formats(model):
        return {}
    files = {}
    for tag, q in (("float", None), ("int8", "int8")):
        path = os.path.join(tmp, f"{name}-{tag}.tflite")
        try:
            kp.export_tflite(model, path, q, representative_data=x if q else None, int8_io=False)
        except ValueError as e:  # MobileNetV2 on JAX: the int8 file is refused (float tensors)
            print(f"{name}: no TFLite rows, the {tag} export failed: {e}", flush=True)
            return {}
        files[tag] = open(path, "rb").read()
    return files


def abba_paused(baseline, candidate, repeats):
    """`_harness.abba` with a pause before each timed block (spinning threads settle)."""
    wall, cpu = [], []
    for _ in range(repeats):
        t = []
        for fn in (baseline, candidate, candidate, baseline):
            time.sleep(PAUSE)
            t.append(timed(fn))
        wall.append((t[1][0] + t[2][0]) / (t[0][0] + t[3][0]))
        cpu.append((t[1][1] + t[2][1]) / max(t[0][1] + t[3][1], 1e-9))
    return summarize(wall, cpu)


def add(rows, r):
    """Append row `r` and print it at once (a run cut short keeps what it measured)."""
    rows.append(r)
    print("row:", r, flush=True)


def speed_rows(name, model, small, repeats, tmp, shrunk=None, keras_rows=True, smoke=False):
    x = np.random.default_rng(0).random((64, *model.input_shape[1:]), dtype=np.float32)
    paths = {}
    for tag, m, q in (("float", model, None), ("int8", model, "int8")) + (
        (("shrunk-int8", shrunk, "int8"),) if shrunk is not None else ()
    ):
        paths[tag] = os.path.join(tmp, f"{name}-{tag}.onnx")
        kp.export_onnx(m, paths[tag], q, representative_data=x if q else None)
    sess = {tag: _onnx_session.session(p, os.cpu_count()) for tag, p in paths.items()}
    tflite = tflite_files(model, x, tmp, name.split()[0])
    formats = [f for f in available_formats(model) if tflite or not f.startswith("tflite")]
    if smoke:  # the report's int8 and TFLite conversions run again in accuracy_rows' reports
        formats = [f for f in formats if f in ("keras", "onnx")]
    report = kp.inference_report(model, x, batch_sizes=(1, 64), formats=formats, repeats=repeats)
    print(f"{name}:", report, flush=True)
    rows = []
    for b, calls, target in ((64, 2, "<= 0.67"), (1, 10, "<= 0.77")):
        xb = x[:b]
        for s in sess.values():  # warm-up
            s.run(None, feeds(s, xb))
        r = abba_paused(block(sess["float"], xb, calls), block(sess["int8"], xb, calls), repeats)
        add(rows, row(f"{name}: ONNX int8 / ONNX float, batch {b}", r, target if small else "-"))
        if b == 64 and shrunk is not None:
            r = abba_paused(
                block(sess["float"], xb, calls), block(sess["shrunk-int8"], xb, calls), repeats
            )
            add(rows, row(f"{name}: shrink 50% + int8 / float ONNX, batch {b}", r, "<= 0.33"))
        if tflite:
            r = abba_paused(
                tflite_block(tflite["float"], xb, calls),
                tflite_block(tflite["int8"], xb, calls),
                repeats,
            )
            add(rows, row(f"{name}: TFLite int8 / TFLite float, batch {b}", r, "-"))
        if not keras_rows:  # The report's table above has Keras' latency.
            continue
        n_keras = max(calls // 2, 1)

        def keras_call(xb=xb, n=n_keras):
            return [model.predict_on_batch(xb) for _ in range(n)]

        keras_call()
        r = abba_paused(keras_call, block(sess["float"], xb, n_keras), repeats)
        add(rows, row(f"{name}: ONNX float / Keras predict_on_batch, batch {b}", r, "-"))
    return rows


def accuracy_rows(tmp, quick, smoke=False):
    (x, y), (xv, yv) = digits()
    calibration = x[:32] if smoke else x[:200]
    model = mlp([64, 32], seed=0, functional=True, optimizer=keras.optimizers.Adam(3e-3))
    model.fit(x, y, epochs=2 if smoke else 10 if quick else 20, batch_size=64, verbose=0)
    acc = lambda out: float((np.asarray(out).argmax(1) == yv).mean())  # noqa: E731
    base = acc(model.predict(xv, verbose=0))
    p = os.path.join(tmp, "mlp-int8.onnx")
    kp.export_onnx(model, p, "int8", representative_data=calibration)
    ptq = acc(kp.onnx_predict(p, xv))
    qat = kp.quantize_aware(model)
    qat.compile(keras.optimizers.Adam(3e-4), keras.losses.SparseCategoricalCrossentropy(True))
    qat.fit(x, y, epochs=1 if smoke else 2, batch_size=32, verbose=0)
    q = os.path.join(tmp, "mlp-qat.onnx")
    kp.export_onnx(qat, q, "int8")
    from_qat = acc(kp.onnx_predict(q, xv))
    note = f"float {base:.4f}, PTQ int8 {ptq:.4f}, QAT int8 {from_qat:.4f}"
    print("digits MLP accuracy:", note)
    repeats = 1 if smoke else 3 if quick else 7
    for tag, m in (("float", model), ("QAT", qat)):
        report = kp.inference_report(
            m, xv, yv, (1, 64), representative_data=calibration, repeats=repeats
        )
        print(f"digits MLP ({tag}):", report)
    return [
        row(
            "digits MLP: ONNX int8 (PTQ) accuracy / float",
            {"wall_ratio": ptq / base},
            ">= 0.99",
            note=note,
        ),
        row(
            "digits MLP: ONNX int8 (QAT) accuracy / float",
            {"wall_ratio": from_qat / base},
            ">= 0.99",
        ),
    ]


def main():
    args = parse_args(__doc__.splitlines()[0])
    repeats = 1 if args.smoke else 3 if args.quick else 7  # --smoke (CI): one of each
    print("load:", os.getloadavg())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # --smoke (CI): the CNN a quarter as wide (16-16-32 filters), its report on Keras and
        # float ONNX alone, the digits MLP calibrated on 32 images: the same rows.
        model = cnn(width=0.25 if args.smoke else 1.0)
        model(np.zeros((1, 32, 32, 3), "float32"))
        shrunk_source = keras.models.clone_model(model)
        shrunk_source.set_weights(model.get_weights())
        rows += speed_rows(
            "CNN 32x32",
            model,
            True,
            repeats,
            tmp,
            halved(shrunk_source),
            not args.quick,
            smoke=args.smoke,
        )
        rows += accuracy_rows(tmp, args.quick, args.smoke)
        if not args.quick:
            mobile = keras.applications.MobileNetV2(
                input_shape=(96, 96, 3), alpha=0.35, weights=None, classes=10
            )
            # No Keras ratio rows: Keras on torch took 5 s per call at batch 1 under load (the
            # report's table gives Keras' latency).
            rows += speed_rows("MobileNetV2 0.35 96x96", mobile, False, repeats, tmp, None, False)
    print("load:", os.getloadavg())
    finish(rows, args)


if __name__ == "__main__":
    main()
