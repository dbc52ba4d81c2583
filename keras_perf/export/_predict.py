"""`tflite_predict`: run a `.tflite` file on inputs given as `model.predict` takes them.

`_feeds` matches `x` (an array, a list in `model.inputs` order, or a name-keyed dict) to the
file's input tensors and checks it. Not here: the interpreter (`keras_perf.export._tflite_lib`)
and the stored input order (`_metadata`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from keras_perf._utils import check_int
from keras_perf.export import _tflite_lib as _tflite
from keras_perf.export._metadata import _stored_input_order


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
        >>> _ = kp.export_tflite(model, "m.tflite")
        >>> x = np.random.rand(5, 8).astype("float32")
        >>> bool(np.allclose(kp.tflite_predict("m.tflite", x), model.predict(x, verbose=0),
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
