"""What an exporter needs to know of a quantization-aware model, from the quantization side.

- `is_quantized_model`: whether a model was made by `kp.quantize_aware` (public);
- `check_learned_ranges`: whether its activation ranges can go into an int8 file (8 bits,
  learned in training), checked by every exporter before anything is written;
- `constant_kernels`: while a model is traced for export, its quantized layers use their
  fake-quantized kernels as constants. `keras_perf.export` (the TFLite QAT export,
  `keras_perf/export/_qat.py`) uses it; quantization never imports export.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np

from keras_perf._utils import iter_layers
from keras_perf.quantization._layers import EXPORT_KERNELS, QuantizedKernelMixin
from keras_perf.quantization._quantizers import ActivationQuantizer, fake_quant_kernel


def is_quantized_model(model) -> bool:
    """Whether `model` (or a model nested in it) was made by `kp.quantize_aware`."""
    return any(
        isinstance(layer, (ActivationQuantizer, QuantizedKernelMixin))
        for layer in iter_layers(model)
    )


def check_learned_ranges(model, exporter: str) -> None:
    """Raise a `ValueError` unless every activation quantizer of `model` has 8 bits and a range
    learned in training, naming the quantizers that do not and what to do.

    A quantizer still at its initial range `(-6, 6)` with `initialized == 0` has never been
    called in training; one whose training batches were all zero (a dead ReLU) has
    `initialized == 0` too but the range `[0, tiny]` it saw, which is its right range.
    """
    quantizers = [q for q in iter_layers(model) if isinstance(q, ActivationQuantizer)]
    bits = sorted({q.num_bits for q in quantizers} - {8})
    if bits:
        raise ValueError(
            f"{exporter} needs 8-bit activations; this model's activation quantizers have "
            f"{bits} bits. Make it with `quantize_aware(..., activation_bits=8)`."
        )
    untrained = []
    for q in quantizers:
        state = [float(keras.ops.convert_to_numpy(v)) for v in (q.initialized, q.min, q.max)]
        if np.array_equal(state, [0.0, -6.0, 6.0]):
            untrained.append(q.name)
    if untrained:
        more = f" (and {len(untrained) - 3} more)" if len(untrained) > 3 else ""
        raise ValueError(
            f"{exporter} writes the ranges learned in training, and the activation quantizers "
            f"{untrained[:3]}{more} have never seen a training batch: their ranges are still "
            "the initial (-6, 6). Nothing was written: train the model (fit) before exporting."
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
