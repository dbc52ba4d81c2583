"""Training that survives out-of-memory: `fit_with_oom_retry` and `find_max_microbatch`.

We follow Composer's approach rather than the reference articles' (catch the error, re-run
`fit` with half the batch: progress lost and the optimisation changed): the failed epoch is
re-run from its starting state with the same effective batch cut into more micro-batches.

How a run recovers, step by step:

1. Before each epoch, the values of the model's variables (weights, non-trainable state,
   random-seed state) and of the optimizer's variables are copied to host memory. Host
   copies, because on JAX the failing call may already have donated (freed) the device
   buffers that held the state.
2. An exception that the backend shim recognises as out-of-memory (`kp.backend.is_oom`) ends
   the current `fit` call; any other exception propagates unchanged.
3. The snapshot is restored, garbage is collected and the backend's cache released, and the
   number of micro-batches is doubled: the model has `kp.LossScaleTrainStep` (its
   `microbatches` is raised) or, for a stock Sequential/Functional model, a `kp.loss_scaled`
   twin is made that shares the model's layers and optimizer. Each batch keeps its size and
   each step stays one optimizer update: in-step gradient accumulation equal to the
   full-batch update, so the optimisation does not change. A subclassed model without the
   mixin, fed arrays, instead gets half the batch size and an optimizer copy that averages
   twice as many batches per update (Keras' gradient accumulation): the same update again.
4. `fit` is called again with `initial_epoch` = the failed epoch and the same callbacks.
"""

from __future__ import annotations

import math
import re

import keras
import numpy as np

from keras_perf import backend as _backend
from keras_perf._utils import check_int, first_tensor, map_batch
from keras_perf.train_step import LossScaleTrainStep, loss_scaled

__all__ = ["fit_with_oom_retry", "find_max_microbatch"]

_KERAS_DEFAULT_BATCH = 32


# -- state snapshots ----------------------------------------------------------------------
def _state_variables(model) -> list:
    """Every variable a train step changes, except metrics (reset at each epoch anyway)."""
    variables, seen = [], set()
    optimizer = getattr(model, "optimizer", None)
    extra = list(optimizer.variables) if optimizer is not None else []
    for v in list(model.variables) + extra:
        if id(v) not in seen:
            seen.add(id(v))
            variables.append(v)
    return variables


def _snapshot(model) -> list:
    # np.array(copy=True): on CPU, torch and JAX may hand out views of the live buffers.
    return [
        (v, np.array(keras.ops.convert_to_numpy(v.value), copy=True))
        for v in _state_variables(model)
    ]


def _restore(snapshot) -> None:
    for variable, value in snapshot:
        variable.assign(value)


# -- callbacks: each hook of the whole run once -------------------------------------------
class _RunCallbacks(keras.callbacks.CallbackList):
    """The user's callbacks, shared by every `fit` call of one `fit_with_oom_retry` run.

    `on_train_begin` is forwarded once (so callbacks that reset their state there, like
    `EarlyStopping`, are not reset by a retry); `on_epoch_end` runs only for epochs that
    completed, so each completed epoch reaches the callbacks once. `on_train_end` comes from
    the final, successful `fit` call. The snapshot of the state is taken at each epoch start.
    """

    def __init__(self, callbacks, **kwargs):
        super().__init__(callbacks, **kwargs)
        self._kp_started = False
        self.begun_epoch = None  # epoch whose on_epoch_begin ran last
        self.completed_epoch = None  # epoch whose on_epoch_end ran last
        self.snapshot = None

    def on_train_begin(self, logs=None):
        if not self._kp_started:
            self._kp_started = True
            super().on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self.snapshot = _snapshot(self.model)
        self.begun_epoch = epoch
        super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self.completed_epoch = epoch

    def epoch_in_progress(self) -> bool:
        return self.begun_epoch is not None and self.begun_epoch != self.completed_epoch


# -- inputs -------------------------------------------------------------------------------
def _is_array_input(x) -> bool:
    """numpy / backend tensors (or a dict, list or tuple of them): data `fit` batches itself."""
    leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
    return bool(leaves) and all(
        isinstance(t, np.ndarray) or (hasattr(t, "shape") and hasattr(t, "dtype")) for t in leaves
    )


def _infer_batch_size(x):
    """The batch size of already-batched data (tf.data, PyDataset, DataLoader), when knowable."""
    try:
        spec = getattr(x, "element_spec", None)  # tf.data.Dataset
        if spec is not None:
            dim = keras.tree.flatten(spec)[0].shape[0]
            return int(dim) if dim is not None else None
        if getattr(x, "batch_size", None) is not None:  # torch DataLoader, PyDataset subclasses
            return int(x.batch_size)
    except (TypeError, ValueError, IndexError, AttributeError):
        pass
    return None


def _steps(x, batch_size, fit_kwargs):
    """Steps per epoch for the progress bar (None when not known in advance)."""
    if fit_kwargs.get("steps_per_epoch") is not None:
        return fit_kwargs["steps_per_epoch"]
    try:
        if _is_array_input(x):
            n = int(first_tensor(x).shape[0])
            n = math.floor(n * (1.0 - float(fit_kwargs.get("validation_split") or 0.0)))
            return math.ceil(n / (batch_size or _KERAS_DEFAULT_BATCH))
        return len(x)
    except (TypeError, ValueError, AttributeError, StopIteration):
        return None


# -- recovery -----------------------------------------------------------------------------
# The accumulation route below reads three private attributes of Keras optimizers:
# `_iterations` (the raw batch counter behind `iterations`), `_learning_rate` (the schedule
# or variable behind `learning_rate`) and `_accumulated_gradients`. Checked on Keras 3.8-3.15;
# the tests on every backend fail if they change.
def _plain_variables(optimizer) -> list:
    """The optimizer's variables other than its step counter and gradient accumulators."""
    skip = {
        id(a) for a in (getattr(optimizer, "_accumulated_gradients", None) or []) if a is not None
    }
    skip.add(id(optimizer._iterations))
    return [v for v in optimizer.variables if id(v) not in skip]


def _copy_optimizer_state(source, target) -> None:
    """Copy slots, learning rate and step count from `source` into `target` (same variables).

    Either may accumulate gradients (Keras' `gradient_accumulation_steps`, whose counter
    counts accumulated batches); the optimizer-step count is carried over, and `target`'s
    accumulators are left at zero.
    """
    src, dst = _plain_variables(source), _plain_variables(target)
    if len(src) != len(dst) or any(tuple(a.shape) != tuple(b.shape) for a, b in zip(src, dst)):
        raise RuntimeError(
            f"fit_with_oom_retry: cannot carry the state of optimizer '{source.name}' over to an "
            "accumulating copy (its variables differ)."
        )
    for a, b in zip(src, dst):
        b.assign(a.value)
    steps = int(keras.ops.convert_to_numpy(source._iterations)) // (
        source.gradient_accumulation_steps or 1
    )
    target._iterations.assign(steps * (target.gradient_accumulation_steps or 1))
    for acc in getattr(target, "_accumulated_gradients", None) or []:
        if acc is not None:
            acc.assign(keras.ops.zeros(acc.shape, acc.dtype))


@keras.saving.register_keras_serializable(package="keras_perf")
class PerUpdateSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule read at the update count of an accumulating optimizer.

    Keras' optimizer with `gradient_accumulation_steps=k` evaluates its schedule at the count
    of accumulated batches (k per update), which would run the schedule k times too fast;
    this reads `schedule` at `step // k`, the number of updates.
    """

    def __init__(self, schedule, steps: int):
        self.schedule, self.steps = schedule, int(steps)

    def __call__(self, step):
        return self.schedule(step // self.steps)

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule), "steps": self.steps}

    @classmethod
    def from_config(cls, config):
        return cls(keras.saving.deserialize_keras_object(config["schedule"]), config["steps"])


class _Accumulation:
    """Gradient accumulation for a stock model fed arrays: batches of batch_size/k, k per update.

    The user's optimizer is not changed in structure: while the run needs accumulation the
    model trains with a copy built with `gradient_accumulation_steps=k` (Keras averages the k
    gradients and applies them once; its `iterations` counts updates, and a learning-rate
    schedule is read at the update count too, see `PerUpdateSchedule`), and the state is
    handed back to the user's optimizer when the run ends.
    """

    def __init__(self, model):
        self.model = model
        self.original = model.optimizer
        self.k = 1

    @staticmethod
    def refuses(model) -> str | None:
        if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
            return (
                "its optimizer is a LossScaleOptimizer (mixed_float16), which Keras does not let "
                "accumulate gradients."
            )
        if model.optimizer.gradient_accumulation_steps and not getattr(
            model.optimizer, "_kp_copy", False
        ):
            return "its optimizer already accumulates gradients (gradient_accumulation_steps)."
        return None

    def set(self, k: int) -> None:
        """Train with k accumulated batches per update from the next `fit` call on."""
        current = self.model.optimizer
        if k == 1:
            target = self.original
        else:
            config = dict(self.original.get_config(), gradient_accumulation_steps=k)
            with _backend.model_scope(self.model):
                target = type(self.original).from_config(config)
            schedule = self.original._learning_rate
            if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
                target._learning_rate = PerUpdateSchedule(schedule, k)
            target._kp_copy = True
        if current.built and not target.built:
            # (Unbuilt when the OOM came before the first update: Keras builds it then.)
            with _backend.model_scope(self.model):
                target.build(self.model.trainable_variables)
        _copy_optimizer_state(current, target)
        self.model.optimizer = target
        self.model.train_function = None  # rebuilt by the next fit, with the new optimizer
        self.k = k

    def finish(self) -> None:
        if self.k != 1:
            self.set(1)


def _microbatches(model) -> int:
    return model.microbatches if isinstance(model, LossScaleTrainStep) else 1


def _error_text(exc: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # Keras bolds the message in a terminal
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Exception encountered when calling"):
        lines = lines[1:]  # Keras' note on which layer raised; the error's own text follows
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 300 else text[:297] + "..."


def _tried(events, batch_size) -> str:
    parts = []
    for e in events:
        size = "?" if batch_size is None else math.ceil(batch_size / e["microbatches"])
        parts.append(
            f"epoch {e['epoch']}: batch {e['batch_size']} in {e['microbatches']} micro-batch(es) of {size}"
        )
    return "; ".join(parts)


def _cannot_microbatch(model, array_input) -> str | None:
    """Why `model` cannot be given more micro-batches, or None if it can."""
    if isinstance(model, LossScaleTrainStep):
        return None
    if isinstance(model, keras.Sequential) or _backend.is_functional(model):
        return None
    if array_input:
        refusal = _Accumulation.refuses(model)
        if refusal is None:
            return None  # smaller batches with gradient accumulation
        data = f"Smaller batches with gradient accumulation are not possible either: {refusal}"
    else:
        data = (
            "tf.data datasets, PyDatasets and generators cannot be re-batched, so micro-batching "
            "is the only way to keep the batch."
        )
    return (
        f"{type(model).__name__} is a subclassed model without keras-perf's train step, so its "
        f"batch cannot be cut into micro-batches. {data} Subclass the mixin: "
        f"`class {type(model).__name__}(kp.LossScaleTrainStep, keras.Model): ...`."
    )


def _accumulates(model, array_input) -> bool:
    """Whether recovery halves the batch and accumulates gradients (stock subclassed model)."""
    return (
        array_input
        and not isinstance(model, LossScaleTrainStep)
        and not isinstance(model, keras.Sequential)
        and not _backend.is_functional(model)
    )


def _why_not_retry(
    model, array_input, accumulation, batch, nxt, oom_count, max_retries, min_batch_size
):
    """Why the run gives up instead of retrying with `nxt` pieces per batch (None: retry)."""
    reason = _cannot_microbatch(model, array_input)
    if reason is None and oom_count > max_retries:
        reason = f"max_retries={max_retries} recoveries were used up."
    if reason is None and accumulation is not None and batch % nxt:
        reason = (
            f"batch_size={batch} cannot be cut into {nxt} equal batches, which gradient accumulation "
            "needs to keep the update unchanged (use a power-of-two batch_size, or keras-perf's "
            "train step)."
        )
    if reason is None and batch is not None:
        if nxt // 2 >= batch:
            reason = "each micro-batch is already a single example."
        elif math.ceil(batch / nxt) < min_batch_size:
            reason = (
                f"the next micro-batch ({math.ceil(batch / nxt)} examples) would be below "
                f"min_batch_size={min_batch_size}."
            )
    return reason


def fit_with_oom_retry(
    model: keras.Model,
    x=None,
    y=None,
    *,
    batch_size: int | None = None,
    epochs: int = 1,
    min_batch_size: int = 1,
    max_retries: int = 8,
    **fit_kwargs,
) -> keras.callbacks.History:
    """`model.fit` that recovers from out-of-memory without changing the effective batch.

    Before each epoch the model's and optimizer's variables are copied to host memory. When
    a step runs out of memory (TensorFlow `ResourceExhaustedError` or the `InternalError`
    "Dst tensor is not initialized", XLA `RESOURCE_EXHAUSTED`, torch `OutOfMemoryError` or an
    "out of memory" `RuntimeError`), the epoch's starting state is restored, memory is freed
    and the epoch runs again with twice as many micro-batches per step. Batches keep their
    size, each step stays one optimizer update equal to the full-batch update (see
    `kp.LossScaleTrainStep`), so the run optimises exactly what it would have without the
    error. Any other exception propagates unchanged.

    Micro-batching comes from the model's own `kp.LossScaleTrainStep` (its `microbatches` is
    doubled and stays raised afterwards) or, for a stock Sequential or Functional model, from
    a `kp.loss_scaled` twin made at the first OOM, which shares the model's layers and
    optimizer: the model you passed ends with the trained weights; `history.model` is the
    model that finished the run. This works for every kind of input, including tf.data and
    generators, which cannot be re-batched. A subclassed model without the mixin, fed arrays,
    goes on with half the `batch_size` and its optimizer averaging 2 batches per update
    (Keras' `gradient_accumulation_steps`, on a copy of the optimizer whose state is handed
    back to yours when the run ends): the same updates when `batch_size` splits evenly (the
    run gives up otherwise) and the number of examples is a multiple of it (otherwise the
    short last batch is averaged with the next one). Only the train step is sliced: an OOM
    during validation is retried until `max_retries` is used up (pass a smaller
    `validation_batch_size`). When the run gives up, the model keeps the weights and
    optimizer state it had when the failed epoch began.

    Callback contract: one set of callbacks serves the whole run. `on_train_begin` and
    `on_train_end` are called once; `on_epoch_end` once per completed epoch, so `History`,
    `EarlyStopping`, `ModelCheckpoint`, `ReduceLROnPlateau` see every epoch once. A failed
    epoch's `on_epoch_begin` and batch hooks ran before the error and run again on the retry
    (the epoch restarts from its first batch), as do the progress bar's lines.

    Args:
        model: A compiled `keras.Model`.
        x: Training inputs, as for `model.fit`. Defaults to `None`.
        y: Targets, as for `model.fit`. Defaults to `None`.
        batch_size: Batch size, as for `model.fit` (Keras uses 32 for arrays when `None`).
            Defaults to `None`.
        epochs: Index of the last epoch, as for `model.fit`. Defaults to `1`.
        min_batch_size: Smallest micro-batch (examples per slice) to try; when halving once
            more would go below it, the run gives up. Defaults to `1`.
        max_retries: Most out-of-memory recoveries in the whole run. Defaults to `8`.
        **fit_kwargs: Passed on to `model.fit` (`callbacks`, `validation_data`, `verbose`,
            `initial_epoch`, ...).

    Returns:
        The Keras `History` of the run, every epoch once, with `history.oom_events`: one dict
        per out-of-memory error, `{"epoch", "batch_size", "microbatches", "error"}` (the
        micro-batch count that failed and the error's first line).

    Raises:
        TypeError: `model` is not a Keras model, or a bad argument type.
        ValueError: the model is not compiled, or an argument is out of range.
        RuntimeError: out of memory again with micro-batches below `min_batch_size`, after
            `max_retries` recoveries, or on a model that can be neither micro-batched nor
            given smaller batches with gradient accumulation; the message
            lists what was tried, and the last OOM error is its `__cause__`. Also at the start
            under a multi-worker `MultiWorkerMirroredStrategy`, which it does not support.

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile("sgd", "mse")
        >>> h = kp.fit_with_oom_retry(model, np.ones((64, 4)), np.ones((64, 2)),
        ...                           batch_size=16, epochs=2, verbose=0)
        >>> len(h.history["loss"]), h.oom_events
        (2, [])
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if _backend.is_multi_worker(model):
        raise RuntimeError(
            "kp.fit_with_oom_retry does not support a multi-worker MultiWorkerMirroredStrategy: "
            "an out-of-memory error on one worker cannot be coordinated with the other workers, "
            "which would wait in their next collective instead of retrying. Use `model.fit` "
            "with a batch size that fits."
        )
    batch_size = check_int("batch_size", batch_size, minimum=1, allow_none=True)
    epochs = check_int("epochs", epochs, minimum=1)
    min_batch_size = check_int("min_batch_size", min_batch_size, minimum=1)
    max_retries = check_int("max_retries", max_retries, minimum=0)
    initial_epoch = check_int("initial_epoch", fit_kwargs.pop("initial_epoch", 0), minimum=0)
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"Model '{model.name}' is not compiled: call `model.compile(optimizer, loss)` before "
            "kp.fit_with_oom_retry()."
        )
    user_callbacks = fit_kwargs.pop("callbacks", None)
    if isinstance(user_callbacks, keras.callbacks.CallbackList):
        raise TypeError("Pass `callbacks` as a list of callbacks, not a CallbackList.")
    verbose = fit_kwargs.pop("verbose", "auto")

    array_input = _is_array_input(x)
    batch = (batch_size or _KERAS_DEFAULT_BATCH) if array_input else _infer_batch_size(x)
    callbacks = _RunCallbacks(
        list(user_callbacks or []),
        add_history=True,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=epochs,
        steps=_steps(x, batch_size, fit_kwargs),
    )
    events: list[dict] = []
    fitting = model
    epoch = initial_epoch
    accumulation = _Accumulation(model) if _accumulates(model, array_input) else None
    try:
        while True:
            try:
                fitting.fit(
                    x,
                    y,
                    batch_size=batch_size,
                    epochs=epochs,
                    initial_epoch=epoch,
                    callbacks=callbacks,
                    verbose=verbose,
                    **fit_kwargs,
                )
                break
            except Exception as exc:
                if not _backend.is_oom(exc):
                    raise
                in_progress = callbacks.epoch_in_progress()
                failed = (
                    callbacks.begun_epoch
                    if in_progress
                    else (
                        epoch
                        if callbacks.completed_epoch is None
                        else callbacks.completed_epoch + 1
                    )
                )
                current = accumulation.k if accumulation is not None else _microbatches(fitting)
                events.append(
                    {
                        "epoch": failed,
                        "batch_size": batch,
                        "microbatches": current,
                        "error": _error_text(exc),
                    }
                )
                nxt = current * 2
                reason = _why_not_retry(
                    fitting,
                    array_input,
                    accumulation,
                    batch,
                    nxt,
                    len(events),
                    max_retries,
                    min_batch_size,
                )
                if reason is not None:
                    if in_progress:
                        # Leave the model as it was when the failed epoch began (on JAX the
                        # failed call may have left its variables without values).
                        _restore(callbacks.snapshot)
                    raise RuntimeError(
                        f"fit_with_oom_retry gave up after {len(events)} out-of-memory error(s): {reason} "
                        f"Tried: {_tried(events, batch)}. Last error: {events[-1]['error']}. Use a "
                        "smaller batch_size or model, or free accelerator memory."
                    ) from exc
            # Outside the `except` block, so that the failed step's traceback (and the tensors
            # its frames hold) is released before memory is cleared.
            if in_progress:
                _restore(callbacks.snapshot)
            _backend.clear_memory()
            if accumulation is not None:
                accumulation.set(nxt)
                batch_size = batch // nxt
                callbacks.set_params(
                    dict(callbacks.params or {}, steps=_steps(x, batch_size, fit_kwargs))
                )
            elif isinstance(fitting, LossScaleTrainStep):
                fitting.microbatches = nxt
            else:
                fitting = loss_scaled(fitting, microbatches=nxt)
            callbacks.set_model(fitting)
            epoch = failed
    finally:
        if accumulation is not None:
            accumulation.finish()  # the user's optimizer gets the trained state back

    history = next(cb for cb in callbacks.callbacks if isinstance(cb, keras.callbacks.History))
    history.oom_events = events
    model.history = history
    return history


def find_max_microbatch(model: keras.Model, x, y=None, batch_size: int = 32) -> int:
    """Probe the largest micro-batch of a `batch_size` batch that fits in memory.

    One training step on the first `batch_size` examples is tried with 1, 2, 4, ...
    micro-batches (halving the examples per slice each time) until one runs without
    out-of-memory. The model's and optimizer's variables are restored afterwards, and its
    `microbatches` setting too: the probe leaves no trace.

    Args:
        model: A compiled Sequential or Functional `keras.Model`, or one with
            `kp.LossScaleTrainStep`.
        x: Training inputs (arrays, or a dict/list of arrays) with at least `batch_size` rows.
        y: Targets. Defaults to `None`.
        batch_size: The batch to fit. Defaults to `32`.

    Returns:
        The number of examples per micro-batch that fitted; use
        `microbatches = ceil(batch_size / result)`.

    Raises:
        TypeError: bad argument types, or a subclassed model without the train step.
        ValueError: the model is not compiled, or `batch_size` < 1.
        RuntimeError: even single-example micro-batches run out of memory.

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile("sgd", "mse")
        >>> kp.find_max_microbatch(model, np.ones((16, 4)), np.ones((16, 2)), batch_size=16)
        16
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if getattr(model, "optimizer", None) is None:
        raise ValueError(f"Model '{model.name}' is not compiled: call `model.compile(...)` first.")
    probe = model if isinstance(model, LossScaleTrainStep) else loss_scaled(model)
    xb, yb = map_batch(lambda t: t[:batch_size], (x, y))
    n = int(first_tensor(xb).shape[0])
    saved, original = _snapshot(probe), probe.microbatches
    microbatches, errors = 1, []
    try:
        while True:
            probe.microbatches = microbatches
            try:
                probe.train_on_batch(xb, yb)
                return math.ceil(n / microbatches)
            except Exception as exc:
                if not _backend.is_oom(exc):
                    raise
                errors.append(_error_text(exc))
            _backend.clear_memory()
            if microbatches >= n:
                raise RuntimeError(
                    f"find_max_microbatch: even micro-batches of one example run out of memory "
                    f"(tried {len(errors)} sizes from {n} down to 1). Last error: {errors[-1]}"
                )
            microbatches *= 2
    finally:
        _restore(saved)
        probe.microbatches = original
        probe.reset_metrics()
