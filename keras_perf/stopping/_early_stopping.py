"""`EarlyStopping`: Keras' early-stopping rule plus thresholds and a NaN/Inf stop.

`EarlyStopping` is a drop-in for `keras.callbacks.EarlyStopping`: with Keras' arguments (the
added ones left at their defaults) it takes the same decisions on the same logs, NaN and Inf
included, and has Keras' public attributes. Opt-in additions give the criteria PyTorch
Lightning and Hugging Face users expect: a relative `min_delta`, a "good enough" threshold, a
divergence threshold and a stop on NaN/Inf.

Not here: what it shares with `TimeLimit` (monitored value and direction, best weights,
missing key, `state_dict()` and the save beside a `BackupAndRestore` backup) is
`keras_perf.stopping._base.MonitoringCallback`; `TimeLimit` is in `_time_limit`.
"""

from __future__ import annotations

import math

import keras
import numpy as np

from keras_perf._utils import check_bool, check_int, check_number
from keras_perf.stopping._base import _LESS, MonitoringCallback

__all__ = ["EarlyStopping"]


# The registered name is the one in every saved config since 0.1 ("keras_perf>EarlyStopping"):
# keep it when moving the class.
@keras.saving.register_keras_serializable(package="keras_perf", name="EarlyStopping")
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
        >>> model.compile(keras.optimizers.SGD(0.05), "mse")  # the loss falls 4x an epoch
        >>> es = kp.EarlyStopping(monitor="loss", patience=1, stopping_threshold=1e-3,
        ...                       restore_best_weights=True)
        >>> x = np.ones((8, 4), "float32")
        >>> h = model.fit(x, np.zeros((8, 1)), epochs=50, callbacks=[es], verbose=0)
        >>> es.stop_reason, len(h.history["loss"]) < 50
        ('threshold', True)
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
