"""The memory measures keras-perf reports: name -> what it counts.

Every figure of memory keras-perf reports names its measure (a `"measure"` key: the backends'
`memory_stats`, `step_memory` and `epoch_memory`, the monitor's `memory_measure`, a
`find_max_batch_size` row, a `diagnose` step). This table lists each of them once, beside the
backend modules that mint them; `kp.oom.MEASURES` and `diagnose`'s table read it.
"""

from __future__ import annotations

#: What each measure counts.
MEASURES = {
    "tf_allocator_peak": "TensorFlow allocator's peak during the step, plus the variables",
    "torch_cuda_peak": "torch CUDA allocator's peak during the step, plus the variables",
    "torch_saved_tensors": "tensors saved for backward (peak) + variables, gradients, batch",
    "xla_memory_analysis": "XLA memory analysis: arguments + outputs - donated + temp",
    "xla_peak_bytes_in_use": "XLA device's peak bytes in use since the process started",
    "host_peak_rss": "the process's peak resident memory (host RAM), since start or the last reset",
}
