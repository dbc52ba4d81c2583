"""Benchmark of `remat="full"` (gradient checkpointing of an existing model): memory and time.

Memory is counted, not timed, with benchmarks/_memory.py's measures (TensorFlow's CPU
allocator peak during one compiled step, the median over 3 new models, 1 with --quick; XLA's
temp buffers of the compiled step on JAX; the peak of the tensors torch's autograd saves for
backward). The TensorFlow and JAX counts also hold what does not grow with the batch
(gradients, optimizer temporaries), so activation memory is read as the growth per example
between two batch sizes, as in _memory.py; torch's count is activations only. Every row's note
also gives the raw counts at both batch sizes.

Step time: one compiled step (`_harness.one_step`) with and without remat, A B B A, the
median ratio of process CPU time (and wall) over the repeats.

Models (`--models`; all three by default, the MLP and the Transformer with --quick): a deep
MLP (512 inputs, 16 Dense(512, gelu), Dense(10)), a Transformer encoder (sequence 128,
d=256, 4 heads, feed-forward 1024 with gelu, 2 blocks, no dropout) and `keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3))`
(its BatchNormalization layers own moving statistics, so remat recomputes the convolutions and
activations around them, not the normalisations; its own 1000-way softmax head is kept, and
the loss reads that output as logits, as for the other two: for memory and time that makes no
difference worth counting, and Keras warns about it on TensorFlow).
Targets: activation memory >= 2x lower at <= 1.4x step time on the MLP and the Transformer;
ResNet50 as measured.

Run: python -m benchmarks.bench_remat [--quick] [--json PATH] [--models mlp,transformer,resnet50]
[--batches B1,B2]
"""

from __future__ import annotations

import argparse

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_perf as kp  # noqa: E402

from . import _memory  # first: it sets TensorFlow's allocator options before the import
from ._harness import abba, compile_sce, finish, one_step, row  # noqa: E402


def deep_mlp():
    keras.utils.set_random_seed(0)
    inp = keras.Input((512,))
    h = inp
    for _ in range(16):
        h = keras.layers.Dense(512, activation="gelu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h)), (512,)


def transformer():
    keras.utils.set_random_seed(0)
    inp = keras.Input((128, 256))
    h = inp
    for _ in range(2):
        a = keras.layers.MultiHeadAttention(4, 64)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(1024, activation="gelu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(256)(f))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inp, keras.layers.Dense(10)(h)), (128, 256)


def resnet50():
    keras.utils.set_random_seed(0)
    return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3)), (64, 64, 3)


# name: (builder, the two batch sizes of the memory count (the step is timed at the second),
# the row's label).
MODELS = {
    "mlp": (deep_mlp, (128, 256), "deep MLP 16 x Dense(512, gelu)"),
    "transformer": (transformer, (8, 16), "Transformer d=256 h=4 2 blocks seq 128"),
    "resnet50": (resnet50, (8, 16), "ResNet50 64x64 (weights=None, 1000 classes)"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="half the batches, 3 repeats")
    p.add_argument("--json", metavar="PATH", help="write the result rows as JSON to PATH")
    p.add_argument(
        "--models",
        help="comma-separated: "
        + ",".join(MODELS)
        + " (default: all; with --quick: mlp,transformer)",
    )
    p.add_argument(
        "--batches",
        help="the two batch sizes of the memory count, e.g. 1024,2048 (the step is timed at the "
        "second); default: each model's own",
    )
    args = p.parse_args()
    if args.batches is not None:
        try:
            args.batches = tuple(int(b) for b in args.batches.split(","))
        except ValueError:
            args.batches = ()
        if len(args.batches) != 2 or not 0 < args.batches[0] < args.batches[1]:
            p.error("--batches: two increasing positive sizes, e.g. 1024,2048")
    if args.models is None:
        # ResNet50 costs minutes per count on 2 cores: the quick (CI) run leaves it out.
        args.models = "mlp,transformer" if args.quick else ",".join(MODELS)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = sorted(set(args.models) - set(MODELS))
    if bad or not args.models:
        p.error(f"--models: unknown {bad}; choose from {list(MODELS)}")
    return args


def _model(build, remat):
    base, shape = build()
    model = compile_sce(kp.loss_scaled(base, remat=remat), keras.optimizers.Adam(1e-3))
    return model, shape


def _data(shape, batch):
    rng = np.random.default_rng(0)
    return rng.normal(size=(batch, *shape)).astype("float32"), rng.integers(0, 10, batch)


def memory(build, remat, batches, tf_models=1) -> tuple[float, list]:
    """Activation bytes per example (torch: saved tensors; TF, JAX: growth between batches),
    and the raw counts at each batch size. TensorFlow's count follows its executor's op order,
    which differs from one trace to the next: there, each count is the median over
    `tf_models` new models (JAX and torch count the same bytes every time)."""
    backend = keras.backend.backend()
    fn = {"tensorflow": _memory._tensorflow, "jax": _memory._jax, "torch": _memory._torch}[backend]
    counts = []
    for batch in batches:
        measured = []
        for _ in range(tf_models if backend == "tensorflow" else 1):
            model, shape = _model(build, remat)
            x, y = _data(shape, batch)
            model.fit(x, y, batch_size=batch, verbose=0)
            measured.append(fn(model, x, y))
        counts.append(int(np.median(measured)))
    if keras.backend.backend() == "torch":
        return counts[-1] / batches[-1], counts
    return (counts[1] - counts[0]) / (batches[1] - batches[0]), counts


def step_time(build, batch, repeats) -> dict:
    fns = []
    for remat in (None, "full"):
        model, shape = _model(build, remat)
        x, y = _data(shape, batch)
        model.fit(x, y, batch_size=batch, verbose=0)
        step = one_step(model, x, y)
        step()
        fns.append(step)
    return abba(*fns, repeats=repeats)


def _in_own_process() -> bool:
    """On TensorFlow, when this process imported TensorFlow before `_memory` could choose the
    BFC allocator (`keras-perf bench --quick` runs every script in one interpreter), run this
    script again in a process of its own, with the same arguments; True when that was done."""
    if keras.backend.backend() != "tensorflow" or kp.backend.step_memory_unavailable() is None:
        return False
    import subprocess
    import sys

    from ._harness import module_command

    cmd, env = module_command(f"{__package__}.bench_remat")
    subprocess.run([*cmd, *sys.argv[1:]], env=env, check=True)
    return True


def main() -> None:
    args = parse_args()
    if _in_own_process():
        return
    repeats = 3 if args.quick else 7
    scale = 2 if args.quick else 1
    rows = []
    for key in args.models:
        build, sizes, name = MODELS[key]
        batches = args.batches or tuple(b // scale for b in sizes)
        tf_models = 1 if args.quick else 3
        (plain, plain_counts), (full, full_counts) = (
            memory(build, None, batches, tf_models),
            memory(build, "full", batches, tf_models),
        )
        # XLA's temp count can stay flat between the two batches (no growth measured).
        less = f"{plain / full:.2f}x less" if full > 0 else "no growth with remat"
        print(
            f"{name}: activation bytes/example {plain:.0f} -> {full:.0f}; counts at batches "
            f"{batches}: {plain_counts} -> {full_counts}",
            flush=True,
        )
        result = step_time(build, batches[-1], repeats)
        note = (
            f"activation bytes/example {plain:.0f} -> {full:.0f} ({less}; "
            f"{_memory.WHAT[keras.backend.backend()]}; counts at batches {list(batches)}: "
            f"{plain_counts} -> {full_counts})"
        )
        target = "as measured" if key == "resnet50" else "<= 1.4x"
        claim = f"remat='full' step time, {name}, batch {batches[-1]}"
        rows.append(row(claim, result, target, note=note))
    finish(rows, args)


if __name__ == "__main__":
    main()
