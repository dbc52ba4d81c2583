"""Keras layers whose kernel is fake-quantized: subclasses of Dense, EinsumDense, Conv1D/2D/3D,
DepthwiseConv2D and Conv2DTranspose.

Each is the float layer's own class underneath (same config, same `kernel` and `bias`
variables, `isinstance(layer, keras.layers.Dense)` still holds); only `call` differs: it uses
the fake-quantized kernel. The kernel is quantized symmetrically with the narrow integer range
(`[-(2^(b-1)-1), 2^(b-1)-1]`), per output channel by default, its scale taken from the
kernel itself at every step (tfmot's `LastValueQuantizer`). With `sparsity_mask=True` the layer
holds a 0/1 mask of the kernel's non-zero entries (taken when `quantize_aware` cloned a pruned
layer) and uses `kernel * mask`, so pruned weights get no gradient and stay exactly 0.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_perf import _keras_internals as keras_internals
from keras_perf.quantization._quantizers import WEIGHT_BITS, check_bits, fake_quant_kernel

# Export: id(layer) -> numpy fake-quantized kernel, used as a constant while the model is
# traced for TFLite (per-channel fake-quant ops in the graph do not convert; see FACTS).
EXPORT_KERNELS: dict[int, object] = {}


class QuantizedKernelMixin:
    """What the quantized kernel layers share: config, mask, the quantized kernel.

    Listed first in each quantized class's bases, so its `__init__`, `build` and `get_config`
    wrap those of the float layer class it is mixed into.
    """

    def __init__(self, *args, **kwargs):
        weight_bits = kwargs.pop("weight_bits", 8)
        per_channel = kwargs.pop("per_channel", True)
        sparsity_mask = kwargs.pop("sparsity_mask", False)
        activation_quantizer = kwargs.pop("activation_quantizer", None)
        super().__init__(*args, **kwargs)
        self.weight_bits = check_bits("weight_bits", weight_bits, WEIGHT_BITS)
        self.per_channel = bool(per_channel)
        self.sparsity_mask = bool(sparsity_mask)
        # Name of the ActivationQuantizer that ends this layer's fused block (for the report).
        self.activation_quantizer = activation_quantizer
        self.kernel_mask = None

    def build(self, input_shape):
        super().build(input_shape)
        if self.sparsity_mask:
            self.kernel_mask = self.add_weight(
                shape=self.kernel.shape,
                initializer="ones",
                trainable=False,
                name="kernel_mask",
                dtype=self.kernel.dtype,
                autocast=False,
            )

    def get_config(self):
        return {
            **super().get_config(),
            "weight_bits": self.weight_bits,
            "per_channel": self.per_channel,
            "sparsity_mask": self.sparsity_mask,
            "activation_quantizer": self.activation_quantizer,
        }

    def save_own_variables(self, store):
        # Dense, EinsumDense and Conv save only their kernel and bias; the mask goes after them
        # (DepthwiseConv2D saves every variable, the mask last, already).
        super().save_own_variables(store)
        if self.kernel_mask is not None and len(store.keys()) < len(self.variables):
            store[str(len(store.keys()))] = self.kernel_mask

    def load_own_variables(self, store):
        super().load_own_variables(store)
        if self.kernel_mask is not None:
            self.kernel_mask.assign(store[str(len(store.keys()) - 1)])

    def channel_axes(self):
        """Axes of the kernel that index output channels (`None`: per-tensor)."""
        if not self.per_channel:
            return None
        return (len(self.kernel.shape) - 1,)

    def masked_kernel(self):
        """The kernel times its sparsity mask, in the variable's dtype (float32 under a mixed
        policy: fake quantization of the bfloat16/float16-rounded kernel with a half-precision
        scale would put the weights on another grid than the exported int8 file's)."""
        k = keras_internals.master_value(self.kernel)
        if self.kernel_mask is not None:
            k = ops.multiply(k, ops.cast(self.kernel_mask, k.dtype))
        return k

    def quantized_kernel(self):
        """The fake-quantized kernel this layer computes with."""
        constant = EXPORT_KERNELS.get(id(self))
        if constant is not None:
            return ops.cast(constant, self.compute_dtype)
        q = fake_quant_kernel(self.masked_kernel(), self.weight_bits, self.channel_axes())
        return ops.cast(q, self.compute_dtype)  # quantized in float32, rounded once

    def _finish(self, x):
        if self.activation is not None:
            x = self.activation(x)
        return x


@keras.saving.register_keras_serializable(package="keras_perf")
class QuantizedDense(QuantizedKernelMixin, keras.layers.Dense):
    """`keras.layers.Dense` with a fake-quantized kernel (see `kp.quantize_aware`)."""

    def call(self, inputs, training=None):
        # Traced for export, a (batch, steps, features) input is flattened around the matmul:
        # TFLite fuses MatMul and BiasAdd into one int8 FULLY_CONNECTED on 2-D inputs only
        # (Keras' tensordot puts a Reshape between them, whose tensor has no learned range).
        flat = id(self) in EXPORT_KERNELS and len(inputs.shape) > 2
        x = ops.reshape(inputs, (-1, inputs.shape[-1])) if flat else inputs
        x = ops.matmul(x, self.quantized_kernel())
        if self.bias is not None:
            x = ops.add(x, self.bias)
        if flat:
            x = ops.reshape(x, (*ops.shape(inputs)[:-1], self.units))
        return self._finish(x)


@keras.saving.register_keras_serializable(package="keras_perf")
class QuantizedEinsumDense(QuantizedKernelMixin, keras.layers.EinsumDense):
    """`keras.layers.EinsumDense` with a fake-quantized kernel (per channel: its last axis)."""

    def call(self, inputs, training=None):
        x = ops.einsum(self.equation, inputs, self.quantized_kernel())
        if self.bias is not None:
            x = ops.add(x, self.bias)
        return self._finish(x)


class _QuantizedConvMixin(QuantizedKernelMixin):
    def _conv(self, inputs, kernel):
        if self.padding == "causal":  # Conv1D only: pad on the left, then "valid".
            left = self.dilation_rate[0] * (self.kernel_size[0] - 1)
            pad = [[0, 0], [left, 0], [0, 0]]
            if self.data_format == "channels_first":
                pad = [[0, 0], [0, 0], [left, 0]]
            inputs = ops.pad(inputs, pad)
            return ops.conv(
                inputs,
                kernel,
                strides=list(self.strides),
                padding="valid",
                dilation_rate=self.dilation_rate,
                data_format=self.data_format,
            )
        return self.convolution_op(inputs, kernel)

    def _bias(self, x, channels):
        if not self.use_bias:
            return x
        if self.data_format == "channels_last":
            shape = (1,) * (self.rank + 1) + (channels,)
        else:
            shape = (1, channels) + (1,) * self.rank
        return ops.add(x, ops.reshape(self.bias, shape))

    def call(self, inputs):
        x = self._conv(inputs, self.quantized_kernel())
        return self._finish(self._bias(x, self.filters))


@keras.saving.register_keras_serializable(package="keras_perf")
class QuantizedConv1D(_QuantizedConvMixin, keras.layers.Conv1D):
    """`keras.layers.Conv1D` with a fake-quantized kernel (see `kp.quantize_aware`)."""


@keras.saving.register_keras_serializable(package="keras_perf")
class QuantizedConv2D(_QuantizedConvMixin, keras.layers.Conv2D):
    """`keras.layers.Conv2D` with a fake-quantized kernel (see `kp.quantize_aware`)."""


@keras.saving.register_keras_serializable(package="keras_perf")
class QuantizedConv3D(_QuantizedConvMixin, keras.layers.Conv3D):
    """`keras.layers.Conv3D` with a fake-quantized kernel (see `kp.quantize_aware`)."""


@keras.saving.register_keras_serializable(package="keras_perf")
class QuantizedDepthwiseConv2D(_QuantizedConvMixin, keras.layers.DepthwiseConv2D):
    """`keras.layers.DepthwiseConv2D` with a fake-quantized kernel; its channels are
    input channel x multiplier (the last two kernel axes), as TFLite quantizes them."""

    def channel_axes(self):
        if not self.per_channel:
            return None
        n = len(self.kernel.shape)
        return (n - 2, n - 1)

    def call(self, inputs):
        x = ops.depthwise_conv(
            inputs,
            self.quantized_kernel(),
            strides=self.strides,
            padding=self.padding,
            dilation_rate=self.dilation_rate,
            data_format=self.data_format,
        )
        return self._finish(self._bias(x, self.kernel.shape[-2] * self.kernel.shape[-1]))


@keras.saving.register_keras_serializable(package="keras_perf")
class QuantizedConv2DTranspose(_QuantizedConvMixin, keras.layers.Conv2DTranspose):
    """`keras.layers.Conv2DTranspose` with a fake-quantized kernel; its kernel is
    `(h, w, out, in)`, so the output channels are the kernel's axis -2."""

    def channel_axes(self):
        return None if not self.per_channel else (len(self.kernel.shape) - 2,)

    def call(self, inputs):
        x = ops.conv_transpose(
            inputs,
            self.quantized_kernel(),
            strides=list(self.strides),
            padding=self.padding,
            output_padding=self.output_padding,
            dilation_rate=self.dilation_rate,
            data_format=self.data_format,
        )
        return self._finish(self._bias(x, self.filters))


# Float class -> quantized class. Exact classes only: a user's subclass of Dense may have its
# own `call`, which the quantized class would silently drop.
QUANTIZED_CLASSES = {
    keras.layers.Dense: QuantizedDense,
    keras.layers.EinsumDense: QuantizedEinsumDense,
    keras.layers.Conv1D: QuantizedConv1D,
    keras.layers.Conv2D: QuantizedConv2D,
    keras.layers.Conv3D: QuantizedConv3D,
    keras.layers.DepthwiseConv2D: QuantizedDepthwiseConv2D,
    keras.layers.Conv2DTranspose: QuantizedConv2DTranspose,
}
