"""`export_onnx` and `onnx_predict`: a Keras 3 model to an ONNX file (float, float16, int8) and
back to numpy outputs through ONNX Runtime.

The float graph is Keras' own `model.export(format="onnx")` on every backend (`_onnx_export`);
quantization is ONNX Runtime's (`_onnx_quantize`). A quantization-aware model's learned ranges
are read by `_onnx_qat`. The calibration data checks are `export_tflite`'s (`_calibration`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import keras
import numpy as np

from keras_perf.export import _onnx_export, _onnx_graph, _onnx_quantize
from keras_perf.export._calibration import _calibration, _check_calibration
from keras_perf.export._checks import (
    _check_export_arguments,
    _check_path,
    _input_count,
    _input_specs,
    export_twin,
    pack_inputs,
    refuse_reduced_precision_qat,
)

QUANTIZATIONS = (None, "float16", "dynamic", "int8")
METADATA_KEY = "keras_perf"


def export_onnx(
    model: keras.Model,
    path: str | os.PathLike,
    quantization: str | None = None,
    representative_data=None,
    *,
    calibration_samples: int = 200,
    reduce_range: bool | None = None,
) -> dict:
    """Export a Keras model to an ONNX file, optionally quantized (float16 or int8).

    The graph is Keras' own `model.export(path, format="onnx")` (tf2onnx on TensorFlow,
    jax2onnx on JAX, `torch.onnx` on PyTorch); quantization is ONNX Runtime's:

    - `None`: float32, as Keras writes it.
    - `"float16"`: weights and activations float16, float32 in and out; ~2x smaller.
    - `"dynamic"`: int8 weights of MatMul/Gemm/Conv, activations quantized on the fly.
    - `"int8"`: static QDQ quantization: int8 weights (per output channel), uint8 activations
      with ranges calibrated on `representative_data` (`quant_pre_process`, then
      `quantize_static`). A model made by `kp.quantize_aware` needs no data: its learned
      ranges become the file's scales and zero points, so the file computes what the Keras
      model computes.

    An `"int8"` file in which a Conv, MatMul or Gemm stayed in float is refused (nothing is
    written). `"int8"` weights are stored in `[-64, 64]` (7 bits, ORT's `reduce_range`): on an
    x86-64 CPU without VNNI (`avx512_vnni`, `avx_vnni`, `amx_int8`) ONNX Runtime's fused
    uint8 x int8 kernels add pairs of products in 16 bits, which full-range weights saturate;
    the file then runs right on any CPU. `reduce_range=False` keeps 8-bit weights for a target
    with VNNI or ARM; `onnx_predict` runs such a file unfused on a CPU that would saturate. The model's input names, in `model.inputs` order, are stored in the file's
    metadata, so that `onnx_predict` takes a list in that order.

    Args:
        model: A built Sequential or Functional Keras model (it has an `Input`).
        path: Where to write the `.onnx` file (its directory must exist and be writable).
        quantization: One of `None`, `"float16"`, `"dynamic"`, `"int8"`. Defaults to `None`.
        representative_data: Calibration inputs for `"int8"` (refused otherwise, and for a
            quantization-aware model): an array of examples for a one-input model, a list in
            `model.inputs` order or a dict keyed by input name, or a callable returning an
            iterable of samples, as `export_tflite` takes them. Defaults to `None`.
        calibration_samples: How many examples of an array `representative_data` to
            calibrate on (the first ones). Defaults to `200`.
        reduce_range: Store int8 weights in 7 bits (`[-64, 64]`) with `"int8"` or
            `"dynamic"`: `True`, `False`, or `None` for `True` with `"int8"` (calibrated or a
            quantization-aware model's; weights learned in fewer than 8 bits keep their
            levels) and `False` with `"dynamic"` (whose kernels do not saturate). Defaults to
            `None`.

    Returns:
        A dict: `path`, `bytes` (file size), `quantization`, `reduce_range` (whether the
        weights were quantized to 7 bits), `inputs` and `outputs` (one dict per tensor:
        `name`, `shape` with `None` for free dimensions, `dtype`) and `input_order` (input
        names in `model.inputs` order).

    Raises:
        ImportError: a package of the `onnx` extra is missing (named in the message).
        TypeError: an argument has the wrong type.
        ValueError: an unknown `quantization`; `"int8"` without `representative_data`, or data
            with another mode; the model is not built or is subclassed; the path cannot be
            written; the calibration data does not match the model's inputs, is empty or not
            finite; a quantization-aware model with another mode than `"int8"`; an `"int8"`
            file with ops left in float.

    Example:
        >>> import keras, numpy as np, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> x = np.random.rand(64, 8).astype("float32")
        >>> report = kp.export_onnx(model, "/tmp/m.onnx", "int8", representative_data=x)
        >>> report["bytes"] < 10_000
        True
    """
    _check_export_arguments(model, path, quantization, QUANTIZATIONS, calibration_samples)
    from keras_perf import quantization as _quantization

    qat = _quantization.is_quantized_model(model)
    if reduce_range is not None and not isinstance(reduce_range, bool):
        raise TypeError(f"`reduce_range` must be True, False or None; got {reduce_range!r}.")
    if reduce_range is not None and quantization not in ("dynamic", "int8"):
        raise ValueError(
            f"`reduce_range` goes with quantization='dynamic' or 'int8'; got it with "
            f"quantization={quantization!r}. Drop it."
        )
    if qat and quantization != "int8":
        raise ValueError(
            "A quantization-aware model is exported with quantization='int8' (its learned "
            f"ranges); got quantization={quantization!r}. Export the float model for other modes."
        )
    if qat:
        refuse_reduced_precision_qat(model, "export_onnx")
    if qat and representative_data is not None:
        raise ValueError(
            "`representative_data` is not used for a quantization-aware model: its activation "
            "ranges were learned in training. Drop the argument."
        )
    if not qat and quantization == "int8" and representative_data is None:
        raise ValueError(
            "quantization='int8' needs `representative_data` to calibrate the activation "
            "ranges: pass ~100-500 training examples, e.g. `export_onnx(model, path, 'int8', "
            "representative_data=x_train[:200])`, or use quantization='dynamic', which needs "
            "no data."
        )
    if quantization != "int8" and representative_data is not None:
        raise ValueError(
            f"`representative_data` is only used with quantization='int8'; got it with "
            f"quantization={quantization!r}. Drop it, or ask for 'int8'."
        )
    specs = _input_specs(model) if model.built else None
    if specs is None:
        raise ValueError(
            "`model` has no symbolic inputs (it is unbuilt or subclassed): export_onnx needs a "
            "Sequential or Functional model that starts with `keras.Input(shape)`."
        )
    path = _check_path(path)
    if not qat:
        model = export_twin(model, "export_onnx", seed_state=False)  # Mixed precision.
    backend = keras.backend.backend()
    _onnx_export.require_onnx("export_onnx", backend)
    calibration = None
    if quantization == "int8" and not qat:
        calibration = _calibration(representative_data, specs, _input_count(model))
        if not callable(representative_data):
            calibration = [a[:calibration_samples] for a in calibration]
        _check_calibration(model, calibration, specs)
    names = [name for name, _, _ in specs]
    if reduce_range is None:
        reduce_range = quantization == "int8"

    with tempfile.TemporaryDirectory() as tmp:
        graph = model
        if qat:
            from keras_perf.export import _onnx_qat

            graph = _onnx_qat.float_copy(model)
        _call_once(graph, specs)  # Keras exports a model only after it has been called.
        float_path = os.path.join(tmp, "float.onnx")
        _onnx_export.export_float(graph, float_path)
        out = os.path.join(tmp, "out.onnx")
        if quantization is None:
            out = float_path
        elif quantization in ("float16", "dynamic"):
            _onnx_quantize.quantize(float_path, out, quantization, reduce_range=reduce_range)
        else:
            prepared = os.path.join(tmp, "prepared.onnx")
            _onnx_quantize.pre_process(float_path, prepared)
            ranges, reader = None, None
            if qat:
                ranges = _onnx_qat.learned_ranges(model, graph, prepared)
            else:
                reader = _onnx_quantize.CalibrationReader(
                    calibration, _file_inputs(prepared, names)
                )
            cache = os.path.join(tmp, "ranges.json")
            _onnx_quantize.quantize(
                prepared, out, "int8", reader, ranges, cache, reduce_range=reduce_range
            )
            _refuse_float(out, qat)
        _write(out, path, names, _output_keys(model))
    return {**_report(path, quantization), "reduce_range": bool(reduce_range)}


def _call_once(model, specs):
    x = [
        np.zeros([1 if d is None else d for d in (1, *shape[1:])], dtype=dtype)
        for _, shape, dtype in specs
    ]
    model(pack_inputs(model, x), training=False)


def _file_inputs(path, names: list[str]) -> list[str]:
    """The file's input names in `model.inputs` order (they carry the Keras names)."""
    import onnx

    graph = onnx.load(str(path)).graph
    initializers = {i.name for i in graph.initializer}
    file_names = [i.name for i in graph.input if i.name not in initializers]
    if sorted(file_names) == sorted(names):
        return list(names)
    return file_names  # Positional: the exporters keep `model.inputs` order.


def _refuse_float(path, qat: bool) -> None:
    import onnx

    left = _onnx_graph.float_ops(onnx.load(str(path)))
    if left:
        why = (
            "a tensor around them has no learned range (put the layers through "
            "`quantize_aware`, and train it)"
            if qat
            else "ONNX Runtime did not quantize them (check `representative_data`: real, finite "
            "examples in the model's input range)"
        )
        raise ValueError(
            f"quantization='int8' left {len(left)} weight op(s) in float ({', '.join(left[:5])}"
            f"{', ...' if len(left) > 5 else ''}), so nothing was written: {why}. "
            "quantization='dynamic' quantizes the weights alone."
        )


def _output_keys(model) -> list[str] | None:
    """The keys of a dict-output model's outputs, in the order the exporters write them
    (`keras.tree.flatten`'s: sorted); `None` for any other model."""
    try:
        structure = model.output
    except (AttributeError, ValueError):
        return None
    if not isinstance(structure, dict) or any(isinstance(v, dict) for v in structure.values()):
        return None
    return [str(k) for k in sorted(structure)]


def _write(src, path: Path, names: list[str], output_keys: list[str] | None = None) -> None:
    import onnx

    proto = onnx.load(str(src))
    del proto.metadata_props[:]
    entry = proto.metadata_props.add()
    stored = {"inputs": names}
    if output_keys is not None and len(output_keys) == len(proto.graph.output):
        stored["outputs"] = output_keys  # `onnx_predict` returns a dict with these keys.
    entry.key, entry.value = METADATA_KEY, json.dumps(stored)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(proto, str(tmp))
    shutil.move(str(tmp), str(path))


def _describe(values) -> list[dict]:
    import onnx

    out = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        out.append({"name": v.name, "shape": shape, "dtype": dtype})
    return out


def _report(path: Path, quantization) -> dict:
    import onnx

    proto = onnx.load(str(path))
    initializers = {i.name for i in proto.graph.initializer}
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "quantization": quantization,
        "inputs": _describe(i for i in proto.graph.input if i.name not in initializers),
        "outputs": _describe(proto.graph.output),
        "input_order": _stored_order(proto),
    }


def _stored_order(proto) -> list[str] | None:
    for entry in proto.metadata_props:
        if entry.key == METADATA_KEY:
            try:
                return list(json.loads(entry.value)["inputs"])
            except (ValueError, KeyError, TypeError):
                return None
    return None
