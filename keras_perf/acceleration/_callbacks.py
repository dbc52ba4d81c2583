"""The callbacks the user will pass to `fit`, as far as `steps_per_execution` concerns them.

With `steps_per_execution=N` Keras calls every callback's batch-level methods
(`on_train_batch_begin` / `on_train_batch_end`, and the `on_batch_*` aliases) once per N steps,
not once per step. A callback that only watches (the progress bar, `History`, TensorBoard,
`TerminateOnNaN`, a checkpoint saved once an epoch) or that keras-perf wrote to count
executions (the monitor, the time limit) trains the same either way. Any other callback with
a batch-level method may act per batch and would then act every N steps: a learning-rate
warm-up set before each batch, the pruning callbacks (their masks change at execution
boundaries only: 0.3 apart after 2 epochs), a checkpoint every `save_freq` batches (saved at
other steps). The next `fit` would not train, or save, as it would have, so `accelerate`
leaves `steps_per_execution` as the model has it.
"""

from __future__ import annotations

import keras

BATCH_METHODS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")


def _safe_types() -> tuple[type, ...]:
    """Callbacks that train the same under `steps_per_execution` (keras-perf's own imported
    when first asked, as `accelerate` itself needs none of those packages)."""
    from keras_perf.monitor import TrainingMonitor
    from keras_perf.stopping import TimeLimit

    cb = keras.callbacks
    keras_own = (cb.History, cb.ProgbarLogger, cb.TensorBoard, cb.TerminateOnNaN, cb.CSVLogger)
    return (*keras_own, TrainingMonitor, TimeLimit)


def _saves_per_epoch(callback) -> bool:
    """A checkpoint (or backup) saved once an epoch: its batch methods save nothing."""
    checkpoints = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)
    return isinstance(callback, checkpoints) and getattr(callback, "save_freq", None) == "epoch"


def check_callbacks(callbacks) -> list:
    """`callbacks` as a list, or a `TypeError` naming the argument."""
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            "accelerate: `callbacks` must be a list of keras.callbacks.Callback (the ones you "
            f"pass to fit), got {type(callbacks).__name__}."
        )
    for c in callbacks:
        if not isinstance(c, keras.callbacks.Callback):
            raise TypeError(
                "accelerate: every item of `callbacks` must be a keras.callbacks.Callback, got "
                f"{type(c).__name__}."
            )
    return list(callbacks)


def _acts_per_batch(callback) -> bool:
    base = keras.callbacks.Callback
    for name in BATCH_METHODS:
        if name in vars(callback):  # LambdaCallback sets the functions it is given
            return True
        if getattr(type(callback), name, None) is not getattr(base, name):
            return True
    return False


def per_batch(callbacks) -> list[str]:
    """Class names of the callbacks that may act per batch (see the module's docstring)."""
    safe = _safe_types()
    return [
        type(c).__name__
        for c in callbacks
        if not isinstance(c, safe) and not _saves_per_epoch(c) and _acts_per_batch(c)
    ]


def changes_steps_per_execution(settings, model) -> bool:
    """Whether `settings` set `steps_per_execution` to other than the model's own."""
    if "steps_per_execution" not in settings:
        return False
    own = int(getattr(model, "steps_per_execution", 1) or 1)
    return int(settings["steps_per_execution"]) != own
