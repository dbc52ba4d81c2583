"""The stopping callbacks' public module: `EarlyStopping`, `TimeLimit` and their shared base.

Nothing is defined here; `from keras_perf.stopping import EarlyStopping, TimeLimit` (and
`MonitoringCallback`) keep working. Each concept lives in its own module:

- `keras_perf.early_stopping`: `EarlyStopping`, a drop-in for `keras.callbacks.EarlyStopping`
  with opt-in thresholds, a relative `min_delta` and a stop on NaN/Inf;
- `keras_perf.time_limit`: `TimeLimit`, which ends training before a wall-clock budget runs out;
- `keras_perf._monitoring_callback`: `MonitoringCallback`, their base (not public): monitored
  value and direction, best weights, missing key, `state_dict()`, save beside a backup;
- `keras_perf._state`: the state files kept beside a `keras.callbacks.BackupAndRestore` backup.
"""

from keras_perf._monitoring_callback import MODES as MODES
from keras_perf._monitoring_callback import STOP_REASONS as STOP_REASONS
from keras_perf._monitoring_callback import MonitoringCallback
from keras_perf.early_stopping import EarlyStopping
from keras_perf.time_limit import TimeLimit

__all__ = ["EarlyStopping", "MonitoringCallback", "TimeLimit"]
