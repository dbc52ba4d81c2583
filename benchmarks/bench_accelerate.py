"""`kp.accelerate`: plain `fit` against `fit` after `kp.accelerate`, and against the bare floor.

The zoo of issue 40: an MLP 64-256-256-10, a small CNN at 28x28, a Transformer encoder (2
blocks, d 128, seq 64), an LSTM classifier, a small ResNet with BatchNormalization at 32x32 and a
dict-input model (`--quick`: the MLP and the CNN only, smaller data; `--models mlp,lstm`: the
models whose names start so). For each, on the backend KERAS_BACKEND names: two models with the
same weights, one accelerated (`kp.accelerate(..., max_seconds=...)`, its report printed), both
warmed up with one epoch, then whole 3-epoch fits alternated A B B A, the median of the ratios
(wall and process CPU time): the gain a real `fit` shows. Beside it, `r.speedup` (what
accelerate predicted) over that gain (target: within 15 %). For every model, the bare-framework
floor too (`_zoo_floors.zoo_floor`: the same model, loss and Adam written in tf.function /
jax.jit / eager torch, and on torch also with the module under `torch.compile`, unless
`--smoke`): an epoch of its steps over the same data against an epoch of the accelerated `fit`,
one row per floor (on torch the faster of the two is the floor).

Ratios below 1 in the first rows are the gain (`fit` after accelerate / plain `fit`); the floor
rows are accelerated `fit` / bare framework (target <= 1.15).

    KERAS_BACKEND=torch python -m benchmarks.bench_accelerate --models mlp --n 2048 \
        --repeats 3 --max-seconds 10
"""

from __future__ import annotations

import numpy as np

from benchmarks import _harness
from benchmarks._zoo_floors import zoo_floor


def mlp(keras):
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def cnn(keras):
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )


def transformer(keras, d=128, seq=64, vocab=1000):
    tokens = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, d)(tokens)
    for _ in range(2):
        a = keras.layers.MultiHeadAttention(4, d // 4)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(4 * d, activation="relu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(d)(f))
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(tokens, out)


def lstm(keras, seq=32, vocab=1000):
    return keras.Sequential(
        [
            keras.Input((seq,), dtype="int32"),
            keras.layers.Embedding(vocab, 64),
            keras.layers.LSTM(64),
            keras.layers.Dense(10),
        ]
    )


def resnet(keras):
    def block(h, filters, stride):
        s = h
        h = keras.layers.Conv2D(filters, 3, stride, padding="same", use_bias=False)(h)
        h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        if stride != 1 or s.shape[-1] != filters:
            s = keras.layers.Conv2D(filters, 1, stride, use_bias=False)(s)
        return keras.layers.ReLU()(h + s)

    x = keras.Input((32, 32, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    for filters, stride in ((16, 1), (32, 2), (64, 2)):
        h = block(h, filters, stride)
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(x, out)


def dict_input(keras):
    a, b = keras.Input((32,), name="a"), keras.Input((8,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(64, activation="relu")(a), b])
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(10)(h))


def data(name, n, rng):
    y = rng.integers(0, 10, n).astype("int32")
    if name == "MLP 64-256-256-10":
        return rng.normal(size=(n, 64)).astype("float32"), y
    if name == "small CNN 28x28":
        return rng.normal(size=(n, 28, 28, 1)).astype("float32"), y
    if name == "Transformer encoder (2 blocks, d 128, seq 64)":
        return rng.integers(0, 1000, (n, 64)).astype("int32"), y
    if name == "LSTM classifier":
        return rng.integers(0, 1000, (n, 32)).astype("int32"), y
    if name == "small ResNet + BatchNorm 32x32":
        return rng.normal(size=(n, 32, 32, 3)).astype("float32"), y
    return {
        "a": rng.normal(size=(n, 32)).astype("float32"),
        "b": rng.normal(size=(n, 8)).astype("float32"),
    }, y


ZOO = {
    "MLP 64-256-256-10": mlp,
    "small CNN 28x28": cnn,
    "Transformer encoder (2 blocks, d 128, seq 64)": transformer,
    "LSTM classifier": lstm,
    "small ResNet + BatchNorm 32x32": resnet,
    "dict-input model": dict_input,
}
QUICK = ("MLP 64-256-256-10", "small CNN 28x28")


def _epochs(model, x, y, batch, epochs):
    return lambda: model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)


def measure(name, build, n, batch, max_seconds, repeats, rows, compiled_floor=True):
    import keras

    import keras_perf as kp

    backend = keras.backend.backend()
    rng = np.random.default_rng(0)
    x, y = data(name, n, rng)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(0)
    plain = build(keras)
    plain.compile(keras.optimizers.Adam(1e-3), loss)
    fast = keras.models.clone_model(plain)
    fast.set_weights(plain.get_weights())
    fast.compile(keras.optimizers.Adam(1e-3), loss)
    r = kp.accelerate(fast, x, y, batch_size=batch, max_seconds=max_seconds)
    print(f"\n{name}:\n{r}\n", flush=True)

    for m in (plain, fast):
        _epochs(m, x, y, batch, 1)()  # warm-up: trace and compile (a short last batch too)
    # The real gain: whole 3-epoch fits, alternated A B B A.
    res = _harness.abba(
        _epochs(plain, x, y, batch, 3), _epochs(fast, x, y, batch, 3), repeats=repeats
    )
    chosen = r.chosen or "nothing"
    rows.append(
        _harness.row(
            f"accelerate: 3-epoch fit after / plain ({name})",
            res,
            "<= 1.05",
            note=f"chosen {chosen}; load {_load()}",
        )
    )
    # r.speedup against the gain the 3-epoch fits show (1 / ratio): within 15 %.
    pred = {
        "wall_ratio": r.speedup * res["wall_ratio"],
        "cpu_ratio": r.speedup * res["cpu_ratio"],
        "wall_spread": tuple(r.speedup * v for v in res["wall_spread"]),
        "cpu_spread": tuple(r.speedup * v for v in res["cpu_spread"]),
        "repeats": res["repeats"],
    }
    rows.append(
        _harness.row(
            f"accelerate: r.speedup / real 3-epoch gain ({name})",
            pred,
            "0.87-1.15",
            note=f"r.speedup {r.speedup:.2f}x; real gain (CPU) {1 / res['cpu_ratio']:.2f}x, "
            f"(wall) {1 / res['wall_ratio']:.2f}x",
        )
    )
    print(
        f"{backend} {name}: r.speedup {r.speedup:.2f}x, real 3-epoch gain "
        f"{1 / res['cpu_ratio']:.2f}x (CPU) {1 / res['wall_ratio']:.2f}x (wall)",
        flush=True,
    )
    # The bare-framework floors: an epoch of the same model's steps, without Keras.
    steps = -(-n // batch)
    kinds = {"eager" if backend == "torch" else "compiled": False}
    if backend == "torch" and compiled_floor:
        kinds["torch.compile"] = True
    for kind, compiled in kinds.items():
        try:
            floor = zoo_floor(name, x, y, batch, compiled=compiled)
        except ValueError as e:  # torch.compile failing on this machine: no row, said why
            if not compiled:
                raise
            print(f"{backend} {name}: no {kind} floor: {e}", flush=True)
            continue
        res = _harness.abba(floor, _epochs(fast, x, y, batch, 1), repeats=repeats)
        rows.append(
            _harness.row(
                f"accelerate: fit after / bare framework, {kind} ({name})",
                res,
                "<= 1.15",
                note="floor: _zoo_floors.zoo_floor, the same model and Adam on the bare backend, "
                f"an epoch of {steps} steps against one epoch of fit; load {_load()}",
            )
        )


def _load() -> str:
    import os

    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _harness.add_mode_flags(p)
    p.add_argument("--json", metavar="PATH", help="write the result rows as JSON to PATH")
    p.add_argument("--models", help="comma-separated prefixes of the zoo's names (default: all)")
    p.add_argument("--n", type=int, help="examples (default 8192; --quick 2048)")
    p.add_argument("--repeats", type=int, help="A B B A repeats (default 5; --quick 3)")
    p.add_argument("--max-seconds", type=float, help="kp.accelerate's budget (default 30)")
    args = _harness.resolve_modes(p.parse_args())
    n = args.n or (512 if args.smoke else 2048 if args.quick else 8192)
    repeats = args.repeats or (1 if args.smoke else 3 if args.quick else 5)
    max_seconds = args.max_seconds or (1 if args.smoke else 2 if args.quick else 30)
    rows: list[dict] = []
    names = QUICK[:1] if args.smoke else QUICK if args.quick else tuple(ZOO)
    if args.models:
        wanted = [w.strip().lower() for w in args.models.split(",")]
        names = tuple(k for k in ZOO if any(k.lower().startswith(w) for w in wanted))
    for name in names:
        measure(name, ZOO[name], n, 64, max_seconds, repeats, rows, compiled_floor=not args.smoke)
    _harness.finish(rows, args)


if __name__ == "__main__":
    main()
