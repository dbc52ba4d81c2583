"""`find_max_microbatch`: the largest micro-batch of a batch that fits, by probing.

Lives here: the probe. Not here: how it takes its batch from arrays or a dataset
(`keras_perf._inputs.probe_batch`), the snapshot it restores afterwards (`_state`), training
that recovers from OOM (`_retry`).
"""

from __future__ import annotations

import math

import keras

from keras_perf import backend as _backend
from keras_perf._inputs import probe_batch
from keras_perf._utils import check_int, first_tensor
from keras_perf.oom._retry import _error_text
from keras_perf.oom._state import _restore, _snapshot
from keras_perf.train_step import LossScaleTrainStep, loss_scaled


def find_max_microbatch(model: keras.Model, x, y=None, batch_size: int = 32) -> int:
    """Probe the largest micro-batch of a `batch_size` batch that fits in memory.

    One training step on the first `batch_size` examples is tried with 1, 2, 4, ...
    micro-batches (halving the examples per slice each time) until one runs without
    out-of-memory. The model's and optimizer's variables are restored afterwards, and its
    `microbatches` setting too: the probe leaves no trace.

    Args:
        model: A compiled Sequential or Functional `keras.Model`, or one with
            `kp.LossScaleTrainStep`.
        x: Training inputs with at least `batch_size` examples: arrays (or a dict/list of
            them), a `tf.data.Dataset` (batched, or unbatched: then batched here), a
            `keras.utils.PyDataset` or a torch DataLoader; their first batches are read.
            Not a generator or iterator, which the probe would consume.
        y: Targets, with arrays only. Defaults to `None`.
        batch_size: The batch to fit. Defaults to `32`.

    Returns:
        The number of examples per micro-batch that fitted; use
        `microbatches = ceil(batch_size / result)`.

    Raises:
        TypeError: bad argument types, a subclassed model without the train step, or `x` a
            generator or iterator.
        ValueError: the model is not compiled, `batch_size` < 1, `y` given with a dataset,
            or `x` has fewer than `batch_size` examples.
        RuntimeError: even single-example micro-batches run out of memory.

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile("sgd", "mse")
        >>> kp.find_max_microbatch(model, np.ones((16, 4)), np.ones((16, 2)), batch_size=16)
        16
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if getattr(model, "optimizer", None) is None:
        raise ValueError(f"Model '{model.name}' is not compiled: call `model.compile(...)` first.")
    xb, yb, sw = probe_batch(model, x, y, batch_size, caller="find_max_microbatch")
    probe = model if isinstance(model, LossScaleTrainStep) else loss_scaled(model)
    n = int(first_tensor(xb).shape[0])
    saved, original = _snapshot(probe), probe.microbatches
    microbatches, errors = 1, []
    try:
        while True:
            probe.microbatches = microbatches
            try:
                probe.train_on_batch(xb, yb, sample_weight=sw)
                return math.ceil(n / microbatches)
            except Exception as exc:
                if not _backend.is_oom(exc):
                    raise
                errors.append(_error_text(exc))
            _backend.clear_memory()
            if microbatches >= n:
                raise RuntimeError(
                    f"find_max_microbatch: even micro-batches of one example run out of memory "
                    f"(tried {len(errors)} sizes from {n} down to 1). Last error: {errors[-1]}"
                )
            microbatches *= 2
    finally:
        _restore(saved)
        probe.microbatches = original
        probe.reset_metrics()
