"""Claim: kp.find_learning_rate costs its `steps` training steps plus one save/restore of the state.

Measured, on the backend picked by KERAS_BACKEND, in one process, ABBA, median of repeats (MLP
64-256-256-10 on scikit-learn's digits, Adam, batch 32):

1. `kp.find_learning_rate(model, x, y, steps=N)` (a learning-rate range low enough never to
   diverge, so all N steps run) vs `model.fit(x, y, epochs=1, steps_per_epoch=N)`, the same N
   training steps in Keras' loop. The test runs one step per epoch (so that each logged loss is
   one step's), and pays Keras' per-epoch work N times; the ratio is what that and the
   save/restore cost. Reported, with the time per step.
2. Direct: one save and restore of the state (`ModelState`: every variable of the model, the
   optimizer and the metrics copied to the host and assigned back), timed over many calls.

Run: `python -m benchmarks.bench_lr_finder [--quick] [--json out.json]`.
"""

from __future__ import annotations

import keras

import keras_perf as kp
from keras_perf.lr_finder._state import ModelState

from . import _harness


def model() -> keras.Model:
    return _harness.mlp([256, 256], seed=0, optimizer=keras.optimizers.Adam(1e-3))


def range_test_vs_fit(x, y, steps: int, repeats: int) -> dict:
    m = model()

    def baseline():
        m.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=steps, verbose=0)

    def candidate():
        kp.find_learning_rate(m, x, y, min_lr=1e-7, max_lr=1e-5, steps=steps, batch_size=32)

    baseline(), candidate()  # compile before timing
    result = _harness.abba(baseline, candidate, repeats)
    return _harness.row(
        f"find_learning_rate(steps={steps}) vs fit of {steps} steps",
        result,
        "report",
        note="one step per epoch",
    )


def save_restore_cost(x, y, calls: int) -> dict:
    import time

    m = model()
    m.fit(x, y, batch_size=32, epochs=1, verbose=0)  # everything built
    state = ModelState(m)
    state.save_attributes()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        state.save_variables()
        state.restore()
    wall, cpu = (time.perf_counter() - w0) / calls, (time.process_time() - c0) / calls
    epoch = _harness.timed(lambda: m.fit(x, y, batch_size=32, epochs=1, verbose=0))
    result = {"wall_ratio": wall / epoch[0], "cpu_ratio": cpu / epoch[1], "repeats": calls}
    n = len(m.variables) + len(m.optimizer.variables) + len(m.metrics_variables)
    note = f"{wall * 1e3:.1f} ms for {n} variables; an epoch of 134 steps {epoch[0] * 1e3:.0f} ms"
    return _harness.row("save + restore of the state / one epoch", result, "report", note=note)


def main() -> None:
    args = _harness.parse_args(__doc__.splitlines()[0])
    import numpy as np

    (x, y), _ = _harness.digits()
    x, y = np.concatenate([x] * 3), np.concatenate([y] * 3)  # 134 batches: room for 100 steps
    steps, repeats, calls = (20, 1, 5) if args.quick else (100, 5, 50)
    rows = [range_test_vs_fit(x, y, steps, repeats), save_restore_cost(x, y, calls)]
    _harness.finish(rows, args)


if __name__ == "__main__":
    main()
