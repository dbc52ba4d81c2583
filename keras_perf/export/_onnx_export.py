"""A Keras model to a float ONNX file that ONNX Runtime loads: Keras' own
`model.export(path, format="onnx")`, whose exporter differs by backend (tf2onnx on TensorFlow,
jax2onnx on JAX, `torch.onnx` with onnxscript on PyTorch: `EXPORTERS`), what the `onnx`
extra must hold for it (`require_onnx`), and `quiet_logs`, which hides the exporters' and ONNX
Runtime quantization's INFO and WARNING lines (`_onnx_quantize` uses it too). Like `keras_perf.export._tflite_lib`, the ONNX modules serve every
backend and import their packages lazily, inside each function. Checked with Keras 3.15.1,
onnx 1.23, onnxruntime 1.32, tf2onnx 1.17, jax2onnx 0.17, onnxscript 0.7.

Beside it: `_onnx_graph` (the proto's reads and rewrites), `_onnx_quantize` (ONNX Runtime's
quantization), `_onnx_session` (ONNX Runtime's sessions).
"""

from __future__ import annotations

import contextlib
import logging
import warnings

from keras_perf._imports import require
from keras_perf.export import _onnx_graph, _onnx_session

EXTRA = "onnx"
# What Keras' `model.export(format="onnx")` needs on each backend.
EXPORTERS = {"tensorflow": "tf2onnx", "jax": "jax2onnx", "torch": "onnxscript"}


def require_onnx(feature: str, backend: str | None = None) -> None:
    """ImportError naming the `onnx` extra when a package `feature` needs is missing."""
    for module in ("onnx", "onnxruntime"):
        require(module, feature, extra=EXTRA)
    if backend in EXPORTERS:
        require(EXPORTERS[backend], feature, extra="onnx-jax" if backend == "jax" else EXTRA)


@contextlib.contextmanager
def quiet_logs():
    """Hide the exporters' and ORT quantization's INFO/WARNING lines (not errors)."""
    import onnxruntime as ort

    loggers = [logging.getLogger(n) for n in ("", "tf2onnx", "tensorflow", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, logging.ERROR))
    ort.set_default_logger_severity(3)
    try:
        with warnings.catch_warnings():
            # torch.onnx's tracer on Keras' shape arithmetic ("Converting a tensor to a Python
            # integer..."): Keras' shapes are static here, the trace is right.
            warnings.filterwarnings("ignore", message="Converting a tensor to a Python")
            # torch.onnx's notice that Keras' call (the TorchScript exporter) will go.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
            warnings.filterwarnings("ignore", message="You are using the legacy TorchScript")
            yield
    finally:
        ort.set_default_logger_severity(2)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_float(model, path: str) -> None:
    """Keras' own ONNX export of `model` to `path`, made loadable by ONNX Runtime."""
    import keras
    import onnx

    exporter = EXPORTERS.get(keras.backend.backend(), "Keras")
    try:
        with quiet_logs(), _constant_statistics(model):
            model.export(str(path), format="onnx", verbose=False)
    except ImportError:
        raise
    except Exception as e:
        raise ValueError(
            f"Keras' ONNX export ({exporter}) cannot convert this model: {type(e).__name__}: "
            f"{first_line(e)}. Replace the layer or op it names, or export on another Keras "
            "backend."
        ) from e
    proto = onnx.load(str(path))
    _refuse_extra_inputs(proto, model, exporter)
    if _onnx_graph.rewrite_pooling(proto):
        onnx.save(proto, str(path))
    try:
        _onnx_session.session(str(path))
    except Exception as e:  # tf2onnx writes an op it cannot convert as it is.
        raise ValueError(
            f"Keras' ONNX export ({exporter}) wrote a graph ONNX Runtime cannot load: "
            f"{first_line(e)}. Replace the layer or op it names, or export on another Keras "
            "backend."
        ) from e


@contextlib.contextmanager
def _constant_statistics(model):
    """On TensorFlow, a `Normalization`'s mean and variance as numpy arrays while Keras exports.

    After `adapt` (or given to the constructor), Keras' `Normalization` holds its statistics as
    eager tensors, not variables; the traced function captures them and tf2onnx writes each
    capture as a required graph input (`.../Sub/y:0`, `.../Sqrt/x:0`), so the file cannot run
    on the model's inputs alone. As numpy arrays they are traced as constants instead. The
    layers get their tensors back afterwards. (JAX and PyTorch export them as constants.)
    """
    import keras

    from keras_perf._utils import iter_layers

    swapped = []
    if keras.backend.backend() == "tensorflow":
        for layer in iter_layers(model):
            if isinstance(layer, keras.layers.Normalization) and layer.mean is not None:
                swapped.append((layer, layer.mean, layer.variance))
                layer.mean = keras.ops.convert_to_numpy(layer.mean)
                layer.variance = keras.ops.convert_to_numpy(layer.variance)
    try:
        yield
    finally:
        for layer, mean, variance in swapped:
            layer.mean, layer.variance = mean, variance


def _refuse_extra_inputs(proto, model, exporter: str) -> None:
    """A `ValueError` when the exported graph needs inputs the model does not have.

    A tensor the traced function captured instead of reading from a variable (a layer's
    constant held as an eager tensor) becomes a graph input on TensorFlow: such a file cannot
    run on the model's inputs alone, and ORT's int8 calibration fails on it.
    """
    initializers = {i.name for i in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in initializers]
    wanted = len(model.inputs)
    if len(names) <= wanted:
        return
    own = {t.name for t in model.inputs}
    extra = [n for n in names if n not in own] or names[wanted:]
    raise ValueError(
        f"Keras' ONNX export ({exporter}) wrote a graph that needs {len(extra)} input(s) the "
        f"model does not have ({', '.join(extra[:4])}): a layer holds a constant as a "
        "tensor rather than a variable (as Keras' `Normalization` does), and the exporter "
        "made it an input. Nothing was written. Hold the constant in a variable "
        "(`self.add_weight(..., trainable=False)`) or in the layer's config, or export on "
        "another Keras backend."
    )


def first_line(e: Exception) -> str:
    """The first non-blank line of `e`'s message, at most 300 characters (for our errors)."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""
