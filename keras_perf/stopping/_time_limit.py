"""`TimeLimit`: stop training before a wall-clock budget runs out.

It shares `keras_perf.stopping._base.MonitoringCallback` with `EarlyStopping`
(best-epoch tracking, best weights, `state_dict()`, and the persistence beside a
`BackupAndRestore` backup through `keras_perf.stopping._state`); this module adds the clock and the
estimate of the next epoch.
"""

from __future__ import annotations

import math
import time

import keras

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf._utils import check_choice, check_number, warn
from keras_perf.stopping._base import MonitoringCallback

__all__ = ["TimeLimit"]

GRANULARITIES = ("epoch", "batch")

# The clock every timing here reads; a module attribute so tests can drive it.
_now = time.perf_counter


def _longest_after_first(times: list, longest_after_first: float) -> float:
    """The longest of `times`, leaving out the first (compilation) once there are two."""
    if not times:
        return 0.0
    return longest_after_first if len(times) > 1 else times[0]


# The registered name is the one in every saved config since 0.1 ("keras_perf>TimeLimit"):
# keep it when moving the class.
@keras.saving.register_keras_serializable(package="keras_perf", name="TimeLimit")
class TimeLimit(MonitoringCallback):
    """Stop training before a wall-clock budget runs out.

    After each epoch the callback estimates the next epoch's duration (the longest epoch so far,
    leaving out the first, which includes compilation, once there are two) and stops training
    when finishing that epoch would exceed `seconds`; so a run given an hour ends before the
    hour, not after. With `granularity="batch"` it checks after every training batch instead
    (estimate: the longest batch so far plus the validation and end-of-epoch time measured in
    earlier epochs) and ends the epoch early, so the last epoch may be partial; Keras still
    validates and calls `on_epoch_end` after it.

    The clock starts at `on_train_begin`. On a resumed fit (`backup_dir`) the time spent in the
    completed epochs before the interruption counts; the interrupted epoch and the downtime
    do not. A single epoch longer than the whole budget cannot be prevented with
    `granularity="epoch"`.

    With `restore_best_weights=True` the callback tracks `monitor` like `EarlyStopping` and
    restores the best epoch's weights at the end of training, whatever ended it.

    Args:
        seconds: Wall-clock budget of the fit, in seconds (> 0).
        restore_best_weights: Restore the weights of the best epoch of `monitor` when training
            ends. Defaults to `False`.
        monitor: Key of the logs that ranks epochs for `restore_best_weights`.
            Defaults to `"val_loss"`.
        mode: `"auto"`, `"min"` or `"max"`, as in `EarlyStopping`. Defaults to `"auto"`.
        granularity: `"epoch"` (check after each epoch) or `"batch"` (also after each training
            batch). Defaults to `"epoch"`.
        verbose: 1 prints a line when the callback stops training. Defaults to `0`.
        strict: Raise `KeyError` instead of warning when `monitor` is missing and
            `restore_best_weights` needs it. Defaults to `False`.
        backup_dir: Directory to save and reload the state for resumed fits (the `backup_dir`
            of your `BackupAndRestore`). Defaults to `None`.

    Raises:
        ValueError: `seconds` is not > 0, or `mode`/`granularity` is unknown.
        TypeError: an argument has the wrong type.

    Example:
        >>> import keras, numpy as np, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> limit = kp.TimeLimit(seconds=30)
        >>> _ = model.fit(np.ones((8, 4)), np.zeros((8, 1)), epochs=3, callbacks=[limit], verbose=0)
        >>> limit.elapsed < 30
        True
    """

    _STATE_KEYS = MonitoringCallback._STATE_KEYS + (
        "elapsed",
        "epoch_times",
        "tail_times",
        "max_batch_time",
    )

    def __init__(
        self,
        seconds: float,
        restore_best_weights: bool = False,
        monitor: str = "val_loss",
        mode: str = "auto",
        granularity: str = "epoch",
        verbose: int = 0,
        strict: bool = False,
        backup_dir: str | None = None,
    ):
        self.seconds = check_number(
            "seconds", seconds, low=0.0, high=math.inf, low_inclusive=False, high_inclusive=False
        )
        if not isinstance(granularity, str):
            raise TypeError(f"`granularity` must be one of {GRANULARITIES}, got {granularity!r}.")
        self.granularity = check_choice("granularity", granularity, GRANULARITIES)
        super().__init__(monitor, mode, restore_best_weights, verbose, strict, backup_dir)
        # The batch hook only reads a clock, and touches the model once, to stop it.
        self.async_safe = True
        self._multi_worker = False

    def _reset(self) -> None:
        super()._reset()
        self.elapsed = 0.0
        self.epoch_times = []
        self.tail_times = []
        self.max_batch_time = 0.0
        # Running maxima of the times after the first (kept so the hooks stay O(1)).
        self._epoch_est = 0.0
        self._tail_est = 0.0

    def _begin_fit(self) -> None:
        self._fit_start = _now()
        self._last_mark = self._fit_start
        self._last_batch_end = None
        self._first_batch = True
        # Several workers must stop at the same point: batch-level checks would let one
        # worker leave an epoch the others are still in, so they decide per epoch only.
        self._multi_worker = _backend.is_multi_worker(self.model)
        if self._multi_worker and self.granularity == "batch":
            warn(
                "TimeLimit(granularity='batch') checks per epoch under a multi-worker strategy, "
                "so that every worker stops after the same epoch."
            )

    def _apply_state(self, state: dict) -> None:
        super()._apply_state(state)
        self.epoch_times = list(self.epoch_times)
        self.tail_times = list(self.tail_times)
        self._epoch_est = max(self.epoch_times[1:], default=0.0)
        self._tail_est = max(self.tail_times[1:], default=0.0)
        # The clock of this fit continues from the time already spent.
        now = _now()
        self._fit_start = now - float(self.elapsed)
        self._last_mark = now

    def _elapsed(self, now: float) -> float:
        return now - self._fit_start

    def next_epoch_estimate(self) -> float:
        """Seconds the next epoch is expected to take (0.0 before the first epoch ends).

        Returns:
            The longest epoch so far, the first one excluded once there are two.
        """
        return _longest_after_first(self.epoch_times, self._epoch_est)

    def _tail_estimate(self) -> float:
        # Validation and end-of-epoch work after the last batch (first epoch: compiles too).
        return _longest_after_first(self.tail_times, self._tail_est)

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch_end = _now()

    def on_train_batch_end(self, batch, logs=None):
        if self.granularity != "batch" or self.stop_reason is not None or self._multi_worker:
            return
        now = _now()
        if self._first_batch:
            self._first_batch = False  # includes compilation: not a batch time
        elif self._last_batch_end is not None:
            self.max_batch_time = max(self.max_batch_time, now - self._last_batch_end)
        self._last_batch_end = now
        if self._elapsed(now) + self.max_batch_time + self._tail_estimate() > self.seconds:
            self.stop_reason = "time_limit"
            # Not `self.model`: on JAX that property syncs the training state, which is neither
            # needed to set a flag nor safe from Keras' async dispatch thread.
            keras_internals.callback_model(self).stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        now = _now()
        logs = logs or {}
        self._last_epoch = epoch
        self.epoch_times.append(now - self._last_mark)
        if len(self.epoch_times) > 1:
            self._epoch_est = max(self._epoch_est, self.epoch_times[-1])
        if self._last_batch_end is not None and self.granularity == "batch":
            self.tail_times.append(now - self._last_batch_end)
            if len(self.tail_times) > 1:
                self._tail_est = max(self._tail_est, self.tail_times[-1])
        self._last_mark = now
        self.elapsed = self._elapsed(now)
        self._track(epoch, logs)
        if self.granularity == "batch":
            # A partial epoch may still fit: stop only if not even one more batch does.
            needed = self.max_batch_time + self._tail_estimate()
        else:
            needed = self.next_epoch_estimate()
        stop = self.stop_reason is not None or self.elapsed + needed > self.seconds
        # Clocks differ between workers: under a multi-worker strategy all stop if one must.
        if _backend.any_worker(stop, self.model):
            self._stop(epoch, "time_limit")
        self._persist(epoch)

    def _track(self, epoch: int, logs: dict) -> None:
        """Keep the best epoch of `monitor` (warn about a missing key only if it is needed)."""
        if not self.restore_best_weights and self.monitor not in logs:
            return
        if self.monitor_op is None:
            try:
                self._set_monitor_op()
            except ValueError:
                if self.restore_best_weights:
                    raise
                return  # only informative here: no direction, no ranking
        current = self._monitored_value(logs)
        if current is not None and math.isfinite(current):
            if self.best is None or bool(self.monitor_op(current, self.best)):
                self.best = current
                self.best_epoch = epoch
                if self.restore_best_weights:
                    self.best_weights = self.model.get_weights()

    def get_config(self) -> dict:
        config = self._config()
        config.update(seconds=self.seconds, granularity=self.granularity)
        return config
