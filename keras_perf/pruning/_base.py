"""`MaskingCallback`: the schedule stepping shared by `PruningCallback` and `ChannelPruningCallback`.

Both callbacks hold 0/1 masks in variables installed as weight constraints, and recompute them
at the steps a pruning schedule names. What they share lives here once:

- the step: the optimizer's iteration count, read by the subclass (`_read_step`) and counted
  in Python in between, `steps_per_execution` (`_spe`) steps per `on_train_batch_begin`;
- the stepping: `on_train_batch_begin` asks the schedule about each of those steps and hands
  the last one due, `(step, sparsity)` or None, to `_on_step`, whose default runs
  `_update(step, sparsity)` when one is due;
- the masks in the step's state: `_carry_masks` (JAX: the masks join the optimizer state, so a
  mask update needs no retrace), `_release_masks`, and `_refresh_train_step` (a new train
  function when constraints change, or when the step baked in the old mask values).

A subclass sets `schedule` and defines `_update(step, sparsity)` and `_mask_variables()`; only
`on_train_batch_begin` is overridden here, which Keras always calls in line, so the batch-end
hooks stay asynchronous (`async_safe`).
"""

from __future__ import annotations

import keras
from keras import ops

from keras_perf import backend as _backend
from keras_perf.pruning._constraint import _refresh_train_step
from keras_perf.pruning._schedules import scheduled


class MaskingCallback(keras.callbacks.Callback):
    """Base of the masking callbacks: schedule stepping and the masks' place in the step."""

    def __init__(self):
        super().__init__()
        self.async_safe = True
        self._carried = False
        self._step = 0
        self._spe = 1

    # -- to define in a subclass ----------------------------------------------------------------
    def _update(self, step: int, sparsity: float) -> None:
        """Recompute the masks for `sparsity` at `step`."""
        raise NotImplementedError

    def _mask_variables(self) -> list:
        """The mask variables installed on the model."""
        raise NotImplementedError

    # -- stepping -------------------------------------------------------------------------------
    def _read_step(self, model) -> None:
        """Set the step from the optimizer's iteration count."""
        self._step = int(ops.convert_to_numpy(model.optimizer.iterations))

    def _read_steps_per_execution(self, model) -> None:
        self._spe = int(getattr(model, "steps_per_execution", 1) or 1)

    def on_train_batch_begin(self, batch, logs=None):
        step = self._step
        self._step += self._spe
        due = None
        for s in range(step, step + self._spe):
            should, sparsity = scheduled(self.schedule, s)
            if should:
                due = (s, sparsity)
        self._on_step(due)

    def _on_step(self, due) -> None:
        """Before a batch: `due` is the last `(step, sparsity)` the schedule names in it, or None."""
        if due is not None:
            self._update(*due)

    # -- masks in the train step ----------------------------------------------------------------
    def _carry_masks(self, model) -> None:
        self._carried = _backend.carry_in_step_state(model, self._mask_variables())

    def _release_masks(self, model) -> None:
        if self._carried:
            _backend.release_step_state(model, self._mask_variables())
            self._carried = False

    def _refresh_train_step(self, model, masks_changed: bool, constraints_changed: bool) -> None:
        _refresh_train_step(
            model,
            masks_changed=masks_changed,
            constraints_changed=constraints_changed,
            masks_carried=self._carried,
        )
