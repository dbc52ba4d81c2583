"""Mixed precision on this device: `fit` epochs under `mixed_bfloat16` vs `float32`, and `auto`.

Four models (the MLP 1024-2048-2048-10 at batch 512; a CNN conv 64-64-pool-128-GAP on 32x32x3
at batch 128; a Transformer encoder, d=256, 4 heads, 2 blocks, sequence 128, batch 32; and
`keras.applications.ResNet50(weights=None)` at 64x64, batch 32), each trained whole epochs of
`fit` under both policies, A B B A, median of the ratios (wall and process CPU time). The ratio
is float32 time / mixed_bfloat16 time: above 1, bfloat16 is faster. Beside the MLP, the bare
framework's floor: the same MLP step written on bare TensorFlow (`tf.function`, bfloat16 casts),
torch (`torch.autocast("cpu", torch.bfloat16)`) or JAX (`jax.jit`, bfloat16 casts), SGD.
The last row is `kp.setup_mixed_precision("auto")`: its pick and its speed over float32 on the
slowest model (1.0 where it picks float32). Targets on a CPU with AMX/AVX-512 BF16 units,
TensorFlow: >= 1.8x on the MLP and the CNN; `auto` never slower than float32 (>= 1.0).

    KERAS_BACKEND=tensorflow python -m benchmarks.bench_precision [--quick] [--json PATH]
        [--models mlp,cnn,transformer,resnet50]   # --quick alone: mlp,cnn, 2 steps per epoch
"""

from __future__ import annotations

import argparse

import numpy as np

from ._harness import abba, finish, row

MODELS = ("mlp", "cnn", "transformer", "resnet50")


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps (CI smoke run)")
    p.add_argument("--json", metavar="PATH", help="write the result rows as JSON to PATH")
    p.add_argument(
        "--models",
        help=f"comma-separated subset of {','.join(MODELS)} (default: all; --quick: mlp,cnn)",
    )
    args = p.parse_args()
    default = "mlp,cnn" if args.quick else ",".join(MODELS)
    args.models = [m.strip() for m in (args.models or default).split(",") if m.strip()]
    bad = sorted(set(args.models) - set(MODELS))
    if bad:
        p.error(f"--models: unknown {bad}; choose from {list(MODELS)}")
    return args


def _build(name: str, policy: str):
    """(model, x, y, batch) for `name`, built under `policy`; logits out in float32."""
    import keras

    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    L = keras.layers
    if name == "mlp":
        inputs = keras.Input((1024,))
        h = L.Dense(2048, "relu")(inputs)
        h = L.Dense(2048, "relu")(h)
        shape, batch = (1024,), 512
    elif name == "cnn":
        inputs = keras.Input((32, 32, 3))
        h = L.Conv2D(64, 3, padding="same", activation="relu")(inputs)
        h = L.Conv2D(64, 3, padding="same", activation="relu")(h)
        h = L.MaxPooling2D()(h)
        h = L.Conv2D(128, 3, padding="same", activation="relu")(h)
        h = L.GlobalAveragePooling2D()(h)
        shape, batch = (32, 32, 3), 128
    elif name == "transformer":
        inputs = keras.Input((128, 256))
        h = inputs
        for _ in range(2):
            a = L.MultiHeadAttention(4, 64)(h, h)
            h = L.LayerNormalization()(h + a)
            f = L.Dense(1024, "relu")(h)
            h = L.LayerNormalization()(h + L.Dense(256)(f))
        h = L.GlobalAveragePooling1D()(h)
        shape, batch = (128, 256), 32
    else:
        base = keras.applications.ResNet50(weights=None, include_top=False, input_shape=(64, 64, 3))
        inputs = base.input
        h = L.GlobalAveragePooling2D()(base.output)
        shape, batch = (64, 64, 3), 32
    outputs = L.Dense(10, dtype="float32")(h)
    model = keras.Model(inputs, outputs)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    return model, rng.standard_normal((batch, *shape), dtype=np.float32), batch, rng


def _epochs(name: str, steps: int):
    """One-epoch callables for float32 and mixed_bfloat16 (each built under its own policy)."""
    import keras

    fns = {}
    for policy in ("float32", "mixed_bfloat16"):
        model, x1, batch, rng = _build(name, policy)
        x = np.concatenate([x1] * steps)
        y = rng.integers(0, 10, len(x))

        def epoch(model=model, x=x, y=y, batch=batch):
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

        epoch()  # trace, warm up
        fns[policy] = epoch
    keras.mixed_precision.set_global_policy("float32")
    return fns


def _floor(steps: int):
    """One-epoch callables of the bare-framework MLP step, float32 and bfloat16."""
    import keras

    backend = keras.backend.backend()
    rng = np.random.default_rng(0)
    sizes = (1024, 2048, 2048, 10)
    weights = [
        (rng.standard_normal((a, b), dtype=np.float32) * 0.02, np.zeros(b, np.float32))
        for a, b in zip(sizes, sizes[1:])
    ]
    x = rng.standard_normal((512, 1024), dtype=np.float32)
    y = rng.integers(0, 10, 512)
    make = {"tensorflow": _tf_step, "torch": _torch_step, "jax": _jax_step}[backend]
    out = {}
    for dtype in ("float32", "bfloat16"):
        step = make(weights, x, y, dtype)
        step()

        def epoch(step=step):
            for _ in range(steps):
                step()

        out[dtype] = epoch
    return out


def _tf_step(weights, x, y, dtype):
    import tensorflow as tf

    params = [tf.Variable(w) for pair in weights for w in pair]
    x, y = tf.constant(x), tf.constant(y)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = tf.cast(x, dtype)
            for i in range(0, len(params), 2):
                h = tf.matmul(h, tf.cast(params[i], dtype)) + tf.cast(params[i + 1], dtype)
                h = tf.nn.relu(h) if i < len(params) - 2 else h
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.cast(h, "float32"))
            )
        for p, g in zip(params, tape.gradient(loss, params)):
            p.assign_sub(1e-3 * g)
        return loss

    return lambda: float(step())


def _torch_step(weights, x, y, dtype):
    import torch

    params = [torch.tensor(w, requires_grad=True) for pair in weights for w in pair]
    opt = torch.optim.SGD(params, lr=1e-3)
    x, y = torch.tensor(x), torch.tensor(y)

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
            h = x
            for i in range(0, len(params), 2):
                h = h @ params[i] + params[i + 1]
                h = torch.relu(h) if i < len(params) - 2 else h
        loss = torch.nn.functional.cross_entropy(h.float(), y)
        loss.backward()
        opt.step()
        return float(loss)

    return step


def _jax_step(weights, x, y, dtype):
    import jax
    import jax.numpy as jnp

    params = [jnp.asarray(w) for pair in weights for w in pair]

    def loss_fn(params):
        h = x.astype(dtype)
        for i in range(0, len(params), 2):
            h = h @ params[i].astype(dtype) + params[i + 1].astype(dtype)
            h = jax.nn.relu(h) if i < len(params) - 2 else h
        logp = jax.nn.log_softmax(h.astype("float32"))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    @jax.jit
    def update(params):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return [p - 1e-3 * g for p, g in zip(params, grads)], loss

    x, y = jnp.asarray(x), jnp.asarray(y)
    state = {"p": params}

    def step():
        state["p"], loss = update(state["p"])
        return float(loss)

    return step


def main() -> None:
    args = _args()
    import keras_perf as kp

    steps, repeats = (2, 1) if args.quick else (8, 3)
    report = kp.precision_report()
    auto = report["policy"]
    rows, ratios = [], {}
    for name in args.models:
        fns = _epochs(name, steps)
        result = abba(fns["mixed_bfloat16"], fns["float32"], repeats=repeats)
        ratios[name] = result["cpu_ratio"]
        target = ">= 1.8x" if name in ("mlp", "cnn") else "(figure)"
        rows.append(
            row(
                f"fit epoch float32 / mixed_bfloat16 time: {name}",
                result,
                target,
                note=f"{steps} steps/epoch",
            )
        )
        if name == "mlp":
            floor = _floor(steps)
            f = abba(floor["bfloat16"], floor["float32"], repeats=repeats)
            rows.append(
                row("  bare-framework floor, same MLP step (SGD)", f, "(figure)", note="floor")
            )
    slowest = min(ratios, key=ratios.get) if ratios else None
    auto_ratio = ratios[slowest] if auto == "mixed_bfloat16" and slowest else 1.0
    rows.append(
        row(
            f"auto ({auto}) speed over float32, slowest model ({slowest})",
            {"wall_ratio": auto_ratio, "cpu_ratio": auto_ratio, "repeats": repeats},
            ">= 1.0",
            note=report["reason"],
        )
    )
    print(report)
    finish(rows, args)


if __name__ == "__main__":
    main()
