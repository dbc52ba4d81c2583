"""Deployment: TFLite export with post-training quantization, and a model-size report.

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

`compression_report` counts parameters, non-zero parameters, raw bytes and gzip bytes per
layer, as the TensorFlow Model Optimization pruning tutorial measures a pruned model's size.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import keras
import numpy as np

from keras_perf._imports import require
from keras_perf._utils import check_bool, check_choice, check_int, iter_layers
from keras_perf.backend import tflite as _tflite

__all__ = ["compression_report", "export_tflite", "tflite_predict"]

QUANTIZATIONS = _tflite.QUANTIZATIONS


# ----------------------------------------------------------------------------------------------
# export_tflite
# ----------------------------------------------------------------------------------------------


def export_tflite(
    model: keras.Model,
    path: str | os.PathLike,
    quantization: str | None = None,
    representative_data=None,
    *,
    calibration_samples: int = 200,
    int8_io: bool = True,
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

    Args:
        model: A built Keras model (it has been called, or it has an `Input`).
        path: Where to write the `.tflite` file (parent directory must exist).
        quantization: One of `None`, `"dynamic"`, `"float16"`, `"int8"`. Defaults to `None`.
        representative_data: Calibration inputs, required for `"int8"` and refused otherwise:
            an array of examples (first axis = examples) for a one-input model, a list of
            arrays (model input order) for a multi-input model, or a callable returning an
            iterable of samples in TFLite's `representative_dataset` format (each sample a
            list with one batch-of-one array per input). Defaults to `None`.
        calibration_samples: How many examples of an array `representative_data` to
            calibrate on (the first ones; pass shuffled data). Defaults to `200`.
        int8_io: With `"int8"`, make the model's input and output tensors int8 (as
            microcontroller runtimes need); `False` keeps float32 in and out around the int8
            body. Defaults to `True`.
        custom_modules: PyTorch backend only: modules the TensorFlow child process imports
            before loading the model, so that custom registered layers resolve.
            Defaults to `()`.

    Returns:
        A dict: `path`, `bytes` (file size), `quantization`, `input_dtype`, `output_dtype`
        (of the first input/output, e.g. `"int8"`), `input_quantization`,
        `output_quantization` (`(scale, zero_point)` or `None`), and `inputs`/`outputs`: one
        dict per tensor with `name`, `shape` (-1 for the batch dimension), `dtype`,
        `quantization`.

    Raises:
        ValueError: `quantization` is not a known mode; `"int8"` without
            `representative_data`, or `representative_data` with another mode; the model is
            not built; `representative_data` does not match the model's inputs.
        TypeError: a keyword argument has the wrong type.
        RuntimeError: PyTorch backend: the TensorFlow child process failed (its error is
            quoted).

    Example:
        >>> import keras, numpy as np, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> x = np.random.rand(64, 8).astype("float32")
        >>> report = kp.export_tflite(model, "/tmp/m.tflite", "int8", representative_data=x)
        >>> report["input_dtype"], report["bytes"] < 10_000
        ('int8', True)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a str or path-like, got {type(path).__name__}.")
    check_choice("quantization", quantization, QUANTIZATIONS)
    check_int("calibration_samples", calibration_samples, minimum=1)
    check_bool("int8_io", int8_io)
    if isinstance(custom_modules, str) or not all(isinstance(m, str) for m in custom_modules):
        raise TypeError(f"`custom_modules` must be a list of module names, got {custom_modules!r}.")
    if quantization == "int8" and representative_data is None:
        raise ValueError(
            "quantization='int8' (full-integer) needs `representative_data` to calibrate the "
            "activation ranges: pass ~100-500 training examples, e.g. "
            "`export_tflite(model, path, 'int8', representative_data=x_train[:200])`, or use "
            "quantization='dynamic', which needs no data."
        )
    if quantization != "int8" and representative_data is not None:
        raise ValueError(
            f"`representative_data` is only used with quantization='int8'; got it with "
            f"quantization={quantization!r}. Drop it, or ask for 'int8'."
        )
    if not model.built or not _model_inputs(model):
        raise ValueError(
            "`model` is not built, so its input signature is unknown: start it with "
            "`keras.Input(shape)`, or call it once on a batch (`model(x[:1])`) before exporting."
        )
    path = Path(path)
    if not path.parent.exists():
        raise ValueError(f"`path`'s directory {str(path.parent)!r} does not exist.")

    arrays = None
    if quantization == "int8" and not callable(representative_data):
        arrays = _calibration_arrays(model, representative_data, calibration_samples)

    require("tensorflow", "export_tflite")  # the converter is TensorFlow's on every backend
    if keras.backend.backend() == "torch":
        return _export_via_tensorflow_process(
            model, path, quantization, arrays, int8_io, list(custom_modules)
        )

    dataset = None
    if quantization == "int8":
        dataset = representative_data if arrays is None else _dataset(arrays)
    with tempfile.TemporaryDirectory() as saved_model_dir, _tflite.quiet_tensorflow_logs():
        model.export(saved_model_dir, format="tf_saved_model", verbose=False)
        content = _tflite.convert_saved_model(saved_model_dir, quantization, dataset, int8_io)
    path.write_bytes(content)
    return _report(path, content, quantization)


def _model_inputs(model) -> list:
    try:
        return list(model.inputs or [])
    except (AttributeError, ValueError):
        # A subclassed model called on data has no symbolic inputs but Keras can still
        # derive an input signature from its build shapes.
        return [None]


def _input_count(model) -> int:
    try:
        return len(model.inputs) if model.inputs else 1
    except (AttributeError, ValueError):
        return 1


def _calibration_arrays(model, data, samples: int) -> list[np.ndarray]:
    n_inputs = _input_count(model)
    if n_inputs == 1:
        arrays = [np.asarray(data, dtype="float32")]
    else:
        if not isinstance(data, (list, tuple)) or len(data) != n_inputs:
            raise ValueError(
                f"The model has {n_inputs} inputs, so `representative_data` must be a list of "
                f"{n_inputs} arrays (model input order) or a callable; got {type(data).__name__}."
            )
        arrays = [np.asarray(a, dtype="float32") for a in data]
    lengths = {len(a) for a in arrays} if all(a.ndim for a in arrays) else {0}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            "`representative_data` must hold at least one example per input, with the same "
            f"number of examples for every input; got shapes {[a.shape for a in arrays]}."
        )
    return [a[:samples] for a in arrays]


def _dataset(arrays: list[np.ndarray]) -> Callable:
    def dataset():
        for i in range(len(arrays[0])):
            yield [a[i : i + 1] for a in arrays]

    return dataset


def _report(path: Path, content: bytes, quantization) -> dict:
    inputs, outputs = _tflite.describe(content)
    return {
        "path": str(path),
        "bytes": len(content),
        "quantization": quantization,
        "input_dtype": inputs[0]["dtype"],
        "output_dtype": outputs[0]["dtype"],
        "input_quantization": inputs[0]["quantization"],
        "output_quantization": outputs[0]["quantization"],
        "inputs": inputs,
        "outputs": outputs,
    }


_CHILD = """
import importlib, json, sys
import numpy as np
args = json.loads(sys.argv[1])
for name in args["custom_modules"]:
    importlib.import_module(name)
import keras, keras_perf
model = keras.saving.load_model(args["model"], compile=False)
data = None
if args["data"] is not None:
    data = [np.load(p) for p in args["data"]]
    data = data[0] if len(data) == 1 else data
report = keras_perf.export_tflite(
    model, args["path"], args["quantization"], data,
    calibration_samples=args["calibration_samples"], int8_io=args["int8_io"])
print("KERAS_PERF_REPORT " + json.dumps(report))
"""


def _export_via_tensorflow_process(
    model, path, quantization, arrays, int8_io, custom_modules
) -> dict:
    if quantization == "int8" and arrays is None:
        raise ValueError(
            "On the PyTorch backend the conversion runs in a TensorFlow child process, so "
            "`representative_data` must be arrays, not a callable."
        )
    with tempfile.TemporaryDirectory() as tmp:
        model_file = os.path.join(tmp, "model.keras")
        try:
            model.save(model_file)
        except Exception as e:
            raise ValueError(
                "On the PyTorch backend export_tflite saves the model as a .keras file and "
                "converts it with Keras on TensorFlow in a child process, but this model "
                f"could not be saved ({type(e).__name__}: {e}). Give custom layers/models a "
                "`get_config`, or export from the TensorFlow or JAX backend."
            ) from e
        data_files = None
        if arrays is not None:
            data_files = []
            for i, a in enumerate(arrays):
                data_files.append(os.path.join(tmp, f"data{i}.npy"))
                np.save(data_files[-1], a)
        args = {
            "model": model_file,
            "path": str(path),
            "quantization": quantization,
            "data": data_files,
            "calibration_samples": len(arrays[0]) if arrays else 1,
            "int8_io": int8_io,
            "custom_modules": custom_modules,
        }
        env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
        # The child must import this very keras_perf (a checkout may shadow an install).
        package_root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH")) if p
        )
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(args)],
            env=env, capture_output=True, text=True, check=False,
        )
    for line in proc.stdout.splitlines():
        if line.startswith("KERAS_PERF_REPORT "):
            report = json.loads(line[len("KERAS_PERF_REPORT "):])
            for key in ("input_quantization", "output_quantization"):
                if report[key] is not None:
                    report[key] = tuple(report[key])
            for entry in report["inputs"] + report["outputs"]:
                if entry["quantization"] is not None:
                    entry["quantization"] = tuple(entry["quantization"])
            return report
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    raise RuntimeError(
        "TFLite export on the PyTorch backend runs Keras on TensorFlow in a child process to "
        f"convert the saved model, and that process failed (exit code {proc.returncode}). "
        "If the model has custom layers, name the modules registering them in "
        f"`custom_modules`. Its last output:\n{tail}"
    )


# ----------------------------------------------------------------------------------------------
# tflite_predict
# ----------------------------------------------------------------------------------------------


def tflite_predict(path: str | os.PathLike | bytes, x, batch_size: int = 256, num_threads=None):
    """Run a `.tflite` model on `x` and return float outputs, like `model.predict`.

    Int8 inputs are quantized with the file's own scale and zero point, and int8 outputs
    dequantized, so the result compares directly with the Keras model's predictions. Uses
    `ai_edge_litert`'s interpreter when installed, else `tf.lite.Interpreter`.

    Args:
        path: The `.tflite` file, or its contents as bytes.
        x: An array (one-input model) or a list of arrays in the file's input order.
        batch_size: Examples per interpreter call. Defaults to `256`.
        num_threads: Interpreter threads, `None` for TFLite's default. Defaults to `None`.

    Returns:
        A float array of outputs (a list of arrays when the model has several outputs).

    Raises:
        TypeError: `batch_size` or `num_threads` is not an int.
        ValueError: `batch_size`/`num_threads` below 1; the number of input arrays does not
            match the model's inputs.

    Example:
        >>> import keras, numpy as np, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> _ = kp.export_tflite(model, "/tmp/m.tflite")
        >>> x = np.random.rand(5, 8).astype("float32")
        >>> bool(np.allclose(kp.tflite_predict("/tmp/m.tflite", x), model.predict(x, verbose=0),
        ...                  atol=1e-5))
        True
    """
    check_int("batch_size", batch_size, minimum=1)
    check_int("num_threads", num_threads, minimum=1, allow_none=True)
    content = path if isinstance(path, bytes) else Path(path).read_bytes()
    inputs = [np.asarray(a) for a in x] if isinstance(x, (list, tuple)) else [np.asarray(x)]
    in_details, _ = _tflite.describe(content)
    if len(inputs) != len(in_details):
        raise ValueError(
            f"The TFLite model has {len(in_details)} inputs "
            f"({', '.join(d['name'] for d in in_details)}); got {len(inputs)} arrays."
        )
    outputs = _tflite.predict(content, inputs, batch_size, num_threads)
    return outputs[0] if len(outputs) == 1 else outputs


# ----------------------------------------------------------------------------------------------
# compression_report
# ----------------------------------------------------------------------------------------------


def compression_report(model: keras.Model, compresslevel: int = 9) -> dict:
    """Count parameters, non-zero parameters, raw bytes and gzip bytes, per layer and in total.

    Pruning leaves a weight tensor's size unchanged; what shrinks is how well it compresses.
    The tfmot pruning tutorial measures that by gzipping the saved model; this report gzips
    the raw weight bytes (no file-format overhead), per layer and for the whole model. Every
    weight is counted once (trainable or not, e.g. BatchNorm statistics), under the innermost
    layer that owns it; optimizer state is not part of a model's size and is left out.

    Args:
        model: A built Keras model (or layer).
        compresslevel: gzip level, 1 (fast) to 9 (smallest). Defaults to `9`.

    Returns:
        A dict with `layers`, a list with one dict per layer that owns weights (`name`,
        `class`, `params`, `nonzero`, `sparsity`, `bytes`, `gzip_bytes`), and `total`, the
        same counts for the whole model (`gzip_bytes` of all weights compressed together,
        plus `compression_ratio` = `bytes / gzip_bytes`).

    Raises:
        TypeError: `model` is not a Keras layer or model; `compresslevel` is not an int.
        ValueError: `compresslevel` outside 1-9; the model is not built.

    Example:
        >>> import keras, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> report = kp.compression_report(model)
        >>> report["total"]["params"], report["layers"][0]["class"]
        (27, 'Dense')
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model or layer, got {type(model).__name__}.")
    check_int("compresslevel", compresslevel, minimum=1)
    if compresslevel > 9:
        raise ValueError(f"`compresslevel` must be an integer in [1, 9], got {compresslevel}.")
    if not model.built:
        raise ValueError(
            "`model` is not built, so it has no weights yet: start it with `keras.Input(shape)` "
            "or call it once on a batch before asking for its compression report."
        )

    owner = {}  # id(variable) -> layer; pre-order traversal, so the innermost owner wins.
    variables = {}
    for layer in [model, *iter_layers(model)]:
        for v in layer.weights:
            owner[id(v)] = layer
            variables[id(v)] = v

    rows = {}
    blobs = []
    for vid, v in variables.items():
        layer = owner[vid]
        value = np.asarray(keras.ops.convert_to_numpy(v.value))
        raw = np.ascontiguousarray(value).tobytes()
        row = rows.setdefault(
            id(layer),
            {"name": layer.name, "class": type(layer).__name__, "params": 0, "nonzero": 0,
             "bytes": 0, "_blobs": []},
        )
        row["params"] += int(value.size)
        row["nonzero"] += int(np.count_nonzero(value))
        row["bytes"] += len(raw)
        row["_blobs"].append(raw)
        blobs.append(raw)

    layers = []
    for row in rows.values():
        data = b"".join(row.pop("_blobs"))
        row["gzip_bytes"] = len(gzip.compress(data, compresslevel=compresslevel, mtime=0))
        row["sparsity"] = _sparsity(row["params"], row["nonzero"])
        layers.append(row)
    params = sum(r["params"] for r in layers)
    nonzero = sum(r["nonzero"] for r in layers)
    raw_bytes = sum(r["bytes"] for r in layers)
    gz = len(gzip.compress(b"".join(blobs), compresslevel=compresslevel, mtime=0))
    total = {
        "params": params,
        "nonzero": nonzero,
        "sparsity": _sparsity(params, nonzero),
        "bytes": raw_bytes,
        "gzip_bytes": gz,
        "compression_ratio": raw_bytes / gz if gz else 1.0,
    }
    return {"layers": layers, "total": total}


def _sparsity(params: int, nonzero: int) -> float:
    return 1.0 - nonzero / params if params else 0.0
