"""`find_max_batch_size`: the largest batch that fits, per train-step setting, by trying.

Read top to bottom: the settings (`SETTINGS`, `_check_settings`), the search (`_search`:
doubling, then bisection, as Lightning's `BatchSizeFinder` in "power" mode then "binsearch"),
one try (`_Trial`: one training step at a batch size, failed by an out-of-memory error or by a
measured peak above the cap, the model's state put back after it), and
`find_max_batch_size`, which checks everything before any step. Not here: the report it
returns (`_batch_report`), the probe batch read from `x` (`_probe`), the host snapshot
(`_state`), how each backend measures a step's memory (`keras_perf.backend.step_memory`).
"""

from __future__ import annotations

import keras

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf._inputs import (
    check_fit_data,
    check_memory_limit,
    check_no_ignored_settings,
    check_not_consumable,
    is_array_input,
    probe_batch,
)
from keras_perf._utils import check_int, first_tensor, map_batch
from keras_perf.oom._batch_report import MaxBatchSizeReport
from keras_perf.oom._retry import _error_text
from keras_perf.oom._rungs import BOTH, MICROBATCHES, REMAT
from keras_perf.oom._state import _restore, _snapshot, _state_variables
from keras_perf.train_step import LossScaleTrainStep, loss_scaled

__all__ = ["SETTINGS", "find_max_batch_size"]

PLAIN = "plain"
#: The settings a row can have: (remat, micro-batched) of keras-perf's train step.
SETTINGS = {PLAIN: (None, False), REMAT: ("full", False), MICROBATCHES: (None, True)}
SETTINGS[BOTH] = ("full", True)
_DEFAULT_SETTINGS = (PLAIN, REMAT, MICROBATCHES)
_CALLER = "find_max_batch_size"


def _check_settings(settings) -> tuple:
    """Validate `settings`: a name or a non-empty list/tuple of distinct names."""
    if isinstance(settings, str):
        settings = (settings,)
    if (
        not isinstance(settings, (list, tuple))
        or not settings
        or any(not isinstance(s, str) or s not in SETTINGS for s in settings)
        or len(set(settings)) != len(settings)
    ):
        raise ValueError(
            f"`settings` must be a name or a non-empty list or tuple of distinct names from "
            f"{list(SETTINGS)}; got {settings!r}."
        )
    return tuple(settings)


def _search(attempt, start: int, cap: int, limit=None, step: int = 1) -> list:
    """Try batch sizes up to `cap` until the largest that fits is known; returns the tries.

    `attempt(size)` runs one try and returns its entry (`batch_size`, `fits`,
    `peak_bytes`). Sizes are multiples of `step` (the micro-batch count: an uneven batch
    adds a shorter slice, with memory of its own, so memory is monotone only over even
    ones), or any size when `cap` < `step`. They double from `start` until one fails or the
    largest multiple within `cap` fits (Lightning's "power" mode); then the bracket between
    the largest size that fitted and the smallest that failed is narrowed until they are
    neighbours, so the answer's next size up was tried and failed (unless none is left).
    Narrowed by bisection, or, when both ends have a measured peak and `limit` is set, first
    at the size where the straight line between them crosses `limit` and at its neighbour
    towards the answer (a step whose memory grows linearly with the batch is settled by
    these two tries: on JAX a try is a compilation), then by bisection: at most two tries
    more than bisection alone. Whether a size fits is taken to be monotone.
    """
    step = step if cap >= step else 1

    def run(units):
        tries.append(attempt(units * step))
        return tries[-1]

    tries = []
    low, high, units, top = None, None, min(-(-start // step), cap // step), cap // step
    while high is None:  # doubling
        entry = run(units)
        if not entry["fits"]:
            high = entry
        elif units == top:
            return tries
        else:
            low, units = entry, min(2 * units, top)
    # Narrowing: the size where the line through the bracket's peaks crosses `limit`, then
    # its neighbour towards the answer (the two tries that settle a step whose memory grows
    # linearly), then bisection.
    guess = _crossing(low, high, limit, step)
    for _ in range(2 if guess is not None else 0):
        if not _units(low, step) < guess < _units(high, step):
            break
        if run(guess)["fits"]:
            low, guess = tries[-1], guess + 1
        else:
            high, guess = tries[-1], guess - 1
    while _units(high, step) - _units(low, step) > 1:
        if run((_units(low, step) + _units(high, step)) // 2)["fits"]:
            low = tries[-1]
        else:
            high = tries[-1]
    return tries


def _units(entry, step: int) -> int:
    return 0 if entry is None else entry["batch_size"] // step


def _crossing(low, high, limit, step: int):
    """The size in steps, strictly between `low` and `high`, where the line through their
    peaks meets `limit`; None when a peak or the limit is missing (the caller bisects)."""
    if limit is None or low is None or low["peak_bytes"] is None or high["peak_bytes"] is None:
        return None
    a, b = _units(low, step), _units(high, step)
    p, q = low["peak_bytes"], high["peak_bytes"]
    if q <= p:
        return None
    return min(max(a + (limit - p) * (b - a) // (q - p), a + 1), b - 1)


def _best(tries) -> int:
    """The largest batch size that fitted among `tries` (0 if none did)."""
    return max((t["batch_size"] for t in tries if t["fits"]), default=0)


class _Trial:
    """Tries one training step of `probe` at a batch size and records the try.

    A try fails on an out-of-memory error, or when `limit` is set and the step's measured
    peak is above it. The variables the step changed (the model's, the optimizer's, the
    metrics') are put back after every try, so each starts from the user's state (on JAX a
    failed step may even have freed the buffers it was given).
    """

    def __init__(self, probe, data, limit, saved):
        self.probe, self.data, self.limit, self.saved = probe, data, limit, saved
        available = _backend.step_memory_unavailable() is None
        # Without a cap, measure each try only where that costs nothing (the measure runs the
        # step), else the answer alone, at the end (a compilation on JAX).
        self.measure_each = limit is not None or (_backend.STEP_MEMORY_RUNS_STEP and available)
        self.measure_answer = available and not self.measure_each
        self.run_too = _backend.has_accelerator()  # a compiled-only measure: run it as well
        self.measure = None

    def _run(self, batch):
        x, y, sample_weight = batch
        self.probe.train_on_batch(x, y, sample_weight=sample_weight)

    def measured(self, size: int) -> dict:
        """The step's memory at `size` examples (compiled or run, as the backend measures)."""
        batch = map_batch(lambda t: t[:size], self.data)
        try:
            result = _backend.step_memory(self.probe, batch, lambda: self._run(batch))
        finally:
            self.restore()
        self.measure = result["measure"]
        return result

    def __call__(self, size: int) -> dict:
        batch = map_batch(lambda t: t[:size], self.data)
        entry = {
            "batch_size": size,
            "fits": True,
            "peak_bytes": None,
            "reason": None,
            "error": None,
        }
        try:
            ran = False
            if self.measure_each:
                result = _backend.step_memory(self.probe, batch, lambda: self._run(batch))
                self.measure, ran = result["measure"], result["ran"]
                entry["peak_bytes"] = result["bytes"]
                if self.limit is not None and result["bytes"] > self.limit:
                    entry.update(fits=False, reason="memory_limit")
            if entry["fits"] and not ran and (self.limit is None or self.run_too):
                self._run(batch)
        except Exception as exc:
            if not _backend.is_oom(exc):
                raise
            entry.update(fits=False, reason="out_of_memory", error=_error_text(exc))
            _backend.clear_memory()
        finally:
            self.restore()
        return entry

    def restore(self) -> None:
        _restore(self.saved)


def _probe_model(model, names):
    """The model the steps run on: `model` itself with the train step, else a twin."""
    if isinstance(model, LossScaleTrainStep):
        return model
    if isinstance(model, keras.Sequential) or keras_internals.is_functional(model):
        # Every row with keras-perf's train step, so that rows differ by their setting alone.
        return loss_scaled(model)
    if names != (PLAIN,):
        raise TypeError(
            f"{_CALLER}: {type(model).__name__} is a subclassed model without keras-perf's "
            f"train step, so it has no remat or micro-batches: settings={list(names)} needs "
            f"them. Pass settings=('plain',), or subclass the mixin: "
            f"`class {type(model).__name__}(kp.LossScaleTrainStep, keras.Model): ...`."
        )
    return model


def _largest(x, max_batch_size):
    """The largest batch to try: `max_batch_size`, or the number of examples in array `x`."""
    if not is_array_input(x):
        check_not_consumable(x, _CALLER)
        if max_batch_size is None:
            raise ValueError(
                f"{_CALLER}: `x` is a dataset, whose size is not known here: pass "
                "`max_batch_size`, the largest batch to try (that many examples are read)."
            )
        return max_batch_size
    n = int(first_tensor(x).shape[0])
    if n == 0:
        raise ValueError(f"{_CALLER}: `x` has no examples.")
    if max_batch_size is not None and max_batch_size > n:
        raise ValueError(
            f"`max_batch_size` must be at most the {n} examples of `x`, got {max_batch_size}."
        )
    return n if max_batch_size is None else max_batch_size


def _check_limit(memory_limit_bytes):
    if memory_limit_bytes is None:
        if not _backend.has_accelerator():
            raise ValueError(
                f"{_CALLER}: nothing runs out of memory on a CPU, so trying finds no limit. "
                "Pass `memory_limit_bytes`, the memory a step may use: each try then measures "
                "the step's peak and fails above it."
            )
        return None
    return check_memory_limit(_CALLER, memory_limit_bytes)


@_backend.traced_graphs_released()
def find_max_batch_size(
    model: keras.Model,
    x,
    y=None,
    settings=_DEFAULT_SETTINGS,
    memory_limit_bytes: int | None = None,
    *,
    microbatches: int = 4,
    start_batch_size: int = 32,
    max_batch_size: int | None = None,
) -> MaxBatchSizeReport:
    """Find the largest batch that fits in memory for each train-step setting, by trying.

    For each setting, one training step is tried at `start_batch_size` examples, then at
    twice as many, until a step fails or `max_batch_size` fits; then the sizes between the
    last that fitted and the first that failed are narrowed down (where the line through
    their measured peaks crosses the cap, then by bisection) until the next size up has
    failed. A step fails on an out-of-memory error (TensorFlow, XLA, torch) or, with
    `memory_limit_bytes`, when its measured peak is above that cap: on a CPU, where nothing
    runs out of memory, the cap is what makes the search meaningful. The peak is read in
    process (`kp.oom.MEASURES`): TensorFlow's allocator (GPU, or CPU with the BFC
    allocator), torch's CUDA allocator, on a CPU the tensors torch saves for backward plus
    the variables, gradients and batch, and on JAX XLA's memory analysis of the compiled
    step (on a CPU the step is compiled, not run).

    Settings: `"plain"` (keras-perf's train step as is), `"remat"` (`remat="full"`: the
    activations recomputed in the backward pass), `"microbatches"` (each batch cut into
    `microbatches` slices whose gradients add up to the full-batch update) and
    `"remat+microbatches"`. A row's batch size is the whole batch, the effective batch the
    update sees; micro-batched rows try multiples of `microbatches` only (an uneven batch
    adds a shorter slice, whose memory breaks the search's monotonicity). Sequential and
    Functional models run through a `kp.loss_scaled` twin that shares their layers and
    optimizer; a model with `kp.LossScaleTrainStep` runs itself, its `remat` and
    `microbatches` set per row and put back. The model is left untouched: its variables
    (weights, non-trainable state, random-seed state), optimizer state and step count,
    metrics and settings are as before (put back after every try).

    On TensorFlow on a CPU, set `TF_CPU_ALLOCATOR_USE_BFC=true` in the environment before
    TensorFlow is imported: without the BFC allocator its statistics miss most of what a
    step allocates, and a cap is refused.

    Args:
        model: A compiled `keras.Model`: Sequential, Functional, or with
            `kp.LossScaleTrainStep` (a subclassed model without it: `settings=("plain",)`).
        x: Training inputs: arrays (or a dict/list of them), or a dataset as for
            `kp.find_max_microbatch` (then `max_batch_size` is required).
        y: Targets, with arrays only. Defaults to `None`.
        settings: The rows, names from `"plain"`, `"remat"`, `"microbatches"`,
            `"remat+microbatches"`. Defaults to `("plain", "remat", "microbatches")`.
        memory_limit_bytes: The memory a step may use; a try whose measured peak is above it
            fails. Required without an accelerator. Defaults to `None` (out-of-memory alone).
        microbatches: Slices per batch in the micro-batched rows (at least 2). Defaults to `4`.
        start_batch_size: The first batch tried. Defaults to `32`.
        max_batch_size: The largest batch tried. Defaults to `None`: the number of examples
            in `x`.

    Returns:
        A `kp.oom.MaxBatchSizeReport`: setting name -> row with `batch_size`, `peak_bytes`,
        `measure`, `limited_by` and `tries`; `str()` prints a table, `to_dict()` gives JSON.

    Raises:
        TypeError: `model` is not a Keras model, a subclassed model without the train step is
            asked for remat or micro-batches, bad argument types, or `x` a generator.
        ValueError: the model is not compiled, an unknown setting, `memory_limit_bytes` <= 0,
            no accelerator and no `memory_limit_bytes`, a peak this backend cannot measure
            (TensorFlow's CPU allocator without statistics: set `TF_CPU_ALLOCATOR_USE_BFC=true`
            before TensorFlow is imported), `microbatches` < 2, sizes < 1, `x` empty, smaller
            than `max_batch_size` or a dict without one of the model's inputs. All before any
            step.

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        >>> model.compile("adam", "mse")
        >>> report = kp.find_max_batch_size(
        ...     model, np.ones((64, 8)), np.ones((64, 4)), settings=("plain", "microbatches"),
        ...     memory_limit_bytes=10**9)
        >>> {name: row["batch_size"] for name, row in report.items()}
        {'plain': 64, 'microbatches': 64}
        >>> [t["batch_size"] for t in report["plain"]["tries"]]
        [32, 64]
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if getattr(model, "optimizer", None) is None:
        raise ValueError(f"Model '{model.name}' is not compiled: call `model.compile(...)` first.")
    names = _check_settings(settings)
    microbatches = check_int("microbatches", microbatches, minimum=2)
    start_batch_size = check_int("start_batch_size", start_batch_size, minimum=1)
    max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1, allow_none=True)
    check_fit_data(_CALLER, model, x)
    check_no_ignored_settings(_CALLER, model)
    largest = _largest(x, max_batch_size)
    probe = _probe_model(model, names)
    limit = _check_limit(memory_limit_bytes)
    data = probe_batch(model, x, y, largest, caller=_CALLER, size_name="max_batch_size")
    with _backend.model_scope(probe):
        keras_internals.symbolic_build(probe, map_batch(lambda t: t[:1], data))
    own = None
    if isinstance(probe, LossScaleTrainStep):
        own = (probe.remat, probe.remat_threshold, probe.microbatches)
    variables = _state_variables(probe)
    seen = {id(v) for v in variables}
    variables += [v for v in probe.metrics_variables if id(v) not in seen]
    trial = _Trial(probe, data, limit, _snapshot(probe, variables))
    rows = {}
    try:
        for name in names:
            remat, sliced = SETTINGS[name]
            k = microbatches if sliced else 1
            if isinstance(probe, LossScaleTrainStep):
                probe.set_remat(remat)
                probe.microbatches = k
            tries = _search(trial, start_batch_size, largest, limit, step=k)
            best = _best(tries)
            at = next((t for t in tries if t["batch_size"] == best), None)
            peak = None if at is None else at["peak_bytes"]
            if best and trial.measure_answer:
                peak = trial.measured(best)["bytes"]
            step = k if largest >= k else 1
            above = next((t for t in tries if t["batch_size"] == best + step), None)
            rows[name] = {
                "setting": name,
                "remat": remat,
                "microbatches": k,
                "batch_size": best,
                "peak_bytes": peak,
                "measure": trial.measure,
                "limited_by": "max_batch_size" if above is None else above["reason"],
                "tries": tries,
            }
    finally:
        trial.restore()
        if own is not None:
            probe.set_remat(own[0], own[1])
            probe.microbatches = own[2]
    device = next(
        (d["name"] for d in _backend.list_devices() if d["kind"] in ("GPU", "TPU")), "CPU"
    )
    return MaxBatchSizeReport(rows, _backend.BACKEND, device, limit, largest)
