"""The reading of `fit`'s inputs, one place for every tool that takes data "as `fit` takes it".

`diagnose`, `accelerate`, `find_max_batch_size`, `fit_with_oom_retry` and `lr_range_test` read
the user's `x` (and `y`, `batch_size`, `memory_limit_bytes`) through this package:

- `_kinds`: what kind of input `x` is, without consuming it (`is_array_input`,
  `is_tf_dataset`, `infer_batch_size`, `KERAS_DEFAULT_BATCH`).
- `_checks`: the checks made before any work, each naming the tool, the argument and the fix
  (`check_fit_data`, `check_not_consumable`, `check_memory_limit`,
  `check_no_ignored_settings`).
- `_probe`: `probe_batch`, the first examples of `x` as arrays, for a step tried on them.
- `_sources`: the data behind one interface for the measuring tools (`make_source`: arrays,
  restartable inputs, a one-pass generator read once; `stack`, `leading_dim`).

Private to keras-perf; it sits above the backend and the train step and below the tools that
use it (tests/test_imports.py).
"""

from keras_perf._inputs import _sources as sources
from keras_perf._inputs._checks import (
    check_fit_data,
    check_memory_limit,
    check_no_ignored_settings,
    check_not_consumable,
    required_input_names,
)
from keras_perf._inputs._kinds import (
    KERAS_DEFAULT_BATCH,
    infer_batch_size,
    is_array_input,
    is_tf_dataset,
)
from keras_perf._inputs._probe import probe_batch

__all__ = [
    "KERAS_DEFAULT_BATCH",
    "check_fit_data",
    "check_memory_limit",
    "check_no_ignored_settings",
    "check_not_consumable",
    "infer_batch_size",
    "is_array_input",
    "is_tf_dataset",
    "probe_batch",
    "required_input_names",
    "sources",
]
