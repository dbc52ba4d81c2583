"""A probe batch: the first examples of `x`, read as arrays, for a step tried on them.

`probe_batch` takes them from arrays, a tf.data dataset (batched here where its elements are
single examples), a PyDataset or a torch DataLoader, and refuses a generator, which reading
would consume (`find_max_microbatch`, `find_max_batch_size`).
"""

from __future__ import annotations

import keras
import numpy as np

from keras_perf._inputs._checks import check_not_consumable
from keras_perf._inputs._kinds import is_array_input
from keras_perf._utils import first_tensor, map_batch


def _is_unbatched_tf_data(model, x) -> bool:
    """A tf.data.Dataset whose elements have one dimension less than the model's inputs."""
    inputs = getattr(model, "inputs", None)
    spec = keras.tree.flatten(x.element_spec)[0]
    if not inputs or spec.shape.rank is None:
        return False
    return spec.shape.rank == len(inputs[0].shape) - 1


def probe_batch(model, x, y, batch_size, caller: str, size_name: str = "batch_size"):
    """The first `batch_size` examples of `x` as `(x, y, sample_weight)` arrays; `caller`
    and `size_name` name the function and the size's argument in error messages."""
    if is_array_input(x):
        return (*map_batch(lambda t: t[:batch_size], (x, y)), None)
    check_not_consumable(x, caller)
    if y is not None:
        raise ValueError(f"{caller}: `y` must be None when `x` is a dataset.")
    if hasattr(x, "element_spec") and _is_unbatched_tf_data(model, x):
        x = x.batch(batch_size)
    if isinstance(x, keras.utils.PyDataset):
        batches = (x[i] for i in range(len(x)))
    else:
        try:
            batches = iter(x)
        except TypeError:
            raise TypeError(f"{caller}: unsupported `x` of type {type(x).__name__}.") from None
    taken, n = [], 0
    for batch in batches:
        # A DataLoader yields lists: (x, y) as a list.
        batch = keras.utils.unpack_x_y_sample_weight(
            tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)
        )
        taken.append(map_batch(keras.ops.convert_to_numpy, batch))
        n += int(first_tensor(batch).shape[0])
        if n >= batch_size:
            break
    if n < batch_size:
        raise ValueError(f"{caller}: `x` holds {n} examples, fewer than {size_name}={batch_size}.")
    joined = keras.tree.map_structure(
        lambda *ts: None if ts[0] is None else np.concatenate(ts)[:batch_size], *taken
    )
    return joined
