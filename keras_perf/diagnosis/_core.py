"""`kp.diagnose`: where the training time goes, and what each change would buy, measured."""

from __future__ import annotations

import math
import time

import keras
import numpy as np

from keras_perf import _fit_measure as _measure
from keras_perf import backend as _backend
from keras_perf._inputs import check_fit_data, check_memory_limit, check_no_ignored_settings
from keras_perf._inputs import sources as _data
from keras_perf._utils import check_bool, check_int, check_number
from keras_perf.diagnosis import _trial
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


def _check(model, steps, max_seconds, batch_size, what_if, memory_limit_bytes):
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
    if memory_limit_bytes is None:
        return None
    return check_memory_limit("diagnose", memory_limit_bytes)


@_backend.traced_graphs_released()
def diagnose(
    model,
    x,
    y=None,
    batch_size=None,
    steps=50,
    max_seconds=60,
    what_if=True,
    memory_limit_bytes=None,
):
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
        memory_limit_bytes: The memory a training step may use: memory is the limit where a
            step's measured peak is above it (a what-if above it is not timed). On a CPU,
            where nothing runs out of memory, this is what brings out the remat and
            micro-batching what-ifs. Defaults to `None`: an accelerator's own memory.

    Returns:
        A `Diagnosis`: `bottleneck`, `shares`, `examples_per_s`, `what_if`,
        `peak_memory_bytes`, `step_memory`; `print` it for a table, `to_dict()` for JSON,
        `plot(path)`.

    Raises:
        ValueError: An uncompiled model, `steps < 1`, `max_seconds <= 0`,
            `memory_limit_bytes <= 0`, a cap where this backend cannot measure a step's peak
            (TensorFlow's CPU allocator without `TF_CPU_ALLOCATOR_USE_BFC=true`), `x` with no
            examples or a dict without one of the model's inputs, or data `fit` would reject
            (before anything is measured).
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
    limit = _check(model, steps, max_seconds, batch_size, what_if, memory_limit_bytes)
    check_fit_data("diagnose", model, x)
    check_no_ignored_settings("diagnose", model)
    source = _data.make_source(x, y, batch_size, steps, model=model)
    rng = _measure.RandomState()
    try:
        return _run(model, source, steps, float(max_seconds), what_if, limit)
    finally:
        rng.restore()


def _run(model, source, steps, max_seconds, what_if, limit):
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
            limit,
        )
    finally:
        if snapshot is not None:
            snapshot.restore()
            model.stop_training = False


def _fill_tf_data_cache(dataset, until, notes) -> None:
    """A pipeline that caches is slow on its first pass only: read it once before measuring,
    so the figures are those of the later epochs that make up most of training."""
    if not _backend.tf_data_has_stage(dataset, "CacheDataset") or int(dataset.cardinality()) <= 0:
        return
    for _ in dataset:
        if time.perf_counter() > until:
            notes.append(
                "the pipeline caches, but one pass to fill the cache took more than a quarter "
                "of max_seconds: the figures are those of its first, uncached pass."
            )
            return
    notes.append("the pipeline caches: it was read once before measuring (the cached epochs).")


class _Baseline:
    """What the baseline measurements found, filled in phase by phase by `_measure_all`.

    `n`: steps per measurement; `deadline`: the end of the budget; `together`: seconds per
    step of input and step together; `batches`: the batches read, `input_per_batch` the
    seconds each took alone; `setups`: fit's own set-up times before its first batch;
    `trace_s`: making the twin and the first trace; `measured`: the raw figures for the
    report. Then, from the step alone: `B`, `xs`, `ys`, `sws` (the batches in memory), `t_b`
    (seconds per step alone), `retrace` (seconds to trace each batch shape), `host` and
    `compute`.
    """

    def __init__(self, twin, source, n, slice_s, notes):
        self.twin, self.source, self.n, self.slice_s, self.notes = twin, source, n, slice_s, notes
        self.measured, self.setups = {}, []
        self.deadline = None

    def until(self, seconds):
        return min(time.perf_counter() + seconds, self.deadline)


def _measure_all(
    model,
    twin,
    source,
    steps,
    max_seconds,
    what_if,
    notes,
    t_start,
    can_recompile,
    peak_before,
    limit,
):
    n = steps if source.batches_per_epoch is None else min(steps, source.batches_per_epoch)
    share = _BASELINE_SHARE if what_if else 0.95
    r = _Baseline(twin, source, n, max_seconds * share / 4, notes)
    _first_fit(r, steps)
    # The budget starts now: making the twin and the first trace do not count against it.
    r.trace_s = time.perf_counter() - t_start
    # The last fit stops at its first step past the deadline, then the twin is put back:
    # 3 % of the budget is kept for that, so the whole call stays inside `max_seconds`.
    r.deadline = time.perf_counter() + 0.97 * max_seconds
    if not source.one_pass:
        _together_and_input(r, max_seconds)
    r.measured["together_s_per_step"] = r.together
    r.measured["input_alone_s_per_batch"] = r.input_per_batch
    _step_alone(r)
    if source.one_pass:
        r.together = max(r.together, r.t_b)
    input_part = max(r.together - r.t_b, 0.0)
    total = input_part + r.host + r.compute
    shares = {"input": input_part / total, "host": r.host / total, "compute": r.compute / total}
    bottleneck = max(shares, key=shares.get)
    peak = _peak_memory(peak_before, notes)
    t0 = time.perf_counter()
    r.step_memory = _step_memory(r, limit, max_seconds)
    r.measured["step_memory_seconds"] = time.perf_counter() - t0
    notes.append(
        "the optimizer update runs once per step: its per-variable launches and Python count "
        "as host, its per-parameter arithmetic as compute."
    )
    what_ifs = []
    if what_if:
        what_ifs = _trial.what_ifs(r, model, can_recompile, peak, bottleneck, max_seconds, limit)
    return Diagnosis(
        bottleneck=bottleneck,
        shares=shares,
        examples_per_s=r.B / r.together,
        what_if=what_ifs,
        peak_memory_bytes=peak,
        step_memory=r.step_memory,
        memory_limit_bytes=limit,
        batch_size=r.B,
        backend=keras.backend.backend(),
        input_kind=source.kind,
        seconds_per_step={
            "together": r.together,
            "input_alone": r.input_per_batch,
            "step_alone": r.t_b,
            "input": input_part,
            "host": r.host,
            "compute": r.compute,
        },
        measured=r.measured,
        steps=r.n,
        batches_consumed=len(r.batches) if source.one_pass else None,
        trace_seconds=r.trace_s,
        seconds=time.perf_counter() - t_start,
        max_seconds=max_seconds,
        notes=notes,
    )


def _first_fit(r, steps) -> None:
    """The first fit, which traces the train function. A one-pass input is read only by it:
    its input and step together are timed there (after the first step)."""
    twin, source, n = r.twin, r.source, r.n
    rec = source.recorder() if source.one_pass else None
    try:
        if rec is None:
            _measure.fit_steps(twin, min(2, n), None, **source.fit_kwargs())
            return
        t0 = time.perf_counter()
        _, _, clock = _measure.fit_steps(twin, n, t0 + 2 * r.slice_s, x=rec)
    except Exception as exc:
        raise ValueError(f"diagnose: fit rejects this data or model: {exc}") from exc
    r.together = _measure.steady(clock)
    r.batches, input_s = source.recorded, source.pull_seconds
    r.input_per_batch = input_s / max(len(r.batches), 1)
    r.notes.append(
        f"one-pass input: took {len(r.batches)} batches from it (at most steps={steps}); "
        "its together time is timed after the first step, and the what-ifs run on those "
        "batches held in memory."
    )


def _together_and_input(r, max_seconds) -> None:
    """1. Input and step together, as fit runs them; 2. the input alone (re-readable input)."""
    source = r.source
    if source.kind == "tf.data":
        _fill_tf_data_cache(source.x, r.until(max_seconds / 4), r.notes)
    # `r.setups`: fit's own set-up before the first batch, on the user's input as it is.
    r.together, done = _measure.repeat_fits(
        r.twin, r.n, r.until(r.slice_s), r.deadline, setups=r.setups, **source.fit_kwargs()
    )
    r.n = done  # every later measurement runs as many steps: the same fixed costs
    r.batches, input_s = source.take(r.n, r.until(r.slice_s))
    r.input_per_batch = input_s / max(len(r.batches), 1)


def _step_alone(r) -> None:
    """3. The step alone on batches in memory, at B and at B/2.

    Fits of each are alternated, so that drift on a busy machine hits both alike, and each
    lasts at least `_MIN_FIT_S` so that a fit's own end and the timer's noise stay small
    against the steps (a 0.4 ms step over 30 steps measured 0.28-0.50 ms from one diagnosis
    to the next, and once put B/2 30 % below B): tiny steps run over the batches in memory
    repeated. The slope between the two sizes is the compute per example; the rest of a step
    of `n` steps (as "together" ran, the same fixed costs of a fit) is host.
    """
    source, twin = r.source, r.twin
    B = r.B = source.batch_size or _data.leading_dim(r.batches[0])
    stacked = _data.stack(r.batches, B)
    if stacked is None:
        raise ValueError(f"diagnose: no full batch of size {B} in the data.")
    (xs, ys, sws), m = stacked
    r.xs, r.ys, r.sws = xs, ys, sws
    m = min(m, r.n)
    if source.one_pass:
        r.n = m
    nbytes = sum(a.nbytes for a in keras.tree.flatten((xs, ys, sws)) if a is not None)
    reps = _repeats_in_memory(r.together * m, nbytes)
    if reps > 1:
        xs, ys, sws = keras.tree.map_structure(
            lambda a: None if a is None else np.concatenate([a] * reps), (xs, ys, sws)
        )
    sizes = [B, B // 2] if B >= 2 else [B]
    # Under a tf.distribute strategy a tf.data pipeline of the arrays (backend.array_fit_kwargs).
    kwargs = [_backend.array_fit_kwargs(twin, xs, ys, sws, b, shuffle=False) for b in sizes]
    r.retrace = []
    for kw in kwargs:
        t0 = time.perf_counter()
        _measure.fit_steps(twin, 1, None, **kw)  # traces a new batch shape
        r.retrace.append(time.perf_counter() - t0)
    runs = [(m * reps, kw) for kw in kwargs]
    if reps > 1:
        runs.append((m, kwargs[0]))  # at B over `n` steps, as "together"
    alone = _measure.alternate_fits(twin, runs, r.until(2 * r.slice_s), r.deadline)
    r.t_b = alone[len(kwargs)] if reps > 1 else alone[0]
    r.measured["step_alone_s_per_step"] = r.t_b
    if reps > 1:
        r.measured[f"step_alone_s_per_step_over_{m * reps}_steps"] = alone[0]
    if B >= 2:
        b2 = B // 2
        r.measured[f"step_alone_s_per_step_at_batch_{b2}"] = alone[1]
        r.compute = min(max((alone[0] - alone[1]) / (B - b2) * B, 0.0), r.t_b)
        r.host = r.t_b - r.compute
    else:
        r.host, r.compute = r.t_b, 0.0  # one example per step: nothing to separate


def _step_memory(r, limit, max_seconds):
    """The peak memory of one step at the batch size (`kp.backend.step_memory`, on batches in
    memory): `{"peak_bytes", "measure", "batch_size"}`, or None with a note saying why.

    TensorFlow and torch run one step to measure it; JAX compiles the step (XLA's memory
    analysis), which costs about a first trace (0.7x of it on an MLP). That is measured when
    it takes at most a quarter of `max_seconds`, or always with `memory_limit_bytes`, which
    needs it.
    """
    problem = _backend.step_memory_unavailable()
    if problem is not None:
        r.notes.append(f"peak step memory not measured: {problem}")
        return None
    cost = max(r.retrace) if _backend.STEP_MEMORY_RUNS_STEP else r.trace_s
    if limit is None and cost > max_seconds / 4:
        r.notes.append(
            f"peak step memory not measured: measuring it costs about {cost:.1f} s here ("
            f"{'a step traced' if _backend.STEP_MEMORY_RUNS_STEP else 'the step compiled'}), "
            "more than a quarter of max_seconds."
        )
        return None
    batch = tuple(
        None if a is None else keras.tree.map_structure(lambda t: t[: r.B], a)
        for a in (r.xs, r.ys, r.sws)
    )
    try:
        measured = _measure.step_peak(r.twin, batch)
    except Exception as exc:  # an out-of-memory on an accelerator, a backend without a measure
        r.notes.append(f"peak step memory not measured: the measure failed ({type(exc).__name__}).")
        if _backend.is_oom(exc):
            _backend.clear_memory()
        return None
    return {**measured, "batch_size": r.B}


def _peak_memory(peak_before, notes):
    """The accelerator's peak during the diagnosis, or None when it cannot be told."""
    peak = _measure.peak_memory()
    if peak is not None and peak_before is not None and peak <= peak_before:
        notes.append(
            "peak accelerator memory not known: the backend cannot reset its peak counter, "
            "and this model did not raise the peak of earlier work in this process; the larger "
            "batch is tried (one that runs out of memory is micro-batched)."
        )
        peak = None
    return peak
