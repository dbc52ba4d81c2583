"""What an exporter needs to know of a quantization-aware model, from the quantization side.

- `is_quantized_model`: whether a model was made by `kp.quantize_aware` (public);
- `constant_kernels`: while a model is traced for export, its quantized layers use their
  fake-quantized kernels as constants. `keras_perf.export` (the TFLite QAT export,
  `keras_perf/export/_qat.py`) uses it; quantization never imports export.
"""

from __future__ import annotations

import contextlib

import keras

from keras_perf._utils import iter_layers
from keras_perf.quantization._layers import EXPORT_KERNELS, QuantizedKernelMixin
from keras_perf.quantization._quantizers import ActivationQuantizer, fake_quant_kernel


def is_quantized_model(model) -> bool:
    """Whether `model` (or a model nested in it) was made by `kp.quantize_aware`."""
    return any(
        isinstance(layer, (ActivationQuantizer, QuantizedKernelMixin))
        for layer in iter_layers(model)
    )


@contextlib.contextmanager
def constant_kernels(model):
    """While tracing for export, quantized layers use their fake-quantized kernels as
    constants (computed eagerly here)."""
    layers = [x for x in iter_layers(model) if isinstance(x, QuantizedKernelMixin)]
    for layer in layers:
        k = fake_quant_kernel(layer.masked_kernel(), layer.weight_bits, layer.channel_axes())
        EXPORT_KERNELS[id(layer)] = keras.ops.convert_to_numpy(k)
    try:
        yield
    finally:
        for layer in layers:
            EXPORT_KERNELS.pop(id(layer), None)
