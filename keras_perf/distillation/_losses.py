"""The distillation losses: the soft-target KL and a user's loss, both in float32.

`_SoftTargetKL` is T² · KL(softmax(t/T) ‖ softmax(s/T)) from log-softmax values
(`_log_probs`; the soft target of several teachers is the mean of their probabilities,
`_teacher_log_probs`), so no probability is ever passed through `log` unclipped.
`_CustomDistillationLoss` wraps a user's `fn(teacher_outputs, student_outputs)`. Not here:
which loss is used and how it is weighted (`_model.DistillationModel`), the feature loss
(`_features`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import keras
import numpy as np
from keras import ops

# Smallest normal float32: probabilities are clipped here before `log` when the models output
# probabilities (from_logits=False). A probability below it has underflowed already.
_TINY = float(np.finfo("float32").tiny)


def _log_probs(outputs, temperature: float, from_logits: bool):
    """log softmax(z / T) in float32, where z are logits or log-probabilities."""
    z = ops.cast(outputs, "float32")
    if not from_logits:
        z = ops.log(ops.clip(z, _TINY, 1.0))
    if temperature != 1.0:
        z = z / temperature
    return ops.log_softmax(z, axis=-1)


def _teacher_log_probs(teacher_outputs, temperature: float, from_logits: bool):
    """log of the soft target: one teacher's, or the mean of several teachers' probabilities."""
    if isinstance(teacher_outputs, (list, tuple)):
        logs = [_log_probs(t, temperature, from_logits) for t in teacher_outputs]
        if len(logs) == 1:
            return logs[0]
        return ops.logsumexp(ops.stack(logs, axis=0), axis=0) - math.log(len(logs))
    return _log_probs(teacher_outputs, temperature, from_logits)


class _SoftTargetKL(keras.losses.Loss):
    """T² · KL(softmax(t/T) ‖ softmax(s/T)) per position; y_true is log softmax(t/T)."""

    def __init__(self, temperature: float, from_logits: bool, name: str = "distillation_loss"):
        super().__init__(name=name, dtype="float32")
        self.temperature = temperature
        self.from_logits = from_logits

    def call(self, y_true, y_pred):
        log_t = y_true
        log_s = _log_probs(y_pred, self.temperature, self.from_logits)
        kl = ops.sum(ops.exp(log_t) * (log_t - log_s), axis=-1)
        return kl * (self.temperature**2)


class _CustomDistillationLoss(keras.losses.Loss):
    """Wraps a user callable `fn(teacher_outputs, student_outputs)` (float32 inputs)."""

    def __init__(self, fn: Callable, name: str = "distillation_loss"):
        super().__init__(name=name, dtype="float32")
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, ops.cast(y_pred, "float32"))
