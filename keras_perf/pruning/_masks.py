"""Which entries to keep: magnitude masks (per weight or global) and m-by-n blocks."""

from __future__ import annotations

import numpy as np
from keras import ops

from keras_perf._utils import check_int


def _keep_count(n: int, sparsity: float) -> int:
    """tfmot's k = max(round(n * (1 - s)), 1), in float32 with round-half-to-even."""
    kept = np.float32(n) * (np.float32(1.0) - np.float32(sparsity))
    return max(int(np.round(kept)), 1)


def _threshold(abs_flat: np.ndarray, sparsity: float) -> np.float32:
    """The k-th largest magnitude: elements >= it are kept (tfmot's threshold)."""
    n = abs_flat.shape[0]
    k = _keep_count(n, sparsity)
    return np.partition(abs_flat, n - k)[n - k]


def _magnitude_masks(weights, sparsity: float, scope: str):
    """Masks keeping the largest magnitudes, per weight or with one global threshold.

    Computed on the host with NumPy: a partition is linear in the weight count, and it needs
    no compiled kernel per sparsity (`top_k(k)` on a jitted backend compiles again for each new
    k, about 50 ms each on a CPU). The weights come over once per mask update (every
    `frequency` steps); the masks go back as the mask variables' new values.
    """
    absolute = [np.abs(np.asarray(ops.convert_to_numpy(w), dtype=np.float32)) for w in weights]
    if scope == "global":
        flat = np.concatenate([a.ravel() for a in absolute])
        thresholds = [_threshold(flat, sparsity)] * len(absolute)
    else:
        thresholds = [_threshold(a.ravel(), sparsity) for a in absolute]
    masks = [(a >= t).astype(np.float32) for a, t in zip(absolute, thresholds)]
    return masks, thresholds


def _m_by_n_mask(weight, m: int, n: int, axis: int):
    """Keep the n - m largest magnitudes of every block of n consecutive entries along `axis`.

    A trailing partial block of length L keeps its min(L, n - m) largest.
    """
    x = ops.moveaxis(ops.abs(ops.cast(weight, "float32")), axis, -1)
    shape = tuple(x.shape)
    length = shape[-1]
    pad = (-length) % n
    x = ops.reshape(x, (-1, length))
    if pad:
        x = ops.pad(x, [[0, 0], [0, pad]], constant_values=-1.0)
    blocks = ops.reshape(x, (-1, n))
    _, idx = ops.top_k(blocks, n - m, sorted=False)
    mask = ops.minimum(ops.sum(ops.one_hot(idx, n), axis=-2), 1.0)
    mask = ops.reshape(mask, (-1, length + pad))[:, :length]
    mask = ops.moveaxis(ops.reshape(mask, shape), -1, axis)
    return ops.cast(mask, weight.dtype)


def _compute_masks(targets, sparsity: float, scope: str, m_by_n):
    """(masks, thresholds): thresholds are None under m-by-n."""
    weights = [t.variable.value for t in targets]
    if m_by_n is not None:
        m, n = m_by_n
        return [_m_by_n_mask(w, m, n, t.axis) for w, t in zip(weights, targets)], None
    return _magnitude_masks(weights, sparsity, scope)


def _check_m_by_n(m_by_n):
    if m_by_n is None:
        return None
    if not isinstance(m_by_n, (tuple, list)) or len(m_by_n) != 2:
        raise ValueError(f"`m_by_n` must be None or a pair (m, n) such as (2, 4); got {m_by_n!r}.")
    m = check_int("m_by_n[0]", m_by_n[0], minimum=1)
    n = check_int("m_by_n[1]", m_by_n[1], minimum=2)
    if m >= n:
        raise ValueError(
            f"`m_by_n` (m, n) must have 1 <= m < n (m zeros in every n entries); got {m_by_n!r}."
        )
    return (m, n)
