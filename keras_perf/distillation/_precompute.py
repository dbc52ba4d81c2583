"""`precompute_teacher_logits`: a teacher's outputs computed once, for offline distillation.

Train `DistillationModel(student, teacher=None, ...)` on `(x, (y, outputs))` with what it
returns. Not here: how the stored outputs are used in the loss (`_model`, `_losses`).
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from keras_perf._utils import check_int


def precompute_teacher_logits(teacher, x, batch_size: int = 256, verbose=0):
    """Run a teacher once over `x` and return its outputs, for offline distillation.

    Train a `kp.DistillationModel(student, teacher=None, ...)` on `(x, (y, outputs))` with
    the same `temperature`/`from_logits` as an online distiller: the teacher's forward pass is
    paid once instead of once per epoch. Not for augmented or otherwise randomised inputs:
    the stored outputs belong to the exact inputs given here.

    Args:
        teacher: A `keras.Model` or a list of them.
        x: Inputs (anything `teacher.predict` accepts, in the order used for training).
        batch_size: Batch size of the forward pass. Defaults to `256`.
        verbose: `predict` verbosity. Defaults to `0`.

    Returns:
        A float32 NumPy array of the teacher's outputs (logits, or probabilities for
        probability-output teachers); a list of arrays for a list of teachers.

    Raises:
        TypeError: `teacher` is not a model or a list of models, or a bad `batch_size`.
        ValueError: `batch_size` < 1.

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> teacher = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> kp.precompute_teacher_logits(teacher, np.ones((10, 4)), batch_size=4).shape
        (10, 3)
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if isinstance(teacher, (list, tuple)):
        return [precompute_teacher_logits(t, x, batch_size, verbose) for t in teacher]
    if not isinstance(teacher, keras.Model):
        raise TypeError(
            f"`teacher` must be a keras.Model or a list of them, got {type(teacher).__name__}."
        )
    out = teacher.predict(x, batch_size=batch_size, verbose=verbose)
    return np.asarray(ops.convert_to_numpy(ops.cast(out, "float32")))
