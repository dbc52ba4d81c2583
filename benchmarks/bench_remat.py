"""Benchmark of `remat="full"` (gradient checkpointing of an existing model): memory and time.

Memory is counted, not timed, with benchmarks/_memory.py's measures (TensorFlow's CPU
allocator peak during one compiled step, XLA's temp buffers of the compiled step on JAX, the
peak of the tensors torch's autograd saves for backward). The TensorFlow and JAX counts also
hold what does not grow with the batch (gradients, optimizer temporaries), so activation
memory is read as the growth per example between two batch sizes, as in _memory.py; torch's
count is activations only.

Step time: one compiled step (`_harness.one_step`) with and without remat, A B B A, the
median ratio of process CPU time (and wall) over the repeats.

Models: a deep MLP (512 inputs, 16 Dense(512, gelu), Dense(10)) and a Transformer encoder
(sequence 128, d=256, 4 heads, feed-forward 1024 with gelu, 2 blocks, no dropout).
Targets: activation memory >= 2x lower at <= 1.4x step time.

Run: python -m benchmarks.bench_remat [--quick] [--json PATH]
"""

from __future__ import annotations

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_perf as kp  # noqa: E402

from . import _memory  # first: it sets TensorFlow's allocator options before the import
from ._harness import abba, compile_sce, finish, one_step, parse_args, row  # noqa: E402


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


def _model(build, remat):
    base, shape = build()
    model = compile_sce(kp.loss_scaled(base, remat=remat), keras.optimizers.Adam(1e-3))
    return model, shape


def _data(shape, batch):
    rng = np.random.default_rng(0)
    return rng.normal(size=(batch, *shape)).astype("float32"), rng.integers(0, 10, batch)


def memory(build, remat, batches) -> float:
    """Activation bytes per example (torch: saved tensors; TF, JAX: growth between batches)."""
    measure = {"tensorflow": _memory._tensorflow, "jax": _memory._jax, "torch": _memory._torch}
    fn = measure[keras.backend.backend()]
    counts = []
    for batch in batches:
        model, shape = _model(build, remat)
        x, y = _data(shape, batch)
        model.fit(x, y, batch_size=batch, verbose=0)
        counts.append(fn(model, x, y))
    if keras.backend.backend() == "torch":
        return counts[-1] / batches[-1]
    return (counts[1] - counts[0]) / (batches[1] - batches[0])


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


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    repeats = 3 if args.quick else 7
    scale = 2 if args.quick else 1
    rows = []
    for name, build, batches in (
        ("deep MLP 16 x Dense(512, gelu)", deep_mlp, (128 // scale, 256 // scale)),
        ("Transformer d=256 h=4 2 blocks seq 128", transformer, (8 // scale, 16 // scale)),
    ):
        plain, full = memory(build, None, batches), memory(build, "full", batches)
        print(f"{name}: activation bytes/example {plain:.0f} -> {full:.0f}", flush=True)
        result = step_time(build, batches[-1], repeats)
        note = (
            f"activation bytes/example {plain:.0f} -> {full:.0f} "
            f"({plain / full:.2f}x less; {_memory.WHAT[keras.backend.backend()]})"
        )
        rows.append(row(f"remat='full' step time, {name}", result, "<= 1.4x", note=note))
    finish(rows, args)


if __name__ == "__main__":
    main()
