"""How a 0/1 mask is held on a weight: `MaskConstraint`, and `constraint_masks` to read it back.

Shared by magnitude pruning (`keras_perf.pruning`, which installs and updates the masks),
channel pruning (its `_ChannelMask` is a `MaskConstraint`), quantization (a masked kernel is
a pruned one) and the OOM retry (the masks travel with the model's state). It lives on the
ground floor, not in `pruning/`, because it is a mechanism of all four, not a part of magnitude
pruning: it needs Keras only, and every package that reads a mask imports it from here.
"""

from __future__ import annotations

import keras
from keras import ops

__all__ = ["MaskConstraint", "constraint_masks"]


class MaskConstraint:
    """Variable constraint `w -> mask * original(w)`: run by the optimizer after each update.

    Not a public class and never serialized: layers serialize their own `kernel_constraint`,
    not the variable's, so a saved model stays a plain Keras model.
    """

    def __init__(self, mask: keras.Variable, original=None):
        self.mask = mask
        self.original = original

    def __call__(self, w):
        if self.original is not None:
            w = self.original(w)
        return ops.multiply(w, ops.cast(self.mask, w.dtype))


def constraint_masks(variable) -> list:
    """The mask variables installed on `variable` by pruning (magnitude and channel masks
    chain through each other's `original`), outermost first; [] when it has none."""
    masks, constraint = [], getattr(variable, "constraint", None)
    while isinstance(constraint, MaskConstraint):
        masks.append(constraint.mask)
        constraint = constraint.original
    return masks
