"""Training monitor: throughput, step-time percentiles, peak memory and MFU per epoch.

Two parts, as in Lightning's ThroughputMonitor: `EpochMeter` is plain Python that turns clock
readings into per-epoch figures; `TrainingMonitor` is the Keras callback that forwards hooks to
it and adds what needs the model (examples seen, memory, loss scale, FLOPs), the logs, the
crash-safe JSON-lines file and the TensorBoard scalars (`keras_perf._tensorboard`). The
summary, the plot and the CSV are built in `keras_perf.monitor._report`.

Public names: `TrainingMonitor` (also `kp.TrainingMonitor`) and `EpochMeter`; `MONITOR_KEYS`
(the keys added to the logs) is importable from here too.

The parts: `_meter` (`EpochMeter`: clock readings to epoch figures, no Keras inside),
`_callback` (`TrainingMonitor`: the hooks, the record, the writes) and `_report` (summary,
CSV and plot of a recorded history). The log-location checks and the all-or-nothing append
are in `keras_perf/_files.py`.

How the clock is read without slowing training down:

- The only per-batch work is one `time.perf_counter()` and one `list.append` in
  `on_train_batch_begin` (main thread) and in `on_train_batch_end`. The callback sets
  `async_safe = True`, so on JAX and PyTorch Keras keeps its asynchronous batch dispatch;
  there the end hook runs in Keras' worker thread *after* Keras has turned that step's logs
  into Python numbers, i.e. after the step finished on the device. On TensorFlow Keras
  converts the logs in the main thread before the hook, which is the same point. No extra
  device synchronisation is added per batch, and `self.model` is never touched in a batch
  hook. (Keras' JAX loop dispatches a whole epoch ahead of the device; the worker readings
  still land when each step's results arrive, so they time the device, not the dispatch.
  Worker threads may wake out of order; steps finish in order, so the k-th earliest reading
  is taken as step k's end.)
- A step's time is the gap between consecutive end readings (the first from the epoch's start,
  so epoch 1's first step includes tracing/compilation) or, when the host is the bottleneck
  and the worker threads read late and bunched, between begin readings (`EpochMeter` says how
  it picks). With `steps_per_execution=N` Keras calls the hooks once per execution: each
  execution is timed and divided by the steps it ran, so percentiles are over executions, in
  milliseconds per step.
- Examples come from Keras' own loss tracker, which every built-in `train_step` updates with
  the batch's leading dimension (a short last batch counts as it is). It is read once per
  epoch, before validation resets it.
"""

from keras_perf.monitor._callback import TrainingMonitor
from keras_perf.monitor._meter import EpochMeter
from keras_perf.monitor._report import MONITOR_KEYS as MONITOR_KEYS

__all__ = ["EpochMeter", "TrainingMonitor"]
