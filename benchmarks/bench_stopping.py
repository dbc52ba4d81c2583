"""Claim: kp.EarlyStopping and kp.TimeLimit add no measurable cost to `fit` (<= 1.01x).

Measured, on the backend picked by KERAS_BACKEND, in one process, ABBA, median of repeats; each
unit of work is one `fit` call of several epochs (MLP 64-256-256-10 on scikit-learn's digits,
1437 training rows, batch 32, with validation on 360 rows):

1. `fit` with `kp.EarlyStopping` (never triggering) and `kp.TimeLimit` (a budget never reached)
   vs the same `fit` with no callback. Target <= 1.01x.
2. `kp.EarlyStopping(restore_best_weights=True)` vs `keras.callbacks.EarlyStopping(
   restore_best_weights=True)`: the drop-in costs what Keras' own costs. Target <= 1.01x.
3. `kp.TimeLimit(granularity="batch")` (a clock read per batch; `async_safe`) vs no callback.
   Target <= 1.01x.
4. Direct: the time both callbacks' hooks take per epoch (EarlyStopping.on_epoch_end, and
   TimeLimit's epoch hooks plus one batch hook per step, 45 steps), timed over many calls on a
   real model, added to the median epoch time of plain `fit`. On a shared machine the ABBA
   ratios above carry several % of noise either way; this bound does not.

Run: `python -m benchmarks.bench_stopping [--quick | --smoke] [--json out.json]`.
"""

from __future__ import annotations

import keras

import keras_perf as kp

from . import _harness

NEVER = 10**9  # patience / seconds large enough never to stop the run


digits = _harness.digits


def model() -> keras.Model:
    return _harness.mlp(
        [256, 256], seed=0, optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"]
    )


def fitter(m, data, epochs, make_callbacks):
    (x, y), val = data

    def run():
        m.fit(
            x,
            y,
            validation_data=val,
            batch_size=32,
            epochs=epochs,
            shuffle=False,
            callbacks=make_callbacks(),
            verbose=0,
        )

    return run


def compare(claim, data, epochs, repeats, base_cbs, cand_cbs, target="<= 1.01"):
    a = fitter(model(), data, epochs, base_cbs)
    b = fitter(model(), data, epochs, cand_cbs)
    a(), b()  # compile both before timing
    return _harness.row(claim, _harness.abba(a, b, repeats), target, note=f"{epochs} epochs/fit")


def hook_cost(data, calls: int) -> dict:
    import statistics
    import time

    (x, y), val = data
    m = model()
    m.fit(x, y, validation_data=val, batch_size=32, epochs=1, verbose=0)  # compile
    epochs = []
    for _ in range(5):
        epochs.append(
            _harness.timed(
                lambda: m.fit(x, y, validation_data=val, batch_size=32, epochs=1, verbose=0)
            )
        )
    epoch_wall = statistics.median(e[0] for e in epochs)
    epoch_cpu = statistics.median(e[1] for e in epochs)
    steps = -(-len(x) // 32)
    es = kp.EarlyStopping(patience=NEVER)
    tl = kp.TimeLimit(NEVER, granularity="batch")
    for cb in (es, tl):
        cb.set_model(m)
        cb.on_train_begin()

    def hooks():
        for epoch in range(calls):
            logs = {"loss": 1.0 / (epoch + 1), "val_loss": 1.0 / (epoch + 1), "accuracy": 0.5}
            tl.on_epoch_begin(epoch)
            for step in range(steps):
                tl.on_train_batch_end(step)
            es.on_epoch_end(epoch, logs)
            tl.on_epoch_end(epoch, logs)

    w0, c0 = time.perf_counter(), time.process_time()
    hooks()
    hook_wall, hook_cpu = (time.perf_counter() - w0) / calls, (time.process_time() - c0) / calls
    result = {
        "wall_ratio": (epoch_wall + hook_wall) / epoch_wall,
        "cpu_ratio": (epoch_cpu + hook_cpu) / epoch_cpu,
        "repeats": calls,
    }
    note = f"hooks {hook_wall * 1e6:.0f} us/epoch vs epoch {epoch_wall * 1e3:.0f} ms"
    return _harness.row(
        "hook time per epoch / epoch time (both callbacks)", result, "<= 1.01", note=note
    )


def main() -> None:
    args = _harness.parse_args(__doc__.splitlines()[0])
    repeats = 1 if args.smoke else 2 if args.quick else 9
    epochs = 1 if args.quick else 5
    data = digits()
    if args.smoke:  # CI: 4 training steps per epoch, one A B B A
        (x, y), (xv, yv) = data
        data = (x[:128], y[:128]), (xv[:64], yv[:64])
    elif args.quick:  # 16 training steps per epoch instead of 45
        (x, y), (xv, yv) = data
        data = (x[:512], y[:512]), (xv[:128], yv[:128])
    rows = [
        compare(
            "EarlyStopping + TimeLimit vs no callback",
            data,
            epochs,
            repeats,
            lambda: [],
            lambda: [kp.EarlyStopping(patience=NEVER), kp.TimeLimit(NEVER)],
        ),
        compare(
            "kp vs keras EarlyStopping (restore_best_weights)",
            data,
            epochs,
            repeats,
            lambda: [keras.callbacks.EarlyStopping(patience=NEVER, restore_best_weights=True)],
            lambda: [kp.EarlyStopping(patience=NEVER, restore_best_weights=True)],
        ),
        compare(
            "TimeLimit(granularity='batch') vs no callback",
            data,
            epochs,
            repeats,
            lambda: [],
            lambda: [kp.TimeLimit(NEVER, granularity="batch")],
        ),
        hook_cost(data, 20 if args.smoke else 200 if args.quick else 2000),
    ]
    _harness.finish(rows, args)


if __name__ == "__main__":
    main()
