"""Deployment: TFLite and ONNX export, their runners, the model-size and inference reports.

Public names: `export_tflite`, `tflite_predict`, `compression_report`, `export_onnx`,
`onnx_predict`, `inference_report` (`InferenceReport`).

The parts:

- `_convert`: `export_tflite`, its argument checks and flow (TF and JAX convert in process);
- `_checks`: the output path and the model's input signature, checked before converting;
- `_errors`: a failed conversion's `ValueError`, naming the layers at fault;
- `_calibration`: `representative_data` of an `"int8"` export, read, checked and fed;
- `_tensorflow_process`: the conversion in a TensorFlow child process (PyTorch; QAT on JAX);
- `_metadata`: the input order stored in a written file, and the report `export_tflite` returns;
- `_predict`: `tflite_predict` and the matching of its inputs to the file's;
- `_compression`: `compression_report`;
- `_qat`: the int8 TFLite export of a quantization-aware model from its learned ranges (export
  depends on `keras_perf.quantization`; quantization never imports export);
- `_onnx`, `_onnx_predict`: `export_onnx` and `onnx_predict`, their argument checks and flow;
  `_onnx_qat`: a quantization-aware model's learned ranges in the ONNX file;
- `_tflite_lib`: the TFLite converter and interpreter calls (TensorFlow imported lazily);
- the ONNX library calls, one module per concern (onnx/onnxruntime imported lazily):
  `_onnx_export` (Keras' `model.export(format="onnx")`, its exporter per Keras backend in
  `EXPORTERS`, and what the `onnx` extra must hold), `_onnx_graph` (the proto's reads and
  rewrites, the checks of a quantized file), `_onnx_quantize` (ONNX Runtime's pre-processing,
  calibration reader and quantization), `_onnx_session` (ONNX Runtime's sessions, and the int8
  kernels that saturate on a CPU without VNNI). They and `_tflite_lib` serve every Keras
  backend, so they live here, with their only user, and not in `keras_perf/backend/` (the
  Keras-backend dispatch alone);
- `_inference_report`: `inference_report`, every format timed side by side.
"""

from __future__ import annotations

from keras_perf.export._compression import compression_report
from keras_perf.export._convert import export_tflite
from keras_perf.export._inference_report import InferenceReport, inference_report

# Package-internal (not in `__all__`): the formats `inference_report` can time on this
# install, which the demo's deployment lever names before it runs the report.
from keras_perf.export._inference_report import available_formats as available_formats
from keras_perf.export._onnx import export_onnx
from keras_perf.export._onnx_predict import onnx_predict
from keras_perf.export._predict import tflite_predict

__all__ = [
    "InferenceReport",
    "compression_report",
    "export_onnx",
    "export_tflite",
    "inference_report",
    "onnx_predict",
    "tflite_predict",
]
