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
        custom_modules: PyTorch backend only: modules the TensorFlow child process imports
            before loading the model, so that custom registered layers resolve.
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
            converter needs select TF ops and `allow_select_tf_ops` is off; an `"int8"`
            conversion did not give a full-integer file.
        TypeError: an argument has the wrong type.
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
    if quantization is not None and not isinstance(quantization, str):
        raise TypeError(
            f"`quantization` must be None or one of {QUANTIZATIONS[1:]}, got "
            f"{type(quantization).__name__}."
        )
    check_choice("quantization", quantization, QUANTIZATIONS)
    check_int("calibration_samples", calibration_samples, minimum=1)
    check_bool("int8_io", int8_io)
    check_bool("allow_select_tf_ops", allow_select_tf_ops)
    if isinstance(custom_modules, str) or not all(isinstance(m, str) for m in custom_modules):
        raise TypeError(f"`custom_modules` must be a list of module names, got {custom_modules!r}.")
    from keras_perf import quantization as _quantization

    if _quantization.is_quantized_model(model):  # Learned ranges: its own converter settings.
        return _quantization.export_quantized(
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
            raise ValueError(
                "TFLite's builtin ops cannot express this model (e.g. the loop of an LSTM/GRU "
                "with a free batch size); the converter said:\n"
                + _last_lines(str(e), 3)
                + "\nPass `allow_select_tf_ops=True` to keep those ops as TensorFlow ops; "
                "the file then needs an interpreter linked with the Flex delegate (Android: "
                "`org.tensorflow:tensorflow-lite-select-tf-ops`)."
            ) from None
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


METADATA_NAME = "keras_perf"


def _check_path(path) -> Path:
    path = Path(path)
    parent = path.parent
    if not parent.exists():
        raise ValueError(f"`path`'s directory {str(parent)!r} does not exist; create it first.")
    if not parent.is_dir():
        raise ValueError(f"`path`'s parent {str(parent)!r} is not a directory.")
    if path.is_dir():
        raise ValueError(f"`path` {str(path)!r} is a directory; give a file name (`m.tflite`).")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".keras_perf_probe_"):
            pass
    except OSError as e:
        raise ValueError(
            f"`path`'s directory {str(parent)!r} is not writable ({type(e).__name__}: {e})."
        ) from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"`path` {str(path)!r} exists and is not writable.")
    return path


def _last_lines(text: str, n: int) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


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


def _input_specs(model) -> list[tuple] | None:
    """`(name, shape, dtype)` per input in `model.inputs` order; `None` for a subclassed model.

    The names are the ones `model.export` gives the SavedModel signature, so the TFLite
    file's signature too.
    """
    try:
        inputs = list(model.inputs or [])
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    return [(t.name, tuple(t.shape), str(t.dtype)) for t in inputs]


def _calibration(data, specs, n_inputs: int) -> list[np.ndarray]:
    """`representative_data` as one array per input, in `model.inputs` order (unchecked)."""
    names = None if specs is None else [name for name, _, _ in specs]
    if not callable(data):
        return _per_input(data, names, n_inputs, "`representative_data`")
    samples = data()
    try:
        iterator = iter(samples)
    except TypeError:
        raise TypeError(
            "A callable `representative_data` must return an iterable of samples (e.g. be a "
            f"generator function); it returned {type(samples).__name__}."
        ) from None
    columns = None
    for i, sample in enumerate(iterator):
        if isinstance(sample, tuple) and len(sample) == 2 and isinstance(sample[1], dict):
            sample = sample[1]  # TFLite's (signature_key, {name: array}) form.
        arrays = _per_input(sample, names, n_inputs, f"`representative_data` sample {i}")
        if columns is None:
            columns = [[] for _ in arrays]
        for column, a in zip(columns, arrays):
            if a.ndim == 0:
                raise ValueError(
                    f"`representative_data` sample {i} holds a scalar; each sample must be a "
                    "batch (usually of one example: `x[i:i+1]`)."
                )
            column.append(a)
    if columns is None:
        raise ValueError(
            "`representative_data` yielded no samples, so there is nothing to calibrate on "
            "(the converter would return a float model). Is the generator already exhausted? "
            "Pass a function that creates a new generator on each call, or an array."
        )
    out = []
    for k, column in enumerate(columns):
        shapes = {a.shape[1:] for a in column}
        if len(shapes) != 1:
            raise ValueError(
                f"`representative_data` samples disagree on the shape of input "
                f"{_input_label(names, k)}: {sorted(shapes)} (batch axis left out)."
            )
        out.append(np.concatenate(column, axis=0))
    return out


def _input_label(names, k: int) -> str:
    return f"{k} ({names[k]!r})" if names else str(k)


def _per_input(data, names, n_inputs: int, what: str) -> list[np.ndarray]:
    """Arrays in `model.inputs` order from an array, a list (that order) or a name-keyed dict."""
    if isinstance(data, dict):
        if names is None:
            if len(data) != 1:
                raise ValueError(f"{what}: the model has 1 input; got a dict of {len(data)}.")
            return [_as_array(next(iter(data.values())), what)]
        if set(data) != set(names):
            raise ValueError(
                f"{what} is a dict with keys {sorted(map(str, data))}; the model's inputs are "
                f"named {names} (`model.inputs` order): give exactly those keys."
            )
        return [_as_array(data[name], f"{what}[{name!r}]") for name in names]
    if n_inputs == 1:
        if isinstance(data, (list, tuple)) and len(data) == 1 and hasattr(data[0], "shape"):
            data = data[0]  # [array]: the one input's batch, TFLite's sample format.
        return [_as_array(data, what)]
    if not isinstance(data, (list, tuple)) or len(data) != n_inputs:
        got = f"{len(data)} items" if isinstance(data, (list, tuple)) else type(data).__name__
        raise ValueError(
            f"The model has {n_inputs} inputs ({', '.join(map(repr, names or []))}), so {what} "
            f"must be a list of {n_inputs} arrays (model input order) or a dict keyed by input "
            f"name; got {got}."
        )
    return [
        _as_array(a, f"{what}[{k}] (input {_input_label(names, k)})") for k, a in enumerate(data)
    ]


def _as_array(value, what: str) -> np.ndarray:
    try:
        array = np.asarray(value)
    except Exception as e:  # ragged nested lists and the like.
        raise ValueError(f"{what} cannot be read as an array ({type(e).__name__}: {e}).") from e
    if array.dtype.kind not in "biuf":
        raise ValueError(
            f"{what} has dtype {array.dtype}; calibration data must be numbers (bool, integer "
            "or floating point)."
        )
    return array


def _check_calibration(model, arrays: list[np.ndarray], specs: list[tuple]) -> None:
    """Shapes, example counts and finiteness of calibration arrays against the model's inputs,
    then the model's outputs on them: what TFLite's calibrator would crash or fail on."""
    names = [name for name, _, _ in specs]
    if len(arrays) != len(specs):
        raise ValueError(
            f"The model has {len(specs)} inputs ({names}); `representative_data` gives "
            f"{len(arrays)}."
        )
    for k, (a, (_, shape, dtype)) in enumerate(zip(arrays, specs)):
        label = f"input {_input_label(names, k)}"
        expected = "(" + ", ".join(["examples"] + [str(d) for d in shape[1:]]) + ")"
        if a.ndim != len(shape) or any(
            d is not None and d != g for d, g in zip(shape[1:], a.shape[1:])
        ):
            raise ValueError(
                f"`representative_data` for {label}: expected shape {expected}, got {a.shape}."
            )
        if len(a) == 0:
            raise ValueError(
                f"`representative_data` for {label} holds no examples (shape {a.shape}); "
                "calibration needs at least one example per input."
            )
        with np.errstate(over="ignore", invalid="ignore"):
            a = arrays[k] = a.astype(dtype, copy=False)  # float64 1e300 -> inf: caught next.
        if a.dtype.kind == "f":
            bad = ~np.isfinite(a)
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                kinds = [k for k, m in (("NaN", np.isnan(a)), ("Inf", np.isinf(a))) if m.any()]
                raise ValueError(
                    f"`representative_data` for {label} has {int(bad.sum())} non-finite "
                    f"value(s) ({' and '.join(kinds)}), the first at index {where} (example "
                    f"{where[0]}). TFLite calibration needs finite ranges (an Inf crashes the "
                    "converter, NaN gives a float file): clean or drop those examples."
                )
    counts = {len(a) for a in arrays}
    if len(counts) != 1:
        raise ValueError(
            "`representative_data` must hold the same number of examples for every input; got "
            f"{ {name: len(a) for name, a in zip(names, arrays)} }."
        )
    x = arrays[0] if len(arrays) == 1 else dict(zip(names, arrays))
    outputs = model.predict(x, batch_size=min(len(arrays[0]), 256), verbose=0)
    for i, y in enumerate(keras.tree.flatten(outputs)):
        y = np.asarray(keras.ops.convert_to_numpy(y))
        if y.dtype.kind == "f" and not np.isfinite(y).all():
            raise ValueError(
                f"The model's output {i} is not finite on `representative_data` (the "
                "activations overflow or hit NaN), so its int8 ranges cannot be calibrated: "
                "pass examples in the range the model was trained on."
            )


def _dataset(arrays: list[np.ndarray], names: list[str]) -> Callable:
    # Samples keyed by signature input name: TFLite's calibrator maps them to its own tensor
    # order (a list would be taken in the file's order, which is not `model.inputs` order).
    def dataset():
        for i in range(len(arrays[0])):
            yield {name: a[i : i + 1] for name, a in zip(names, arrays)}

    return dataset


def _report(path: Path, content: bytes, quantization) -> dict:
    inputs, outputs = _tflite.describe(content)
    for entry in inputs + outputs:
        entry.pop("index")
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
        "input_order": _stored_input_order(content),
        "select_tf_ops": _tflite.flex_ops(content),
    }


def _stored_input_order(content: bytes) -> list[str] | None:
    raw = _tflite.read_metadata(content, METADATA_NAME)
    if raw is None:
        return None
    try:
        return list(json.loads(raw.decode())["inputs"])
    except (ValueError, KeyError, TypeError):
        return None


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
    calibration_samples=args["calibration_samples"], int8_io=args["int8_io"],
    allow_select_tf_ops=args["allow_select_tf_ops"])
print("KERAS_PERF_REPORT " + json.dumps(report))
"""


def _export_via_tensorflow_process(
    model, path, quantization, arrays, int8_io, allow_select_tf_ops, custom_modules
) -> dict:
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
            "allow_select_tf_ops": allow_select_tf_ops,
            "custom_modules": custom_modules,
        }
        env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
        # The child must import this very keras_perf (a checkout may shadow an install).
        package_root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(args)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    for line in proc.stdout.splitlines():
        if line.startswith("KERAS_PERF_REPORT "):
            report = json.loads(line[len("KERAS_PERF_REPORT ") :])
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

    Inputs are taken as `model.predict` takes them: one array for a one-input model; for
    several inputs a list in `model.inputs` order or a dict keyed by input name. The file's
    own tensor order can differ from `model.inputs` (the converter orders them its own way),
    so inputs are matched by name through the file's signature, using the input order that
    `export_tflite` stores in the file's metadata. Outputs come back as `model.predict`
    returns them: an array for one output, a list in the model's order for several, a dict
    for a model with dict outputs.

    Int8 inputs are quantized with the file's own scale and zero point, and int8 outputs
    dequantized, so the result compares directly with the Keras model's predictions. Uses
    `ai_edge_litert`'s interpreter when installed, else `tf.lite.Interpreter`.

    Args:
        path: The `.tflite` file, or its contents as bytes.
        x: An array (one-input model), a list of arrays in `model.inputs` order, or a dict
            of arrays keyed by input name. A multi-input file that `export_tflite` did not
            write has no stored order: pass a dict.
        batch_size: Examples per interpreter call. Defaults to `256`.
        num_threads: Interpreter threads, `None` for TFLite's default. Defaults to `None`.

    Returns:
        A float array of outputs; a list of arrays (model output order) for several outputs;
        a dict of arrays for a model with dict outputs.

    Raises:
        TypeError: `batch_size` or `num_threads` is not an int.
        ValueError: `batch_size`/`num_threads` below 1; the inputs do not match the file's
            (number, names, shapes, dtype, example counts, none at all).
        RuntimeError: the file holds TensorFlow (select TF) ops and this interpreter cannot
            run them.

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
    if isinstance(path, bytes):
        content = path
    elif isinstance(path, (str, os.PathLike)):
        content = Path(path).read_bytes()
    else:
        raise TypeError(f"`path` must be a path or bytes, got {type(path).__name__}.")
    in_details, out_details = _tflite.describe(content)
    feeds = _feeds(x, in_details, _stored_input_order(content))
    results = _tflite.predict(content, feeds, batch_size, num_threads)
    keys = [d["key"] for d in out_details]
    if None in keys:  # No signature: the file's order.
        outputs = [results[d["index"]] for d in out_details]
        return outputs[0] if len(outputs) == 1 else outputs
    by_key = {d["key"]: results[d["index"]] for d in out_details}
    positional = [f"output_{i}" for i in range(len(keys))]
    if sorted(keys) == sorted(positional):
        outputs = [by_key[k] for k in positional]
        return outputs[0] if len(outputs) == 1 else outputs
    return {k: by_key[k] for k in sorted(by_key)}


def _feeds(x, in_details: list[dict], order: list[str] | None) -> dict:
    """Input tensor index -> checked array, from `x` as `model.predict` takes it."""
    keys = [d["key"] for d in in_details]  # Signature names, in the file's tensor order.
    signed = None not in keys
    if not signed:
        order = None
    elif order is None or sorted(order) != sorted(keys):
        order = None
    names = order or (sorted(keys) if signed else [d["name"] for d in in_details])
    if isinstance(x, dict):
        if not signed:
            raise ValueError(
                "This TFLite file has no signature, so its inputs have no names: pass `x` as a "
                "list in the file's input order."
            )
        if set(x) != set(keys):
            raise ValueError(
                f"`x` is a dict with keys {sorted(map(str, x))}; the TFLite file's inputs are "
                f"named {names}: give exactly those keys."
            )
        by_key = dict(x)
    else:
        items = list(x) if isinstance(x, (list, tuple)) else [x]
        if len(items) != len(keys):
            raise ValueError(
                f"The TFLite model has {len(keys)} inputs ({', '.join(names)}); got "
                f"{len(items)} arrays."
            )
        if len(items) == 1 or not signed:
            by_key = dict(zip(keys, items)) if signed else dict(enumerate(items))
            keys = keys if signed else list(range(len(items)))
        elif order is None:
            raise ValueError(
                "This multi-input TFLite file does not record the model's input order (it was "
                "not written by `export_tflite`), so a list is ambiguous: pass `x` as a dict "
                f"keyed by input name ({', '.join(names)})."
            )
        else:
            by_key = dict(zip(order, items))
    feeds = {}
    for detail, key in zip(in_details, keys):
        label = f"input {key!r}" if signed else f"input {key}"
        try:
            a = np.asarray(by_key[key])
        except Exception as e:
            raise ValueError(f"`x` for {label} cannot be read as an array ({e}).") from e
        if a.dtype.kind not in "biuf":
            raise ValueError(f"`x` for {label} has dtype {a.dtype}; expected numbers.")
        shape = detail["shape"]
        if a.ndim != len(shape) or any(d != -1 and d != g for d, g in zip(shape[1:], a.shape[1:])):
            dims = ", ".join("None" if d == -1 else str(d) for d in shape[1:])
            raise ValueError(f"`x` for {label}: expected shape (examples, {dims}), got {a.shape}.")
        # Quantized inputs are quantized from float by `_tflite.predict`; others take the
        # file's dtype.
        dtype = "float32" if detail["quantization"] else detail["dtype"]
        with np.errstate(over="ignore", invalid="ignore"):
            feeds[detail["index"]] = a.astype(dtype, copy=False)
    counts = {len(a) for a in feeds.values()}
    if len(counts) != 1:
        raise ValueError(
            f"Every input of `x` needs the same number of examples; got {sorted(counts)}."
        )
    if counts == {0}:
        raise ValueError("`x` holds no examples.")
    return feeds


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
            {
                "name": layer.name,
                "class": type(layer).__name__,
                "params": 0,
                "nonzero": 0,
                "bytes": 0,
                "_blobs": [],
            },
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
