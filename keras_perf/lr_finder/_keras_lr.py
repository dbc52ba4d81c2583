"""The one private Keras attribute the range test reads: an optimizer's learning-rate object.

Keras' public `optimizer.learning_rate` returns the *value* of a schedule, not the schedule, and
its setter untracks the learning-rate variable when anything but a number is assigned, so the
schedule a user passed cannot be read back, nor a variable put back, through it. The range test
needs the object itself, to put the user's schedule (the same object) back afterwards.

Checked on Keras 3.8-3.15: `BaseOptimizer._learning_rate` holds a `backend.Variable`, a
`LearningRateSchedule` or a callable; `LossScaleOptimizer` delegates to `inner_optimizer`.
This belongs with keras-perf's other private-Keras reads (the Keras-internals shim).
"""

from __future__ import annotations

import keras


def learning_rate_object(optimizer):
    """The learning rate as `optimizer` holds it: a variable, a schedule or a callable."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer._learning_rate
