"""TFLite export of a quantization-aware model: the learned ranges, no calibration data.

The file is built in a TensorFlow graph from the QAT model's weights and ranges: each
quantized kernel enters the graph as a constant, already fake-quantized in numpy (per-channel
fake-quant ops of a kernel do not convert, and the converter's own weight quantization then
finds the same integers), and each activation quantizer is TensorFlow's
`FakeQuantWithMinMaxVars` op with the learned range, which the converter reads. The converter
runs with `optimizations=[DEFAULT]` and no representative dataset (asking for the INT8 op set
alone raises without one). On JAX and PyTorch the model goes through a `.keras` file to a
child process running Keras on TensorFlow, as `export_tflite` does for PyTorch.

`export_tflite` (`_convert`) routes a model for which `kp.is_quantized_model` holds here. What
this module needs of the quantization side is `keras_perf.quantization._model`
(`constant_kernels`); export depends on quantization, never the reverse.
"""

from __future__ import annotations

import json
import re
import tempfile

import keras

from keras_perf.export import _tflite_lib as _tflite
from keras_perf.export._checks import _check_path, _input_specs, refuse_reduced_precision_qat
from keras_perf.export._errors import RECURRENT, describe_layers, graph_layers, select_tf_ops_error
from keras_perf.export._metadata import METADATA_NAME, _report
from keras_perf.export._tensorflow_process import _export_via_tensorflow_process
from keras_perf.quantization import ActivationQuantizer, check_learned_ranges, constant_kernels


def export_quantized(
    model, path, quantization, representative_data, int8_io, allow_select_tf_ops, custom_modules
) -> dict:
    """`export_tflite` for a QAT model (arguments already type-checked by the caller)."""
    if quantization != "int8":
        raise ValueError(
            "A quantization-aware model is exported with quantization='int8' (its learned "
            f"ranges); got quantization={quantization!r}. Export the float model for other modes."
        )
    if representative_data is not None:
        raise ValueError(
            "`representative_data` is not used for a quantization-aware model: its activation "
            "ranges were learned in training. Drop the argument."
        )
    if not model.built or not model.inputs:
        raise ValueError("`model` is not built; give it an `Input` before exporting.")
    refuse_reduced_precision_qat(model, "export_tflite")
    check_learned_ranges(model, "TFLite's int8 export")  # 8 bits, learned: before any file
    path = _check_path(path)
    if keras.backend.backend() != "tensorflow":
        return _export_via_tensorflow_process(
            model, path, quantization, None, int8_io, allow_select_tf_ops, list(custom_modules)
        )
    specs = _input_specs(model)
    with (
        tempfile.TemporaryDirectory() as saved_model_dir,
        _tflite.quiet_tensorflow_logs(),
        constant_kernels(model),
    ):
        model.export(saved_model_dir, format="tf_saved_model", verbose=False)
        try:
            content = _tflite.convert_saved_model(
                saved_model_dir, "qat_int8", None, int8_io, allow_select_tf_ops
            )
        except _tflite.NeedsSelectTfOps as e:
            raise select_tf_ops_error(e, model, quantized=True) from None
    in_float = _layers_in_float(model, content, allow_select_tf_ops)
    if in_float:
        raise ValueError(
            "TFLite cannot compute these layers of the quantization-aware model in int8: "
            f"{describe_layers(in_float)}. Nothing was written. `quantize_aware` learns a "
            "range for each "
            "layer's output, and TFLite's int8 kernels need one for every tensor inside these "
            "layers too (attention scores, normalization statistics...); the converter would "
            "leave them in float. Export the float model instead: `export_tflite(model, path, "
            "quantization='dynamic')` (int8 weights, float activations) needs no ranges, and "
            "post-training `quantization='int8'` with `representative_data` calibrates the "
            "tensors inside a layer where TFLite has int8 kernels for them."
        )
    problems = _tflite.integer_problems(content, int8_io, allow_select_tf_ops)
    if problems:
        raise ValueError(
            "The quantization-aware model did not convert to a full-integer file, so nothing "
            "was written: " + "; ".join(problems) + ". Every tensor needs a learned range: "
            "quantize layers TFLite has int8 kernels for."
        )
    order = [name for name, _, _ in specs]
    keys = [d["key"] for d in _tflite.describe(content)[0]]
    if sorted(order) == sorted(k for k in keys if k is not None):
        metadata = json.dumps({"inputs": order}).encode()
        content = _tflite.add_metadata(content, METADATA_NAME, metadata)
    path.write_bytes(content)
    return _report(path, content, quantization)


def _layers_in_float(model, content: bytes, select_tf_ops: bool) -> list:
    """The model's layers with float32 tensors in the file, found by the tensors' names
    (`<model>_1/<layer>_1/<op>`, fused ops joined by `;`). With select TF ops a recurrent
    layer's loop is float by design (Flex ops), so it is not listed."""
    by_name = {
        layer.name: layer
        for layer in graph_layers(model)
        if not isinstance(layer, (ActivationQuantizer, keras.layers.InputLayer))
    }
    found = set()
    for tensor in _tflite.float_tensors(content):
        for op in tensor.split(";"):
            parts = op.split("/")
            if parts and _scope_name(parts[0]) == model.name:
                parts = parts[1:]  # The model's own scope.
            layer = _layer_of(parts, by_name)
            if layer is not None:
                found.add(layer.name)
                break
    return [
        layer
        for layer in by_name.values()  # The model's order.
        if layer.name in found and not (select_tf_ops and isinstance(layer, RECURRENT))
    ]


def _layer_of(parts: list[str], by_name: dict):
    """The first layer named by a scope in `parts` (`ln1_1`, or `dense_1` itself), or None."""
    for part in parts:
        for name in (_scope_name(part), part):
            if name in by_name:
                return by_name[name]
    return None


def _scope_name(part: str) -> str:
    """A layer's name from its name scope in the graph (`ln1_1` -> `ln1`)."""
    return re.sub(r"_\d+$", "", part)
