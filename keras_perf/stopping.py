"""Early stopping that users can rely on: Keras' rule plus thresholds, NaN checks, time limits.

`EarlyStopping` is a drop-in for `keras.callbacks.EarlyStopping` (same arguments, defaults and
stop epochs on the same logs) with the criteria PyTorch Lightning and Hugging Face users expect:
a relative `min_delta`, a "good enough" threshold, a divergence threshold and a stop on
NaN/Inf. `TimeLimit` ends training before a wall-clock budget runs out, estimating the next
epoch's duration from the epochs so far.

Both callbacks

- record why they stopped (`stop_reason`), where (`stopped_epoch`), and the best value and
  epoch seen (`best`, `best_epoch`), and can restore the best weights whatever ended training;
- warn once (or raise with `strict=True`) when the monitored key is missing, naming the keys
  that exist;
- carry their state across an interruption: `state_dict()`/`load_state_dict()`, and, with
  `backup_dir=` set to the directory of a `keras.callbacks.BackupAndRestore`, they save that
  state beside the backup after every epoch and reload it when the fit is resumed;
- reset in `on_train_begin`, so one instance serves several fits.

The decision is taken on the host from the epoch logs, which Keras has already reduced across
replicas under `tf.distribute`, so every replica (and every worker) takes the same decision.
"""

from __future__ import annotations

import json
import math
import os
import re
import time

import keras
import numpy as np

from keras_perf import backend as _backend
from keras_perf._utils import check_bool, check_choice, check_int, check_number, warn

__all__ = ["EarlyStopping", "TimeLimit"]

MODES = ("auto", "min", "max")
GRANULARITIES = ("epoch", "batch")
STOP_REASONS = ("patience", "threshold", "divergence", "non_finite", "time_limit")

# The clock every timing here reads; a module attribute so tests can drive it.
_now = time.perf_counter

# Name of the metadata file `keras.callbacks.BackupAndRestore` writes in its `backup_dir`
# (checked with Keras 3.8-3.15). Read only to pick the saved state matching the resumed epoch;
# when it is absent the latest saved state is used.
_BACKUP_METADATA = "training_metadata.json"
_STATE_FORMAT = 1

_MAX_NAMES = ("acc", "accuracy", "auc", "precision", "recall", "f1", "iou", "map", "r2", "psnr")
_MIN_NAMES = ("loss", "error", "mse", "mae", "mape", "msle", "rmse", "crossentropy", "hinge")


def _direction_from_name(monitor: str) -> str | None:
    """"min"/"max" when the monitored name says it (`val_loss`, `accuracy`...), else None."""
    name = monitor.removeprefix("val_").lower()
    if name == "loss" or name.endswith("loss") or name.endswith("crossentropy"):
        return "min"
    for token in re.split(r"[^a-z0-9]+", name):
        if token in _MAX_NAMES:
            return "max"
        if token in _MIN_NAMES:
            return "min"
    return None


def _metric_direction(model, monitor: str) -> str | None:
    """The direction a compiled metric of `model` declares for `monitor`, if any."""
    name = monitor.removeprefix("val_")
    stack = list(getattr(model, "metrics", None) or [])
    while stack:
        metric = stack.pop()
        # Keras wraps compiled metrics in containers that expose `.metrics`.
        stack.extend(getattr(metric, "metrics", None) or [])
        if getattr(metric, "name", None) == name:
            # Keras metrics declare "up" or "down" in `_direction` (Keras 3.x).
            direction = getattr(metric, "_direction", None)
            if direction in ("up", "down"):
                return "max" if direction == "up" else "min"
    return None


def _longest_after_first(times: list, longest_after_first: float) -> float:
    """The longest of `times`, leaving out the first (compilation) once there are two."""
    if not times:
        return 0.0
    return longest_after_first if len(times) > 1 else times[0]


class _MonitoringCallback(keras.callbacks.Callback):
    """Shared machinery: monitored value, direction, best weights, missing key, resumable state.

    Not public. Subclasses call `_track_best` from `on_epoch_end` and set `stop_reason`.
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
            raise TypeError(f"`monitor` must be a non-empty string such as 'val_loss', got {monitor!r}.")
        if not isinstance(mode, str):
            raise TypeError(f"`mode` must be one of {MODES}, got {mode!r}.")
        check_choice("mode", mode, MODES)
        if isinstance(verbose, bool):
            verbose = int(verbose)
        if backup_dir is not None and not isinstance(backup_dir, (str, os.PathLike)):
            raise TypeError(f"`backup_dir` must be a path (str) or None, got {backup_dir!r}.")
        self.monitor = monitor
        self.mode = mode
        self.restore_best_weights = check_bool("restore_best_weights", restore_best_weights)
        self.verbose = check_int("verbose", verbose, minimum=0)
        self.strict = check_bool("strict", strict)
        self.backup_dir = None if backup_dir is None else os.fspath(backup_dir)
        self._direction = mode if mode != "auto" else None
        self._pending_state = None
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
        self._saved_best_file = None

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
            raise TypeError(f"`state` must be a dict from `state_dict()`, got {type(state).__name__}.")
        self._apply_state(state)
        self._pending_state = state

    def _apply_state(self, state: dict) -> None:
        for key in self._STATE_KEYS:
            if key in state:
                setattr(self, key, state[key])
        self._last_epoch = state.get("epoch", self._last_epoch)
        if self._direction is None:
            self._direction = state.get("direction")
        weights = state.get("best_weights")
        self.best_weights = None if weights is None else [np.asarray(w) for w in weights]

    # ------------------------------------------------------------- monitored value
    def _resolve_direction(self) -> str:
        if self._direction is None:
            direction = _direction_from_name(self.monitor)
            if direction is None or self.monitor.removeprefix("val_") != "loss":
                direction = _metric_direction(self._model, self.monitor) or direction
            if direction is None:
                raise ValueError(
                    f"{type(self).__name__} cannot tell whether `{self.monitor}` should go up "
                    "or down. Pass `mode='max'` (accuracy-like) or `mode='min'` (loss-like)."
                )
            self._direction = direction
            self._check_direction(direction)
        return self._direction

    def _check_direction(self, direction: str) -> None:
        """Hook: validate direction-dependent arguments once the direction is known."""

    def _better(self, a: float, b: float, delta: float = 0.0) -> bool:
        """Whether `a` improves on `b` by more than `delta` (same arithmetic as Keras)."""
        if self._direction == "min":
            return a + delta < b
        return a - delta > b

    def _monitored_value(self, logs: dict) -> float | None:
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
        return float(value)

    def _keep_best(self, epoch: int, current: float) -> None:
        self.best = current
        self.best_epoch = epoch
        if self.restore_best_weights:
            self.best_weights = self.model.get_weights()

    def _stop(self, epoch: int, reason: str) -> None:
        self.stop_reason = reason
        self.stopped_epoch = epoch
        self.model.stop_training = True

    # -------------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        self._reset()
        self._begin_fit()
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None
        elif self.backup_dir is not None:
            self._load_backup()

    def _begin_fit(self) -> None:
        """Hook: subclass resets at the start of each fit (before a backup is loaded)."""

    def on_train_end(self, logs=None):
        if self.stop_reason is not None and self.verbose > 0:
            print(f"Epoch {self.stopped_epoch + 1}: {type(self).__name__} stopped training ({self.stop_reason}).")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                print(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.")
            self.model.set_weights(self.best_weights)
        if self.backup_dir is not None:
            # Training finished (not interrupted): the state must not leak into the next fit.
            self._delete_backup()

    # ------------------------------------------------------------ backup on disk
    def _backup_prefix(self) -> str:
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{type(self).__name__}_{self.monitor}")
        return os.path.join(self.backup_dir, f"keras_perf_{tag}")

    def _save_backup(self) -> None:
        os.makedirs(self.backup_dir, exist_ok=True)
        prefix = self._backup_prefix()
        state = self.state_dict()
        weights = state.pop("best_weights")
        weights_file = None
        if weights is not None:
            weights_file = f"{os.path.basename(prefix)}_best_{self.best_epoch}.npz"
            if weights_file != self._saved_best_file:
                tmp = os.path.join(self.backup_dir, weights_file + ".tmp.npz")
                np.savez(tmp, *weights)
                os.replace(tmp, os.path.join(self.backup_dir, weights_file))
                self._saved_best_file = weights_file
        state["best_weights_file"] = weights_file
        # Keep the last two epochs' states: the one matching BackupAndRestore's checkpoint is
        # there whichever of the two callbacks saved first when the run was interrupted.
        states = [s for s in self._read_states() if s.get("epoch") != state["epoch"]][-1:]
        states.append(state)
        tmp = prefix + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": _STATE_FORMAT, "states": states}, f)
        os.replace(tmp, prefix + ".json")
        keep = {s.get("best_weights_file") for s in states}
        for name in os.listdir(self.backup_dir):
            if name.startswith(os.path.basename(prefix) + "_best_") and name not in keep:
                os.remove(os.path.join(self.backup_dir, name))

    def _read_states(self) -> list[dict]:
        path = self._backup_prefix() + ".json"
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return list(json.load(f).get("states", []))

    def _load_backup(self) -> None:
        states = self._read_states()
        if not states:
            return
        meta_path = os.path.join(self.backup_dir, _BACKUP_METADATA)
        chosen = states[-1]
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                resume_epoch = json.load(f).get("epoch")
            if isinstance(resume_epoch, int):
                earlier = [s for s in states if s.get("epoch") is not None and s["epoch"] < resume_epoch]
                if not earlier:
                    return  # the backup predates every saved state: start afresh
                chosen = earlier[-1]
                if chosen["epoch"] != resume_epoch - 1:
                    warn(
                        f"{type(self).__name__}: the saved state is from epoch {chosen['epoch'] + 1} "
                        f"but training resumes at epoch {resume_epoch + 1}; epochs in between are "
                        "not counted.",
                        stacklevel=4,
                    )
        state = dict(chosen)
        weights_file = state.pop("best_weights_file", None)
        if weights_file is not None:
            with np.load(os.path.join(self.backup_dir, weights_file)) as data:
                state["best_weights"] = [data[f"arr_{i}"] for i in range(len(data.files))]
            self._saved_best_file = weights_file
        self._apply_state(state)

    def _delete_backup(self) -> None:
        prefix = self._backup_prefix()
        if not os.path.isdir(self.backup_dir):
            return
        for name in os.listdir(self.backup_dir):
            if name.startswith(os.path.basename(prefix)):
                os.remove(os.path.join(self.backup_dir, name))

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
class EarlyStopping(_MonitoringCallback):
    """Stop training when the monitored metric stops improving, is good enough, or diverges.

    A drop-in for `keras.callbacks.EarlyStopping`: the first eight arguments are Keras' own, in
    Keras' order, with the same meaning and defaults, and the same logs give the same stop epoch
    and the same restored weights. Added:

    - `relative_delta=True` reads `min_delta` as a fraction of `|best|` (0.01: improve by 1%);
    - `stopping_threshold`: stop once the metric is at least this good (`<=` in `"min"` mode,
      `>=` in `"max"` mode);
    - `divergence_threshold`: stop once the metric is at least this bad;
    - `check_finite`: stop at once when the metric or `loss` is NaN or infinite (such a value
      never counts as the best);
    - `stop_reason`: `"patience"`, `"threshold"`, `"divergence"`, `"non_finite"` or None;
    - a missing monitored key warns once per fit, naming the keys that exist (Keras warns every
      epoch), or raises `KeyError` with `strict=True`;
    - `state_dict()`/`load_state_dict()` and `backup_dir=` to survive an interruption resumed
      with `keras.callbacks.BackupAndRestore` (pass the same directory).

    The thresholds and patience apply from `start_from_epoch` on; `check_finite` applies from
    the first epoch. Comparisons are made in float64 (Keras rounds to float32, so values that
    differ only below float32 precision can be ranked differently). `restore_best_weights`
    restores the best epoch's weights whatever ended training, also when it ran to the end.

    Args:
        monitor: Key of the logs to watch. Defaults to `"val_loss"`.
        min_delta: Smallest change that counts as an improvement (>= 0). Defaults to `0`.
        patience: Epochs without improvement after which training stops. Defaults to `0`.
        verbose: 1 prints a line when the callback stops training or restores weights.
            Defaults to `0`.
        mode: `"auto"`, `"min"` or `"max"`; `"auto"` reads the direction from the metric.
            Defaults to `"auto"`.
        baseline: Value the metric must beat for the patience counter to reset.
            Defaults to `None`.
        restore_best_weights: Restore the weights of the best epoch at the end of training.
            Defaults to `False`.
        start_from_epoch: Epochs of warm-up before monitoring starts. Defaults to `0`.
        relative_delta: Read `min_delta` as a fraction of `|best|`. Defaults to `False`.
        stopping_threshold: Stop once the metric is at least this good. Defaults to `None`.
        divergence_threshold: Stop once the metric is at least this bad. Defaults to `None`.
        check_finite: Stop when the metric or `loss` is NaN/Inf. Defaults to `True`.
        strict: Raise `KeyError` instead of warning when `monitor` is missing from the logs.
            Defaults to `False`.
        backup_dir: Directory where the state is saved after every epoch and reloaded at the
            start of a resumed fit: the `backup_dir` of your `BackupAndRestore`. The files are
            removed when training ends normally. Defaults to `None` (nothing saved).

    Raises:
        ValueError: `patience`, `start_from_epoch` or `min_delta` is negative, `mode` is
            unknown, or the thresholds are on the wrong side of each other or of `baseline`
            for the direction of `mode` (checked at the first epoch when `mode="auto"` and the
            name does not tell).
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

    _STATE_KEYS = _MonitoringCallback._STATE_KEYS + ("wait",)

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
        check_finite: bool = True,
        strict: bool = False,
        backup_dir: str | None = None,
    ):
        self.min_delta = check_number("min_delta", min_delta, low=0.0, high=math.inf, high_inclusive=False)
        self.patience = check_int("patience", patience, minimum=0)
        self.baseline = check_number("baseline", baseline, low=-math.inf, high=math.inf,
                                     low_inclusive=False, high_inclusive=False, allow_none=True)
        self.start_from_epoch = check_int("start_from_epoch", start_from_epoch, minimum=0)
        self.relative_delta = check_bool("relative_delta", relative_delta)
        finite = {"low": -math.inf, "high": math.inf, "low_inclusive": False,
                  "high_inclusive": False, "allow_none": True}
        self.stopping_threshold = check_number("stopping_threshold", stopping_threshold, **finite)
        self.divergence_threshold = check_number("divergence_threshold", divergence_threshold, **finite)
        self.check_finite = check_bool("check_finite", check_finite)
        super().__init__(monitor, mode, restore_best_weights, verbose, strict, backup_dir)
        direction = self._direction or _direction_from_name(monitor)
        if direction is not None:
            self._check_direction(direction)

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

    def _delta(self, reference: float) -> float:
        return self.min_delta * abs(reference) if self.relative_delta else self.min_delta

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        self._last_epoch = epoch
        current = self._monitored_value(logs)
        if current is not None:
            self._resolve_direction()
        reason = None
        if self.check_finite:
            loss = logs.get("loss")
            if (current is not None and not math.isfinite(current)) or (
                loss is not None and not math.isfinite(float(loss))
            ):
                reason = "non_finite"
        if reason is None and current is not None and epoch >= self.start_from_epoch:
            reason = self._update(epoch, current)
        if reason is not None:
            self._stop(epoch, reason)
        if self.backup_dir is not None:
            self._save_backup()

    def _update(self, epoch: int, current: float) -> str | None:
        """Keras' bookkeeping for one monitored epoch, then the extra criteria."""
        if self.restore_best_weights and self.best_weights is None:
            # As Keras: until an improvement is recorded, the current weights are the best.
            self.best_weights = self.model.get_weights()
            self.best_epoch = epoch
        self.wait += 1
        improved = self.best is None or self._better(current, self.best, self._delta(self.best))
        if improved:
            self._keep_best(epoch, current)
            # Reset the wait only when both the baseline and the previous best are beaten.
            if self.baseline is None or self._better(current, self.baseline, self._delta(self.baseline)):
                self.wait = 0
        if self.stopping_threshold is not None and not self._better(self.stopping_threshold, current):
            return "threshold"
        if self.divergence_threshold is not None and not self._better(current, self.divergence_threshold):
            return "divergence"
        if not improved and self.wait >= self.patience and epoch > 0:
            return "patience"
        return None

    def get_config(self) -> dict:
        config = self._config()
        config.update(
            min_delta=self.min_delta,
            patience=self.patience,
            baseline=self.baseline,
            start_from_epoch=self.start_from_epoch,
            relative_delta=self.relative_delta,
            stopping_threshold=self.stopping_threshold,
            divergence_threshold=self.divergence_threshold,
            check_finite=self.check_finite,
        )
        return config


@keras.saving.register_keras_serializable(package="keras_perf")
class TimeLimit(_MonitoringCallback):
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

    _STATE_KEYS = _MonitoringCallback._STATE_KEYS + ("elapsed", "epoch_times", "tail_times",
                                                     "max_batch_time")

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
        self.seconds = check_number("seconds", seconds, low=0.0, high=math.inf,
                                    low_inclusive=False, high_inclusive=False)
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
            warn("TimeLimit(granularity='batch') checks per epoch under a multi-worker strategy, "
                 "so that every worker stops after the same epoch.")

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
            # `_model`, not `model`: on JAX the `model` property syncs the training state,
            # which is neither needed to set a flag nor safe from Keras' async dispatch thread.
            self._model.stop_training = True

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
        if self.backup_dir is not None:
            self._save_backup()

    def _track(self, epoch: int, logs: dict) -> None:
        """Keep the best epoch of `monitor` (warn about a missing key only if it is needed)."""
        if not self.restore_best_weights:
            if self.monitor not in logs:
                return
            try:
                self._resolve_direction()
            except ValueError:
                return  # only informative here: no direction, no ranking
        current = self._monitored_value(logs)
        if current is not None and math.isfinite(current):
            self._resolve_direction()
            if self.best is None or self._better(current, self.best):
                self._keep_best(epoch, current)

    def get_config(self) -> dict:
        config = self._config()
        config.update(seconds=self.seconds, granularity=self.granularity)
        return config
