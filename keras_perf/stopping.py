"""Early stopping that users can rely on: Keras' rule plus thresholds, NaN checks, time limits.

`EarlyStopping` is a drop-in for `keras.callbacks.EarlyStopping`: with Keras' arguments (the
added ones left at their defaults) it takes the same decisions on the same logs, NaN and Inf
included, and has Keras' public attributes. Opt-in additions give the criteria PyTorch
Lightning and Hugging Face users expect: a relative `min_delta`, a "good enough" threshold, a
divergence threshold and a stop on NaN/Inf. `TimeLimit` ends training before a wall-clock
budget runs out, estimating the next epoch's duration from the epochs so far.

Both callbacks

- record why they stopped (`stop_reason`), where (`stopped_epoch`), and the best value and
  epoch seen (`best`, `best_epoch`), and can restore the best weights;
- warn once (or raise with `strict=True`) when the monitored key is missing, naming the keys
  that exist;
- carry their state across an interruption: `state_dict()`/`load_state_dict()`, and, with
  `backup_dir=` set to the directory of a `keras.callbacks.BackupAndRestore`, they save that
  state beside the backup after every epoch and reload it when the fit is resumed
  (`keras_perf._state`), whatever the order of the callbacks;
- reset in `on_train_begin`, so one instance serves several fits.

The decision is taken on the host from the epoch logs, which Keras has already reduced across
replicas under `tf.distribute`, so every replica (and every worker) takes the same decision.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import re

import keras
import numpy as np

from keras_perf._state import CallbackStateStore, check_backup_dir, read_backup_epoch
from keras_perf._utils import check_bool, check_choice, check_int, check_number, warn
from keras_perf.backend import keras_internals

__all__ = ["EarlyStopping", "MonitoringCallback", "TimeLimit"]  # noqa: F822 (see __getattr__)

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
            # keras.src.trainers.compile_utils.CompileMetrics / MetricsList (not imported:
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
            >>> state = es.state_dict()
            >>> kp.EarlyStopping(patience=2).load_state_dict(state)
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
        # resumed fit trains the next epoch again from them (see `keras_perf._state`).
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


@keras.saving.register_keras_serializable(package="keras_perf")
class EarlyStopping(MonitoringCallback):
    """Stop training when the monitored metric stops improving, is good enough, or diverges.

    A drop-in for `keras.callbacks.EarlyStopping`: the first eight arguments are Keras' own, in
    Keras' order, with the same meaning and defaults. With the added arguments at their
    defaults it takes Keras' decisions on every sequence of logs (NaN and Inf included: as in
    Keras, a NaN is never an improvement, and a NaN first value becomes `best`), and it has
    Keras' public attributes with Keras' meaning: `monitor_op` (`keras.ops.less` or
    `keras.ops.greater`, set at the first epoch), `min_delta` (negated in "min" mode at that
    point, as in Keras), `best` (None until the first monitored epoch), `wait`,
    `stopped_epoch`, `best_epoch`, `best_weights`, `baseline`, `patience`, `start_from_epoch`.

    Added, all opt-in:

    - `relative_delta=True` reads `min_delta` as a fraction of `|best|` (0.01: improve by 1%);
    - `stopping_threshold`: stop once the metric is at least this good (`<=` in "min" mode,
      `>=` in "max" mode);
    - `divergence_threshold`: stop once the metric is at least this bad;
    - `check_finite=True`: stop at once when the metric or `loss` is NaN or infinite (such a
      value never counts as the best);
    - `stop_reason`: `"patience"`, `"threshold"`, `"divergence"`, `"non_finite"` or None;
    - `state_dict()`/`load_state_dict()` and `backup_dir=` to survive an interruption resumed
      with `keras.callbacks.BackupAndRestore` (pass the same directory).

    The thresholds apply from `start_from_epoch` on; `check_finite` applies from the first
    epoch. A value logged as a one-element array counts as its element; a longer array is an
    error.

    Args:
        monitor: Key of the logs to watch. Defaults to `"val_loss"`.
        min_delta: Smallest change that counts as an improvement (>= 0). Defaults to `0`.
        patience: Epochs without improvement after which training stops. Defaults to `0`.
        verbose: 1 prints a line when the callback stops training or restores weights.
            Defaults to `0`.
        mode: `"auto"`, `"min"` or `"max"`; `"auto"` takes the direction Keras takes: down
            for `loss`/`val_loss`, else the direction the compiled metric declares.
            Defaults to `"auto"`.
        baseline: Value the metric must beat for the patience counter to reset.
            Defaults to `None`.
        restore_best_weights: Restore the weights of the best epoch at the end of training.
            Defaults to `False`.
        start_from_epoch: Epochs of warm-up before monitoring starts. Defaults to `0`.
        relative_delta: Read `min_delta` as a fraction of `|best|`. Defaults to `False`.
        stopping_threshold: Stop once the metric is at least this good. Defaults to `None`.
        divergence_threshold: Stop once the metric is at least this bad. Defaults to `None`.
        check_finite: Stop when the metric or `loss` is NaN/Inf. Defaults to `False`.
        strict: Raise `KeyError` instead of warning when `monitor` is missing from the logs.
            Defaults to `False`.
        backup_dir: Directory where the state is saved after every epoch and reloaded at the
            start of a resumed fit: the `backup_dir` of your `BackupAndRestore`. The files are
            removed when training ends normally. Defaults to `None` (nothing saved).

    Raises:
        ValueError: `patience`, `start_from_epoch` or `min_delta` is negative, `mode` is
            unknown, or the thresholds are on the wrong side of each other or of `baseline`
            for the direction (checked at construction when `mode` is "min"/"max" or the
            monitor is a loss, else at the first epoch). At the first epoch, like Keras: the
            direction of `monitor` cannot be told in `mode="auto"`.
        TypeError: an argument has the wrong type.

    Example:
        >>> import keras, numpy as np, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> es = kp.EarlyStopping(monitor="loss", patience=1, stopping_threshold=1e-3,
        ...                       restore_best_weights=True)
        >>> x = np.ones((8, 4), "float32")
        >>> _ = model.fit(x, np.zeros((8, 1)), epochs=50, callbacks=[es], verbose=0)
        >>> es.stop_reason in ("threshold", "patience", None)
        True
    """

    _STATE_KEYS = MonitoringCallback._STATE_KEYS + ("wait",)

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0,
        patience: int = 0,
        verbose: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
        *,
        relative_delta: bool = False,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_finite: bool = False,
        strict: bool = False,
        backup_dir: str | None = None,
    ):
        # Keras stores abs(min_delta) and negates it when the direction turns out to be "min".
        self.min_delta = check_number(
            "min_delta", min_delta, low=0.0, high=math.inf, high_inclusive=False
        )
        self.patience = check_int("patience", patience, minimum=0)
        self.baseline = check_number(
            "baseline",
            baseline,
            low=-math.inf,
            high=math.inf,
            low_inclusive=False,
            high_inclusive=False,
            allow_none=True,
        )
        self.start_from_epoch = check_int("start_from_epoch", start_from_epoch, minimum=0)
        self.relative_delta = check_bool("relative_delta", relative_delta)
        finite = {
            "low": -math.inf,
            "high": math.inf,
            "low_inclusive": False,
            "high_inclusive": False,
            "allow_none": True,
        }
        self.stopping_threshold = check_number("stopping_threshold", stopping_threshold, **finite)
        self.divergence_threshold = check_number(
            "divergence_threshold", divergence_threshold, **finite
        )
        self.check_finite = check_bool("check_finite", check_finite)
        self.wait = 0
        super().__init__(monitor, mode, restore_best_weights, verbose, strict, backup_dir)
        known = (
            mode if mode != "auto" else ("min" if monitor.removeprefix("val_") == "loss" else None)
        )
        if known is not None:
            self._check_direction(known)

    def _set_op(self, op) -> None:
        super()._set_op(op)
        if op is _LESS:
            self.min_delta = -abs(self.min_delta)  # Keras' sign convention

    def _check_direction(self, direction: str) -> None:
        better, worse = ("lower", "higher") if direction == "min" else ("higher", "lower")

        def is_better(a, b):
            return a < b if direction == "min" else a > b

        st, dt, base = self.stopping_threshold, self.divergence_threshold, self.baseline
        where = f"in mode '{direction}' (monitor `{self.monitor}`)"
        if st is not None and dt is not None and not is_better(st, dt):
            raise ValueError(
                f"`stopping_threshold` ({st}) must be {better} than `divergence_threshold` ({dt}) "
                f"{where}; swap them or pass the other `mode`."
            )
        if st is not None and base is not None and is_better(base, st):
            raise ValueError(
                f"`stopping_threshold` ({st}) must not be {worse} than `baseline` ({base}) {where}: "
                "training would stop before reaching the baseline. Swap them or pass the other `mode`."
            )
        if dt is not None and base is not None and not is_better(base, dt):
            raise ValueError(
                f"`divergence_threshold` ({dt}) must be {worse} than `baseline` ({base}) {where}; "
                "otherwise every value short of the baseline counts as divergence."
            )

    def _reset(self) -> None:
        super()._reset()
        self.wait = 0

    def _is_improvement(self, monitor_value: float, reference_value) -> bool:
        """Keras' `MonitorCallback._is_improvement` (with `relative_delta`, a scaled delta)."""
        if reference_value is None:
            return True
        delta = self.min_delta * abs(reference_value) if self.relative_delta else self.min_delta
        return bool(self.monitor_op(monitor_value - delta, reference_value))

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        self._last_epoch = epoch
        if self.monitor_op is None:
            # As Keras: delayed until the model's metrics are built (may raise in "auto").
            self._set_monitor_op()
        current = self._monitored_value(logs)
        if self.check_finite and self._non_finite(current, logs):
            self._stop(epoch, "non_finite")
        elif current is not None and epoch >= self.start_from_epoch:
            reason = self._update(epoch, current)
            if reason is not None:
                self._stop(epoch, reason)
        self._persist(epoch)

    def _non_finite(self, current, logs) -> bool:
        if current is not None and not math.isfinite(current):
            return True
        loss = logs.get("loss")
        return (
            loss is not None and self.monitor != "loss" and not math.isfinite(self._scalar_of(loss))
        )

    @staticmethod
    def _scalar_of(value) -> float:
        try:
            return float(
                np.asarray(keras.ops.convert_to_numpy(value), dtype="float64").reshape(-1)[0]
            )
        except (TypeError, ValueError, IndexError):
            return 0.0

    def _update(self, epoch: int, current: float) -> str | None:
        """Keras' bookkeeping for one monitored epoch, then the added criteria."""
        if self.restore_best_weights and self.best_weights is None:
            # As Keras: until an improvement is recorded, the current weights are the best.
            self.best_weights = self.model.get_weights()
            self.best_epoch = epoch
        self.wait += 1
        improved = self._is_improvement(current, self.best)
        if improved:
            self.best = current
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            # Only restart wait if we beat both the baseline and our previous best.
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
        if self.stopping_threshold is not None and not self._better(
            self.stopping_threshold, current
        ):
            if current == current:  # NaN never reaches the threshold
                return "threshold"
        # Not better than the divergence threshold: worse, equal, or NaN.
        if self.divergence_threshold is not None and not self._better(
            current, self.divergence_threshold
        ):
            return "divergence"
        if not improved and self.wait >= self.patience and epoch > 0:
            return "patience"
        return None

    def get_config(self) -> dict:
        config = self._config()
        config.update(
            min_delta=abs(self.min_delta),
            patience=self.patience,
            baseline=self.baseline,
            start_from_epoch=self.start_from_epoch,
            relative_delta=self.relative_delta,
            stopping_threshold=self.stopping_threshold,
            divergence_threshold=self.divergence_threshold,
            check_finite=self.check_finite,
        )
        return config


def __getattr__(name):
    # `from keras_perf.stopping import TimeLimit` keeps working; imported on first use because
    # keras_perf.time_limit subclasses MonitoringCallback from this module.
    if name == "TimeLimit":
        from keras_perf.time_limit import TimeLimit

        return TimeLimit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
