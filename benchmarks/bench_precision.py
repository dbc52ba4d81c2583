"""Mixed precision on this device: `fit` epochs under `mixed_bfloat16` vs `float32`, and `auto`.

Four models (the MLP 1024-2048-2048-10 at batch 512; a CNN conv 64-64-pool-128-GAP on 32x32x3
at batch 128; a Transformer encoder, d=256, 4 heads, 2 blocks, sequence 128, batch 32; and
`keras.applications.ResNet50(weights=None)` at 64x64, batch 32), each trained whole epochs of
`fit` under both policies, A B B A, median of the ratios (wall and process CPU time). The ratio
is float32 time / mixed_bfloat16 time: above 1, bfloat16 is faster. Per model, three rows of
that ratio: plain `fit`, `fit` of `kp.loss_scaled(model)` (keras-perf's train step), and the
bare framework's floor (benchmarks/_precision_floors.py: the same model's training step on bare
TensorFlow, JAX or torch, `torch.autocast("cpu", torch.bfloat16)` on torch, the same number
of steps); then our step against the floor, both in bfloat16 (time of `kp.loss_scaled`'s
epoch over the floor's). The last row is `kp.setup_mixed_precision("auto")`: its pick and its
speed over float32 on the slowest model (1.0 where it picks float32). Targets on a CPU with
AMX/AVX-512 BF16 units: TensorFlow >= 1.8x on the MLP and the CNN; torch's `kp.loss_scaled`
within 10 % of the autocast floor (<= 1.10); `auto` never slower than float32 (>= 1.0).
On a CPU where `kp.precision_report()` measures bfloat16 matmuls below 0.05x float32's
(emulated: torch on an AVX2-only CPU, 0.016x) the models are not timed; the kernel ratio is
the row.

    KERAS_BACKEND=tensorflow python -m benchmarks.bench_precision [--quick] [--json PATH]
        [--models mlp,cnn,transformer,resnet50] [--traced (torch)]
    # --quick alone: mlp,cnn (mlp alone on a CPU without bf16 units), 2 steps per epoch
"""

from __future__ import annotations

import argparse

import numpy as np

from ._harness import abba, add_mode_flags, finish, resolve_modes, row

MODELS = ("mlp", "cnn", "transformer", "resnet50")


# Below this bfloat16/float32 matmul ratio on a CPU, bfloat16 is emulated so slowly that the
# models are not timed (JAX measured 0.07x here and its quick run took 34 s; torch 0.016x).
EMULATED = 0.05


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_flags(p)
    p.add_argument("--json", metavar="PATH", help="write the result rows as JSON to PATH")
    p.add_argument(
        "--traced",
        action="store_true",
        help="PyTorch: also time kp.loss_scaled(model, traced_step=True), keras-perf's traced "
        "step (what kp.accelerate applies), against the floor and the eager step",
    )
    p.add_argument(
        "--models",
        help=f"comma-separated subset of {','.join(MODELS)} (default: all; --quick: mlp,cnn, "
        "or mlp alone on a CPU without bfloat16 units)",
    )
    args = resolve_modes(p.parse_args())
    default = ",".join(MODELS)
    if args.quick:
        # Where the CPU has no bfloat16 units every bfloat16 kernel is emulated: the quick CNN
        # rows took 2 of the 4 minutes on an AVX2-only EPYC (2026-11-27), and measure nothing
        # a user would want there.
        from keras_perf._cpu import cpu_info

        flags = cpu_info()[1]
        default = "mlp,cnn" if flags & {"avx512_bf16", "amx_bf16"} else "mlp"
    args.models = [m.strip() for m in (args.models or default).split(",") if m.strip()]
    bad = sorted(set(args.models) - set(MODELS))
    if bad:
        p.error(f"--models: unknown {bad}; choose from {list(MODELS)}")
    return args


def _build(name: str, policy: str, smoke: bool = False):
    """(model, x, y, batch) for `name`, built under `policy`; logits out in float32 (`smoke`:
    an eighth of the batch)."""
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
    if smoke:
        batch //= 8
    outputs = L.Dense(10, dtype="float32")(h)
    model = keras.Model(inputs, outputs)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    return model, rng.standard_normal((batch, *shape), dtype=np.float32), batch, rng


def _epochs(name: str, steps: int, smoke: bool = False, traced: bool = False) -> dict:
    """One-epoch callables `{(variant, policy): fn}`, each warmed up: "keras" (plain `fit`),
    "loss_scaled" (`fit` of `kp.loss_scaled(model)`), with `traced` "traced" (the same with
    `traced_step=True`) and "floor" (the same model's step on the bare framework, `steps`
    calls), under float32 and mixed_bfloat16."""
    import keras

    import keras_perf as kp

    from ._precision_floors import precision_floor

    fns = {}
    for policy in ("float32", "mixed_bfloat16"):
        for variant in ("keras", "loss_scaled", "traced")[: 3 if traced else 2]:
            model, x1, batch, rng = _build(name, policy, smoke)
            if variant != "keras":
                model = kp.loss_scaled(model, traced_step=variant == "traced")
            x = np.concatenate([x1] * steps)
            y = rng.integers(0, 10, len(x))

            def epoch(model=model, x=x, y=y, batch=batch):
                model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

            epoch()  # trace, warm up
            fns[variant, policy] = epoch
        keras.mixed_precision.set_global_policy("float32")
        step = precision_floor(name, x1, y[:batch], policy.replace("mixed_", ""))

        def floor_epoch(step=step):
            for _ in range(steps):
                step()

        fns["floor", policy] = floor_epoch
    keras.mixed_precision.set_global_policy("float32")
    return fns


def main() -> None:
    args = _args()
    import keras

    import keras_perf as kp

    # --smoke (CI): one step per epoch at an eighth of the batch (MLP 64 rows): the same rows.
    steps, repeats = (1, 1) if args.smoke else (2, 1) if args.quick else (8, 3)
    report = kp.precision_report()
    auto = report["policy"]
    rows, ratios = [], {}
    matmul = report["speedup"]["matmul"]
    models = args.models
    if report["device"].get("kind") == "CPU" and matmul is not None and matmul < EMULATED:
        # torch's emulated bfloat16 on an AVX2 EPYC (matmul 0.016x): the quick MLP epoch did
        # not finish in 7 minutes. The kernel ratio is the row; the models are not timed.
        rows.append(
            row(
                "bfloat16 / float32 matmul throughput (kp.precision_report); models not timed",
                {"wall_ratio": matmul, "cpu_ratio": None, "repeats": 1},
                "(figure)",
                note=f"bfloat16 is emulated on this CPU, {1 / matmul:.0f}x slower than float32",
            )
        )
        models = []
    traced = args.traced and keras.backend.backend() == "torch"
    for name in models:
        fns = _epochs(name, steps, args.smoke, traced)
        variants = [
            ("keras", "fit epoch"),
            ("loss_scaled", "kp.loss_scaled fit epoch"),
            ("floor", "  bare-framework floor, same steps"),
        ]
        if traced:
            variants.insert(2, ("traced", "kp.loss_scaled(traced_step=True) fit epoch"))
        for variant, claim in variants:
            result = abba(fns[variant, "mixed_bfloat16"], fns[variant, "float32"], repeats)
            if variant == "keras":
                ratios[name] = result["cpu_ratio"]
            target = ">= 1.8x (TF)" if variant == "keras" and name in ("mlp", "cnn") else "(figure)"
            rows.append(row(f"{claim} float32 / mixed_bfloat16 time: {name}", result, target,
                            note=f"{steps} steps/epoch"))  # fmt: skip
        result = abba(fns["floor", "mixed_bfloat16"], fns["loss_scaled", "mixed_bfloat16"], repeats)
        rows.append(row(f"  kp.loss_scaled / floor time, both mixed_bfloat16: {name}", result,
                        "<= 1.10 (torch)", note="our step against the bare framework's"))  # fmt: skip
        if traced:
            result = abba(fns["floor", "mixed_bfloat16"], fns["traced", "mixed_bfloat16"], repeats)
            rows.append(row(f"  traced step / floor time, both mixed_bfloat16: {name}", result,
                            "<= 1.10 (torch)", note="kp.accelerate's torch step"))  # fmt: skip
            result = abba(fns["traced", "mixed_bfloat16"], fns["loss_scaled", "mixed_bfloat16"],
                          repeats)  # fmt: skip
            rows.append(row(f"  eager / traced step time, both mixed_bfloat16: {name}", result,
                            "(figure)", note="above 1: the traced step is faster"))  # fmt: skip
        del fns
        # As it goes: a model can take long where bfloat16 is emulated.
        for r in rows[-(len(variants) + 1 + 2 * traced) :]:
            print(f"{r['claim']:<60} cpu {r['cpu_ratio']} wall {r['wall_ratio']}", flush=True)
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
