"""`fit_with_oom_retry`: `fit` calls, and the recovery between them.

Read top to bottom: the argument checks (all before any training step), how an OOM and the
attempts are written (`_error_text`, `_tried`), `_Run` (one run: its `fit` call, what is
recorded at an OOM, whether to retry, the recovery: rewind, free memory, climb one rung) and
`fit_with_oom_retry`, the loop. Not here: the inputs, snapshot, replay and callbacks
(`_state`), the rungs (`_rungs`), `find_max_microbatch` (`_probe`).
"""

from __future__ import annotations

import math
import re
import types

import keras

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf._inputs import (
    KERAS_DEFAULT_BATCH,
    check_no_ignored_settings,
    infer_batch_size,
    is_array_input,
)
from keras_perf._utils import check_int
from keras_perf.oom import _state
from keras_perf.oom._rungs import (
    ACCUMULATE,
    MICROBATCHES,
    REMAT,
    _Accumulation,
    _cannot_climb,
    _microbatches,
    _rung,
    check_strategies,
    ladder,
)
from keras_perf.oom._state import (
    _Replay,
    _RunCallbacks,
    _steps,
    build_state,
)
from keras_perf.train_step import LossScaleTrainStep, loss_scaled


def _check_validation_data(fit_kwargs) -> None:
    if isinstance(fit_kwargs.get("validation_data"), types.GeneratorType):
        raise ValueError(
            "fit_with_oom_retry: `validation_data` is a generator. The epoch retried after an "
            "out-of-memory error runs in a new `fit` call, which cannot read the batches the "
            "failed one took from it. Pass arrays, a `keras.utils.PyDataset` or a "
            "`tf.data.Dataset` as `validation_data`."
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
    check_no_ignored_settings("kp.fit_with_oom_retry", model)
    return batch_size, epochs, min_batch_size, max_retries, initial_epoch


def _check_min_batch_size(min_batch_size, batch) -> None:
    if batch is not None and min_batch_size > batch:
        raise ValueError(
            f"`min_batch_size` ({min_batch_size}) must be at most the batch size ({batch}): "
            "no micro-batch could be tried. Lower `min_batch_size`."
        )


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
            + (f", then {e['strategy']}" if e.get("strategy") else "")
        )
    return "; ".join(parts)


class _Run:
    """One `fit_with_oom_retry` run: `fit` calls, and the recovery between them."""

    def __init__(self, model, x, y, batch_size, epochs, initial_epoch, fit_kwargs, strategies):
        self.model = self.fitting = model
        self.y, self.epochs, self.epoch = y, epochs, initial_epoch
        self.user_callbacks = fit_kwargs.pop("callbacks", None)
        self.verbose = fit_kwargs.pop("verbose", "auto")
        self.fit_kwargs = fit_kwargs
        self.array_input = is_array_input(x)
        self.weighted = (
            fit_kwargs.get("sample_weight") is not None
            or fit_kwargs.get("class_weight") is not None
        )
        self.batch_size = batch_size
        self.batch = (
            (batch_size or KERAS_DEFAULT_BATCH) if self.array_input else infer_batch_size(x)
        )
        self.replay = _Replay(x) if isinstance(x, types.GeneratorType) else None
        self.x = x if self.replay is None else self.replay.stream(0)
        self.events: list[dict] = []
        rung = _rung(model, self.array_input)
        self.accumulation = _Accumulation(model) if rung == ACCUMULATE else None
        if self.accumulation is not None and strategies is not None and REMAT in strategies:
            raise ValueError(
                f'`strategies` has "remat", which needs keras-perf\'s train step; '
                f"{type(model).__name__} is a subclassed model without it. Subclass "
                'kp.LossScaleTrainStep, or pass strategies=("microbatches",).'
            )
        self.rungs = None if self.accumulation is not None else ladder(model, strategies)
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

    def next_rung(self, event) -> tuple:
        """(strategy, remat, pieces per batch) to retry with; strategy None: none is left."""
        if self.accumulation is not None:
            return MICROBATCHES, None, event["microbatches"] * 2
        return next(self.rungs, (None, None, event["microbatches"]))

    def why_not_retry(self, nxt, max_retries, min_batch_size) -> str | None:
        """Why the run gives up instead of retrying with `nxt` pieces per batch (None: retry)."""
        batch = self.batch
        if self.events and self.events[-1]["strategy"] is None:
            return "every rung of `strategies` was tried."
        reason = _cannot_climb(self.fitting, self.array_input, self.weighted)
        callbacks = self.callbacks
        if reason is None and callbacks.epoch_in_progress() and callbacks.epoch_steps:
            # Made in the epoch's first step and trained since: nothing to rewind them to.
            # (Made in a step that failed, they still hold their initial values.)
            missing = [v.path for v in callbacks.not_in_snapshot(self.fitting)]
            if missing:
                reason = (
                    f"{len(missing)} variables ({', '.join(missing[:3])}, ...) were made in "
                    "the failed epoch's first step (TensorFlow builds an unbuilt model there) "
                    "and trained since, so that epoch cannot be rolled back. Build the model "
                    "before the run: call it on a batch of data, or `model.build(input_shape)`."
                )
        if reason is None and len(self.events) > max_retries:
            reason = f"max_retries={max_retries} recoveries were used up."
        if reason is None and self.replay is not None:
            if not self.replay.can_replay(self.callbacks.steps_done):
                reason = (
                    "the generator given as `x` cannot be replayed: the failed epoch took more "
                    f"than {_state._REPLAY_LIMIT_BYTES} bytes of batches from it, more than are "
                    "kept. "
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

    def settle_metrics(self, from_twin: bool = True) -> None:
        """Give the user's model's metric variables values, as a plain `fit` leaves them.

        On JAX a `fit` that raised leaves the variables it took into the compiled step without
        values (Keras purges them for the step's duration; a donated buffer is deleted): the
        snapshot restores weights and optimizer, not metrics, which Keras resets at each epoch
        start. A model that trained on as a `kp.loss_scaled` twin never runs that reset, so
        its metrics are reset here and get the twin's final states where the twin has the
        same metric (path); then `evaluate`, `find_learning_rate` or another `fit` work.
        Giving up (`from_twin=False`), the twin's own metrics are the failed call's: only reset.
        """
        model, fitting = self.model, self.fitting
        for metric in model.metrics:
            metric.reset_state()
        if fitting is model or not from_twin:
            return
        final = {v.path: v for v in fitting.metrics_variables}
        for v in model.metrics_variables:
            twin = final.get(v.path)
            if twin is not None and tuple(twin.shape) == tuple(v.shape):
                v.assign(twin.value)

    def give_up(self, reason, exc) -> RuntimeError:
        # Leave the model as it was when the failed epoch began (on JAX the failed call may
        # have left its variables without values).
        self.rewind()
        if self.events:
            self.settle_metrics(from_twin=False)
        events = self.events
        return RuntimeError(
            f"fit_with_oom_retry gave up after {len(events)} out-of-memory error(s): {reason} "
            f"Tried: {_tried(events, self.batch)}. Last error: {events[-1]['error']}. Use a "
            "smaller batch_size or model, or free accelerator memory."
        )

    def recover(self, epoch, nxt, remat=None) -> None:
        """Rewind, free memory, and set up the retry of `epoch` with `nxt` pieces per batch
        (micro-batches, or accumulated smaller batches) and `remat`."""
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
            self.fitting.remat = remat
        else:
            self.fitting = loss_scaled(self.fitting, microbatches=nxt, remat=remat)
        self.callbacks.set_model(self.fitting)
        # A resumed run: `BackupAndRestore` (or `kp.EarlyStopping` rolling back) set the epoch
        # to resume at on the model in the first `fit`'s `on_train_begin`. Keras never clears
        # it and `fit` prefers it to `initial_epoch`, so a retry of a later epoch would start
        # at the resumed one again and train it twice.
        keras_internals.set_initial_epoch(self.fitting, None)
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
        if self.events:
            self.settle_metrics()
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
    strategies=None,
    **fit_kwargs,
) -> keras.callbacks.History:
    """`model.fit` that recovers from out-of-memory without changing the effective batch.

    Before each epoch the model's and optimizer's variables are copied to host memory. When
    a step runs out of memory (TensorFlow `ResourceExhaustedError` or the `InternalError`
    "Dst tensor is not initialized", XLA `RESOURCE_EXHAUSTED`, torch `OutOfMemoryError` or an
    "out of memory" `RuntimeError`), the epoch's starting state is restored, memory is freed
    and the epoch runs again one rung up the ladder. Batches keep their size, each step stays
    one optimizer update equal to the full-batch update (see `kp.LossScaleTrainStep`), so the
    run optimises exactly what it would have without the error. Any other exception
    propagates unchanged.

    The ladder: `"remat"` (the model's activations recomputed in the backward pass,
    `remat="full"`: the batch stays whole, the same arithmetic) and `"microbatches"` (twice
    as many micro-batches per step). The rung closest to the uninterrupted run comes first:
    remat for a model with BatchNormalization (exact) or a `kp.quantize_aware` model
    (micro-batches would normalise each slice with its own statistics, move the activation
    ranges towards each slice's min and max; remat on a QAT model is not exact on TensorFlow
    and JAX either: recomputed activations round differently, which fake quantization
    amplifies, but it ends closer, docs/oom.md), micro-batches otherwise; then the other
    rung alone; then both, the micro-batches doubling at each further error. `strategies` picks and orders the rungs.

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
        strategies: The rungs to try, in order: a list or tuple of `"remat"` and
            `"microbatches"`. Defaults to `None`: both, the exact one first (see above).
            A subclassed model without the train step has the accumulation rung only.
        **fit_kwargs: Passed on to `model.fit` (`callbacks`, `validation_data`, `verbose`,
            `initial_epoch`, ...).

    Returns:
        The Keras `History` of the run, every epoch once, with `history.oom_events`: one dict
        per out-of-memory error, `{"epoch", "batch_size", "microbatches", "error",
        "strategy"}` (the micro-batch count that failed, the error's first line, and the rung
        tried next: `"remat"`, `"microbatches"` or `"remat+microbatches"`).

    Raises:
        TypeError: `model` is not a Keras model, or a bad argument type.
        ValueError: the model is not compiled, an argument is out of range
            (`min_batch_size` above the batch size included), `validation_data` is a
            generator, or `strategies` is not a list of known rungs (or has `"remat"` for a
            subclassed model without the train step).
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
    strategies = check_strategies(strategies)
    run = _Run(model, x, y, batch_size, epochs, initial_epoch, fit_kwargs, strategies)
    _check_min_batch_size(min_batch_size, run.batch)
    build_state(model, x, y, fit_kwargs.get("sample_weight"))
    try:
        while True:
            try:
                run.fit()
                break
            except Exception as exc:
                if not _backend.is_oom(exc):
                    raise
                event = run.record(exc)
                event["strategy"], remat, nxt = run.next_rung(event)
                reason = run.why_not_retry(nxt, max_retries, min_batch_size)
                if reason is not None:
                    raise run.give_up(reason, exc) from exc
            # Outside the `except` block, so that the failed step's traceback (and the tensors
            # its frames hold) is released before memory is cleared.
            run.recover(event["epoch"], nxt, remat)
    finally:
        if run.accumulation is not None:
            run.accumulation.finish()  # the user's optimizer gets the trained state back
    return run.history()
