"""Overhead of kp.TrainingMonitor on `fit`: one epoch with the monitor vs one without.

An MLP on 64 features, batch 32, 64 steps per epoch (2048 examples), trained 3 epochs (`--quick`: 1) per
timed unit; the two variants share one model and alternate A B B A. Target: <= 1.02x.

    KERAS_BACKEND=tensorflow python -m benchmarks.bench_monitor [--quick] [--json PATH]
"""

from __future__ import annotations

import os
import tempfile

from ._harness import abba, finish, mlp, parse_args, row, summarize


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import numpy as np

    import keras_perf as kp

    steps, batch = (64, 32)
    repeats, epochs = (3, 1) if args.quick else (9, 3)
    rng = np.random.default_rng(0)
    x = rng.random((steps * batch, 64), dtype=np.float32)
    y = rng.integers(0, 10, steps * batch)
    model = mlp([256, 256], optimizer="adam", metrics=["accuracy"])
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
    hooks = _hook_cost(kp.TrainingMonitor, model, x, y, batch, epochs, repeats, tmp)
    note = (
        f"{steps} steps/epoch; monitor saw {r['examples']} examples, "
        f"{r['examples_per_s']:.0f} ex/s, step p50 {r['step_time_ms_p50']:.2f} ms"
    )
    claim = f"fit with TrainingMonitor vs without ({epochs} epoch{'s' * (epochs > 1)})"
    rows = [
        row(claim, result, "<= 1.02x", note=note),
        row(
            "  monitor's own hook time / fit time (1 + fraction)",
            hooks,
            "<= 1.02x",
            note="wall: perf_counter, cpu: thread_time inside the monitor's hooks",
        ),
    ]
    finish(rows, args)


def _hook_cost(monitor_cls, model, x, y, batch, epochs, repeats, tmp) -> dict:
    """Time spent inside the monitor's own hooks, as a fraction of the whole `fit`.

    Independent of load on a shared machine: the hooks' CPU time is read with
    `time.thread_time()` in whichever thread runs them (Keras' worker threads included) and
    set against the process CPU time of the fit; wall time likewise with `perf_counter`.
    """
    import time

    spent = []  # (wall, cpu) per hook call; list.append is safe from worker threads

    def timed_hook(name):
        hook = getattr(monitor_cls, name)

        def wrapper(self, *args, **kwargs):
            w0, c0 = time.perf_counter(), time.thread_time()
            hook(self, *args, **kwargs)
            spent.append((time.perf_counter() - w0, time.thread_time() - c0))

        return wrapper

    names = (
        "on_train_begin",
        "on_epoch_begin",
        "on_train_batch_end",
        "on_test_begin",
        "on_test_end",
        "on_epoch_end",
    )
    timed_cls = type("TimedMonitor", (monitor_cls,), {n: timed_hook(n) for n in names})
    mon = timed_cls(log_path=os.path.join(tmp, "hooks.jsonl"))
    wall, cpu = [], []
    for _ in range(repeats):
        spent.clear()
        w0, c0 = time.perf_counter(), time.process_time()
        model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[mon])
        fit_wall, fit_cpu = time.perf_counter() - w0, time.process_time() - c0
        wall.append(1 + sum(w for w, _ in spent) / fit_wall)
        cpu.append(1 + sum(c for _, c in spent) / fit_cpu)
    return summarize(wall, cpu)


if __name__ == "__main__":
    main()
