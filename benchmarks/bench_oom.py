"""Benchmark of kp.fit_with_oom_retry: per-epoch snapshot cost, and time to recover from an OOM.

1. Snapshot cost: one epoch of `model.fit` against one epoch of `kp.fit_with_oom_retry` (no
   OOM: the only extra work is the host copy of weights and Adam slots before the epoch) on a
   1.06M-parameter MLP, 128 steps per epoch. Target <= 1.03x.
2. Recovery: a fresh model trained one epoch with one out-of-memory error at its first step
   (raised by a callback with the backend's own OOM type, `kp.backend.oom_error`, while the
   model runs undivided batches), against a fresh model trained one epoch with the surviving
   micro-batch count from the start. The difference is what recovery costs: the exception,
   restoring the snapshot, clearing memory, making the `loss_scaled` twin and compiling its
   train step. Reported as a ratio and in seconds.
3. The ladder, on an out-of-memory injected at the 3rd step of epoch 1 (of 2) while the model
   runs its batch undivided and without remat: for the MLP above (no batch-dependent layer:
   micro-batches first) and for the same MLP with BatchNormalization after its first layer
   (remat first). Each against a fresh model trained with the winning rung from the start; the
   row gives the rung the ladder took, the largest weight difference from that run (float32;
   the issue's bound is 1e-6) and the seconds lost.

Run: python -m benchmarks.bench_oom [--quick | --smoke] [--json PATH]
"""

from __future__ import annotations

import statistics

import keras
import numpy as np

import keras_perf as kp

from . import _harness
from ._harness import abba, finish, parse_args, row, summarize, timed


def mlp(seed=0):
    return _harness.mlp([1024, 768], 256, seed=seed, optimizer=keras.optimizers.Adam(1e-3))


class OOMAtFirstStep(keras.callbacks.Callback):
    """Raises the backend's OOM error at the first step while batches are not micro-batched."""

    def on_train_batch_begin(self, batch, logs=None):
        if getattr(self.model, "microbatches", 1) == 1:
            raise kp.backend.oom_error("Out of memory while trying to allocate 1.00GiB (injected).")


def bn_mlp(seed=0):
    """The MLP with BatchNormalization after its first layer: the ladder tries remat first."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((256,))
    h = keras.layers.Dense(1024)(inp)
    h = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(h))
    h = keras.layers.Dense(768, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class OOMMidEpoch(keras.callbacks.Callback):
    """Raises the backend's OOM error at the 3rd step of epoch 1 while the model runs its
    batch undivided and without remat."""

    epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        plain = getattr(self.model, "microbatches", 1) == 1 and not getattr(
            self.model, "remat", None
        )
        if plain and self.epoch == 1 and batch == 2:
            raise kp.backend.oom_error("Out of memory while trying to allocate 1.00GiB (injected).")


def abba_seconds(a, b, repeats, once=False) -> tuple[dict, list]:
    """A B B A as in `_harness.abba`, keeping the wall seconds B costs over A per pair too
    (recovery is a fixed cost, read in seconds): (the ratios as `abba` gives them, seconds).
    `once` (`--smoke`): A then B, one time each, no warm-up before (a figure of nothing, the
    row's code path in half the runs)."""
    if once:
        (aw, ac), (bw, bc) = timed(a), timed(b)
        return summarize([bw / aw], [bc / max(ac, 1e-9)]), [bw - aw]
    wall, cpu, extra = [], [], []
    for _ in range(repeats):
        a1, b1, b2, a2 = timed(a), timed(b), timed(b), timed(a)
        wall.append((b1[0] + b2[0]) / (a1[0] + a2[0]))
        cpu.append((b1[1] + b2[1]) / (a1[1] + a2[1]))
        extra.append((b1[0] + b2[0] - a1[0] - a2[0]) / 2)
    result = {
        "wall_ratio": statistics.median(wall),
        "cpu_ratio": statistics.median(cpu),
        "wall_spread": (min(wall), max(wall)),
        "cpu_spread": (min(cpu), max(cpu)),
        "repeats": len(wall),
    }
    return result, extra


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) if np.size(u) else 0.0
        for u, v in zip(a.get_weights(), b.get_weights())
    )


def ladder_row(name, build, rung, x, y, batch, repeats, once=False) -> dict:
    """Section 3: one model's OOM mid-epoch, recovered by the ladder, against the winning rung
    from the start (`rung`: loss_scaled keyword arguments; `once`: see `abba_seconds`)."""
    fit = dict(batch_size=batch, epochs=2, shuffle=False, verbose=0)
    out = {}

    def from_start():
        out["ref"] = kp.loss_scaled(build(), **rung)
        out["ref"].fit(x, y, **fit)

    def recovering():
        h = kp.fit_with_oom_retry(build(), x, y, callbacks=[OOMMidEpoch()], **fit)
        out["model"], out["events"] = h.model, h.oom_events

    if not once:
        from_start(), recovering()  # warm up
    result, extra = abba_seconds(from_start, recovering, repeats, once)
    events = [(e["epoch"], e["strategy"]) for e in out["events"]]
    expected = [(1, "remat" if "remat" in rung else "microbatches")]
    if events != expected:  # else the weights would be compared with the wrong run
        raise RuntimeError(f"{name}: the ladder took {events}, expected {expected}")
    diff = _max_diff(out["model"], out["ref"])
    setting = ", ".join(f"{k}={v!r}" for k, v in rung.items())
    return row(
        f"OOM ladder, {name}: OOM at epoch 1 step 2, recovered vs {setting} from the start",
        result,
        "max |diff| <= 1e-6",
        note=(
            f"events (epoch, rung) {events}; weights max |diff| {diff:.1e}; recovery costs "
            f"{statistics.median(extra):+.2f} s wall (median; spread {min(extra):+.2f}.."
            f"{max(extra):+.2f})"
        ),
    )


def main():
    args = parse_args(__doc__.splitlines()[0])
    # --smoke (CI): 4 steps per epoch, one A B B A; the fresh-model rows (recovery, ladder) run
    # A then B once, without a warm-up (6 fresh models instead of 18).
    n, repeats = (128, 1) if args.smoke else (512, 2) if args.quick else (4096, 5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 256)).astype("float32")
    y = rng.integers(0, 10, n)
    batch = 32

    model = mlp()
    print(f"parameters: {model.count_params():,}; steps per epoch: {n // batch}")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # compile and warm up
    kp.fit_with_oom_retry(model, x, y, batch_size=batch, epochs=1, verbose=0)

    def plain():
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)

    def retrying():
        kp.fit_with_oom_retry(model, x, y, batch_size=batch, epochs=1, verbose=0)

    rows = [
        row(
            "fit_with_oom_retry vs fit, no OOM (1.06M params, Adam)",
            abba(plain, retrying, repeats=repeats),
            "<= 1.03x",
            note=f"{n // batch} steps/epoch",
        )
    ]

    def surviving():
        m = kp.loss_scaled(mlp(), microbatches=2)
        m.fit(x, y, batch_size=batch, epochs=1, verbose=0)

    def recovering():
        h = kp.fit_with_oom_retry(
            mlp(), x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[OOMAtFirstStep()]
        )
        if [e["microbatches"] for e in h.oom_events] != [1]:
            raise RuntimeError(f"expected one OOM event, got {h.oom_events}")

    if not args.smoke:
        surviving(), recovering()  # warm up imports and caches
    result, extra = abba_seconds(surviving, recovering, 1 if args.quick else repeats, args.smoke)
    rows.append(
        row(
            "recover from 1 OOM at step 0 vs start micro-batched (fresh model, 1 epoch)",
            result,
            "report",
            note=f"recovery costs {statistics.median(extra):+.2f} s wall (median; spread {min(extra):+.2f}..{max(extra):+.2f})",
        )
    )
    small = x[: 8 * batch], y[: 8 * batch]  # 8 steps per epoch
    ladder_repeats = 1 if args.quick else 3
    rows.append(
        ladder_row("MLP", mlp, {"microbatches": 2}, *small, batch, ladder_repeats, args.smoke)
    )
    rows.append(
        ladder_row(
            "MLP + BatchNormalization",
            bn_mlp,
            {"remat": "full"},
            *small,
            batch,
            ladder_repeats,
            args.smoke,
        )
    )
    finish(rows, args)


if __name__ == "__main__":
    main()
