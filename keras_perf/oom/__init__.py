"""Training that survives out-of-memory: `fit_with_oom_retry`, `find_max_microbatch` and
`find_max_batch_size`.

We follow Composer's approach rather than the reference articles' (catch the error, re-run
`fit` with half the batch: progress lost and the optimisation changed): the failed epoch is
re-run from its starting state with the same effective batch cut into more micro-batches.

How a run recovers, step by step:

1. Before each epoch, the values of the model's variables (weights, non-trainable state,
   random-seed state) and of the optimizer's variables are copied to host memory. Host
   copies, because on JAX the failing call may already have donated (freed) the device
   buffers that held the state.
2. An exception that the backend shim recognises as out-of-memory (`kp.backend.is_oom`) ends
   the current `fit` call; any other exception propagates unchanged.
3. The snapshot is restored, garbage is collected and the backend's cache released, and the
   next rung of the ladder is set (`_rungs.ladder`: remat, i.e. activations recomputed in
   the backward pass with the batch whole, first for a model with BatchNormalization or
   `kp.quantize_aware` activation ranges; micro-batches first otherwise; then the other;
   then both). For micro-batches the number of micro-batches is doubled: the model has
   `kp.LossScaleTrainStep` (its `microbatches` is raised) or, for a stock
   Sequential/Functional model, a `kp.loss_scaled` twin is made that shares the model's
   layers and optimizer. Each batch keeps its size and each step stays one optimizer
   update: in-step gradient accumulation equal to the full-batch update, so the
   optimisation does not change. A subclassed model without the
   mixin, fed arrays, instead gets half the batch size and an optimizer copy that averages
   twice as many batches per update (Keras' gradient accumulation): the same update again.
4. `fit` is called again with `initial_epoch` = the failed epoch and the same callbacks.

The parts, in the order a batch `x` goes through a retry:

- `_retry`: `fit_with_oom_retry` and its loop. Checks the arguments, calls `fit`, records
  each OOM, decides whether to retry, and recovers (steps 2-4 above).
- `_state`: what a retried epoch starts from and reads again: what the run reads from `x`
  (array or dataset, batch size, steps), the host snapshot of the variables and RNGs
  (step 1), a Python generator made replayable, and the callbacks shared by the run's
  `fit` calls, which take the snapshot at each epoch start.
- `_rungs`: which rung a model climbs (micro-batches, or smaller batches with gradient
  accumulation), the accumulation rung itself, with `PerUpdateSchedule`, and the ladder
  (the order of remat and micro-batches per model, `strategies=`).
- `_probe`: `find_max_microbatch`, one probing train step per micro-batch count.
- `_batch_size`: `find_max_batch_size`, the largest batch per train-step setting (plain,
  remat, micro-batches, both), by trying steps of doubling then narrowed sizes; a try fails
  on out-of-memory or above a memory cap, measured by `kp.backend.step_memory`.
- `_batch_report`: `MaxBatchSizeReport`, what it returns, and `MEASURES`.

The runnable examples are in the docstrings of `fit_with_oom_retry` (`_retry`),
`find_max_microbatch` (`_probe`) and `find_max_batch_size` (`_batch_size`);
tests/test_doctests.py runs them.
"""

from __future__ import annotations

from keras_perf.oom._batch_report import MEASURES, MaxBatchSizeReport
from keras_perf.oom._batch_size import find_max_batch_size
from keras_perf.oom._probe import find_max_microbatch
from keras_perf.oom._retry import fit_with_oom_retry

# Importable from here as before the split (pickles name `keras_perf.oom.PerUpdateSchedule`).
from keras_perf.oom._rungs import PerUpdateSchedule  # noqa: F401

# Package-internal (not in `__all__`), as optax re-exports its internals: whether a model has
# layers that compute with the whole batch, which picks the OOM ladder's first rung here and
# `diagnose`'s micro-batch what-if. It stays with the ladder it was written for; diagnosis
# imports it from this package, never from `_rungs`.
from keras_perf.oom._rungs import batch_dependent as batch_dependent

__all__ = [
    "MEASURES",
    "MaxBatchSizeReport",
    "find_max_batch_size",
    "find_max_microbatch",
    "fit_with_oom_retry",
]
