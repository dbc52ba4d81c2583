"""Channel pruning: is `kp.shrink(model)` as small and as fast as the model built smaller?

Claims (docs/channel_pruning.md):
1. `kp.shrink` of a model with half the channels of every prunable group removed runs as fast
   as the same architecture built by hand at the smaller widths: shrink / twin <= 1.10, for
   the compiled forward call, `predict` over 1,024 examples at batch 64 and (TensorFlow) the
   TFLite file.
2. On a small ResNet-style CNN (residual adds, BatchNorm), the shrunk model is >= 1.8x faster
   than the original for the TFLite file and the TF compiled forward call (shrink / original
   <= 0.556).

Models: the ResNet-style CNN at 16x16 and 32x32 inputs, and
`keras.applications.MobileNetV2(alpha=0.35, weights=None, input_shape=(32, 32, 3))`.
Half the channels are removed by `kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, 0))`
over one training step. The ResNet twin is `resnet(width / 2)`; MobileNetV2's twin is a fresh
model built from the shrunk model's config (its groups shrink unevenly: no `alpha` gives the
same widths). The twin gets the shrunk model's weights: the TFLite converter merges equal
constant buffers, and the zero biases folded from a fresh model's untrained BatchNorm made a
fresh MobileNetV2 twin's file 6 % smaller (132 tensors instead of 173, same ops) and ~10 %
faster, an effect of the weight values, not of the graph. Params and MACs (from `kp.channel_report`, exact) go in each row's note.

Each timed unit (one forward call of batch 64, one `predict` of 1,024 examples (256 with
`--quick`), 20 TFLite invokes of one example, one thread) runs for the three models in the palindromic order
original, shrink, twin, twin, shrink, original in one process, 7 times (5 for `predict`;
torch on one thread, see `main`);
per path three rows: shrink / original, twin / original (the hand-built model's own speed-up,
the reference where the target cannot be reached) and shrink / twin, each the median ratio of
wall and process CPU time with its spread (min, max). Each row's note has the median
milliseconds per call of the three models and the 1-minute load average. Run:

    KERAS_BACKEND=tensorflow python -m benchmarks.bench_channel_pruning [--quick | --smoke] [--json out.json]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import warnings

import keras
import numpy as np

import keras_perf as kp
from keras_perf.bench import machine

from ._harness import finish, parse_args, row, summarize, timed

warnings.filterwarnings("ignore", message=r"(?s).*tf.lite.Interpreter is deprecated")
L = keras.layers
BACKEND = keras.backend.backend()
BATCH = 64


def resnet(width: int, size: int, name: str = "resnet") -> keras.Model:
    """Stem, two stages of two residual blocks (the second stage at 2x width, stride 2)."""
    inp = keras.Input((size, size, 3), name="image")
    x = L.Conv2D(width, 3, padding="same", use_bias=False, name="stem")(inp)
    x = L.ReLU()(L.BatchNormalization(name="stem_bn")(x))
    for stage, w in enumerate((width, 2 * width)):
        if stage:
            x = L.Conv2D(w, 1, strides=2, use_bias=False, name=f"s{stage}_proj")(x)
            x = L.BatchNormalization(name=f"s{stage}_proj_bn")(x)
        for block in range(2):
            y = L.Conv2D(w, 3, padding="same", use_bias=False, name=f"s{stage}b{block}_c1")(x)
            y = L.ReLU()(L.BatchNormalization(name=f"s{stage}b{block}_bn1")(y))
            y = L.Conv2D(w, 3, padding="same", use_bias=False, name=f"s{stage}b{block}_c2")(y)
            y = L.BatchNormalization(name=f"s{stage}b{block}_bn2")(y)
            x = L.ReLU()(L.Add()([x, y]))
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inp, L.Dense(10, name="logits")(x), name=name)


def mobilenet() -> keras.Model:
    return keras.applications.MobileNetV2(
        alpha=0.35, weights=None, input_shape=(32, 32, 3), classes=10
    )


def prune_half(model) -> keras.Model:
    """One training step with the callback at 50 %, then `kp.shrink`."""
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).random((BATCH, *model.inputs[0].shape[1:]), dtype="float32")
    y = np.zeros((BATCH,), "int32")
    cb = kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, 0))
    model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[cb], verbose=0)
    return kp.shrink(model)


def forward(model, x):
    """A callable: one compiled forward call of `model` on `x`, waited for."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        fn = tf.function(lambda t: model(t, training=False))
        xt = tf.constant(x)
        return lambda: fn(xt).numpy()
    if BACKEND == "jax":
        import jax

        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]
        fn = jax.jit(lambda a, b, t: model.stateless_call(a, b, t, training=False)[0])
        xt = jax.numpy.asarray(x)
        return lambda: jax.block_until_ready(fn(tv, ntv, xt))
    import torch

    xt = keras.ops.convert_to_tensor(x)

    def run():
        with torch.no_grad():
            return keras.ops.convert_to_numpy(model(xt, training=False))

    return run


def predict(model, x):
    return lambda: model.predict(x, batch_size=BATCH, verbose=0)


def tflite(model, x, folder, invokes=20):
    import tensorflow as tf

    path = os.path.join(folder, f"{model.name}_{id(model)}.tflite")
    kp.export_tflite(model, path)
    interp = tf.lite.Interpreter(model_path=path, num_threads=1)
    interp.allocate_tensors()
    inp = interp.get_input_details()[0]["index"]
    out = interp.get_output_details()[0]["index"]
    one = x[:1]

    def run():
        for _ in range(invokes):
            interp.set_tensor(inp, one)
            interp.invoke()
        return interp.get_tensor(out)

    return run, os.path.getsize(path)


def sizes(model) -> tuple[int, int]:
    total = kp.channel_report(model)["total"]
    return total["params_before"], total["macs_before"]


def abba3(original, small, twin, repeats):
    """O S T T S O, `repeats` times: a palindrome, so linear drift cancels for every pair.

    Returns {"s/o": ..., "t/o": ..., "s/t": ...} (each `summarize`'s dict) and the median
    wall and CPU milliseconds of one call of each variant.
    """
    times = {"o": [], "s": [], "t": []}
    ratios = {"s/o": ([], []), "t/o": ([], []), "s/t": ([], [])}
    for _ in range(repeats):
        one = {"o": [], "s": [], "t": []}
        for key, fn in (("o", original), ("s", small), ("t", twin),
                        ("t", twin), ("s", small), ("o", original)):  # fmt: skip
            one[key].append(timed(fn))
        for key, pairs in one.items():
            times[key] += pairs
        sums = {k: (sum(w for w, _ in v), sum(c for _, c in v)) for k, v in one.items()}
        for name, (wall, cpu) in ratios.items():
            a, b = name.split("/")
            wall.append(sums[a][0] / sums[b][0])
            cpu.append(sums[a][1] / max(sums[b][1], 1e-9))
    result = {name: summarize(wall, cpu) for name, (wall, cpu) in ratios.items()}
    ms = {k: (round(1e3 * statistics.median(w for w, _ in v), 2),
              round(1e3 * statistics.median(c for _, c in v), 2)) for k, v in times.items()}  # fmt: skip
    return result, ms


def add_rows(rows, name, kind, repeats, runs, target, note):
    result, ms = abba3(runs["o"], runs["s"], runs["t"], repeats)
    note = (f"{note}; median ms wall/cpu: original {ms['o']}, shrink {ms['s']}, "
            f"twin {ms['t']}; load avg {os.getloadavg()[0]:.1f}")  # fmt: skip
    for pair, label, tgt in (("s/o", "shrink / original", target),
                             ("t/o", "twin / original (reference)", "-"),
                             ("s/t", "shrink / twin", "<= 1.10")):  # fmt: skip
        r = row(f"{name} {kind}: {label}", result[pair], tgt, note=note)
        r["ms"] = ms
        r["loadavg"] = [round(v, 1) for v in os.getloadavg()]
        rows.append(r)
        print(f"  {r['claim']}: cpu {r['cpu_ratio']} {r['cpu_spread']} wall {r['wall_ratio']} "
              f"{r['wall_spread']}", flush=True)  # fmt: skip


def measure(name, original, small, twin, repeats, rows, folder, examples=1024):
    p0, m0 = sizes(original)
    p1, m1 = sizes(small)
    p2, m2 = sizes(twin)
    note = f"params {p0}->{p1} (twin {p2}), MACs {m0}->{m1} (twin {m2})"
    print(f"{name}: {note}", flush=True)
    x = np.random.default_rng(1).random((examples, *original.inputs[0].shape[1:]), dtype="float32")
    resnet_tf = name.startswith("resnet") and BACKEND == "tensorflow"
    for kind, make in (("forward", forward), ("predict", predict)):
        data = x[:BATCH] if kind == "forward" else x
        runs = {k: make(m, data) for k, m in (("o", original), ("s", small), ("t", twin))}
        for fn in runs.values():
            fn()
            fn()  # warm-up: trace and compile
        target = "<= 0.556" if resnet_tf and kind == "forward" else "-"
        add_rows(rows, name, kind, repeats[kind], runs, target, note)
    if BACKEND == "tensorflow":
        runs, files = {}, {}
        for k, m in (("o", original), ("s", small), ("t", twin)):
            runs[k], files[k] = tflite(m, x, folder)
            runs[k]()
        note_f = f"{note}; file bytes {files['o']}->{files['s']} (twin {files['t']})"
        target = "<= 0.556" if name.startswith("resnet") else "-"
        add_rows(rows, name, "tflite", repeats["tflite"], runs, target, note_f)


def main():
    args = parse_args(__doc__.splitlines()[0])
    # Full: 7 repeats (6 calls each) of the short units, 5 of `predict` (the longest unit).
    # --smoke (CI): the 16x16 ResNet alone (every path: forward, predict, TFLite), once, over
    # one batch; MobileNetV2's shrink is in the library's own tests.
    repeats = dict.fromkeys(("forward", "predict", "tflite"), 1 if args.smoke else 2) if args.quick else {
        "forward": 7, "predict": 5, "tflite": 7}  # fmt: skip
    # --quick (a smoke run, CI's `bench --quick`): `predict` over 4 batches, not 16 (MobileNetV2's
    # three models' predicts were about a minute of the quick run on 2 loaded cores).
    examples = BATCH if args.smoke else 256 if args.quick else 1024
    if BACKEND == "torch":
        # One intra-op thread: with two, on the loaded shared machine, threads spinning while
        # they wait inflated CPU time and spread (a run had done 3 of its 18 rows after 7
        # minutes); with one the full run takes about 5 minutes.
        import torch

        torch.set_num_threads(1)
    print(f"{BACKEND}; {machine()}; load average {os.getloadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for size in (16,) if args.quick else (16, 32):
            original = resnet(32, size)
            small = prune_half(original)
            twin = resnet(16, size, name="twin")
            twin.set_weights(small.get_weights())
            measure(f"resnet{size}", original, small, twin, repeats, rows, folder, examples)
        if not args.smoke:
            original = mobilenet()
            small = prune_half(original)
            twin = keras.Model.from_config(small.get_config())
            twin.set_weights(small.get_weights())
            measure("mobilenetv2_0.35", original, small, twin, repeats, rows, folder, examples)
    finish(rows, args)


if __name__ == "__main__":
    main()
