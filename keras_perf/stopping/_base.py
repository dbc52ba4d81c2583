"""`MonitoringCallback`: what `EarlyStopping` and `TimeLimit` share (not public).

Keras' counterpart is `MonitorCallback` (`keras/src/callbacks/monitor_callback.py`), under
`early_stopping.py`. Here live the monitored value and its direction (`monitor_op`; Keras'
"auto" rule in `_metric_direction`), the best value, epoch and weights, the missing-key
warning, and the resumable state. Both callbacks, through this base,

- record why they stopped (`stop_reason`), where (`stopped_epoch`), and the best value and
  epoch seen (`best`, `best_epoch`), and can restore the best weights;
- warn once (or raise with `strict=True`) when the monitored key is missing, naming the keys
  that exist;
- carry their state across an interruption: `state_dict()`/`load_state_dict()`, and, with
  `backup_dir=` set to the directory of a `keras.callbacks.BackupAndRestore`, they save that
  state beside the backup after every epoch and reload it when the fit is resumed
  (`keras_perf.stopping._state`), whatever the order of the callbacks;
- reset in `on_train_begin`, so one instance serves several fits.

The decision is taken on the host from the epoch logs, which Keras has already reduced across
replicas under `tf.distribute`, so every replica (and every worker) takes the same decision.

Not here: the stopping rules (`_early_stopping`, `_time_limit` in this package) and the
files on disk (`_state`). Users import the callbacks from `keras_perf` (or
`keras_perf.stopping`, which also exports this base).
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import re

import keras
import numpy as np

from keras_perf import _keras_internals as keras_internals
from keras_perf._utils import check_bool, check_choice, check_int, warn
from keras_perf.stopping._state import CallbackStateStore, check_backup_dir, read_backup_epoch

__all__ = ["MonitoringCallback"]

MODES = ("auto", "min", "max")
STOP_REASONS = ("patience", "threshold", "divergence", "non_finite", "time_limit")

# Keras' comparison functions: `monitor_op` is one of them, as in Keras (`keras.ops.less` for
# "min", `keras.ops.greater` for "max"), and improvements are decided by calling it exactly as
# Keras does, so the float32 rounding of the comparison is Keras' too.
_LESS = keras.ops.less
_GREATER = keras.ops.greater


def _metric_direction(model, monitor: str):
    """`monitor_op` for `monitor` as Keras' `MonitorCallback._set_monitor_op` finds it in "auto".

    "loss" (after removing "val_") goes down; a compiled metric of that name that declares a
    direction (`keras_internals.metric_direction`) decides; otherwise None. Like Keras, only the metrics
    inside the compiled-metrics containers are looked at, and the last match wins.
    """
    name = monitor.removeprefix("val_")
    op = _LESS if name == "loss" else None
    if model is not None and hasattr(model, "metrics"):
        found = []
        for metric in model.metrics:
            # Keras' CompileMetrics / MetricsList (trainers/compile_utils.py; not imported:
            # private); Keras expands exactly these two.
            if type(metric).__name__ in ("CompileMetrics", "MetricsList"):
                found.extend(metric.metrics)
        for metric in found:
            direction = keras_internals.metric_direction(metric)
            if getattr(metric, "name", None) == name and direction is not None:
                op = _GREATER if direction == "up" else _LESS
    return op


class MonitoringCallback(keras.callbacks.Callback):
    """Shared machinery: monitored value, direction, best weights, missing key, resumable state.

    Not public. Subclasses implement `on_epoch_end` and call `_persist(epoch)` at its end.
    """

    _STATE_KEYS: tuple[str, ...] = ("stopped_epoch", "best", "best_epoch", "stop_reason")

    def __init__(
        self,
        monitor: str,
        mode: str,
        restore_best_weights: bool,
        verbose: int,
        strict: bool,
        backup_dir,
    ):
        super().__init__()
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(
                f"`monitor` must be a non-empty string such as 'val_loss', got {monitor!r}."
            )
        if not isinstance(mode, str):
            raise TypeError(f"`mode` must be one of {MODES}, got {mode!r}.")
        check_choice("mode", mode, MODES)
        if isinstance(verbose, bool):
            verbose = int(verbose)
        if backup_dir is not None and not isinstance(backup_dir, (str, os.PathLike)):
            raise TypeError(f"`backup_dir` must be a path (str) or None, got {backup_dir!r}.")
        if backup_dir is not None and not os.fspath(backup_dir):
            raise ValueError("`backup_dir` must be a directory path or None, got ''.")
        self.monitor = monitor
        self.mode = mode
        self.restore_best_weights = check_bool("restore_best_weights", restore_best_weights)
        self.verbose = check_int("verbose", verbose, minimum=0)
        self.strict = check_bool("strict", strict)
        self.backup_dir = None if backup_dir is None else os.fspath(backup_dir)
        # As Keras: set at the first `on_epoch_end` (the model's metrics are built by then)
        # and kept across fits.
        self.monitor_op = None
        self._pending_state = None
        self._store = None
        self._reset()

    # ----------------------------------------------------------------------- state
    def _reset(self) -> None:
        self.stopped_epoch = 0
        self.best = None
        self.best_epoch = 0
        self.best_weights = None
        self.stop_reason = None
        self._last_epoch = None
        self._warned_missing = False

    @property
    def _direction(self) -> str | None:
        if self.monitor_op is None:
            return None
        return "min" if self.monitor_op is _LESS else "max"

    def state_dict(self) -> dict:
        """The callback's progress as a dict, to save with a checkpoint.

        Returns:
            A dict of plain Python values (JSON-serialisable) plus `"best_weights"`, the list of
            NumPy arrays of the best weights (or None when not kept).

        Example:
            >>> import keras_perf as kp
            >>> es = kp.EarlyStopping(patience=2)
            >>> es.best, es.best_epoch = 0.5, 3  # as a fit leaves them
            >>> restored = kp.EarlyStopping(patience=2)
            >>> restored.load_state_dict(es.state_dict())
            >>> restored.best, restored.best_epoch
            (0.5, 3)
        """
        state = {key: getattr(self, key) for key in self._STATE_KEYS}
        state["epoch"] = self._last_epoch
        state["direction"] = self._direction
        state["best_weights"] = None if self.best_weights is None else list(self.best_weights)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore progress saved by `state_dict()` (keys missing from older saves keep defaults).

        The state is applied now and again at the start of the next fit (which otherwise resets
        the callback), so `load_state_dict(...)` then `model.fit(...)` resumes where the saved
        run was.

        Args:
            state: A dict returned by `state_dict()`.

        Raises:
            TypeError: `state` is not a dict.
        """
        if not isinstance(state, dict):
            raise TypeError(
                f"`state` must be a dict from `state_dict()`, got {type(state).__name__}."
            )
        self._apply_state(state)
        self._pending_state = state

    def _apply_state(self, state: dict) -> None:
        for key in self._STATE_KEYS:
            if key in state:
                setattr(self, key, state[key])
        self._last_epoch = state.get("epoch", self._last_epoch)
        direction = state.get("direction")
        if self.monitor_op is None and direction in ("min", "max"):
            self._set_op(_LESS if direction == "min" else _GREATER)
        weights = state.get("best_weights")
        self.best_weights = None if weights is None else [np.asarray(w) for w in weights]

    # ------------------------------------------------------------- monitored value
    def _set_monitor_op(self) -> None:
        """Keras' `MonitorCallback._set_monitor_op`: the direction from `mode` or the metric."""
        if self.mode == "min":
            op = _LESS
        elif self.mode == "max":
            op = _GREATER
        else:
            op = _metric_direction(keras_internals.callback_model(self), self.monitor)
            if op is None:
                raise ValueError(
                    f"{type(self).__name__} callback received monitor={self.monitor}, but Keras "
                    "isn't able to automatically determine whether that metric should be "
                    "maximized or minimized. Pass `mode='max'` in order to monitor based on the "
                    "highest metric value, or pass `mode='min'` in order to use the lowest value."
                )
        self._set_op(op)

    def _set_op(self, op) -> None:
        self.monitor_op = op
        self._check_direction(self._direction)

    def _check_direction(self, direction: str) -> None:
        """Hook: validate direction-dependent arguments once the direction is known."""

    def _better(self, a: float, b: float) -> bool:
        """Whether `a` is strictly better than `b` (float64; for the added criteria only)."""
        return a < b if self._direction == "min" else a > b

    def _monitored_value(self, logs: dict) -> float | None:
        """The monitored value as a float, or None (after a warning) when it is not logged."""
        value = logs.get(self.monitor)
        if value is None:
            message = (
                f"{type(self).__name__} monitors `{self.monitor}`, which is not in the logs. "
                f"Keys available: {', '.join(sorted(logs)) or '(none)'}. Pass one of them as "
                "`monitor=` (validation keys need `validation_data`)."
            )
            if self.strict:
                raise KeyError(message)
            if not self._warned_missing:
                self._warned_missing = True
                warn(message, stacklevel=3)
            return None
        return self._scalar(value)

    def _scalar(self, value) -> float:
        """A logged value as a Python float, as Keras' `fit` passes it (`pythonify_logs`).

        One-element arrays or tensors (`F1Score(average=None)` on one class; Lightning-style
        `[[[0.3]]]`) are read as their element; more than one element is an error.
        """
        if isinstance(value, numbers.Real):
            return float(value)
        if keras.ops.is_tensor(value):
            value = keras.ops.convert_to_numpy(value)
        try:
            array = np.asarray(value, dtype="float64")
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"{type(self).__name__}: `{self.monitor}` is logged as {value!r}, not a number."
            ) from e
        if array.size != 1:
            raise ValueError(
                f"{type(self).__name__}: `{self.monitor}` is logged as an array of shape "
                f"{array.shape}; one number is needed. Monitor a scalar metric (for example "
                "`F1Score(average='macro')`) or log one element under its own name."
            )
        return float(array.reshape(()))

    def _stop(self, epoch: int, reason: str) -> None:
        self.stop_reason = reason
        self.stopped_epoch = epoch
        self.model.stop_training = True

    # -------------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        self._reset()
        self._store = None
        self._begin_fit()
        if self.backup_dir is not None:
            # Checked before any training step: a bad path fails now, not after an epoch.
            check_backup_dir(self.backup_dir, type(self).__name__)
            self._store = CallbackStateStore(
                self.backup_dir, self._state_name(), type(self).__name__
            )
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None
        elif self._store is not None:
            self._resume_from_backup()

    def _begin_fit(self) -> None:
        """Hook: subclass resets at the start of each fit (before a backup is loaded)."""

    def on_train_end(self, logs=None):
        if self.stop_reason is not None and self.verbose > 0:
            print(
                f"Epoch {self.stopped_epoch + 1}: {type(self).__name__} stopped training ({self.stop_reason})."
            )
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                print(
                    f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}."
                )
            self.model.set_weights(self.best_weights)
        if self._store is not None:
            # Training finished (not interrupted): the state must not leak into the next fit.
            self._store.delete()

    # ------------------------------------------------------------ backup on disk
    def _decision_config(self) -> dict:
        """The arguments that change decisions: a state saved with others is not ours."""
        config = self.get_config()
        for key in ("verbose", "strict", "backup_dir"):
            config.pop(key, None)
        return config

    def _state_name(self) -> str:
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{type(self).__name__}_{self.monitor}")
        digest = hashlib.sha1(json.dumps(self._decision_config(), sort_keys=True).encode())
        return f"keras_perf_{tag}_{digest.hexdigest()[:10]}"

    def _resume_from_backup(self) -> None:
        epochs = (self.params or {}).get("epochs")
        state = self._store.resume(self.model, epochs)
        if state is not None:
            weights_file = state.pop("best_weights_file", None)
            state["best_weights"] = None
            if weights_file is not None:
                state["best_weights"] = self._store.load_weights_file(weights_file)
                self._check_weights(state["best_weights"], weights_file)
            if state["epoch"] >= 0:
                self._apply_state(state)
                return
        # A fresh run: save the starting point, in case BackupAndRestore saves the first
        # epoch and the process dies before this callback does.
        self._persist(-1)

    def _check_weights(self, weights, name) -> None:
        shapes = [tuple(w.shape) for w in self.model.get_weights()]
        if [tuple(w.shape) for w in weights] != shapes:
            raise ValueError(
                f"{type(self).__name__}: the best weights in {os.path.join(self.backup_dir, name)!r} "
                "do not fit this model (another model's run?). Delete that directory's keras_perf_* "
                "files to start afresh."
            )

    def _persist(self, epoch: int) -> None:
        """Save the state of `epoch` (after its `on_epoch_end`) when `backup_dir` is set."""
        if self._store is None:
            return
        state = self.state_dict()
        state["epoch"] = epoch
        state["stop_training"] = self.stop_reason is not None and self.stopped_epoch == epoch
        weights = state.pop("best_weights")
        # When BackupAndRestore has already saved this epoch (it is listed first), keep the
        # weights with the state: if the process dies before the next save of ours, the
        # resumed fit trains the next epoch again from them (see `keras_perf.stopping._state`).
        model = None
        try:
            if epoch < 0 or read_backup_epoch(self.backup_dir) == epoch + 1:
                model = self.model
        except ValueError:
            model = None
        if model is not None and getattr(model, "optimizer", None) is not None:
            if not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
        self._store.save(state, weights, model)

    @classmethod
    def from_config(cls, config: dict):
        """Rebuild the callback from `get_config()`."""
        return cls(**config)

    def _config(self) -> dict:
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "restore_best_weights": self.restore_best_weights,
            "verbose": self.verbose,
            "strict": self.strict,
            "backup_dir": self.backup_dir,
        }
