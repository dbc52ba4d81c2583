"""Overhead of kp.TrainingMonitor on `fit`: one epoch with the monitor vs one without.

An MLP on 64 features, batch 32, 64 steps per epoch (2048 examples), trained 3 epochs (`--quick`: 1) per
timed unit; the two variants share one model and alternate A B B A. Target: <= 1.02x.

    KERAS_BACKEND=tensorflow python benchmarks/bench_monitor.py [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import abba, finish, parse_args, row  # noqa: E402


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import keras
    import numpy as np

    import keras_perf as kp

    steps, batch = (64, 32)
    repeats, epochs = (3, 1) if args.quick else (9, 3)
    rng = np.random.default_rng(0)
    x = rng.random((steps * batch, 64), dtype=np.float32)
    y = rng.integers(0, 10, steps * batch)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    tmp = tempfile.mkdtemp()
    mon = kp.TrainingMonitor(log_path=os.path.join(tmp, "bench.jsonl"))

    def plain():
        model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)

    def monitored():
        model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[mon])

    for _ in range(2):  # compile, warm caches
        plain()
        monitored()
    result = abba(plain, monitored, repeats=repeats)
    r = mon.history[-1]
    note = (
        f"{steps} steps/epoch; monitor saw {r['examples']} examples, "
        f"{r['examples_per_s']:.0f} ex/s, step p50 {r['step_time_ms_p50']:.2f} ms"
    )
    claim = f"fit with TrainingMonitor vs without ({epochs} epoch{'s' * (epochs > 1)})"
    rows = [row(claim, result, "<= 1.02x", note=note)]
    finish(rows, args)


if __name__ == "__main__":
    main()
