"""Magnitude pruning for Keras 3 as a plain callback: no wrapping, cloning or recompiling.

tensorflow-model-optimization (tfmot) prunes only legacy tf_keras models, wraps every layer and
cannot reach into subclassed or nested models. Here the model is left as it is:

- every prunable weight gets a 0/1 mask in a non-trainable `keras.Variable`, and the mask is
  installed as that weight's *constraint*. Keras' optimizers apply constraints right after each
  update inside the compiled train step, so pruned entries are exactly zero after every step,
  whatever the optimizer (momentum, Adam, weight decay) does, with no Python work per batch;
- the callback recomputes the masks (tfmot's rule: keep the k = max(round(n * (1 - s)), 1)
  largest magnitudes) only at the steps the schedule names, the step being the optimizer's
  iteration count;
- nothing is added to the model: saved weights carry the zeros, and a resumed run rebuilds the
  masks from them, so `model.save`/`load_model` and `BackupAndRestore` keep the pattern.

Public names: `PolynomialDecay`, `ConstantSparsity`, `PruningSchedule`, `PruningCallback`,
`sparsity_report`, `strip_pruning`, `prune_low_magnitude`.

The parts: `_schedules` (when and how much; `_polynomial` has tfmot's float32 arithmetic),
`_selection` (which weights; the `include`/`exclude` rules shared with quantization and channel
pruning are `keras_perf._layer_selection`), `_masks` (which entries of them), `_constraint` (how
masks are installed; the constraint class, shared, is `keras_perf._masks`), `_base`
(`MaskingCallback`, the schedule stepping shared with `ChannelPruningCallback`, re-exported
below for it), `_callback` (`PruningCallback`) and `_oneshot` (the functions).
"""

from __future__ import annotations

# `MaskingCallback as MaskingCallback` is package-internal (not in `__all__`, not in API.md),
# as optax re-exports its internals: the schedule stepping `keras_perf.channel_pruning` builds its callback on. It stays here, not on
# the ground floor, because it is pruning's own stepping (schedules, mask refresh, the
# backend's step state); the mask constraint itself is `keras_perf._masks`.
from keras_perf.pruning._base import MaskingCallback as MaskingCallback
from keras_perf.pruning._callback import PruningCallback
from keras_perf.pruning._oneshot import prune_low_magnitude, sparsity_report, strip_pruning
from keras_perf.pruning._schedules import ConstantSparsity, PolynomialDecay, PruningSchedule

__all__ = [
    "ConstantSparsity",
    "PolynomialDecay",
    "PruningCallback",
    "PruningSchedule",
    "prune_low_magnitude",
    "sparsity_report",
    "strip_pruning",
]
