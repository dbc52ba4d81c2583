"""Deployment: TFLite export with post-training quantization, and a model-size report.

Public names: `export_tflite`, `tflite_predict`, `compression_report`.

The parts:

- `_convert`: `export_tflite`, its argument checks and flow (TF and JAX convert in process);
- `_checks`: the output path and the model's input signature, checked before converting;
- `_calibration`: `representative_data` of an `"int8"` export, read, checked and fed;
- `_tensorflow_process`: the PyTorch backend's conversion in a TensorFlow child process;
- `_metadata`: the input order stored in a written file, and the report `export_tflite` returns;
- `_predict`: `tflite_predict` and the matching of its inputs to the file's;
- `_compression`: `compression_report`.

Not here: the TFLite converter and interpreter calls (`keras_perf.backend.tflite`) and the
export of a quantization-aware model (`keras_perf.quantization._export`).
"""

from __future__ import annotations

from keras_perf.export._compression import compression_report
from keras_perf.export._convert import export_tflite
from keras_perf.export._predict import tflite_predict

__all__ = ["compression_report", "export_tflite", "tflite_predict"]
