"""What kind of input `x` is, read without consuming anything.

`is_array_input` (arrays `fit` batches itself), `is_tf_dataset`, `infer_batch_size` (of data
batched already) and Keras' default batch size for arrays.
"""

from __future__ import annotations

import keras
import numpy as np

#: `fit`'s batch size for arrays when none is given.
KERAS_DEFAULT_BATCH = 32


def module_of(x) -> str:
    return type(x).__module__ or ""


def is_array_input(x) -> bool:
    """numpy / backend tensors (or a dict, list or tuple of them): data `fit` batches itself."""
    leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
    return bool(leaves) and all(
        isinstance(t, np.ndarray) or (hasattr(t, "shape") and hasattr(t, "dtype")) for t in leaves
    )


def is_tf_dataset(x) -> bool:
    """A `tf.data.Dataset` (not an iterator over one, which has no `cardinality`)."""
    return (
        module_of(x).startswith("tensorflow")
        and hasattr(x, "element_spec")
        and hasattr(x, "cardinality")
    )


def infer_batch_size(x):
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
