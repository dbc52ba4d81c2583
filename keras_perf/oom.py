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
import random
import re
import sys
import threading
import types

import keras
import numpy as np

from keras_perf import backend as _backend
from keras_perf._utils import check_int, first_tensor, map_batch
from keras_perf.backend import keras_internals
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


def _torch_generators(x) -> list:
    """The torch RNGs that shuffle a DataLoader `x` (the global one, and its own if it has one)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found = [torch.default_generator]
    for owner in (x, getattr(x, "sampler", None), getattr(x, "batch_sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _host_random_state(x) -> tuple:
    """Python's, NumPy's and torch's global RNG states, and the RNG of a DataLoader `x`.

    They draw the shuffling of arrays (NumPy on JAX, torch on torch), of a PyDataset (Python)
    and of a DataLoader (torch): restored with the weights, the retried epoch sees the batches
    the failed attempt saw, in the same order.
    """
    torch_states = [(g, g.get_state()) for g in _torch_generators(x)]
    return random.getstate(), np.random.get_state(), torch_states


def _set_host_random_state(state) -> None:
    python_state, numpy_state, torch_states = state
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    for generator, value in torch_states:
        generator.set_state(value)


# -- callbacks: each hook of the whole run once -------------------------------------------
class _RunCallbacks(keras.callbacks.CallbackList):
    """The user's callbacks, shared by every `fit` call of one `fit_with_oom_retry` run.

    `on_train_begin` is forwarded once (so callbacks that reset their state there, like
    `EarlyStopping`, are not reset by a retry); `on_epoch_end` runs only for epochs that
    completed, so each completed epoch reaches the callbacks once. `on_train_end` comes from
    the final, successful `fit` call. At each epoch start the state is snapshotted (weights,
    optimizer, host RNGs) and the number of training steps run by completed epochs, which
    is where a replayed generator resumes, is handed to `replay`.
    """

    def __init__(self, callbacks, x=None, replay=None, **kwargs):
        super().__init__(callbacks, **kwargs)
        self._kp_started = False
        self._x, self.replay = x, replay
        self.begun_epoch = None  # epoch whose on_epoch_begin ran last
        self.completed_epoch = None  # epoch whose on_epoch_end ran last
        self.snapshot = self.random_state = self.resume_random_state = None
        self.steps_done = 0  # training steps of the completed epochs
        self._epoch_steps = 0

    def on_train_begin(self, logs=None):
        if not self._kp_started:
            self._kp_started = True
            super().on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        if self.resume_random_state is not None and self.resume_random_state[0] == epoch:
            # The retried epoch: the host RNGs as the failed attempt found them. Set here, not
            # before `fit`, which draws seeds (new metrics, a new twin) before the first epoch.
            _set_host_random_state(self.resume_random_state[1])
        self.resume_random_state = None
        self.snapshot = _snapshot(self.model)
        self.random_state = _host_random_state(self._x)
        if self.replay is not None:
            self.replay.keep_from(self.steps_done)
        self.begun_epoch, self._epoch_steps = epoch, 0
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._epoch_steps = batch + 1  # `batch` is the last step of the execution
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self.completed_epoch = epoch
        self.steps_done += self._epoch_steps

    def epoch_in_progress(self) -> bool:
        return self.begun_epoch is not None and self.begun_epoch != self.completed_epoch

    def rewind(self, random_state: bool = True) -> None:
        """Back to the state at the start of the epoch in progress (host RNGs too, or not)."""
        _restore(self.snapshot)
        if random_state:
            _set_host_random_state(self.random_state)


# -- inputs -------------------------------------------------------------------------------
def _is_array_input(x) -> bool:
    """numpy / backend tensors (or a dict, list or tuple of them): data `fit` batches itself."""
    leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
    return bool(leaves) and all(
        isinstance(t, np.ndarray) or (hasattr(t, "shape") and hasattr(t, "dtype")) for t in leaves
    )


# A generator's batches are kept from the start of each epoch until the epoch ends, so that
# a retried epoch gets the same batches again; beyond this many bytes an epoch is not kept
# (an OOM in it then ends the run, saying so).
_REPLAY_LIMIT_BYTES = 2**30


def _nbytes(batch) -> int:
    total = 0
    for t in keras.tree.flatten(batch):
        n = getattr(t, "nbytes", None)
        if n is None and hasattr(t, "shape") and hasattr(t, "dtype"):
            n = int(np.prod(t.shape)) * np.dtype(str(getattr(t.dtype, "name", t.dtype))).itemsize
        total += int(n or 0)
    return total


class _Replay:
    """A Python generator made replayable from the start of the epoch in progress.

    Batches are counted from the start of the run (stream index). `stream(start)` is a new
    generator that yields from index `start`: the kept batches first, then the source's
    next ones, which it keeps. `keep_from(index)` (called at each epoch start with the
    number of training steps run so far) drops the batches before `index`. Batches are kept
    by reference (a generator that refills the same arrays in place cannot be replayed), at
    most `_REPLAY_LIMIT_BYTES` per epoch. A lock guards the source, which a stale input
    pipeline of a failed `fit` call may still be reading.
    """

    def __init__(self, source):
        self._source = source
        self._kept: list = []
        self._first = 0  # stream index of self._kept[0]
        self._pulled = 0  # batches taken from the source
        self._bytes, self._keeping = 0, True
        self._lock = threading.Lock()

    def keep_from(self, index: int) -> None:
        with self._lock:
            if index > self._first:
                drop = min(index, self._pulled) - self._first
                self._bytes -= sum(_nbytes(b) for b in self._kept[:drop])
                del self._kept[:drop]
                self._first += drop
            self._keeping = True

    def can_replay(self, start: int) -> bool:
        return start >= self._first

    def _get(self, index: int):
        with self._lock:
            if index < self._pulled:
                if index < self._first:
                    raise RuntimeError(
                        "fit_with_oom_retry: a batch of the generator to replay was not kept."
                    )
                return self._kept[index - self._first]
            batch = next(self._source)  # StopIteration ends the stream
            self._pulled += 1
            if self._keeping:
                self._kept.append(batch)
                self._bytes += _nbytes(batch)
                if self._bytes > _REPLAY_LIMIT_BYTES:  # give up keeping this epoch
                    self._kept, self._bytes, self._keeping = [], 0, False
                    self._first = self._pulled
            else:
                self._first = self._pulled
            return batch

    def stream(self, start: int):
        index = start
        while True:
            try:
                batch = self._get(index)
            except StopIteration:
                return
            index += 1
            yield batch


def _check_validation_data(fit_kwargs) -> None:
    if isinstance(fit_kwargs.get("validation_data"), types.GeneratorType):
        raise ValueError(
            "fit_with_oom_retry: `validation_data` is a generator. The epoch retried after an "
            "out-of-memory error runs in a new `fit` call, which cannot read the batches the "
            "failed one took from it. Pass arrays, a `keras.utils.PyDataset` or a "
            "`tf.data.Dataset` as `validation_data`."
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
# The accumulation route below reads three private attributes of Keras optimizers, through
# keras_perf/backend/keras_internals.py: the raw batch counter behind `iterations`, the schedule
# behind `learning_rate` and the gradient accumulators.
def _plain_variables(optimizer) -> list:
    """The optimizer's variables other than its step counter and gradient accumulators."""
    skip = {id(a) for a in keras_internals.accumulated_gradients(optimizer)}
    skip.add(id(keras_internals.optimizer_iterations(optimizer)))
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
    steps = int(keras.ops.convert_to_numpy(keras_internals.optimizer_iterations(source))) // (
        source.gradient_accumulation_steps or 1
    )
    keras_internals.optimizer_iterations(target).assign(
        steps * (target.gradient_accumulation_steps or 1)
    )
    for acc in keras_internals.accumulated_gradients(target):
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


def _loss_reductions(model) -> list:
    """The reductions of the compiled losses ("sum_over_batch_size" for a function or name)."""
    losses = keras.tree.flatten(getattr(model, "loss", None))
    return [
        getattr(loss, "reduction", "sum_over_batch_size") for loss in losses if loss is not None
    ]


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
    def refuses(model, weighted: bool = False) -> str | None:
        """Why accumulation would change the update (None: it gives the full-batch update).

        Keras averages the k gradients. That is the full-batch gradient when each batch's
        loss is its sum divided by the batch size ("sum_over_batch_size", "mean", with or
        without sample weights): it is not for "sum" (1/k of the update) nor, with
        sample weights (`weighted`), for "mean_with_sample_weight" (each batch divided by
        its own weight total).
        """
        for reduction in _loss_reductions(model):
            if reduction == "sum" or (reduction == "mean_with_sample_weight" and weighted):
                return (
                    f'its loss has reduction="{reduction}"'
                    + (" and the data has sample weights" if weighted else "")
                    + ", and averaging the gradients of smaller batches would not give the "
                    "full-batch update."
                )
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
            schedule = keras_internals.learning_rate_source(self.original)
            if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
                keras_internals.set_learning_rate_source(target, PerUpdateSchedule(schedule, k))
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


def _cannot_microbatch(model, array_input, weighted) -> str | None:
    """Why `model` cannot be given more micro-batches, or None if it can."""
    if isinstance(model, LossScaleTrainStep):
        return None
    if isinstance(model, keras.Sequential) or _backend.is_functional(model):
        return None
    if array_input:
        refusal = _Accumulation.refuses(model, weighted)
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


def _check_arguments(model, batch_size, epochs, min_batch_size, max_retries, fit_kwargs):
    """Validate the arguments (before any step); returns them checked, and `initial_epoch`."""
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
    if isinstance(fit_kwargs.get("callbacks"), keras.callbacks.CallbackList):
        raise TypeError("Pass `callbacks` as a list of callbacks, not a CallbackList.")
    _check_validation_data(fit_kwargs)
    return batch_size, epochs, min_batch_size, max_retries, initial_epoch


def _check_min_batch_size(min_batch_size, batch) -> None:
    if batch is not None and min_batch_size > batch:
        raise ValueError(
            f"`min_batch_size` ({min_batch_size}) must be at most the batch size ({batch}): "
            "no micro-batch could be tried. Lower `min_batch_size`."
        )


class _Run:
    """One `fit_with_oom_retry` run: `fit` calls, and the recovery between them."""

    def __init__(self, model, x, y, batch_size, epochs, initial_epoch, fit_kwargs):
        self.model = self.fitting = model
        self.y, self.epochs, self.epoch = y, epochs, initial_epoch
        self.user_callbacks = fit_kwargs.pop("callbacks", None)
        self.verbose = fit_kwargs.pop("verbose", "auto")
        self.fit_kwargs = fit_kwargs
        self.array_input = _is_array_input(x)
        self.weighted = (
            fit_kwargs.get("sample_weight") is not None
            or fit_kwargs.get("class_weight") is not None
        )
        self.batch_size = batch_size
        self.batch = (
            (batch_size or _KERAS_DEFAULT_BATCH) if self.array_input else _infer_batch_size(x)
        )
        self.replay = _Replay(x) if isinstance(x, types.GeneratorType) else None
        self.x = x if self.replay is None else self.replay.stream(0)
        self.events: list[dict] = []
        self.accumulation = _Accumulation(model) if _accumulates(model, self.array_input) else None
        self.callbacks = _RunCallbacks(
            list(self.user_callbacks or []),
            x=x,
            replay=self.replay,
            add_history=True,
            add_progbar=self.verbose != 0,
            model=model,
            verbose=self.verbose,
            epochs=epochs,
            steps=_steps(x, batch_size, fit_kwargs),
        )

    def fit(self) -> None:
        self.fitting.fit(
            self.x,
            self.y,
            batch_size=self.batch_size,
            epochs=self.epochs,
            initial_epoch=self.epoch,
            callbacks=self.callbacks,
            verbose=self.verbose,
            **self.fit_kwargs,
        )

    def failed_epoch(self) -> int:
        """The epoch the OOM interrupted (or the next one, between epochs)."""
        callbacks = self.callbacks
        if callbacks.epoch_in_progress():
            return callbacks.begun_epoch
        return self.epoch if callbacks.completed_epoch is None else callbacks.completed_epoch + 1

    def pieces(self) -> int:
        """Micro-batches (or accumulated batches) per step now."""
        return self.accumulation.k if self.accumulation is not None else _microbatches(self.fitting)

    def record(self, exc) -> dict:
        event = {
            "epoch": self.failed_epoch(),
            "batch_size": self.batch,
            "microbatches": self.pieces(),
            "error": _error_text(exc),
        }
        self.events.append(event)
        return event

    def why_not_retry(self, nxt, max_retries, min_batch_size) -> str | None:
        """Why the run gives up instead of retrying with `nxt` pieces per batch (None: retry)."""
        batch = self.batch
        reason = _cannot_microbatch(self.fitting, self.array_input, self.weighted)
        if reason is None and len(self.events) > max_retries:
            reason = f"max_retries={max_retries} recoveries were used up."
        if reason is None and self.replay is not None:
            if not self.replay.can_replay(self.callbacks.steps_done):
                reason = (
                    "the generator given as `x` cannot be replayed: the failed epoch took more "
                    f"than {_REPLAY_LIMIT_BYTES} bytes of batches from it, more than are kept. "
                    "Pass a `keras.utils.PyDataset` or a `tf.data.Dataset`, which an epoch can "
                    "read again."
                )
        if reason is None and self.accumulation is not None and batch % nxt:
            reason = (
                f"batch_size={batch} cannot be cut into {nxt} equal batches, which gradient "
                "accumulation needs to keep the update unchanged (use a power-of-two "
                "batch_size, or keras-perf's train step)."
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

    def rewind(self) -> None:
        """Restore the state the failed epoch began with (weights, optimizer, host RNGs)."""
        if self.callbacks.epoch_in_progress():
            self.callbacks.rewind()

    def give_up(self, reason, exc) -> RuntimeError:
        # Leave the model as it was when the failed epoch began (on JAX the failed call may
        # have left its variables without values).
        self.rewind()
        events = self.events
        return RuntimeError(
            f"fit_with_oom_retry gave up after {len(events)} out-of-memory error(s): {reason} "
            f"Tried: {_tried(events, self.batch)}. Last error: {events[-1]['error']}. Use a "
            "smaller batch_size or model, or free accelerator memory."
        )

    def recover(self, epoch, nxt) -> None:
        """Rewind, free memory, and set up the retry of `epoch` with `nxt` pieces per batch."""
        in_progress = self.callbacks.epoch_in_progress()
        if in_progress:
            self.callbacks.rewind(random_state=False)
        _backend.clear_memory()
        if self.accumulation is not None:
            self.accumulation.set(nxt)
            self.batch_size = self.batch // nxt
            steps = _steps(self.x, self.batch_size, self.fit_kwargs)
            self.callbacks.set_params(dict(self.callbacks.params or {}, steps=steps))
        elif isinstance(self.fitting, LossScaleTrainStep):
            self.fitting.microbatches = nxt
        else:
            self.fitting = loss_scaled(self.fitting, microbatches=nxt)
        self.callbacks.set_model(self.fitting)
        if self.replay is not None:  # the failed epoch's batches again, then the next ones
            self.x = self.replay.stream(self.callbacks.steps_done)
        self.epoch = epoch
        if in_progress:
            self.callbacks.resume_random_state = (epoch, self.callbacks.random_state)

    def history(self) -> keras.callbacks.History:
        history = next(
            cb for cb in self.callbacks.callbacks if isinstance(cb, keras.callbacks.History)
        )
        history.oom_events = self.events
        self.model.history = history
        return history


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

    Inputs: the retried epoch reads the batches the failed attempt read, in the same order.
    Arrays, a PyDataset and a torch DataLoader are read again; the host RNGs that shuffle
    them (Python's, NumPy's, torch's and the DataLoader's own) are restored to their state at
    the start of the failed epoch. A Python generator cannot be rewound: its batches are
    kept from the start of each epoch (by reference, up to 1 GiB per epoch) and fed again.
    Not replayed exactly: arrays shuffled on TensorFlow (`tf.random` ops) and a
    `tf.data.Dataset` that reshuffles each iteration (the retry gets a new order of the same
    examples); a PyDataset whose `__getitem__` is not deterministic. Refused before any step:
    `validation_data` as a generator.

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
        ValueError: the model is not compiled, an argument is out of range
            (`min_batch_size` above the batch size included), or `validation_data` is a
            generator.
        RuntimeError: out of memory again with micro-batches below `min_batch_size`, after
            `max_retries` recoveries, or on a model that can be neither micro-batched nor
            given smaller batches with gradient accumulation (a subclassed model without
            the train step whose loss has reduction="sum", or "mean_with_sample_weight" with
            sample weights), or when a generator's epoch was too large to keep; the message
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
    batch_size, epochs, min_batch_size, max_retries, initial_epoch = _check_arguments(
        model, batch_size, epochs, min_batch_size, max_retries, fit_kwargs
    )
    run = _Run(model, x, y, batch_size, epochs, initial_epoch, fit_kwargs)
    _check_min_batch_size(min_batch_size, run.batch)
    try:
        while True:
            try:
                run.fit()
                break
            except Exception as exc:
                if not _backend.is_oom(exc):
                    raise
                event = run.record(exc)
                nxt = event["microbatches"] * 2
                reason = run.why_not_retry(nxt, max_retries, min_batch_size)
                if reason is not None:
                    raise run.give_up(reason, exc) from exc
            # Outside the `except` block, so that the failed step's traceback (and the tensors
            # its frames hold) is released before memory is cleared.
            run.recover(event["epoch"], nxt)
    finally:
        if run.accumulation is not None:
            run.accumulation.finish()  # the user's optimizer gets the trained state back
    return run.history()


def _is_unbatched_tf_data(model, x) -> bool:
    """A tf.data.Dataset whose elements have one dimension less than the model's inputs."""
    inputs = getattr(model, "inputs", None)
    spec = keras.tree.flatten(x.element_spec)[0]
    if not inputs or spec.shape.rank is None:
        return False
    return spec.shape.rank == len(inputs[0].shape) - 1


def _probe_batch(model, x, y, batch_size):
    """The first `batch_size` examples of `x` as `(x, y, sample_weight)` arrays."""
    if _is_array_input(x):
        return (*map_batch(lambda t: t[:batch_size], (x, y)), None)
    if isinstance(x, types.GeneratorType) or (hasattr(x, "__next__") and iter(x) is x):
        raise TypeError(
            "find_max_microbatch: `x` is a generator or iterator, which the probe would "
            "consume. Pass arrays, a `tf.data.Dataset`, a `keras.utils.PyDataset` or a torch "
            "DataLoader."
        )
    if y is not None:
        raise ValueError("find_max_microbatch: `y` must be None when `x` is a dataset.")
    if hasattr(x, "element_spec") and _is_unbatched_tf_data(model, x):
        x = x.batch(batch_size)
    if isinstance(x, keras.utils.PyDataset):
        batches = (x[i] for i in range(len(x)))
    else:
        try:
            batches = iter(x)
        except TypeError:
            raise TypeError(
                f"find_max_microbatch: unsupported `x` of type {type(x).__name__}."
            ) from None
    taken, n = [], 0
    for batch in batches:
        # A DataLoader yields lists: (x, y) as a list.
        batch = keras.utils.unpack_x_y_sample_weight(
            tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)
        )
        taken.append(map_batch(keras.ops.convert_to_numpy, batch))
        n += int(first_tensor(batch).shape[0])
        if n >= batch_size:
            break
    if n < batch_size:
        raise ValueError(
            f"find_max_microbatch: `x` holds {n} examples, fewer than batch_size={batch_size}."
        )
    joined = keras.tree.map_structure(
        lambda *ts: None if ts[0] is None else np.concatenate(ts)[:batch_size], *taken
    )
    return joined


def find_max_microbatch(model: keras.Model, x, y=None, batch_size: int = 32) -> int:
    """Probe the largest micro-batch of a `batch_size` batch that fits in memory.

    One training step on the first `batch_size` examples is tried with 1, 2, 4, ...
    micro-batches (halving the examples per slice each time) until one runs without
    out-of-memory. The model's and optimizer's variables are restored afterwards, and its
    `microbatches` setting too: the probe leaves no trace.

    Args:
        model: A compiled Sequential or Functional `keras.Model`, or one with
            `kp.LossScaleTrainStep`.
        x: Training inputs with at least `batch_size` examples: arrays (or a dict/list of
            them), a `tf.data.Dataset` (batched, or unbatched: then batched here), a
            `keras.utils.PyDataset` or a torch DataLoader; their first batches are read.
            Not a generator or iterator, which the probe would consume.
        y: Targets, with arrays only. Defaults to `None`.
        batch_size: The batch to fit. Defaults to `32`.

    Returns:
        The number of examples per micro-batch that fitted; use
        `microbatches = ceil(batch_size / result)`.

    Raises:
        TypeError: bad argument types, a subclassed model without the train step, or `x` a
            generator or iterator.
        ValueError: the model is not compiled, `batch_size` < 1, `y` given with a dataset,
            or `x` has fewer than `batch_size` examples.
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
    xb, yb, sw = _probe_batch(model, x, y, batch_size)
    probe = model if isinstance(model, LossScaleTrainStep) else loss_scaled(model)
    n = int(first_tensor(xb).shape[0])
    saved, original = _snapshot(probe), probe.microbatches
    microbatches, errors = 1, []
    try:
        while True:
            probe.microbatches = microbatches
            try:
                probe.train_on_batch(xb, yb, sample_weight=sw)
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
