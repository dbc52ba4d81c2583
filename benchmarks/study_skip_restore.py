"""Study: what does restoring a skipped step's forward-pass updates cost on a finite step?

Not a claim script (`keras-perf bench` does not run it). It backs the cost figure of the
skipped-step row in docs/BENCHMARKS.md: the train step with the restore (a skipped step puts
back BatchNormalization's moving statistics and every other non-trainable variable the
forward pass wrote) against the same step with it switched off (a subclass that restores no
variable), on a BatchNormalization MLP 64-256-256-10, batch 128, Adam, no step skipped.
`train_on_batch` alternated A B B A in blocks of `--steps` steps, 4 blocks, median ratio of
process CPU time, for `microbatches` 1 and 2.

    KERAS_BACKEND=torch python -m benchmarks.study_skip_restore [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import keras
import numpy as np

import keras_perf as kp


class _NoRestore(kp.LossScaledModel):
    """The train step without the restore (the baseline)."""

    def _kp_restored_on_skip(self):
        return (False,) * len(self.non_trainable_variables)


def _build(cls, microbatches):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    h = inputs
    for _ in range(2):
        h = keras.layers.Dense(256)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
    outputs = keras.layers.Dense(10)(h)
    model = cls(inputs=inputs, outputs=outputs, microbatches=microbatches, name="bn_mlp")
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main(steps: int = 40) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 64)).astype("float32")
    y = rng.integers(0, 10, 128)
    for microbatches in (1, 2):
        new, old = _build(kp.LossScaledModel, microbatches), _build(_NoRestore, microbatches)
        for model in (new, old):
            for _ in range(5):
                model.train_on_batch(x, y)

        def block(model):
            start = time.process_time()
            for _ in range(steps):
                model.train_on_batch(x, y)
            return (time.process_time() - start) / steps

        ratios, per_step = [], []
        for _ in range(4):
            a1, b1, b2, a2 = block(new), block(old), block(old), block(new)
            ratios.append((a1 + a2) / (b1 + b2))
            per_step.append((a1 + a2) / 2)
        print(
            f"{keras.backend.backend()} microbatches={microbatches}: with / without the "
            f"restore, CPU time per step, median {statistics.median(ratios):.3f} (blocks "
            f"{', '.join(f'{r:.3f}' for r in ratios)}); "
            f"{1e3 * statistics.median(per_step):.2f} ms per step",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    main(parser.parse_args().steps)
