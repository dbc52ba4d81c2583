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
difference worth counting, and Keras warns about it on TensorFlow). `--smoke` (CI) runs the
MLP alone, 4 x Dense(64) on 64 inputs (and its floor the same), which proves the rows are
written, not the claims.
Targets: activation memory >= 2x lower at <= 1.4x step time on the MLP and the Transformer;
ResNet50 as measured.

Floors (MLP and Transformer): the same model written on the bare framework with each layer
checkpointed by the framework's own tool (`tf.recompute_grad`, `jax.checkpoint`,
`torch.utils.checkpoint.checkpoint`), benchmarks/_remat_floors.py. Each gets a row below ours:
its memory counted with the same measure at the same batches, its step time with and without
checkpointing (A B B A), so our "less" and our time ratio read against what the framework
itself gives.

On TensorFlow and JAX the MLP's memory is counted at batches 1024 and 2048 (MEMORY_BATCHES
below; the step is still timed at the model's own batch): at smaller batches the step's peak is
its gradients, not its activations, and does not grow with the batch.

Run: python -m benchmarks.bench_remat [--quick | --smoke] [--json PATH] [--models mlp,transformer,resnet50]
[--batches B1,B2]
"""

from __future__ import annotations

import argparse
import functools

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_perf as kp  # noqa: E402

# _memory first: it sets TensorFlow's allocator options before the import.
from . import _memory, _remat_floors
from ._harness import (  # noqa: E402
    abba,
    add_mode_flags,
    compile_sce,
    finish,
    one_step,
    resolve_modes,
    row,
)


def deep_mlp(depth=16, width=512):
    """`depth` x Dense(`width`, gelu) on `width` inputs, Dense(10) (`--smoke`: 4 x 64)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((width,))
    h = inp
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="gelu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h)), (width,)


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
# On TensorFlow and JAX the MLP's memory is counted at larger batches (the step is still timed
# at the model's own). Their counts are the peak of the whole step, and kp.loss_scaled keeps
# all 16.8 MB of gradients alive at once (for the norm and the non-finite check): while one
# layer's activations are smaller than its 1 MB gradient (below about 512 examples, or 1024
# with remat), that peak is set by the gradients and does not grow with the batch (XLA temp
# 21,043,472 bytes at batch 64 and at 128, with and without remat), so the growth measured
# nothing. torch's count (saved tensors) holds activations only.
MEMORY_BATCHES = {"mlp": (1024, 2048)}
# Models with a bare-framework floor (benchmarks/_remat_floors.py).
FLOORS = ("mlp", "transformer")
# --smoke (CI): the MLP (and its floor) 4 x Dense(64) instead of 16 x Dense(512): the same code
# paths, a quarter of the layers to trace (with the full MLP the script took 76 s of CPU on
# TF, 2026-11-28).
SMOKE_MLP = (4, 64)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_flags(p)
    p.add_argument("--json", metavar="PATH", help="write the result rows as JSON to PATH")
    p.add_argument(
        "--models",
        help="comma-separated: "
        + ",".join(MODELS)
        + " (default: all; with --quick: mlp,transformer; with --smoke: mlp)",
    )
    p.add_argument(
        "--batches",
        help="the two batch sizes of the memory count, e.g. 1024,2048 (the step is timed at the "
        "second); default: each model's own",
    )
    args = resolve_modes(p.parse_args())
    if args.batches is not None:
        try:
            args.batches = tuple(int(b) for b in args.batches.split(","))
        except ValueError:
            args.batches = ()
        if len(args.batches) != 2 or not 0 < args.batches[0] < args.batches[1]:
            p.error("--batches: two increasing positive sizes, e.g. 1024,2048")
    if args.models is None:
        # ResNet50 costs minutes per count on 2 cores: the quick run leaves it out; the smoke
        # run (CI) keeps the MLP alone (the Transformer's rows take the same code path; with
        # it, 155 s of CPU on TF, 2026-11-28).
        args.models = "mlp" if args.smoke else "mlp,transformer" if args.quick else ",".join(MODELS)
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
            # JAX's count compiles the step afresh for (x, y): a few rows build the model.
            part = 8 if backend == "jax" else batch
            model.fit(x[:part], y[:part], batch_size=part, verbose=0)
            measured.append(fn(model, x, y))
        counts.append(int(np.median(measured)))
    return _per_example(counts, batches), counts


def _per_example(counts, batches) -> float:
    if keras.backend.backend() == "torch":
        return counts[-1] / batches[-1]
    return (counts[1] - counts[0]) / (batches[1] - batches[0])


def _floor_kw(key, mlp) -> tuple[tuple, dict]:
    """The floor's input shape and keyword arguments for `key` (`mlp`: the MLP's (depth,
    width), `None` for the default)."""
    if key == "mlp" and mlp is not None:
        return (mlp[1],), {"mlp": mlp}
    return _remat_floors.SHAPES[key], {}


def floor_memory(key, remat, batches, tf_models=1, mlp=None) -> tuple[float, list]:
    """The bare-framework floor's counts (benchmarks/_remat_floors.py), read as `memory` reads
    ours: activation bytes per example and the raw counts at each batch size (TensorFlow's,
    the median over `tf_models` new traces)."""
    shape, kw = _floor_kw(key, mlp)
    counts = []
    for batch in batches:
        x, y = _data(shape, batch)
        runs = tf_models if keras.backend.backend() == "tensorflow" else 1
        measured = [_remat_floors.floor_memory(key, x, y, remat, **kw) for _ in range(runs)]
        counts.append(int(np.median(measured)))
    return _per_example(counts, batches), counts


def floor_time(key, batch, repeats, mlp=None) -> dict:
    shape, kw = _floor_kw(key, mlp)
    x, y = _data(shape, batch)
    steps = (_remat_floors.floor_step(key, x, y, remat, **kw) for remat in (False, True))
    return abba(*steps, repeats)


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


FRAMEWORK = {
    "tensorflow": "tf.recompute_grad",
    "jax": "jax.checkpoint",
    "torch": "torch checkpoint",
}


def _note(plain, full, batches) -> str:
    """The memory half of a row: activation bytes per example, how many times less, counts."""
    (a, a_counts), (b, b_counts) = plain, full
    # XLA's temp count can stay flat between the two batches (no growth measured).
    less = f"{a / b:.2f}x less" if b > 0 else "no growth with remat"
    return (
        f"activation bytes/example {a:.0f} -> {b:.0f} ({less}; "
        f"{_memory.WHAT[keras.backend.backend()]}; counts at batches {list(batches)}: "
        f"{a_counts} -> {b_counts})"
    )


def main() -> None:
    args = parse_args()
    if _in_own_process():
        return
    repeats = 1 if args.smoke else 3 if args.quick else 7
    # --smoke (CI): the MLP and its floor at SMOKE_MLP's size and a quarter of its batches (its
    # memory count too), one repeat.
    scale = 4 if args.smoke else 2 if args.quick else 1
    rows = []
    backend = keras.backend.backend()
    tf_models = 1 if args.quick else 3
    for key in args.models:
        build, sizes, name = MODELS[key]
        mlp = SMOKE_MLP if key == "mlp" and args.smoke else None
        if mlp is not None:
            build = functools.partial(deep_mlp, *mlp)
            name = f"deep MLP {mlp[0]} x Dense({mlp[1]}, gelu)"
        timed_at = args.batches[-1] if args.batches else sizes[-1] // scale
        batches = (
            args.batches
            or (MEMORY_BATCHES.get(key) if backend != "torch" and not args.smoke else None)
            or tuple(b // scale for b in sizes)
        )
        plain, full = (memory(build, r, batches, tf_models) for r in (None, "full"))
        result = step_time(build, timed_at, repeats)
        note = _note(plain, full, batches)
        print(f"{name}: {note}", flush=True)
        target = "as measured" if key == "resnet50" else "<= 1.4x"
        claim = f"remat='full' step time, {name}, batch {timed_at}"
        rows.append(row(claim, result, target, note=note))
        if key in FLOORS:
            plain, full = (floor_memory(key, r, batches, tf_models, mlp) for r in (False, True))
            note = _note(plain, full, batches)
            print(f"{name}, bare-framework floor: {note}", flush=True)
            rows.append(
                row(
                    f"  (floor) bare {FRAMEWORK[backend]} per layer, step time, {name}, "
                    f"batch {timed_at}",
                    floor_time(key, timed_at, repeats, mlp),
                    "-",
                    note=note,
                )
            )
    finish(rows, args)


if __name__ == "__main__":
    main()
