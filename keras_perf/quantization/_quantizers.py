"""Fake quantization: symmetric per-channel kernels and moving-average activation ranges.

Both build on `keras.quantizers.fake_quant_with_min_max_vars`, which Keras implements with
TensorFlow's `FakeQuantWithMinMaxVars*` ops on the TensorFlow backend (the ops TFLite's
converter reads ranges from) and with a straight-through `custom_gradient` on JAX and PyTorch
(checked with Keras 3.15): the gradient passes unchanged inside the (nudged) range and is zero
outside it.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from keras_perf import backend as _backend
from keras_perf._utils import check_int, check_number

WEIGHT_BITS = range(2, 9)
ACTIVATION_BITS = (*range(2, 9), 16)
# A channel whose weights are all zero (e.g. pruned) still needs a positive scale.
_TINY = 1e-12
# Smallest scale of an activation range (torch's observers' floor, float32's eps): a range of
# width 0 (an all-zero batch, a dead ReLU, a zero-initialised head) would divide by zero.
MIN_SCALE = float(np.finfo("float32").eps)


def check_bits(name: str, value, allowed) -> int:
    check_int(name, value)
    if value not in allowed:
        lo, hi = min(allowed), max(v for v in allowed if v <= 8)
        extra = " or 16" if 16 in allowed else ""
        raise ValueError(f"`{name}` must be an integer in {lo}-{hi}{extra}; got {value!r}.")
    return int(value)


def fake_quant(x, min_vals, max_vals, num_bits: int, narrow_range: bool, axis=None):
    """`keras.quantizers.fake_quant_with_min_max_vars`, in the backend's fused ops where Keras'
    own are slow (torch, 2-8 bits; see `keras_perf.backend.torch.fake_quant`)."""
    if _backend.fake_quant is not None and num_bits <= 8:
        x = ops.convert_to_tensor(x)
        return _backend.fake_quant(x, min_vals, max_vals, num_bits, narrow_range, axis)
    return keras.quantizers.fake_quant_with_min_max_vars(
        x, min_vals, max_vals, num_bits=num_bits, narrow_range=narrow_range, axis=axis
    )


def widen_range(lo, hi, bits: int):
    """An activation range TFLite and the fake-quant ops can use: it contains 0 and is at least
    `MIN_SCALE * (2^bits - 1)` wide (`hi` is raised: an all-zero tensor gets `[0, floor]`)."""
    lo = ops.minimum(lo, 0.0)
    hi = ops.maximum(hi, 0.0)
    return lo, ops.maximum(hi, lo + MIN_SCALE * (2**bits - 1))


def kernel_range(kernel, channel_axes):
    """`max |w|` per output channel (reduced over every other axis), or over the whole tensor
    when `channel_axes` is `None`; no gradient flows through the range."""
    a = ops.abs(kernel)
    if channel_axes is None:
        m = ops.max(a)
    else:
        axes = tuple(i for i in range(len(kernel.shape)) if i not in channel_axes)
        m = ops.max(a, axis=axes) if axes else a
    return ops.stop_gradient(ops.maximum(m, _TINY))


def fake_quant_kernel(kernel, bits: int, channel_axes):
    """Symmetric narrow-range fake quantization of a kernel: integers in
    [-(2^(b-1)-1), 2^(b-1)-1] times a scale `max|w| / (2^(b-1)-1)` per channel."""
    if _backend.fake_quant_kernel is not None:  # torch: the same in torch ops, a third of the cost
        return _backend.fake_quant_kernel(kernel, bits, channel_axes, _TINY)
    m = kernel_range(kernel, channel_axes)
    if channel_axes is None:
        return fake_quant(kernel, -m, m, bits, True)
    shape = ops.shape(kernel)
    if len(channel_axes) > 1:  # Depthwise: channels = in x multiplier, the last two axes.
        flat = ops.reshape(kernel, (*kernel.shape[: channel_axes[0]], -1))
        m = ops.reshape(m, (-1,))
        q = fake_quant(flat, -m, m, bits, True, axis=len(flat.shape) - 1)
        return ops.reshape(q, shape)
    last = len(shape) - 1
    if channel_axes[0] != last:  # Conv2DTranspose (h, w, out, in): Keras' JAX op wants the last
        q = fake_quant(ops.moveaxis(kernel, channel_axes[0], -1), -m, m, bits, True, axis=last)
        return ops.moveaxis(q, -1, channel_axes[0])
    return fake_quant(kernel, -m, m, bits, True, axis=last)


@keras.saving.register_keras_serializable(package="keras_perf")
class ActivationQuantizer(keras.layers.Layer):
    """Fake-quantizes a tensor with a range learned as a moving average (as tfmot's
    `MovingAverageQuantizer`).

    In training, the range is an exponential moving average of the batch's min and max (each
    widened to include 0); the first training batch sets it directly. At inference the range
    is frozen. `min`/`max` are non-trainable weights, so they are saved with the model.
    A range is never narrower than `MIN_SCALE * (2^bits - 1)` (`widen_range`), and an all-zero
    batch before any other (a dead ReLU, a zero-initialised layer) does not count as the first:
    the next batch with non-zero values sets the range.

    Args:
        num_bits: Bits of the integer range: 2-8, or 16. Defaults to `8`.
        ema_decay: Weight of the old range in the moving average. Defaults to `0.999`.
        **kwargs: Layer arguments (`name`, ...).
    """

    def __init__(self, num_bits: int = 8, ema_decay: float = 0.999, **kwargs):
        super().__init__(**kwargs)
        self.num_bits = check_bits("num_bits", num_bits, ACTIVATION_BITS)
        self.ema_decay = check_number(
            "ema_decay", ema_decay, low=0.0, high=1.0, high_inclusive=False
        )
        self.supports_masking = True

    def build(self, input_shape):
        self.min = self.add_weight(
            shape=(),
            initializer=keras.initializers.Constant(-6.0),
            trainable=False,
            name="min",
            dtype="float32",
            autocast=False,
        )
        self.max = self.add_weight(
            shape=(),
            initializer=keras.initializers.Constant(6.0),
            trainable=False,
            name="max",
            dtype="float32",
            autocast=False,
        )
        self.initialized = self.add_weight(
            shape=(),
            initializer="zeros",
            trainable=False,
            name="initialized",
            dtype="float32",
            autocast=False,
        )

    def call(self, inputs, training=None):
        if _backend.moving_average_fake_quant is not None and self.num_bits <= 8:  # torch ops
            return _backend.moving_average_fake_quant(
                inputs,
                self.min,
                self.max,
                self.initialized,
                self.ema_decay,
                self.num_bits,
                bool(training),
            )
        x = ops.cast(inputs, "float32")
        lo, hi = self.min.value, self.max.value
        if training:
            batch_min = ops.minimum(ops.stop_gradient(ops.min(x)), 0.0)
            batch_max = ops.maximum(ops.stop_gradient(ops.max(x)), 0.0)
            first = ops.equal(self.initialized.value, 0.0)
            d = self.ema_decay
            lo = ops.where(first, batch_min, d * lo + (1.0 - d) * batch_min)
            hi = ops.where(first, batch_max, d * hi + (1.0 - d) * batch_max)
            lo, hi = widen_range(lo, hi, self.num_bits)
            self.min.assign(lo)
            self.max.assign(hi)
            # An all-zero first batch leaves the range to the next batch.
            started = ops.logical_or(ops.logical_not(first), ops.greater(batch_max, batch_min))
            self.initialized.assign(ops.cast(started, "float32"))
        else:
            lo, hi = widen_range(lo, hi, self.num_bits)  # a file saved with a range of width 0
        y = fake_quant(x, lo, hi, self.num_bits, False)
        return ops.cast(y, inputs.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "num_bits": self.num_bits, "ema_decay": self.ema_decay}
