"""Quantization-aware training: accuracy on digits where post-training quantization loses,
and step time against float.

Claims (docs/quantization.md, "Results"):
1. Accuracy on digits (1437 train / 360 held-out 8x8 images) of a small CNN (Conv 4 -BN-ReLU,
   Conv 8 -ReLU, MaxPool, Dense 16 -ReLU, Dense 10), the smallest of those tried on which
   4-bit post-training quantization loses accuracy (docs/quantization.md lists the others).
   Rows: float (trained `EPOCHS` epochs); the float model trained as many epochs again (the
   control for the fine-tuning the QAT rows get); Keras' `model.quantize("int8")` and
   `"int4"` (post-training, weights of Dense layers only: Keras 3.15 has no Conv quantize);
   TFLite post-training int8 via `kp.export_tflite(..., "int8", representative_data=...)`
   (200 training images, per-channel) and the same converter with per-tensor weights; tfmot's
   `quantize_model` on a tf_keras twin with the same weights, fine-tuned `EPOCHS` epochs,
   accuracy of its TFLite int8 file; ours (`kp.quantize_aware`) at 8 and 4 weight bits
   fine-tuned `EPOCHS` epochs, by Keras and by the interpreter from the int8 file. QAT and
   the control use Adam 3e-4, batch 32. Mean and min-max over 3 seeds (1 with `--quick`).
   Targets: ours within 1 point of float at 8 and at 4 weight bits; ours at 8 bits not below
   tfmot's by more than the seed-to-seed spread.
2. One compiled train step of the QAT model against the float model's, alternated step by
   step (benchmarks/_harness.py `interleaved`), batch 32, for the CNN of claim 1 and a wider
   one (Conv 16 -BN-ReLU, Conv 32 -ReLU, MaxPool, Dense 64, Dense 10); on TensorFlow, tfmot's
   QAT step against tf_keras' float step on the same architectures, as reference. Target
   <= 1.5x.

Run:

    KERAS_BACKEND=tensorflow python -m benchmarks.bench_qat [--quick] [--json out.json]

tfmot rows need the TensorFlow backend (tfmot runs on tf_keras); the other rows run on every
backend (the int8 files are written through a TensorFlow child process on JAX and PyTorch).
"""

from __future__ import annotations

import os
import tempfile
import warnings

import keras
import numpy as np

import keras_perf as kp

from ._harness import accuracy_row, digits, finish, interleaved, one_step, parse_args, row

BATCH = 32
EPOCHS = 10
FINE_TUNE_LR = 3e-4
SIZES = {"small": (4, 8, 16), "wide": (16, 32, 64)}


def cnn(L, seed, size="small"):
    """The CNN with layer module `L` (keras.layers, or tf_keras.layers for the tfmot twin)."""
    c1, c2, d = SIZES[size]
    if seed is not None:
        keras.utils.set_random_seed(seed)
    inp = L.Input((8, 8, 1), name="image")
    h = L.Conv2D(c1, 3, padding="same")(inp)
    h = L.BatchNormalization()(h)
    h = L.ReLU()(h)
    h = L.Conv2D(c2, 3, padding="same", activation="relu")(h)
    h = L.MaxPooling2D()(h)
    h = L.Flatten()(h)
    h = L.Dense(d, activation="relu")(h)
    out = L.Dense(10)(h)
    return (keras.Model if L is keras.layers else _tf_keras().Model)(inp, out)


def _tf_keras():
    import tf_keras

    return tf_keras


def compile_(model, lr=1e-3, k=keras):
    model.compile(
        k.optimizers.Adam(lr),
        k.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def accuracy(pred, y):
    return float((np.asarray(pred).argmax(1) == y).mean())


def tfmot_twin(model, seed):
    """tfmot's `quantize_model` on a tf_keras copy of `model` (same weights), compiled."""
    import tensorflow_model_optimization as tfmot

    tfk = _tf_keras()
    twin = cnn(tfk.layers, None)
    twin.set_weights(model.get_weights())
    qat = tfmot.quantization.keras.quantize_model(twin)
    return compile_(qat, FINE_TUNE_LR, tfk)


def tfmot_tflite(qat):
    """TFLite int8 bytes of a tfmot QAT model (its documented conversion)."""
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_keras_model(qat)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    return converter.convert()


def run_tflite(content, x):
    """Logits of a float-in/float-out TFLite file on `x` (the plain interpreter)."""
    import tensorflow as tf

    interpreter = tf.lite.Interpreter(model_content=content)
    inp, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    interpreter.resize_tensor_input(inp["index"], x.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(inp["index"], x.astype(inp["dtype"]))
    interpreter.invoke()
    return interpreter.get_tensor(out["index"])


def per_tensor_ptq(model, calibration):
    """TFLite post-training int8 with one weight scale per tensor (the converter's flag)."""
    import tensorflow as tf

    with tempfile.TemporaryDirectory() as tmp:
        model.export(tmp, format="tf_saved_model", verbose=False)
        converter = tf.lite.TFLiteConverter.from_saved_model(tmp)
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = lambda: ([c[None]] for c in calibration)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter._experimental_disable_per_channel = True
        return converter.convert()


def one_seed(x, y, xv, yv, seed, epochs, tmp, bits_list=(8, 4), calibration=200):
    on_tf = keras.backend.backend() == "tensorflow"
    model = compile_(cnn(keras.layers, seed))
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    acc = {"float": accuracy(model.predict(xv, verbose=0), yv)}
    for mode in ("int8", "int4"):
        ptq = keras.models.clone_model(model)
        ptq.set_weights(model.get_weights())
        with warnings.catch_warnings():  # "Layer Conv2D has no `quantize`"...
            warnings.simplefilter("ignore", UserWarning)
            ptq.quantize(mode)
        acc[f"Keras model.quantize('{mode}') (Dense only)"] = accuracy(
            ptq.predict(xv, verbose=0), yv
        )
    path = os.path.join(tmp, "ptq.tflite")
    kp.export_tflite(model, path, "int8", representative_data=x[:calibration])
    acc["TFLite post-training int8 (per-channel)"] = accuracy(kp.tflite_predict(path, xv), yv)
    if on_tf:
        acc["TFLite post-training int8 (per-tensor)"] = accuracy(
            kp.tflite_predict(per_tensor_ptq(model, x[:calibration]), xv), yv
        )
        keras.utils.set_random_seed(seed)
        tq = tfmot_twin(model, seed)
        tq.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
        acc["tfmot QAT w8a8 (tf_keras, TFLite int8 file)"] = accuracy(
            run_tflite(tfmot_tflite(tq), xv), yv
        )
    for bits in bits_list:
        keras.utils.set_random_seed(seed)
        qat = compile_(kp.quantize_aware(model, weight_bits=bits), FINE_TUNE_LR)
        qat.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
        acc[f"ours QAT w{bits}a8 (Keras)"] = accuracy(qat.predict(xv, verbose=0), yv)
        qpath = os.path.join(tmp, f"qat{bits}.tflite")
        kp.export_tflite(qat, qpath, "int8")
        acc[f"ours QAT w{bits}a8 (TFLite int8 file)"] = accuracy(kp.tflite_predict(qpath, xv), yv)
    # Control: the float model trained as many epochs again, as the QAT rows were.
    keras.utils.set_random_seed(seed)
    more = compile_(keras.models.clone_model(model), FINE_TUNE_LR)
    more.set_weights(model.get_weights())
    more.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    acc[f"float, {epochs} more epochs (control)"] = accuracy(more.predict(xv, verbose=0), yv)
    return acc


def accuracy_rows(x, y, xv, yv, seeds, epochs, bits_list=(8, 4), calibration=200):
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            acc = one_seed(x, y, xv, yv, seed, epochs, tmp, bits_list, calibration)
            print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in acc.items()), flush=True)
            for k, v in acc.items():
                table.setdefault(k, []).append(v)
    float_mean = float(np.mean(table["float"]))
    tfmot = table.get("tfmot QAT w8a8 (tf_keras, TFLite int8 file)")
    rows = []
    for k, v in table.items():
        target = "report"
        if k.startswith("ours QAT"):
            target = ">= float - 0.01"
            if tfmot and "w8" in k:
                target += ", >= tfmot - seed spread"
        note = f"accuracy mean (min-max over seeds); vs float {np.mean(v) - float_mean:+.4f}"
        rows.append(accuracy_row(f"digits accuracy: {k}", v, target, note))
    return rows


def tf_keras_step(model, x, y):
    """One compiled tf_keras train step (the function tf_keras' fit calls per batch)."""
    import tensorflow as tf

    fn = model.make_train_function()
    # A tf.data iterator, as tf_keras' fit passes: a Python iterator would retrace every call.
    it = iter(tf.data.Dataset.from_tensors((x, y)).repeat())

    def run():
        return {k: v.numpy() for k, v in fn(it).items()}

    return run


def step_row(plain, quantized, step, xb, yb, steps, claim, target):
    """Warm both models up, then time their single steps interleaved; one row."""
    for m in (plain, quantized):
        m.fit(xb, yb, epochs=2, verbose=0)
    a, b = step(plain, xb, yb), step(quantized, xb, yb)
    for _ in range(5):
        a(), b()
    res = interleaved(a, b, steps)
    note = f"float step {res['step_cpu_ms']:.2f} ms CPU, {res['step_ms']:.2f} ms wall"
    return row(claim, res, target, note=note)


def step_rows(x, y, steps, sizes=tuple(SIZES)):
    xb, yb = x[:BATCH], y[:BATCH]
    rows = []
    for size in sizes:
        plain = compile_(cnn(keras.layers, 0, size))
        qat = compile_(kp.quantize_aware(cnn(keras.layers, 0, size)))
        claim = f"QAT step / float step, ours (CNN {size}, batch 32)"
        rows.append(step_row(plain, qat, one_step, xb, yb, steps, claim, "<= 1.5"))
        if keras.backend.backend() != "tensorflow":
            continue
        import tensorflow_model_optimization as tfmot

        tfk = _tf_keras()
        plain = compile_(cnn(tfk.layers, 0, size), k=tfk)
        tq = compile_(tfmot.quantization.keras.quantize_model(cnn(tfk.layers, 0, size)), k=tfk)
        claim = f"(reference) tfmot QAT step / tf_keras float step (CNN {size}, batch 32)"
        rows.append(step_row(plain, tq, tf_keras_step, xb, yb, steps, claim, "-"))
    return rows


def main():
    args = parse_args(__doc__.splitlines()[0])
    (x, y), (xv, yv) = digits()
    x, xv = x.reshape(-1, 8, 8, 1), xv.reshape(-1, 8, 8, 1)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    # --smoke (CI): the small CNN's steps (4 of each), 1 epoch on 512 training images, the w8
    # QAT model alone (w4 is the same code with another bit width): 4 TFLite files on
    # TensorFlow instead of 5, calibrated on 32 images instead of 200.
    if args.smoke:
        rows = step_rows(x, y, 4, sizes=("small",))
        x, y = x[:512], y[:512]
    else:
        rows = step_rows(x, y, 100 if args.quick else 400)
    print(f"load average after step times: {os.getloadavg()}", flush=True)
    seeds = [0] if args.quick else [0, 1, 2]
    epochs = 1 if args.smoke else 2 if args.quick else EPOCHS
    rows += accuracy_rows(
        x, y, xv, yv, seeds, epochs, (8,) if args.smoke else (8, 4), 32 if args.smoke else 200
    )
    finish(rows, args)


if __name__ == "__main__":
    main()
