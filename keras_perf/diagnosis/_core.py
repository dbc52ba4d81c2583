"""`kp.diagnose`: where the training time goes, and what each change would buy, measured."""

from __future__ import annotations

import math
import time

import keras
import numpy as np

from keras_perf import backend as _backend
from keras_perf._utils import check_bool, check_int, check_number
from keras_perf.diagnosis import _data, _measure, _what_if
from keras_perf.diagnosis._report import Diagnosis

# Share of the budget for the four baseline measurements when what-ifs follow.
_BASELINE_SHARE = 0.45
# The shortest fit that times the step alone, and how often its batches may be repeated in
# memory to make it that long.
_MIN_FIT_S = 0.1
_MAX_REPEATS_IN_MEMORY = 16
_MAX_REPEATED_BYTES = 256 * 2**20


def _repeats_in_memory(fit_s: float, nbytes: int) -> int:
    """How many times to repeat the in-memory batches so that a fit of them lasts `_MIN_FIT_S`
    (`fit_s`: their fit once), at most `_MAX_REPEATS_IN_MEMORY` times and `_MAX_REPEATED_BYTES`."""
    if fit_s >= _MIN_FIT_S:
        return 1
    wanted = math.ceil(_MIN_FIT_S / fit_s) if fit_s > 0 else _MAX_REPEATS_IN_MEMORY
    return max(min(wanted, _MAX_REPEATS_IN_MEMORY, _MAX_REPEATED_BYTES // max(nbytes, 1)), 1)


class _Context:
    """What the what-ifs need to know about this run."""

    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.mixed_twin = None

    def use_mixed_twin(self, policy):
        previous = keras.mixed_precision.global_policy()
        try:
            keras.mixed_precision.set_global_policy(policy)

            def clone(layer):
                config = layer.get_config()
                if "dtype" in config:
                    config["dtype"] = policy
                return type(layer).from_config(config)

            with _backend.model_scope(self.model):
                twin = keras.models.clone_model(self.model, clone_function=clone)
                twin.set_weights(self.model.get_weights())
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


def _check(model, steps, max_seconds, batch_size, what_if):
    if not isinstance(model, keras.Model):
        raise TypeError(f"diagnose: `model` must be a keras.Model, got {type(model).__name__}.")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            "diagnose: `model` is not compiled; call `model.compile(optimizer=..., loss=...)` "
            "first, as for fit."
        )
    check_int("steps", steps, minimum=1)
    check_number("max_seconds", max_seconds, low=0.0, low_inclusive=False)
    check_int("batch_size", batch_size, minimum=1, allow_none=True)
    check_bool("what_if", what_if)


def diagnose(model, x, y=None, batch_size=None, steps=50, max_seconds=60, what_if=True):
    """Measure where `model`'s training time goes on this data, and what each change buys.

    Runs real `fit` calls for a few dozen steps each on a twin of `model` (same layers,
    weights and compile settings), so `model` itself, its optimizer and metrics are untouched
    and its next `fit` is what it would have been. Three measurements split the time of one
    step: the input alone, the step alone on batches held in memory (at the batch size and at
    half of it: the part that does not grow with the batch is per-step "host" overhead, the rest
    "compute"), and the two together as `fit` runs them. Then each change that applies
    (`steps_per_execution`, `jit_compile`, `PyDataset` workers, tf.data prefetch, parallel map
    and cache, a larger batch, micro-batched where memory is the limit, mixed precision on a
    GPU) is timed with a real `fit` from its start.

    Args:
        model: A compiled `keras.Model`.
        x: The training data as `fit` takes it: arrays (or a dict/list of them), a
            `tf.data.Dataset`, a `keras.utils.PyDataset`, a torch `DataLoader`, or a generator
            (read once: at most `steps` batches are taken from it).
        y: Targets when `x` is arrays. Defaults to `None`.
        batch_size: Batch size when `x` is arrays. Defaults to `None` (32, as in `fit`).
        steps: Steps per measurement (fewer when `max_seconds` runs out). Defaults to `50`.
        max_seconds: Time budget, not counting the first trace of the train function.
            Defaults to `60`.
        what_if: Whether to measure the changes. Defaults to `True`.

    Returns:
        A `Diagnosis`: `bottleneck`, `shares`, `examples_per_s`, `what_if`,
        `peak_memory_bytes`; `print` it for a table, `to_dict()` for JSON, `plot(path)`.

    Raises:
        ValueError: An uncompiled model, `steps < 1`, `max_seconds <= 0`, or data `fit` would
            reject (before anything is measured).
        TypeError: Arguments of the wrong type.

    Example:

    ```python
    import keras, numpy as np
    import keras_perf as kp
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.zeros((256, 8), "float32"), np.zeros((256, 1), "float32")
    d = kp.diagnose(model, x, y, batch_size=16, steps=10, max_seconds=5)
    print(d.bottleneck, d.shares)
    ```
    """
    _check(model, steps, max_seconds, batch_size, what_if)
    source = _data.make_source(x, y, batch_size, steps)
    rng = _measure.RandomState()
    try:
        return _run(model, source, steps, float(max_seconds), what_if)
    finally:
        rng.restore()


def _repeat(model, n, slice_end, deadline, max_repeats=7, setups=None, setup=None, **fit_kwargs):
    """Fastest seconds per step over `n`-step fits repeated until `slice_end` (3 to 7 times).

    A fit of a few dozen small steps lasts milliseconds, where one lost time slice on a busy
    machine doubles it: as `timeit` does, the fastest of several repeats is the estimate least
    disturbed by other work on the machine.
    """
    per_step, done = [], n
    for _ in range(max_repeats):
        seconds, done, clock = _measure.fit_steps(model, n, deadline, setup, **fit_kwargs)
        per_step.append(seconds / done)
        if setups is not None and clock.setup is not None:
            setups.append(clock.setup)
        if clock.late:  # stopped at the deadline: the later measurements take fewer steps
            return min(per_step), done
        if time.perf_counter() > slice_end and len(per_step) >= 3:
            break
    return min(per_step), n


def _alternate(model, runs, slice_end, deadline, max_rounds=7):
    """Fastest seconds per step of each of `runs` (`(steps, fit_kwargs)` pairs), from fits of
    each in turn, round after round until `slice_end` (3 to `max_rounds` rounds)."""
    per_step = [[] for _ in runs]
    for _ in range(max_rounds):
        for times, (n, kw) in zip(per_step, runs):
            seconds, done, clock = _measure.fit_steps(model, n, deadline, **kw)
            times.append(seconds / done)
            if clock.late:  # stopped at the deadline
                return [min(t) if t else times[-1] for t in per_step]
        if time.perf_counter() > slice_end and len(per_step[0]) >= 3:
            break
    return [min(t) for t in per_step]


def _steady(clock, skip=1):
    """Seconds per step after the first `skip` batches (the trace), from the batch-end times."""
    times, marks = clock.times, clock.marks
    if len(times) > skip + 1:
        return (times[-1] - times[skip]) / (marks[-1] - marks[skip])
    return (times[-1] - clock.start) / max(clock.steps, 1)


def _run(model, source, steps, max_seconds, what_if):
    t_start = time.perf_counter()
    notes = []
    twin = _measure.make_twin(model)
    snapshot = None
    if twin is None:
        snapshot = _measure.Snapshot(model)
        twin = model
        notes.append(
            "Keras could not clone this model: measured on the model itself and restored "
            "afterwards; compile-side changes were not tried."
        )
    # Where the backend cannot reset its peak (JAX), the peak so far, to tell whether this
    # diagnosis raised it.
    peak_before = None if _backend.reset_peak_memory() else _measure.peak_memory()
    try:
        return _measure_all(
            model,
            twin,
            source,
            steps,
            max_seconds,
            what_if,
            notes,
            t_start,
            snapshot is None,
            peak_before,
        )
    finally:
        if snapshot is not None:
            snapshot.restore()
            model.stop_training = False


def _fill_tf_data_cache(dataset, until, notes) -> None:
    """A pipeline that caches is slow on its first pass only: read it once before measuring,
    so the figures are those of the later epochs that make up most of training."""
    from keras_perf.backend import tensorflow as _tf

    if not _tf.has_stage(dataset, "CacheDataset") or int(dataset.cardinality()) <= 0:
        return
    for _ in dataset:
        if time.perf_counter() > until:
            notes.append(
                "the pipeline caches, but one pass to fill the cache took more than a quarter "
                "of max_seconds: the figures are those of its first, uncached pass."
            )
            return
    notes.append("the pipeline caches: it was read once before measuring (the cached epochs).")


def _measure_all(
    model, twin, source, steps, max_seconds, what_if, notes, t_start, can_recompile, peak_before
):
    n = steps if source.batches_per_epoch is None else min(steps, source.batches_per_epoch)
    share = _BASELINE_SHARE if what_if else 0.95
    slice_s = max_seconds * share / 4
    measured = {}

    # 1. Input and step together, as fit runs them (the first fit traces the train function).
    if source.one_pass:
        rec = source.recorder()
        try:
            t0 = time.perf_counter()
            seconds, done, clock = _measure.fit_steps(twin, n, t0 + 2 * slice_s, x=rec)
        except Exception as exc:
            raise ValueError(f"diagnose: fit rejects this data or model: {exc}") from exc
        together = _steady(clock)
        batches, input_s = source.recorded, source.pull_seconds
        input_per_batch = input_s / max(len(batches), 1)
        notes.append(
            f"one-pass input: took {len(batches)} batches from it (at most steps={steps}); "
            "its together time is timed after the first step, and the what-ifs run on those "
            "batches held in memory."
        )
    else:
        try:
            t0 = time.perf_counter()
            _measure.fit_steps(twin, min(2, n), None, **source.fit_kwargs())
        except Exception as exc:
            raise ValueError(f"diagnose: fit rejects this data or model: {exc}") from exc
    # The budget starts now: making the twin and the first trace do not count against it.
    trace_s = time.perf_counter() - t_start
    # The last fit stops at its first step past the deadline, then the twin is put back:
    # 3 % of the budget is kept for that, so the whole call stays inside `max_seconds`.
    deadline = time.perf_counter() + 0.97 * max_seconds

    def until(seconds):
        return min(time.perf_counter() + seconds, deadline)

    if source.kind == "tf.data" and not source.one_pass:
        _fill_tf_data_cache(source.x, until(max_seconds / 4), notes)
    setups = []  # fit's own set-up before the first batch, on the user's input as it is
    if not source.one_pass:
        together, done = _repeat(
            twin, n, until(slice_s), deadline, setups=setups, **source.fit_kwargs()
        )
        n = done  # every later measurement runs as many steps: the same fixed costs
        # 2. The input alone.
        batches, input_s = source.take(n, until(slice_s))
        input_per_batch = input_s / max(len(batches), 1)
    measured["together_s_per_step"] = together
    measured["input_alone_s_per_batch"] = input_per_batch

    B = source.batch_size or _data.leading_dim(batches[0])
    stacked = _data.stack(batches, B)
    if stacked is None:
        raise ValueError(f"diagnose: no full batch of size {B} in the data.")
    (xs, ys, sws), m = stacked

    # 3. The step alone on batches in memory, at B and at B/2. Fits of each are alternated, so
    # that drift on a busy machine hits both alike, and each lasts at least `_MIN_FIT_S` so
    # that a fit's own end and the timer's noise stay small against the steps (a 0.4 ms step
    # over 30 steps measured 0.28-0.50 ms from one diagnosis to the next, and once put B/2 30 %
    # below B): tiny steps run over the batches in memory repeated. The slope between the two
    # sizes is the compute per example; the rest of a step of `n` steps (as "together" ran, the
    # same fixed costs of a fit) is host.
    m = min(m, n)
    if source.one_pass:
        n = m
    nbytes = sum(a.nbytes for a in keras.tree.flatten((xs, ys, sws)) if a is not None)
    reps = _repeats_in_memory(together * m, nbytes)
    if reps > 1:
        xs, ys, sws = keras.tree.map_structure(
            lambda a: None if a is None else np.concatenate([a] * reps), (xs, ys, sws)
        )
    sizes = [B, B // 2] if B >= 2 else [B]
    kwargs = [
        {"x": xs, "y": ys, "sample_weight": sws, "batch_size": b, "shuffle": False} for b in sizes
    ]
    retrace = []
    for kw in kwargs:
        t0 = time.perf_counter()
        _measure.fit_steps(twin, 1, None, **kw)  # traces a new batch shape
        retrace.append(time.perf_counter() - t0)
    runs = [(m * reps, kw) for kw in kwargs]
    if reps > 1:
        runs.append((m, kwargs[0]))  # at B over `n` steps, as "together"
    alone = _alternate(twin, runs, until(2 * slice_s), deadline)
    t_b = alone[len(kwargs)] if reps > 1 else alone[0]
    measured["step_alone_s_per_step"] = t_b
    if reps > 1:
        measured[f"step_alone_s_per_step_over_{m * reps}_steps"] = alone[0]
    if B >= 2:
        b2 = B // 2
        measured[f"step_alone_s_per_step_at_batch_{b2}"] = alone[1]
        compute = min(max((alone[0] - alone[1]) / (B - b2) * B, 0.0), t_b)
        host = t_b - compute
    else:
        host, compute = t_b, 0.0  # one example per step: nothing to separate
    if source.one_pass:
        together = max(together, t_b)
    input_part = max(together - t_b, 0.0)
    total = input_part + host + compute
    shares = {"input": input_part / total, "host": host / total, "compute": compute / total}
    bottleneck = max(shares, key=shares.get)

    peak = _measure.peak_memory()
    if peak is not None and peak_before is not None and peak <= peak_before:
        notes.append(
            "peak accelerator memory not known: the backend cannot reset its peak counter, "
            "and this model did not raise the peak of earlier work in this process; the larger "
            "batch is tried (one that runs out of memory is micro-batched)."
        )
        peak = None
    notes.append(
        "the optimizer update runs once per step: its per-variable launches and Python count "
        "as host, its per-parameter arithmetic as compute."
    )

    what_ifs = []
    if what_if:
        base_kwargs = (
            source.fit_kwargs()
            if not source.one_pass
            else {"x": xs, "y": ys, "sample_weight": sws, "batch_size": B, "shuffle": False}
        )
        base_step = together if not source.one_pass else t_b
        device_bytes = None
        for d in _backend.list_devices():
            if d["kind"] in ("GPU", "TPU") and d.get("memory_bytes"):
                device_bytes = d["memory_bytes"]
                break
        ctx = _Context(
            source=source,
            twin=twin,
            model=model,
            compile_args=_measure.compile_args(model),
            batch_size=B,
            base_fit_kwargs=base_kwargs,
            steps=n,
            can_recompile=can_recompile,
            peak_memory_bytes=peak,
            device_bytes=device_bytes,
            larger_batch_fits=peak is None or device_bytes is None or 2 * peak < device_bytes,
            input_per_batch=input_per_batch,
            max_seconds=max_seconds,
        )
        changes, more_notes = _what_if.candidates(ctx)
        # The changes most likely to help this bottleneck first, in case the budget runs out.
        first = {
            "input": ("PyDataset", "tf.data"),
            "host": ("steps_per_execution", "jit_compile", "batch_size"),
            "compute": ("mixed", "jit_compile", "batch_size"),
        }[bottleneck]
        changes.sort(
            key=lambda c: next((i for i, p in enumerate(first) if c.change.startswith(p)), 99)
        )
        notes.extend(more_notes)
        ctx.setup = min(setups) if setups else None
        ctx.trace_s = trace_s
        ctx.epoch = None
        S = source.batches_per_epoch
        # Short epochs: whole epochs as `fit` runs them (their set-up and teardown weigh
        # against a few milliseconds of steps) are timed for every change, as many as fit in
        # 40 % of the budget left: a fit of 3 to 8 epochs (a teardown can stall at random, on
        # TF's tf.data, so a mean over epochs), up to 3 such fits (their median: a busy machine
        # can slow one).
        round_s = S * base_step * (1 + len(changes)) if S and not source.one_pass else None
        affordable = int(0.4 * (deadline - time.perf_counter()) / round_s) if round_s else 0
        ctx.epochs = min(8, affordable)
        ctx.epoch_fits = max(1, min(3, affordable // max(ctx.epochs, 1)))
        if ctx.epochs >= 3:
            ctx.epoch = _measure.epoch_seconds(
                twin, deadline, ctx.epochs, ctx.epoch_fits, **base_kwargs
            )
        # A change that fails inside `fit` can leave the twin's variables without values (JAX
        # drops them during `fit` and puts them back at its end): the state to put back then.
        ctx.twin_state = _measure.Snapshot(twin)
        what_ifs = _time_changes(ctx, changes, base_step, B, deadline, max(retrace), notes)

    return Diagnosis(
        bottleneck=bottleneck,
        shares=shares,
        examples_per_s=B / together,
        what_if=what_ifs,
        peak_memory_bytes=peak,
        batch_size=B,
        backend=keras.backend.backend(),
        input_kind=source.kind,
        seconds_per_step={
            "together": together,
            "input_alone": input_per_batch,
            "step_alone": t_b,
            "input": input_part,
            "host": host,
            "compute": compute,
        },
        measured=measured,
        steps=n,
        batches_consumed=len(batches) if source.one_pass else None,
        trace_seconds=trace_s,
        seconds=time.perf_counter() - t_start,
        max_seconds=max_seconds,
        notes=notes,
    )


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
        if left < warm_up + ctx.steps * base_step:
            notes.append(f"{change.change} not measured: the time budget ran out.")
            continue
        target = ctx.twin
        try:
            target = change.apply() or ctx.twin
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
            per_step, done = _repeat(
                target, n, slice_end, deadline, setup=setup, **change.fit_kwargs
            )
            epoch = None
            if ctx.epoch is not None:
                epoch = _measure.epoch_seconds(
                    target, deadline, ctx.epochs, ctx.epoch_fits, **change.fit_kwargs
                )
        except Exception as exc:  # the change does not work here: not offered
            ctx.twin_state.restore()
            if _backend.is_oom(exc):
                instead = change.on_oom() if change.on_oom is not None else None
                if instead is not None:
                    notes.append(f"{change.change} did not fit in memory: micro-batched instead.")
                    changes.insert(i, instead)
                else:
                    notes.append(
                        f"{change.change} did not fit in memory; kp.fit_with_oom_retry "
                        "micro-batches a batch that does not fit."
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
            }
        )
    results.sort(key=lambda r: -r["speedup"])
    return results
