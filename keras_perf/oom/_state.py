"""What a retried epoch starts from and reads again: inputs, state snapshot, replay, callbacks.

Read top to bottom: what the run reads from its input `x` (`_steps`; what kind of input it
is: `keras_perf._inputs`); the state an epoch starts from (`_snapshot`/`_restore`: host
copies of every variable a train step changes; `_host_random_state`: Python's, NumPy's and
torch's RNGs, and a DataLoader's own); a Python generator made replayable (`_Replay`, with
its byte limit `_REPLAY_LIMIT_BYTES`, read at call time so tests patch it here); and
`_RunCallbacks`, the user's callbacks shared by every `fit` call of a run, which take the
snapshot at each epoch start. Not here: the retry loop (`_retry`), the rungs (`_rungs`).
"""

from __future__ import annotations

import math
import random
import sys
import threading

import keras
import numpy as np

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf._inputs import KERAS_DEFAULT_BATCH, is_array_input
from keras_perf._masks import constraint_masks
from keras_perf._utils import first_tensor, host_copy, iter_layers, map_batch

# The input `x`


def _steps(x, batch_size, fit_kwargs):
    """Steps per epoch for the progress bar (None when not known in advance)."""
    if fit_kwargs.get("steps_per_epoch") is not None:
        return fit_kwargs["steps_per_epoch"]
    try:
        if is_array_input(x):
            n = int(first_tensor(x).shape[0])
            n = math.floor(n * (1.0 - float(fit_kwargs.get("validation_split") or 0.0)))
            return math.ceil(n / (batch_size or KERAS_DEFAULT_BATCH))
        return len(x)
    except (TypeError, ValueError, AttributeError, StopIteration):
        return None


# The state an epoch starts from


def _state_variables(model) -> list:
    """Every variable a train step changes, except metrics (reset at each epoch anyway), and
    the pruning masks on the weights' constraints, which the pruning callbacks change before
    a step: a retried epoch starts from the masks its first attempt started from."""
    variables, seen = [], set()
    optimizer = getattr(model, "optimizer", None)
    extra = list(optimizer.variables) if optimizer is not None else []
    masks = [m for v in model.variables for m in constraint_masks(v)]
    for v in list(model.variables) + extra + masks:
        if id(v) not in seen:
            seen.add(id(v))
            variables.append(v)
    return variables


def build_state(model, x, y, sample_weight) -> None:
    """Create now every variable the first train step would create, so that the first
    epoch's snapshot holds them.

    TensorFlow (without a distribution strategy) builds an unbuilt model and the optimizer's
    slots inside the first traced step, after the epoch began; an epoch 0 retried after an
    OOM would otherwise keep the slots (and weights) its failed attempt had trained. JAX and
    torch build them before `fit`'s first epoch anyway (`_backend.FIT_BUILDS_IN_FIRST_STEP`),
    and are left to it. Arrays give a one-example batch to build an unbuilt model from (as
    Keras does, symbolically: no value changes); other inputs are not read (that could draw
    a shuffle), so only the optimizer of a built model is built.
    """
    if not _backend.FIT_BUILDS_IN_FIRST_STEP:
        return
    optimizer = getattr(model, "optimizer", None)
    unbuilt = not model.built or not all(layer.built for layer in iter_layers(model))
    if not unbuilt and (optimizer is None or optimizer.built):
        return
    if is_array_input(x):
        batch = map_batch(lambda t: t[:1], (x, y, sample_weight))
        with _backend.model_scope(model):
            keras_internals.symbolic_build(model, batch)
    elif not unbuilt:
        with _backend.model_scope(model):
            optimizer.build(model.trainable_variables)


def _snapshot(model, variables=None) -> list:
    """Host copies of `variables` (default: `_state_variables(model)`), for `_restore`."""
    return [
        (v, host_copy(v)) for v in (_state_variables(model) if variables is None else variables)
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


# A generator made replayable

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


# The callbacks of the run


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
        # Variables a callback made just now (the pruning callbacks install their masks at
        # the first epoch): the epoch starts from the values they were made with.
        made = self.not_in_snapshot(self.model)
        if made:
            self.snapshot += _snapshot(self.model, made)

    def on_train_batch_end(self, batch, logs=None):
        self._epoch_steps = batch + 1  # `batch` is the last step of the execution
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self.completed_epoch = epoch
        self.steps_done += self._epoch_steps

    @property
    def epoch_steps(self) -> int:
        """Training steps of the epoch in progress that completed."""
        return self._epoch_steps

    def not_in_snapshot(self, model) -> list:
        """The state variables of `model` that the epoch's snapshot does not hold: made after
        it was taken, which a rewind would miss."""
        known = {id(v) for v, _ in self.snapshot or []}
        return [v for v in _state_variables(model) if id(v) not in known]

    def epoch_in_progress(self) -> bool:
        return self.begun_epoch is not None and self.begun_epoch != self.completed_epoch

    def rewind(self, random_state: bool = True) -> None:
        """Back to the state at the start of the epoch in progress (host RNGs too, or not)."""
        _restore(self.snapshot)
        if random_state:
            _set_host_random_state(self.random_state)
