"""`export_tflite`: a Keras 3 model to a TensorFlow Lite flatbuffer, with post-training quantization.

`export_tflite` converts a Keras 3 model to a TensorFlow Lite flatbuffer through a SavedModel:

- TensorFlow backend: Keras' own `model.export(format="tf_saved_model")`, then TFLite's
  converter.
- JAX backend: the same call, which Keras implements with `jax2tf`; the converter lowers it.
- PyTorch backend: Keras cannot write a SavedModel from torch without `torch_xla`, so the model
  is saved as a `.keras` file and converted by a child Python process running Keras on the
  TensorFlow backend (same architecture, same weights). Every layer must therefore be
  loadable by `keras.saving.load_model` in a fresh process (built-in Keras layers and
  keras-perf's own are; a custom layer must be registered in a module the child imports,
  see `custom_modules`).

This module holds the function and its flow only. Not here: the path and model-input checks
(`_checks`), the calibration data (`_calibration`), the child process (`_tensorflow_process`),
the file's metadata and report (`_metadata`), the converter itself (`keras_perf.export._tflite_lib`),
and a quantization-aware model's export (`_qat`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence

import keras

from keras_perf._imports import require
from keras_perf._utils import check_bool
from keras_perf.export import _tflite_lib as _tflite
from keras_perf.export._calibration import _calibration, _check_calibration, _dataset
from keras_perf.export._checks import (
    _check_export_arguments,
    _check_path,
    _input_count,
    _input_specs,
    _model_inputs,
    export_twin,
)
from keras_perf.export._errors import select_tf_ops_error
from keras_perf.export._metadata import METADATA_NAME, _report
from keras_perf.export._qat import export_quantized
from keras_perf.export._tensorflow_process import _export_via_tensorflow_process
from keras_perf.quantization import is_quantized_model

QUANTIZATIONS = _tflite.QUANTIZATIONS


def export_tflite(
    model: keras.Model,
    path: str | os.PathLike,
    quantization: str | None = None,
    representative_data=None,
    *,
    calibration_samples: int = 200,
    int8_io: bool = True,
    allow_select_tf_ops: bool = False,
    custom_modules: Sequence[str] = (),
) -> dict:
    """Convert a Keras model to a TensorFlow Lite file, optionally quantized after training.

    Quantization modes (TFLite post-training quantization):

    - `None`: float32 weights and activations.
    - `"dynamic"`: weights stored as int8, activations quantized on the fly; ~4x smaller.
    - `"float16"`: weights stored as float16; ~2x smaller, float32 in and out.
    - `"int8"`: full-integer: weights and activations int8, scales calibrated on
      `representative_data`; with `int8_io=True` the input and output tensors are int8 too
      (feed `round(x / scale + zero_point)`; `tflite_predict` does it for you).

    Everything that reaches TFLite's native converter is checked first, so that a bad
    argument is a `ValueError` rather than a crashed Python process: the calibration data
    (inputs, shapes, dtypes, finite values, at least one example), the path, and after an
    `"int8"` conversion the file itself (every inner tensor integer, finite scales). The
    model's input names in `model.inputs` order are stored in the file's metadata, so that
    `tflite_predict` takes inputs in the model's order.

    Args:
        model: A built Keras model (it has been called, or it has an `Input`).
        path: Where to write the `.tflite` file (its directory must exist and be writable).
        quantization: One of `None`, `"dynamic"`, `"float16"`, `"int8"`. Defaults to `None`.
        representative_data: Calibration inputs, required for `"int8"` and refused otherwise:
            an array of examples (first axis = examples) for a one-input model; for a
            multi-input model a list of arrays in `model.inputs` order or a dict keyed by
            input name; or a callable returning an iterable of samples (TFLite's
            `representative_dataset`), each sample a batch (usually of one) given the same
            way: an array, a list in `model.inputs` order, or a dict keyed by input name.
            Defaults to `None`.
        calibration_samples: How many examples of an array `representative_data` to
            calibrate on (the first ones; pass shuffled data). A callable's samples are all
            used. Defaults to `200`.
        int8_io: With `"int8"`, make the model's input and output tensors int8 (as
            microcontroller runtimes need); `False` keeps float32 in and out around the int8
            body. Defaults to `True`.
        allow_select_tf_ops: Let the converter keep ops that TFLite has no builtin kernel
            for as TensorFlow ops (TFLite's "select TF ops", e.g. the loop of an `LSTM` or
            `GRU`). The file then needs an interpreter linked with the Flex delegate (Android:
            `org.tensorflow:tensorflow-lite-select-tf-ops`); the report lists the ops under
            `select_tf_ops`. Defaults to `False`.
        custom_modules: PyTorch backend (and a quantization-aware model on JAX): modules the
            TensorFlow child process imports before loading the model, so that custom
            registered layers resolve.
            Defaults to `()`.

    Returns:
        A dict: `path`, `bytes` (file size), `quantization`, `input_dtype`, `output_dtype`
        (of the first input/output, e.g. `"int8"`), `input_quantization`,
        `output_quantization` (`(scale, zero_point)` or `None`), `inputs`/`outputs`: one
        dict per tensor in the file's order with `name`, `key` (its signature name: the
        Keras input name, or `output_0`... / the output dict key), `shape` (-1 for the batch
        dimension), `dtype`, `quantization`; `input_order` (input names in `model.inputs`
        order) and `select_tf_ops` (TensorFlow ops kept in the file; empty without
        `allow_select_tf_ops`).

    Raises:
        ValueError: `quantization` is not a known mode; `"int8"` without
            `representative_data`, or `representative_data` with another mode; the model is
            not built; `path`'s directory does not exist or is not writable; the
            calibration data does not match the model's inputs, is empty or not finite; the
            converter needs select TF ops and `allow_select_tf_ops` is off (the message
            names the recurrent layers); an `"int8"` conversion did not give a full-integer
            file; a quantization-aware model that was never trained, or whose layers TFLite
            cannot compute in int8 (named).
        TypeError: an argument has the wrong type.
        RuntimeError: PyTorch backend (or a quantization-aware model on JAX): the
            TensorFlow child process failed other than with a `ValueError` (its error is
            quoted).

    Example:
        >>> import keras, numpy as np, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> x = np.random.rand(64, 8).astype("float32")
        >>> report = kp.export_tflite(model, "m.tflite", "int8", representative_data=x)
        >>> report["input_dtype"], report["bytes"] < 10_000
        ('int8', True)
    """
    _check_export_arguments(model, path, quantization, QUANTIZATIONS, calibration_samples)
    check_bool("int8_io", int8_io)
    check_bool("allow_select_tf_ops", allow_select_tf_ops)
    if isinstance(custom_modules, str) or not all(isinstance(m, str) for m in custom_modules):
        raise TypeError(f"`custom_modules` must be a list of module names, got {custom_modules!r}.")
    if is_quantized_model(model):  # Learned ranges: its own converter settings.
        return export_quantized(
            model,
            path,
            quantization,
            representative_data,
            int8_io,
            allow_select_tf_ops,
            custom_modules,
        )
    if quantization == "int8" and representative_data is None:
        raise ValueError(
            "quantization='int8' (full-integer) needs `representative_data` to calibrate the "
            "activation ranges: pass ~100-500 training examples, e.g. "
            "`export_tflite(model, path, 'int8', representative_data=x_train[:200])`, or use "
            "quantization='dynamic', which needs no data."
        )
    if quantization != "int8" and representative_data is not None:
        # TF's converter does not ignore a representative dataset either: with optimizations
        # on it switches to integer quantization. Our modes are explicit, so refuse it.
        raise ValueError(
            f"`representative_data` is only used with quantization='int8'; got it with "
            f"quantization={quantization!r}. Drop it, or ask for 'int8'."
        )
    if not model.built or not _model_inputs(model):
        raise ValueError(
            "`model` is not built, so its input signature is unknown: start it with "
            "`keras.Input(shape)`, or call it once on a batch (`model(x[:1])`) before exporting."
        )
    path = _check_path(path)
    model = export_twin(model, "export_tflite")  # Mixed precision, JAX dropout: see export_twin.
    specs = _input_specs(model)  # None: a subclassed model, its signature is read on export.

    calibration = None
    if quantization == "int8":
        calibration = _calibration(representative_data, specs, _input_count(model))
        if not callable(representative_data):
            calibration = [a[:calibration_samples] for a in calibration]
        if specs is not None:
            _check_calibration(model, calibration, specs)

    require("tensorflow", "export_tflite")  # the converter is TensorFlow's on every backend
    if keras.backend.backend() == "torch":
        return _export_via_tensorflow_process(
            model,
            path,
            quantization,
            calibration,
            int8_io,
            allow_select_tf_ops,
            list(custom_modules),
        )

    known_order = True
    with tempfile.TemporaryDirectory() as saved_model_dir, _tflite.quiet_tensorflow_logs():
        with _tflite.state_as_weights(model):  # JAX: BatchNormalization's statistics.
            model.export(saved_model_dir, format="tf_saved_model", verbose=False)
        if specs is None:
            specs = _tflite.saved_model_inputs(saved_model_dir)
            if len(specs) > 1:
                known_order = False  # A subclassed model's argument order is not recorded.
            if calibration is not None:
                _check_calibration(model, calibration, specs)
        dataset = None
        if calibration is not None:
            dataset = _dataset(calibration, [name for name, _, _ in specs])
        try:
            content = _tflite.convert_saved_model(
                saved_model_dir, quantization, dataset, int8_io, allow_select_tf_ops
            )
        except _tflite.NeedsSelectTfOps as e:
            raise select_tf_ops_error(e, model) from None
    if quantization == "int8":
        problems = _tflite.integer_problems(content, int8_io, allow_select_tf_ops)
        if problems:
            raise ValueError(
                "quantization='int8' did not give a full-integer file, so nothing was written: "
                + "; ".join(problems)
                + ". Check `representative_data` (real, finite examples in the model's input "
                "range), or use quantization='dynamic'."
            )
    order = [name for name, _, _ in specs]
    keys = [d["key"] for d in _tflite.describe(content)[0]]
    if known_order and sorted(order) == sorted(k for k in keys if k is not None):
        # What lets `tflite_predict` take a list in `model.inputs` order.
        metadata = json.dumps({"inputs": order}).encode()
        content = _tflite.add_metadata(content, METADATA_NAME, metadata)
    path.write_bytes(content)
    return _report(path, content, quantization)
