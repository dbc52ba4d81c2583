"""The what-ifs timed: the context the changes get, and each change applied, warmed up, timed
against the baseline and undone.

Lives here: `what_ifs` (the changes `_what_if.candidates` offers, in the order most likely
to help the bottleneck, with the epoch timing for short epochs) and `_time_changes`. Not
here: the changes themselves (`_what_if`), the baseline (`_core`), timed fits (`_measure`).
"""

from __future__ import annotations

import time

import keras
import numpy as np

from keras_perf import _fit_measure as _measure
from keras_perf import backend as _backend
from keras_perf.diagnosis import _what_if


class _Context:
    """What the what-ifs need to know about this run."""

    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.mixed_twin = None

    def use_mixed_twin(self, policy):
        twin = _measure.policy_twin(self.model, policy)
        previous = keras.mixed_precision.global_policy()
        try:
            keras.mixed_precision.set_global_policy(policy)
            with _backend.model_scope(self.model):
                _measure.compile_twin(
                    twin,
                    self.compile_args,
                    optimizer=_measure._fresh(self.compile_args["optimizer"]),
                )
        finally:
            keras.mixed_precision.set_global_policy(previous)
        self.mixed_twin = twin
        return twin

    def drop_mixed_twin(self):
        self.mixed_twin = None

    def batch_of(self, size):
        """`size` examples as `(x, y, sample_weight)` numpy arrays, to measure a step's memory:
        the user's arrays, else the batches held in memory."""
        if self.source.kind == "arrays":
            parts = (self.source.x, self.source.y, None)
        else:
            parts = self.in_memory

        def take(t):
            return np.asarray(keras.ops.convert_to_numpy(t[:size]))

        return tuple(None if p is None else keras.tree.map_structure(take, p) for p in parts)


class _AboveLimit(Exception):
    """A what-if whose measured step peak is above `memory_limit_bytes`: as an out-of-memory."""

    def __init__(self, peak):
        super().__init__(peak)
        self.peak = peak


def mib(n) -> str:
    return f"{n / 2**20:,.1f} MiB"


# The changes most likely to help each bottleneck (prefixes of their names), timed first in
# case the budget runs out.
_FIRST_FOR = {
    "input": ("PyDataset", "tf.data"),
    "host": ("steps_per_execution", "jit_compile", "batch_size"),
    "compute": ("mixed", "jit_compile", "batch_size"),
}


def _memory_rule(r, peak, device_bytes, limit) -> tuple[bool, bool]:
    """(the current step fits, twice the batch fits): with a cap, the step's measured peak
    against it; else, on an accelerator, twice the peak accelerator memory against the
    device's; else (a CPU, or a peak not known) both fit."""
    if limit is not None:
        step = r.step_memory["peak_bytes"] if r.step_memory is not None else None
        if step is None:
            return True, True
        return step <= limit, 2 * step <= limit
    return True, peak is None or device_bytes is None or 2 * peak < device_bytes


def what_ifs(r, model, can_recompile, peak, bottleneck, max_seconds, limit=None) -> list:
    """Each change that applies (`_what_if.candidates`), timed against the baseline."""
    source, twin, B, notes = r.source, r.twin, r.B, r.notes
    base_kwargs = (
        source.fit_kwargs()
        if not source.one_pass
        else _backend.array_fit_kwargs(twin, r.xs, r.ys, r.sws, B, shuffle=False)
    )
    base_step = r.together if not source.one_pass else r.t_b
    device_bytes = None
    for d in _backend.list_devices():
        if d["kind"] in ("GPU", "TPU") and d.get("memory_bytes"):
            device_bytes = d["memory_bytes"]
            break
    current_fits, larger_batch_fits = _memory_rule(r, peak, device_bytes, limit)
    ctx = _Context(
        source=source,
        twin=twin,
        model=model,
        compile_args=_measure.compile_args(model),
        batch_size=B,
        base_fit_kwargs=base_kwargs,
        steps=r.n,
        can_recompile=can_recompile,
        peak_memory_bytes=peak,
        device_bytes=device_bytes,
        memory_limit=limit,
        step_memory=r.step_memory,
        current_fits=current_fits,
        larger_batch_fits=larger_batch_fits,
        in_memory=(r.xs, r.ys, r.sws),
        # The peaks of the batch, micro-batching and remat what-ifs: measured where memory
        # can be the limit (an accelerator, or a cap); on a CPU without a cap nothing runs
        # out, and on JAX each measure is one more compilation.
        measure_memory=r.step_memory is not None
        and (limit is not None or _backend.has_accelerator()),
        input_per_batch=r.input_per_batch,
        max_seconds=max_seconds,
        bottleneck=bottleneck,
    )
    changes, more_notes = _what_if.candidates(ctx)
    first = _FIRST_FOR[bottleneck]
    changes.sort(key=lambda c: next((i for i, p in enumerate(first) if c.change.startswith(p)), 99))
    notes.extend(more_notes)
    ctx.setup = min(r.setups) if r.setups else None
    ctx.trace_s = r.trace_s
    ctx.epoch = None
    S = source.batches_per_epoch
    # Short epochs: whole epochs as `fit` runs them (their set-up and teardown weigh
    # against a few milliseconds of steps) are timed for every change, as many as fit in
    # 40 % of the budget left: a fit of 3 to 8 epochs (a teardown can stall at random, on
    # TF's tf.data, so a mean over epochs), up to 3 such fits (their median: a busy machine
    # can slow one).
    round_s = S * base_step * (1 + len(changes)) if S and not source.one_pass else None
    affordable = int(0.4 * (r.deadline - time.perf_counter()) / round_s) if round_s else 0
    ctx.epochs = min(8, affordable)
    ctx.epoch_fits = max(1, min(3, affordable // max(ctx.epochs, 1)))
    if ctx.epochs >= 3:
        ctx.epoch = _measure.epoch_seconds(
            twin, r.deadline, ctx.epochs, ctx.epoch_fits, **base_kwargs
        )
    # A change that fails inside `fit` can leave the twin's variables without values (JAX
    # drops them during `fit` and puts them back at its end): the state to put back then.
    ctx.twin_state = _measure.Snapshot(twin)
    return _time_changes(ctx, changes, base_step, B, r.deadline, max(r.retrace), notes)


def _time_changes(ctx, changes, base_step, B, deadline, retrace_s, notes):
    results = []
    changes = list(changes)
    i = 0
    while i < len(changes):  # a change that runs out of memory may queue another
        change = changes[i]
        i += 1
        remaining = len(changes) - i + 1
        left = deadline - time.perf_counter()
        warm_up = retrace_s * change.retraces
        if change.trace_factor is not None:
            warm_up = max(warm_up, change.trace_factor * ctx.trace_s)
        measure = change.memory_batch is not None and ctx.measure_memory
        if measure:
            warm_up *= 2  # its step's memory measured too: one more step, or one more compile
        if left < warm_up + ctx.steps * base_step:
            notes.append(f"{change.change} not measured: the time budget ran out.")
            continue
        target, peak = ctx.twin, None
        try:
            target = change.apply() or ctx.twin
            if measure:
                peak = _measure.step_peak(target, ctx.batch_of(change.memory_batch))["peak_bytes"]
                if ctx.memory_limit is not None and peak > ctx.memory_limit:
                    raise _AboveLimit(peak)
            k = change.steps_multiple
            n = max((ctx.steps // k) * k, k)
            if change.retraces:
                t0 = time.perf_counter()
                _measure.fit_steps(target, min(2 * k, n), None, **change.fit_kwargs)  # trace
                if time.perf_counter() > deadline:
                    notes.append(
                        f"{change.change} not measured: its warm-up took "
                        f"{time.perf_counter() - t0:.1f} s, past the time budget."
                    )
                    continue
            reserve = 0.0
            if ctx.epoch is not None:
                reserve = (ctx.epochs * ctx.epoch_fits + 1) * ctx.epoch
            slice_end = time.perf_counter() + max(left / remaining - reserve, 0.0)
            # A change to the input is timed from the start of its fit, less the set-up the
            # unchanged input needed: batches its workers queue meanwhile are not free.
            setup = ctx.setup if not change.retraces else None
            per_step, done = _measure.repeat_fits(
                target, n, slice_end, deadline, setup=setup, **change.fit_kwargs
            )
            epoch = None
            if ctx.epoch is not None:
                epoch = _measure.epoch_seconds(
                    target, deadline, ctx.epochs, ctx.epoch_fits, **change.fit_kwargs
                )
        except Exception as exc:  # the change does not work here: not offered
            ctx.twin_state.restore()
            above = isinstance(exc, _AboveLimit)
            if above or _backend.is_oom(exc):
                if not above:
                    _backend.clear_memory()
                why = (
                    f"peaks at {mib(exc.peak)} per step, above memory_limit_bytes "
                    f"({mib(ctx.memory_limit)}): not timed"
                    if above
                    else "did not fit in memory"
                )
                instead = change.on_oom() if change.on_oom is not None else []
                if instead:
                    names = [
                        "micro-batched" if "micro" in c.change else "with remat" for c in instead
                    ]
                    notes.append(f"{change.change} {why}: {' and '.join(names)} instead.")
                    changes[i:i] = instead
                elif change.on_oom is None and change.memory_batch is not None:
                    notes.append(f"{change.change} {why}.")  # itself a way to use less memory
                else:
                    notes.append(
                        f"{change.change} {why}; kp.fit_with_oom_retry climbs remat and "
                        "micro-batching when a batch does not fit."
                    )
            else:
                notes.append(f"{change.change} not offered: it failed here ({type(exc).__name__}).")
            continue
        finally:
            target.stop_training = False
            change.undo()
        per_example = per_step / change.examples_per_step
        speedup = (base_step / B) / per_example
        if epoch is not None:  # the same examples in each epoch: the ratio of their times
            speedup = ctx.epoch / epoch
        results.append(
            {
                "change": change.change,
                "speedup": round(speedup, 3),
                "how": change.how,
                "examples_per_s": round(1.0 / per_example, 1),
                "peak_bytes": peak,
            }
        )
    results.sort(key=lambda r: -r["speedup"])
    return results
