"""Study: how much does tfmot's pruning cost over its own loop, on several architectures?

Not a claim script (`keras-perf bench` does not run it). It backs the discussion of the
"ours >= 1.3x faster than tfmot" target in docs/BENCHMARKS.md: since `kp.PruningCallback`
runs on Keras 3's `fit`, ours / tfmot can go no lower than (Keras 3 fit / tf_keras fit) /
(tfmot fit / tf_keras fit), whatever the callback costs.

For each architecture, four variants train on digits (tiled to 5,391 examples), one epoch per
timed unit, in rotating order (A B C D, D C B A, ...), median process CPU time per step:
plain Keras 3, Keras 3 + `kp.PruningCallback`, plain tf_keras, tf_keras + tfmot's
`prune_low_magnitude` and `UpdatePruningStep`. Same schedule in both (PolynomialDecay
0 -> 0.8, end 100000, frequency 100: active for the whole run), Adam 1e-3, accuracy metric.

    KERAS_BACKEND=tensorflow python -m benchmarks.study_tfmot_overhead [--repeats 5]
        [--steps-per-execution 1] [--arch mlp deep_mlp tutorial_cnn cnn]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_perf as kp  # noqa: E402
from keras_perf.data import load_digits_split  # noqa: E402

SCHEDULE = dict(
    initial_sparsity=0.0, final_sparsity=0.8, begin_step=0, end_step=100_000, frequency=100
)
BATCH = {"mlp": 32, "deep_mlp": 32, "tutorial_cnn": 128, "cnn": 32}


def layers_of(arch: str, L) -> list:
    """The architecture with layer module `L` (keras.layers or tf_keras.layers)."""
    if arch == "mlp":  # the claim script's model
        return [L.Input((64,)), L.Dense(512, activation="relu"),
                L.Dense(512, activation="relu"), L.Dense(10)]  # fmt: skip
    if arch == "deep_mlp":  # many small layers: per-layer costs weigh most
        return (
            [L.Input((64,))] + [L.Dense(128, activation="relu") for _ in range(8)] + [L.Dense(10)]
        )
    image = [L.Input((64,)), L.Reshape((8, 8, 1))]
    if arch == "tutorial_cnn":  # tfmot's pruning tutorial model, on 8x8 digits
        return image + [L.Conv2D(12, 3, activation="relu"), L.MaxPooling2D(2), L.Flatten(),
                        L.Dense(10)]  # fmt: skip
    if arch == "cnn":
        convs = [L.Conv2D(c, 3, padding="same", activation="relu") for c in (32, 32, 64, 64)]
        return (
            image
            + convs[:2]
            + [L.MaxPooling2D(2)]
            + convs[2:]
            + [L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10)]
        )
    raise ValueError(f"Unknown `arch` {arch!r}.")


def variants(arch: str, x, y, spe: int) -> dict:
    import tensorflow_model_optimization as tfmot
    import tf_keras

    batch = BATCH[arch]

    def keras3(prune: bool):
        model = keras.Sequential(layers_of(arch, keras.layers))
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=spe)  # fmt: skip
        cbs = [kp.PruningCallback(kp.PolynomialDecay(**SCHEDULE))] if prune else []
        return lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=cbs)

    def legacy(prune: bool):
        model = tf_keras.Sequential(layers_of(arch, tf_keras.layers))
        cbs = []
        if prune:
            schedule = tfmot.sparsity.keras.PolynomialDecay(**SCHEDULE)
            model = tfmot.sparsity.keras.prune_low_magnitude(model, pruning_schedule=schedule)
            cbs = [tfmot.sparsity.keras.UpdatePruningStep()]
        model.compile(tf_keras.optimizers.Adam(1e-3),
                      tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=spe)  # fmt: skip
        return lambda: model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=cbs)

    return {"keras3": keras3(False), "ours": keras3(True), "tf_keras": legacy(False),
            "tfmot": legacy(True)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--arch", nargs="+", default=list(BATCH))
    args = parser.parse_args()
    if keras.backend.backend() != "tensorflow":
        raise SystemExit("tfmot runs on TensorFlow only: set KERAS_BACKEND=tensorflow.")
    [(x, y)] = load_digits_split(seed=None, sizes=())  # all 1,797, in scikit-learn's order
    x, y = np.tile(x, (3, 1)), np.tile(y, 3)
    print(f"steps_per_execution={args.steps_per_execution}, repeats={args.repeats}")
    print("| arch | batch | CPU ms/step: Keras 3 / ours / tf_keras / tfmot | ours / Keras 3 | "
          "Keras 3 / tf_keras | tfmot / tf_keras | ours / tfmot | lowest reachable |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for arch in args.arch:
        fns = variants(arch, x, y, args.steps_per_execution)
        for fn in fns.values():  # compile and warm up
            fn(), fn()
        cpu = {k: [] for k in fns}
        for r in range(args.repeats):
            for key in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                t0 = time.process_time()
                fns[key]()
                cpu[key].append(time.process_time() - t0)
        steps = len(x) // BATCH[arch]
        m = {k: statistics.median(v) for k, v in cpu.items()}
        bound = m["keras3"] / m["tfmot"]  # a callback costing nothing on Keras 3's loop
        per = " / ".join(
            f"{1e3 * m[k] / steps:.2f}" for k in ("keras3", "ours", "tf_keras", "tfmot")
        )
        print(f"| {arch} | {BATCH[arch]} | {per} | {m['ours'] / m['keras3']:.3f} | "
              f"{m['keras3'] / m['tf_keras']:.3f} | {m['tfmot'] / m['tf_keras']:.3f} | "
              f"{m['ours'] / m['tfmot']:.3f} | {bound:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
