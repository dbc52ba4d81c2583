"""Which way a model gets more pieces per batch: micro-batches, accumulation, or none.

Lives here: `_microbatches`, `_cannot_microbatch` (why a model can be given neither) and
`_accumulates` (whether recovery halves the batch). Not here: the accumulation itself
(`_accumulation`), the micro-batched train step (keras_perf/train_step.py).
"""

from __future__ import annotations

import keras

from keras_perf import backend as _backend
from keras_perf.oom._accumulation import _Accumulation
from keras_perf.train_step import LossScaleTrainStep


def _microbatches(model) -> int:
    return model.microbatches if isinstance(model, LossScaleTrainStep) else 1


def _cannot_microbatch(model, array_input, weighted) -> str | None:
    """Why `model` cannot be given more micro-batches, or None if it can."""
    if isinstance(model, LossScaleTrainStep):
        return None
    if isinstance(model, keras.Sequential) or _backend.is_functional(model):
        return None
    if array_input:
        refusal = _Accumulation.refuses(model, weighted)
        if refusal is None:
            return None  # smaller batches with gradient accumulation
        data = f"Smaller batches with gradient accumulation are not possible either: {refusal}"
    else:
        data = (
            "tf.data datasets, PyDatasets and generators cannot be re-batched, so micro-batching "
            "is the only way to keep the batch."
        )
    return (
        f"{type(model).__name__} is a subclassed model without keras-perf's train step, so its "
        f"batch cannot be cut into micro-batches. {data} Subclass the mixin: "
        f"`class {type(model).__name__}(kp.LossScaleTrainStep, keras.Model): ...`."
    )


def _accumulates(model, array_input) -> bool:
    """Whether recovery halves the batch and accumulates gradients (stock subclassed model)."""
    return (
        array_input
        and not isinstance(model, LossScaleTrainStep)
        and not isinstance(model, keras.Sequential)
        and not _backend.is_functional(model)
    )
