"""Quantization-aware training (QAT) for Keras 3 on every backend.

- `_quantizers`: fake quantization of kernels and activations (`ActivationQuantizer`).
- `_layers`: Dense/EinsumDense/Conv/DepthwiseConv/Conv2DTranspose subclasses with fake-quantized kernels.
- `_wrap`: `quantize_aware`, the clone that places the quantizers.
- `_report`: `quantization_report`.
- `_model`: `is_quantized_model`, and `constant_kernels` for an exporter's trace.

What the exporters read is re-exported below as package-internal names.

Not here: the TFLite int8 export from learned ranges (`keras_perf.export._qat`, where
`export_tflite` routes a quantization-aware model). Export depends on quantization; this
package never imports `keras_perf.export`.
"""

# The `name as name` imports are package-internal (not in `__all__`, not in API.md), as optax
# re-exports its internals: what the QAT exporters (`keras_perf.export._qat`, `_onnx_qat`) read of a quantization-aware model.
# They stay here, where they are defined and tested with the layers they describe; export sits
# above quantization and imports them from this package, never from its modules.
from keras_perf.quantization._layers import QUANTIZED_CLASSES as QUANTIZED_CLASSES
from keras_perf.quantization._layers import (
    QuantizedConv1D,
    QuantizedConv2D,
    QuantizedConv2DTranspose,
    QuantizedConv3D,
    QuantizedDense,
    QuantizedDepthwiseConv2D,
    QuantizedEinsumDense,
)
from keras_perf.quantization._layers import QuantizedKernelMixin as QuantizedKernelMixin
from keras_perf.quantization._model import check_learned_ranges as check_learned_ranges
from keras_perf.quantization._model import constant_kernels as constant_kernels
from keras_perf.quantization._model import is_quantized_model
from keras_perf.quantization._quantizers import ActivationQuantizer
from keras_perf.quantization._quantizers import fake_quant_kernel as fake_quant_kernel
from keras_perf.quantization._report import quantization_report
from keras_perf.quantization._wrap import function_name as function_name
from keras_perf.quantization._wrap import layer_graph as layer_graph
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
