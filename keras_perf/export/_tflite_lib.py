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
_DEPRECATED = ".*tf.lite.Interpreter is deprecated.*"


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


@contextlib.contextmanager
def state_as_weights(model):
    """On JAX, the model's float non-trainable variables marked trainable while Keras exports.

    Keras' JAX SavedModel (jax2tf) returns the non-trainable variables from each call and
    assigns them back, even at inference: a BatchNormalization's moving mean and variance
    then stay float32 variables with an `ASSIGN_VARIABLE` in the TFLite file, and the
    statistics' arithmetic is not folded, so a post-training `"int8"` file is not
    full-integer (the same model converts on TensorFlow). Read as weights they are frozen
    into constants like kernels. The flags are restored afterwards; nothing else changes.
    Other backends: no change.
    """
    import keras

    flipped = []
    if keras.backend.backend() == "jax":
        for v in model.non_trainable_variables:
            if v.trainable is False and "float" in str(v.dtype):
                v.trainable = True
                flipped.append(v)
    try:
        yield
    finally:
        for v in flipped:
            v.trainable = False


def convert_saved_model(
    saved_model_dir: str,
    quantization,
    representative_dataset,
    int8_io: bool,
    select_tf_ops: bool = False,
):
    """Convert a SavedModel directory to a TFLite flatbuffer (bytes).

    With `select_tf_ops`, ops that TFLite has no builtin kernel for (the TensorList loop of a
    Keras LSTM/GRU with a free batch size) are kept as TensorFlow ops ("Flex" ops), which
    only an interpreter linked with the Flex delegate can run.
    """
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_saved_model(saved_model_dir)
    if quantization == "qat_int8":
        # A quantization-aware model: every range is in the graph (FakeQuant ops), so no
        # representative data; the INT8-only op set would demand some, so the default set.
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if int8_io:
            converter.inference_input_type = tf.int8
            converter.inference_output_type = tf.int8
        quantization = None
    elif quantization is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    builtins = tf.lite.OpsSet.TFLITE_BUILTINS
    if quantization == "float16":
        converter.target_spec.supported_types = [tf.float16]
    elif quantization == "int8":
        # Full-integer quantization: every op int8, calibrated on the representative data; a
        # model with an op that has no int8 kernel fails here rather than silently keeping it
        # in float.
        converter.representative_dataset = representative_dataset
        builtins = tf.lite.OpsSet.TFLITE_BUILTINS_INT8
        converter.target_spec.supported_ops = [builtins]
        if int8_io:
            converter.inference_input_type = tf.int8
            converter.inference_output_type = tf.int8
    if select_tf_ops:
        converter.target_spec.supported_ops = [builtins, tf.lite.OpsSet.SELECT_TF_OPS]
        # TensorList ops (Keras' RNN loop) stay TF ops instead of failing to lower.
        converter._experimental_lower_tensor_list_ops = False
    try:
        with warnings.catch_warnings():
            # The calibrator builds a tf.lite.Interpreter of its own for name-keyed samples.
            warnings.filterwarnings("ignore", message=_DEPRECATED)
            return converter.convert()
    except Exception as e:  # tf.lite's ConverterError; its class moves between TF versions.
        text = str(e)
        if not select_tf_ops and any(
            hint in text for hint in ("Select TF ops", "TF Select", "SELECT_TF_OPS")
        ):
            raise NeedsSelectTfOps(text) from e
        raise


class NeedsSelectTfOps(Exception):
    """The converter failed on ops that only TensorFlow kernels (Flex) provide."""


def interpreter(model_content: bytes, num_threads: int | None = None, allocate: bool = True):
    """A TFLite interpreter over `model_content`, tensors allocated unless `allocate=False`."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        require("tensorflow", "TFLite inference (tflite_predict)")
        import tensorflow as tf

        Interpreter = tf.lite.Interpreter
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED)
        interp = Interpreter(model_content=model_content, num_threads=num_threads)
    if allocate:
        try:
            interp.allocate_tensors()
        except RuntimeError as e:
            flex = flex_ops(model_content)
            if flex and "Select TensorFlow op" in str(e):
                raise RuntimeError(
                    f"This TFLite file uses TensorFlow ops ({', '.join(flex)}; exported with "
                    "`allow_select_tf_ops=True`) and this interpreter has no Flex delegate "
                    "to run them. Run it where the select-TF-ops runtime is linked (Android: "
                    "`org.tensorflow:tensorflow-lite-select-tf-ops`), or export a model "
                    "that TFLite's builtin ops cover."
                ) from e
            raise
    return interp


def _describe(detail: dict) -> dict:
    scale, zero_point = detail.get("quantization", (0.0, 0))
    return {
        "index": int(detail["index"]),
        "name": detail["name"],
        "shape": [int(d) for d in detail.get("shape_signature", detail["shape"])],
        "dtype": np.dtype(detail["dtype"]).name,
        # TFLite writes (0.0, 0) for a tensor that is not quantized.
        "quantization": None if scale == 0.0 else (float(scale), int(zero_point)),
    }


def describe(model_content: bytes) -> tuple[list[dict], list[dict]]:
    """`(inputs, outputs)`: name, shape (-1 for a free dimension), dtype, (scale, zero point).

    Inputs and outputs come in the file's tensor order; each also carries `key`, its name in
    the file's signature (the Keras input name, `output_0`... or the output dict key), or
    `None` for a file without a signature.
    """
    interp = interpreter(model_content, allocate=False)
    in_keys, out_keys = _signature_keys(interp)
    inputs = [_describe(d) for d in interp.get_input_details()]
    outputs = [_describe(d) for d in interp.get_output_details()]
    for entries, details, keys in (
        (inputs, interp.get_input_details(), in_keys),
        (outputs, interp.get_output_details(), out_keys),
    ):
        for entry, detail in zip(entries, details):
            entry["key"] = keys.get(detail["index"])
    return inputs, outputs


def saved_model_inputs(saved_model_dir: str) -> list[tuple]:
    """`(name, shape, dtype)` of each input of a SavedModel's serving signature, by name."""
    import tensorflow as tf

    signature = tf.saved_model.load(saved_model_dir).signatures["serving_default"]
    specs = signature.structured_input_signature[1]
    return [
        (name, tuple(spec.shape.as_list()), spec.dtype.name) for name, spec in sorted(specs.items())
    ]


def _signature_keys(interp) -> tuple[dict, dict]:
    """Tensor index -> signature name, for inputs and outputs (empty without one signature)."""
    signatures = interp.get_signature_list()
    if len(signatures) != 1:
        return {}, {}
    runner = interp.get_signature_runner(next(iter(signatures)))
    return (
        {d["index"]: name for name, d in runner.get_input_details().items()},
        {d["index"]: name for name, d in runner.get_output_details().items()},
    )


def _schema():
    """TFLite's flatbuffer schema module (generated Python), from TensorFlow or LiteRT."""
    try:
        from tensorflow.lite.python import schema_py_generated
    except ImportError:
        try:
            from ai_edge_litert import schema_py_generated
        except ImportError:
            return None
    return schema_py_generated


def _root(model_content: bytes):
    schema = _schema()
    if schema is None:
        return None, None
    return schema, schema.Model.GetRootAs(model_content, 0)


def add_metadata(model_content: bytes, name: str, data: bytes) -> bytes:
    """`model_content` with a metadata entry `name` -> `data` (replacing one of that name).

    TFLite's `Model.metadata` is a list of named buffers that interpreters ignore; the
    converter stores its own "CONVERSION_METADATA" there the same way (object API round trip,
    `tensorflow/lite/python/util.py:populate_conversion_metadata`, TF 2.21).
    """
    import flatbuffers
    from tensorflow.lite.python import schema_py_generated as schema

    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(model_content, 0))
    buffer = schema.BufferT()
    buffer.data = np.frombuffer(data, dtype=np.uint8)
    model.metadata = model.metadata or []
    for entry in model.metadata:
        if entry.name.decode() == name:
            model.buffers[entry.buffer] = buffer
            break
    else:
        entry = schema.MetadataT()
        entry.name = name.encode()
        entry.buffer = len(model.buffers)
        model.buffers.append(buffer)
        model.metadata.append(entry)
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def read_metadata(model_content: bytes, name: str) -> bytes | None:
    """The metadata entry `name` of a TFLite file, or `None` (absent, or no schema module)."""
    schema, root = _root(model_content)
    if root is None:
        return None
    for i in range(root.MetadataLength()):
        entry = root.Metadata(i)
        if entry.Name().decode() == name:
            return root.Buffers(entry.Buffer()).DataAsNumpy().tobytes()
    return None


def flex_ops(model_content: bytes) -> list[str]:
    """Names of the TensorFlow ("Flex") ops in a TFLite file, sorted."""
    _, root = _root(model_content)
    if root is None:
        return []
    names = set()
    for i in range(root.OperatorCodesLength()):
        code = root.OperatorCodes(i).CustomCode()
        if code and code.startswith(b"Flex"):
            names.add(code.decode()[len("Flex") :])
    return sorted(names)


def float_tensors(model_content: bytes) -> list[str]:
    """Names of the float32 tensors of a file's main graph, its inputs and outputs left out."""
    return _inner_floats(interpreter(model_content, allocate=False))


def _inner_floats(interp) -> list[str]:
    io = {d["index"] for d in interp.get_input_details() + interp.get_output_details()}
    return [
        t["name"]
        for t in interp.get_tensor_details()
        if np.dtype(t["dtype"]) == np.float32 and t["index"] not in io
    ]


def integer_problems(model_content: bytes, int8_io: bool, select_tf_ops: bool) -> list[str]:
    """Why a file asked for as full-integer int8 is not one (empty list: it is).

    The converter can quietly return a float model (calibration ranges that are NaN), or
    write non-finite scales (activations that overflow float32 on the calibration data).
    An integer input or output that is not int8 (token ids, an `argmax`) is the model's own
    and exact: with `int8_io` only a float one is a problem.
    """
    interp = interpreter(model_content, allocate=False)
    problems = []
    int8 = 0
    for t in interp.get_tensor_details():
        scales = np.asarray(t.get("quantization_parameters", {}).get("scales", []))
        if scales.size and not (np.all(np.isfinite(scales)) and np.all(scales > 0)):
            problems.append(
                f"tensor {t['name']!r} has quantization scale(s) {scales[:4].tolist()}: "
                "the model's activations overflow float32 on the calibration data"
            )
        int8 += np.dtype(t["dtype"]) == np.int8
    floats = _inner_floats(interp)
    if not int8:
        problems.append("no tensor is int8: the converter fell back to a float model")
    elif floats and not select_tf_ops:
        problems.append(f"{len(floats)} inner tensor(s) stayed float32 ({', '.join(floats[:5])})")
    if int8_io:
        for kind, details in (
            ("input", interp.get_input_details()),
            ("output", interp.get_output_details()),
        ):
            for d in details:
                if np.issubdtype(np.dtype(d["dtype"]), np.floating):
                    problems.append(
                        f"{kind} {d['name']!r} is {np.dtype(d['dtype']).name}, not int8"
                    )
    return problems


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


def predict(model_content: bytes, feeds: dict, batch_size: int, num_threads) -> dict:
    """Run the model in batches: `feeds` maps input tensor index -> array (validated by the
    caller: shapes match the file's, same number of examples); returns output tensor index ->
    float array."""
    interp = interpreter(model_content, num_threads=num_threads)
    in_details = {d["index"]: d for d in interp.get_input_details()}
    n = len(next(iter(feeds.values())))
    results = {d["index"]: [] for d in interp.get_output_details()}
    current = None
    for start in range(0, n, batch_size):
        chunk = {index: a[start : start + batch_size] for index, a in feeds.items()}
        size = len(next(iter(chunk.values())))
        if size != current:
            current = size
            for index, a in chunk.items():
                interp.resize_tensor_input(index, list(a.shape), strict=False)
            interp.allocate_tensors()
        for index, a in chunk.items():
            interp.set_tensor(index, _quantize(a, in_details[index]))
        interp.invoke()
        for detail in interp.get_output_details():
            results[detail["index"]].append(_dequantize(interp.get_tensor(detail["index"]), detail))
    return {index: np.concatenate(r, axis=0) for index, r in results.items()}
