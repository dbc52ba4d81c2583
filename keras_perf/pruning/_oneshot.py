"""Pruning without a callback: `prune_low_magnitude`, `sparsity_report`, `strip_pruning`."""

from __future__ import annotations

import numpy as np
from keras import ops

from keras_perf._layer_selection import check_selectors
from keras_perf._masks import MaskConstraint
from keras_perf._utils import check_choice
from keras_perf.pruning._constraint import (
    _apply_masks,
    _guard_set_weights,
    _install,
    _refresh_train_step,
    _unguard_set_weights,
    _zero_pruned,
)
from keras_perf.pruning._masks import _check_m_by_n, _compute_masks
from keras_perf.pruning._schedules import _check_sparsity
from keras_perf.pruning._selection import _select


def sparsity_report(model, include=None, exclude=None) -> dict:
    """Sparsity of each prunable weight of `model`, counted from its exact zeros.

    Args:
        model: A built Keras model (pruned or not).
        include: Report only these (layer names, regexes or classes, as in
            `kp.PruningCallback`). Defaults to `None` (every prunable weight).
        exclude: Leave these out. Defaults to `None`.

    Returns:
        `{"weights": [{"path", "layer", "shape", "size", "nonzero", "sparsity"}, ...],
        "total": {"size", "nonzero", "sparsity"}}`.

    Raises:
        ValueError: an unbuilt model, or one without prunable weights.

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> report = kp.sparsity_report(kp.prune_low_magnitude(model, sparsity=0.5))
    >>> report["total"]["sparsity"]
    0.5
    """
    targets = _select(
        model, check_selectors("include", include), check_selectors("exclude", exclude)
    )
    rows, size, nonzero = [], 0, 0
    for t in targets:
        value = ops.convert_to_numpy(t.variable.value)
        nz = int(np.count_nonzero(value))
        rows.append(
            {
                "path": t.path,
                "layer": t.layer.name,
                "shape": tuple(int(d) for d in value.shape),
                "size": int(value.size),
                "nonzero": nz,
                "sparsity": 1.0 - nz / value.size,
            }
        )
        size += value.size
        nonzero += nz
    total = {"size": int(size), "nonzero": nonzero, "sparsity": 1.0 - nonzero / size}
    return {"weights": rows, "total": total}


def strip_pruning(model):
    """Make the pruning permanent and remove its state: the model becomes plain Keras again.

    Each pruned weight is multiplied by its mask one last time and gets its original
    constraint back; the masks are dropped, and the next `fit` traces a fresh train step.
    Calling it on a model that is not pruned changes nothing.

    Args:
        model: A model pruned by `kp.PruningCallback` or `kp.prune_low_magnitude`.

    Returns:
        The same model object, for chaining.

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> model = kp.strip_pruning(kp.prune_low_magnitude(model, sparsity=0.5))
    >>> model.layers[0].kernel.constraint is None
    True
    """
    stripped = False
    for v in model.weights:
        c = v.constraint
        if isinstance(c, MaskConstraint):
            _zero_pruned(v, c.mask)
            v.constraint = c.original
            stripped = True
    if stripped and getattr(model, "train_function", None) is not None:
        model.train_function = None
    _unguard_set_weights(model)
    return model


def prune_low_magnitude(
    model,
    sparsity: float = 0.5,
    scope: str = "layer",
    m_by_n: tuple[int, int] | None = None,
    include=None,
    exclude=None,
):
    """One-shot magnitude pruning, no training: zero the smallest weights now.

    Unlike tfmot's function of the same name this neither wraps nor returns a new model: the
    masks are installed on the weights (as `kp.PruningCallback` does), so a later `fit` keeps
    the pruned entries at zero until `kp.strip_pruning`.

    Args:
        model: A built Keras model.
        sparsity: Fraction of each weight to zero, in `[0, 1)`. Defaults to `0.5`.
        scope: `"layer"` or `"global"`, as in `kp.PruningCallback`. Defaults to `"layer"`.
        m_by_n: `(m, n)` block pattern instead of a sparsity, as in `kp.PruningCallback`.
            Defaults to `None`.
        include: Prune only these layers (names, regexes or classes). Defaults to `None`.
        exclude: Leave these layers out. Defaults to `None`.

    Returns:
        The same model, pruned.

    Raises:
        ValueError: `sparsity` outside `[0, 1)`, a bad `scope`/`m_by_n`, an unbuilt model, no
            prunable weights, or an `include` that matches none.

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> model = kp.prune_low_magnitude(model, sparsity=0.75)
    >>> int((model.layers[0].kernel.numpy() == 0).sum())
    24
    """
    sparsity = _check_sparsity("sparsity", sparsity)
    scope = check_choice("scope", scope, ("layer", "global"))
    m_by_n = _check_m_by_n(m_by_n)
    targets = _select(
        model, check_selectors("include", include), check_selectors("exclude", exclude)
    )
    changed = _install(targets)
    _guard_set_weights(model)
    masks, _ = _compute_masks(targets, sparsity, scope, m_by_n)
    _apply_masks(targets, masks)
    _refresh_train_step(model, masks_changed=True, constraints_changed=changed)
    return model
