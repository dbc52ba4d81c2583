"""Quantization-aware training (QAT) for Keras 3 on every backend.

- `_quantizers`: fake quantization of kernels and activations (`ActivationQuantizer`).
- `_layers`: Dense/EinsumDense/Conv/DepthwiseConv/Conv2DTranspose subclasses with fake-quantized kernels.
- `_wrap`: `quantize_aware`, the clone that places the quantizers.
- `_report`: `quantization_report`.
- `_model`: `is_quantized_model`, and `constant_kernels` for an exporter's trace.

Not here: the TFLite int8 export from learned ranges (`keras_perf.export._qat`, where
`export_tflite` routes a quantization-aware model). Export depends on quantization; this
package never imports `keras_perf.export`.
"""

from keras_perf.quantization._layers import (
    QuantizedConv1D,
    QuantizedConv2D,
    QuantizedConv2DTranspose,
    QuantizedConv3D,
    QuantizedDense,
    QuantizedDepthwiseConv2D,
    QuantizedEinsumDense,
)
from keras_perf.quantization._model import is_quantized_model
from keras_perf.quantization._quantizers import ActivationQuantizer
from keras_perf.quantization._report import quantization_report
from keras_perf.quantization._wrap import quantize_aware

__all__ = [
    "ActivationQuantizer",
    "QuantizedConv1D",
    "QuantizedConv2D",
    "QuantizedConv2DTranspose",
    "QuantizedConv3D",
    "QuantizedDense",
    "QuantizedDepthwiseConv2D",
    "QuantizedEinsumDense",
    "is_quantized_model",
    "quantization_report",
    "quantize_aware",
]
