"""What `fit_with_oom_retry` reads from its inputs: kind, batch size and steps per epoch.

Lives here: `_is_array_input`, `_infer_batch_size`, `_steps` and Keras' default batch size.
Not here: replaying a generator (`_replay`), argument checks (`_checks`), the probe's batch
(`_probe`).
"""

from __future__ import annotations

import math

import keras
import numpy as np

from keras_perf._utils import first_tensor

_KERAS_DEFAULT_BATCH = 32


def _is_array_input(x) -> bool:
    """numpy / backend tensors (or a dict, list or tuple of them): data `fit` batches itself."""
    leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
    return bool(leaves) and all(
        isinstance(t, np.ndarray) or (hasattr(t, "shape") and hasattr(t, "dtype")) for t in leaves
    )


def _infer_batch_size(x):
    """The batch size of already-batched data (tf.data, PyDataset, DataLoader), when knowable."""
    try:
        spec = getattr(x, "element_spec", None)  # tf.data.Dataset
        if spec is not None:
            dim = keras.tree.flatten(spec)[0].shape[0]
            return int(dim) if dim is not None else None
        if getattr(x, "batch_size", None) is not None:  # torch DataLoader, PyDataset subclasses
            return int(x.batch_size)
    except (TypeError, ValueError, IndexError, AttributeError):
        pass
    return None


def _steps(x, batch_size, fit_kwargs):
    """Steps per epoch for the progress bar (None when not known in advance)."""
    if fit_kwargs.get("steps_per_epoch") is not None:
        return fit_kwargs["steps_per_epoch"]
    try:
        if _is_array_input(x):
            n = int(first_tensor(x).shape[0])
            n = math.floor(n * (1.0 - float(fit_kwargs.get("validation_split") or 0.0)))
            return math.ceil(n / (batch_size or _KERAS_DEFAULT_BATCH))
        return len(x)
    except (TypeError, ValueError, AttributeError, StopIteration):
        return None
