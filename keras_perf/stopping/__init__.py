"""Stopping callbacks: `EarlyStopping`, `TimeLimit` and their shared base.

Public names: `EarlyStopping` and `TimeLimit` (also `kp.EarlyStopping`, `kp.TimeLimit`);
`MonitoringCallback`, their base, is importable from here for subclassing. The parts:

- `_early_stopping`: `EarlyStopping`, a drop-in for `keras.callbacks.EarlyStopping` with
  opt-in thresholds, a relative `min_delta` and a stop on NaN/Inf;
- `_time_limit`: `TimeLimit`, which ends training before a wall-clock budget runs out;
- `_base`: `MonitoringCallback`, what both share: monitored value and direction, best
  weights, missing key, `state_dict()`, the save beside a backup;
- `_state`: the state files kept beside a `keras.callbacks.BackupAndRestore` backup.

Saved configs name the classes by their registered names, `"keras_perf>EarlyStopping"` and
`"keras_perf>TimeLimit"`, stated where the classes are registered; those names, not the module
a config also records, are what Keras looks up, so files written before this package existed
(module `keras_perf.early_stopping` / `keras_perf.time_limit`) still load
(tests/test_stopping.py, fixture in tests/data/stopping_v1/).
"""

from keras_perf.stopping._base import MODES as MODES
from keras_perf.stopping._base import STOP_REASONS as STOP_REASONS
from keras_perf.stopping._base import MonitoringCallback
from keras_perf.stopping._early_stopping import EarlyStopping
from keras_perf.stopping._time_limit import TimeLimit

__all__ = ["EarlyStopping", "MonitoringCallback", "TimeLimit"]
