"""TensorFlow Lite (LiteRT) conversion and interpretation, used by `keras_perf.export`.

TFLite is a TensorFlow tool whatever Keras backend trains the model, so this module is not one
of the per-backend implementations: it imports TensorFlow lazily, inside each function, so that
importing keras-perf on the JAX or PyTorch backend does not pay for a TensorFlow import.

The interpreter comes from the `ai_edge_litert` package when it is installed (the runtime that
TensorFlow 2.20+ points to) and otherwise from `tf.lite.Interpreter`, which TF 2.21 still ships
but marks deprecated; its deprecation warning is silenced here because the user did not call
it. Checked with TensorFlow 2.21.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import numpy as np

from keras_perf._imports import require

QUANTIZATIONS = (None, "dynamic", "float16", "int8")


@contextlib.contextmanager
def quiet_tensorflow_logs():
    """Hide TensorFlow's INFO lines ("Assets written to ...") while a SavedModel is written."""
    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def convert_saved_model(saved_model_dir: str, quantization, representative_dataset, int8_io: bool):
    """Convert a SavedModel directory to a TFLite flatbuffer (bytes)."""
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_saved_model(saved_model_dir)
    if quantization is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if quantization == "float16":
        converter.target_spec.supported_types = [tf.float16]
    elif quantization == "int8":
        # Full-integer quantization: every op int8, calibrated on the representative data; a
        # model with an op that has no int8 kernel fails here rather than silently keeping it
        # in float.
        converter.representative_dataset = representative_dataset
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        if int8_io:
            converter.inference_input_type = tf.int8
            converter.inference_output_type = tf.int8
    return converter.convert()


def interpreter(model_content: bytes, num_threads: int | None = None):
    """A TFLite interpreter over `model_content`, tensors allocated."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        require("tensorflow", "TFLite inference (tflite_predict)")
        import tensorflow as tf

        Interpreter = tf.lite.Interpreter
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tf.lite.Interpreter is deprecated.*")
        interp = Interpreter(model_content=model_content, num_threads=num_threads)
    interp.allocate_tensors()
    return interp


def _describe(detail: dict) -> dict:
    scale, zero_point = detail.get("quantization", (0.0, 0))
    return {
        "name": detail["name"],
        "shape": [int(d) for d in detail.get("shape_signature", detail["shape"])],
        "dtype": np.dtype(detail["dtype"]).name,
        # TFLite writes (0.0, 0) for a tensor that is not quantized.
        "quantization": None if scale == 0.0 else (float(scale), int(zero_point)),
    }


def describe(model_content: bytes) -> tuple[list[dict], list[dict]]:
    """`(inputs, outputs)`: name, shape (-1 for a free dimension), dtype, (scale, zero point)."""
    interp = interpreter(model_content)
    return (
        [_describe(d) for d in interp.get_input_details()],
        [_describe(d) for d in interp.get_output_details()],
    )


def _quantize(x: np.ndarray, detail: dict) -> np.ndarray:
    dtype = np.dtype(detail["dtype"])
    scale, zero_point = detail["quantization"]
    if np.issubdtype(dtype, np.integer) and scale != 0.0:
        info = np.iinfo(dtype)
        x = np.clip(np.round(x / scale + zero_point), info.min, info.max)
    return np.asarray(x).astype(dtype)


def _dequantize(y: np.ndarray, detail: dict) -> np.ndarray:
    scale, zero_point = detail["quantization"]
    if np.issubdtype(y.dtype, np.integer) and scale != 0.0:
        return (y.astype(np.float32) - zero_point) * np.float32(scale)
    return y


def predict(model_content: bytes, inputs: list[np.ndarray], batch_size: int, num_threads):
    """Run the model over `inputs` (one array per model input) in batches; float outputs."""
    interp = interpreter(model_content, num_threads=num_threads)
    in_details = interp.get_input_details()
    out_details = interp.get_output_details()
    n = len(inputs[0])
    results = [[] for _ in out_details]
    current = None
    for start in range(0, n, batch_size):
        chunk = [a[start : start + batch_size] for a in inputs]
        if len(chunk[0]) != current:
            current = len(chunk[0])
            for detail, a in zip(in_details, chunk):
                interp.resize_tensor_input(detail["index"], list(a.shape), strict=False)
            interp.allocate_tensors()
        for detail, a in zip(in_details, chunk):
            interp.set_tensor(detail["index"], _quantize(a, detail))
        interp.invoke()
        for i, detail in enumerate(interp.get_output_details()):
            results[i].append(_dequantize(interp.get_tensor(detail["index"]), detail))
    return [np.concatenate(r, axis=0) for r in results]
