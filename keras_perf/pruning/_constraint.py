"""How pruning installs masks on a model: a mask variable per weight, held as its constraint.

The constraint itself (`MaskConstraint`, `constraint_masks`) is on the ground floor,
`keras_perf._masks`, shared with channel pruning, quantization and the OOM retry.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from keras_perf import backend as _backend
from keras_perf._masks import MaskConstraint


def _refresh_train_step(
    model, masks_changed: bool, constraints_changed: bool, masks_carried: bool = False
) -> None:
    """Make the next `fit` step see new constraints (all backends) or new mask values.

    A TF or torch step reads the mask variables when it runs. A jitted JAX step bakes in the
    values of variables it does not receive as state, so after a mask change it is retraced,
    unless the masks travel with the optimizer state (`masks_carried`, set by the callback
    through `kp.backend.carry_in_step_state`).
    """
    stale_masks = masks_changed and not masks_carried
    if constraints_changed or (stale_masks and not _backend.STEP_READS_EXTERNAL_VARIABLES):
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)


def _install(targets, initial=None, derive_from_zeros: bool = False) -> bool:
    """Give every target a mask variable and the masking constraint; True if any was new.

    The mask comes, in order of preference, from a constraint already installed (same
    process), from `initial` (path -> array, e.g. a loaded `state_dict`), from the zeros of the
    weight when `derive_from_zeros` (resuming a run whose pruning has begun), else all ones.
    """
    changed = False
    for t in targets:
        current = t.variable.constraint
        if isinstance(current, MaskConstraint):
            t.mask = current.mask
            continue
        if initial is not None and t.path in initial:
            value = np.asarray(initial[t.path]).astype(t.variable.dtype)
        else:
            value = np.ones(t.variable.shape, dtype=t.variable.dtype)
            if derive_from_zeros:
                nonzero = ops.convert_to_numpy(t.variable.value) != 0
                if nonzero.any():
                    value = nonzero.astype(t.variable.dtype)
        t.mask = keras.Variable(
            value, dtype=t.variable.dtype, trainable=False, autocast=False, name="prune_mask"
        )
        t.variable.constraint = MaskConstraint(t.mask, current)
        changed = True
    return changed


def _guard_set_weights(model) -> None:
    """Make `model.set_weights` keep pruned entries zero while masks are installed.

    `EarlyStopping(restore_best_weights=True)` (Keras' and ours) and `TimeLimit` put back an
    earlier epoch's weights with `model.set_weights` in their `on_train_end`, which may run
    after ours; those weights were masked with the masks of their epoch, and the masks have
    pruned more since. The latest masks apply: restored weights are masked again, so the
    model has the sparsity logged last. Removed by `strip_pruning`.
    """
    if _guarded(model):
        return
    plain = type(model).set_weights

    def set_weights(weights):
        plain(model, weights)
        for v in model.weights:
            if isinstance(v.constraint, MaskConstraint):
                _zero_pruned(v, v.constraint.mask)

    set_weights._kp_pruning_guard = True
    set_weights.__doc__ = plain.__doc__
    object.__setattr__(model, "set_weights", set_weights)


def _guarded(model) -> bool:
    return getattr(vars(model).get("set_weights"), "_kp_pruning_guard", False)


def _unguard_set_weights(model) -> None:
    """Give `model` its class's `set_weights` back (undo `_guard_set_weights`)."""
    if _guarded(model):
        object.__delattr__(model, "set_weights")


def _zero_pruned(variable, mask) -> None:
    """Multiply `variable` by its 0/1 `mask` now."""
    variable.assign(ops.multiply(variable.value, ops.cast(mask.value, variable.dtype)))


def _apply_masks(targets, masks=None) -> None:
    """Set each mask (if given) and zero the pruned entries of its weight now."""
    for i, t in enumerate(targets):
        if masks is not None:
            t.mask.assign(masks[i])
        _zero_pruned(t.variable, t.mask)


def _mask_sparsity(targets) -> tuple[float, dict]:
    """Overall and per-weight fraction of masked entries."""
    zeros, size, per = 0, 0, {}
    for t in targets:
        kept = float(ops.convert_to_numpy(ops.sum(ops.cast(t.mask.value, "float32"))))
        n = int(np.prod(t.variable.shape))
        per[t.path] = 1.0 - kept / n
        zeros += n - kept
        size += n
    return (zeros / size if size else 0.0), per
