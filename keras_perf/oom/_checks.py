"""The argument checks of `fit_with_oom_retry`, all before any training step.

Lives here: `_check_arguments`, `_check_min_batch_size`, `_check_validation_data`. Not here:
the checks made at an OOM, when deciding whether to retry (`_retry._Run.why_not_retry`,
`_routes._cannot_microbatch`), nor `find_max_microbatch`'s own (`_probe`).
"""

from __future__ import annotations

import types

import keras

from keras_perf import backend as _backend
from keras_perf._utils import check_int


def _check_validation_data(fit_kwargs) -> None:
    if isinstance(fit_kwargs.get("validation_data"), types.GeneratorType):
        raise ValueError(
            "fit_with_oom_retry: `validation_data` is a generator. The epoch retried after an "
            "out-of-memory error runs in a new `fit` call, which cannot read the batches the "
            "failed one took from it. Pass arrays, a `keras.utils.PyDataset` or a "
            "`tf.data.Dataset` as `validation_data`."
        )


def _check_arguments(model, batch_size, epochs, min_batch_size, max_retries, fit_kwargs):
    """Validate the arguments (before any step); returns them checked, and `initial_epoch`."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if _backend.is_multi_worker(model):
        raise RuntimeError(
            "kp.fit_with_oom_retry does not support a multi-worker MultiWorkerMirroredStrategy: "
            "an out-of-memory error on one worker cannot be coordinated with the other workers, "
            "which would wait in their next collective instead of retrying. Use `model.fit` "
            "with a batch size that fits."
        )
    batch_size = check_int("batch_size", batch_size, minimum=1, allow_none=True)
    epochs = check_int("epochs", epochs, minimum=1)
    min_batch_size = check_int("min_batch_size", min_batch_size, minimum=1)
    max_retries = check_int("max_retries", max_retries, minimum=0)
    initial_epoch = check_int("initial_epoch", fit_kwargs.pop("initial_epoch", 0), minimum=0)
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"Model '{model.name}' is not compiled: call `model.compile(optimizer, loss)` before "
            "kp.fit_with_oom_retry()."
        )
    if isinstance(fit_kwargs.get("callbacks"), keras.callbacks.CallbackList):
        raise TypeError("Pass `callbacks` as a list of callbacks, not a CallbackList.")
    _check_validation_data(fit_kwargs)
    return batch_size, epochs, min_batch_size, max_retries, initial_epoch


def _check_min_batch_size(min_batch_size, batch) -> None:
    if batch is not None and min_batch_size > batch:
        raise ValueError(
            f"`min_batch_size` ({min_batch_size}) must be at most the batch size ({batch}): "
            "no micro-batch could be tried. Lower `min_batch_size`."
        )
