"""Accuracy under `mixed_bfloat16` vs `float32` on digits: MLP and small CNN, 3 seeds each.

scikit-learn's bundled digits (1437 train / 360 test, `keras_perf.data.load_digits_split`),
trained with the same seeds, data order and optimizer (Adam 3e-3, batch 64) under each
policy; test accuracy per seed. The claim: the mean bfloat16 accuracy lies within the seed
spread (min-max) of float32's, widened by one test example (1/360) so that a spread of zero
still allows for a single flipped prediction. Accuracy, not speed: the machine's load does not
change these figures (bfloat16 units or not: where the CPU has none, bfloat16 is emulated,
slower, with the same rounding).

    KERAS_BACKEND=tensorflow python -m benchmarks.bench_bf16_accuracy [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics

SEEDS = (0, 1, 2)
POLICIES = ("float32", "mixed_bfloat16")


def _model(name: str):
    import keras

    L = keras.layers
    if name == "mlp":
        layers = [keras.Input((64,)), L.Dense(128, activation="relu"),
                  L.Dense(64, activation="relu")]  # fmt: skip
    else:
        layers = [keras.Input((8, 8, 1)), L.Conv2D(16, 3, padding="same", activation="relu"),
                  L.MaxPooling2D(), L.Conv2D(32, 3, padding="same", activation="relu"),
                  L.GlobalAveragePooling2D()]  # fmt: skip
    return keras.Sequential([*layers, L.Dense(10, dtype="float32")])


def accuracy(name: str, policy: str, seed: int, epochs: int) -> float:
    """Test accuracy of model `name` ("mlp" or "cnn") trained under `policy` with `seed`."""
    import keras

    from keras_perf.data import load_digits_split

    (x, y), (xt, yt) = load_digits_split(seed=0, sizes=(1437,))
    if name == "cnn":
        x, xt = x.reshape(-1, 8, 8, 1), xt.reshape(-1, 8, 8, 1)
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        model = _model(name)
        model.compile(
            keras.optimizers.Adam(3e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        model.fit(x, y, batch_size=64, epochs=epochs, verbose=0)
        return float(model.evaluate(xt, yt, verbose=0)[1])
    finally:
        keras.mixed_precision.set_global_policy("float32")
        keras.backend.clear_session()


def compare(name: str, epochs: int, seeds=SEEDS) -> dict:
    """Accuracies per policy and seed, their means, float32's spread and the verdict."""
    acc = {p: [accuracy(name, p, s, epochs) for s in seeds] for p in POLICIES}
    f32, bf16 = acc["float32"], acc["mixed_bfloat16"]
    slack = 1.0 / 360
    low, high = min(f32) - slack, max(f32) + slack
    mean = statistics.mean(bf16)
    return {
        "model": name,
        "epochs": epochs,
        "seeds": list(seeds),
        "accuracy": acc,
        "mean": {p: statistics.mean(v) for p, v in acc.items()},
        "float32_spread": [min(f32), max(f32)],
        "within_spread": low <= mean <= high,
    }


def main() -> None:
    import keras

    from ._harness import add_mode_flags, finish, resolve_modes, row

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_flags(p)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    args = resolve_modes(p.parse_args())
    # --quick (CI's smoke run of every row): 2 epochs and 2 seeds, 8 fits instead of 12 of 5
    # epochs (83 s of `bench --quick` on 2 loaded cores); its verdicts are not the claim's.
    # --smoke (CI): 1 epoch each, one seed (4 fits).
    epochs = {"mlp": 2, "cnn": 2} if args.quick else {"mlp": 30, "cnn": 30}
    if args.smoke:
        epochs = {"mlp": 1, "cnn": 1}
    seeds = SEEDS[:1] if args.smoke else SEEDS[:2] if args.quick else SEEDS
    results = [compare(name, epochs[name], seeds) for name in ("mlp", "cnn")]
    print(f"digits test accuracy, {keras.backend.backend()}, seeds {list(seeds)}")
    for r in results:
        a = r["accuracy"]
        print(
            f"{r['model']:<4} {r['epochs']} epochs  float32 {[round(v, 4) for v in a['float32']]}"
            f"  mixed_bfloat16 {[round(v, 4) for v in a['mixed_bfloat16']]}  means "
            f"{r['mean']['float32']:.4f} / {r['mean']['mixed_bfloat16']:.4f}  within float32's "
            f"spread (+-1/360): {r['within_spread']}"
        )
    rows = [
        row(
            f"digits {r['model'].upper()} test accuracy, mixed_bfloat16 mean / float32 mean "
            f"({r['epochs']} epochs, {len(r['seeds'])} seeds)",
            {
                "wall_ratio": r["mean"]["mixed_bfloat16"] / r["mean"]["float32"],
                "repeats": len(r["seeds"]),
            },
            "within float32's seed spread",
            note=(
                f"accuracy float32 {[round(v, 4) for v in r['accuracy']['float32']]}, "
                f"mixed_bfloat16 {[round(v, 4) for v in r['accuracy']['mixed_bfloat16']]}; within float32's spread (+-1/360): "
                f"{r['within_spread']} (ratio in the wall column)"
            ),
        )
        for r in results
    ]
    finish(rows, args)


if __name__ == "__main__":
    main()
