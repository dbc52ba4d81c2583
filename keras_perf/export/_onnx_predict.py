"""`onnx_predict`: run an `.onnx` file with ONNX Runtime on inputs given as `model.predict` takes
them. Not here: the session and its settings (`keras_perf.export._onnx_session`)."""

from __future__ import annotations

import json
import os

import numpy as np

from keras_perf._utils import check_int
from keras_perf.export import _onnx_export, _onnx_session

METADATA_KEY = "keras_perf"  # What `export_onnx` writes (`_onnx.METADATA_KEY`).


def onnx_predict(path: str | os.PathLike, x, batch_size: int | None = None, *, num_threads=None):
    """Run an ONNX file on `x` with ONNX Runtime's CPU provider; outputs like `model.predict`.

    Inputs are taken as `model.predict` takes them: one array for a one-input model; for
    several inputs a list in `model.inputs` order (the order `export_onnx` stores in the
    file) or a dict keyed by input name. Outputs come back as `model.predict` returns them
    (as `tflite_predict` does): one array for one output, a list in the file's order for
    several, a dict keyed by output name for a dict-output model (the keys `export_onnx`
    stores in the file).

    Args:
        path: The `.onnx` file.
        x: An array, a list of arrays in `model.inputs` order, or a dict keyed by input name.
        batch_size: Examples per ONNX Runtime call; `None` runs `x` in one call.
            Defaults to `None`.
        num_threads: ONNX Runtime's intra-op threads; `None` for its default (one per
            core). Defaults to `None`.

    Returns:
        A numpy array, a list of arrays for a file with several outputs, or a dict of arrays
        for a dict-output model's file.

    Raises:
        ImportError: `onnxruntime` is not installed (the `onnx` extra).
        TypeError: a bad argument type.
        ValueError: `batch_size`/`num_threads` below 1; `path` is not an ONNX file ONNX
            Runtime can load; the inputs do not match the file's (number, names, shapes,
            example counts, none at all).

    Example:
        >>> import keras, numpy as np, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> _ = kp.export_onnx(model, "/tmp/m.onnx")
        >>> x = np.random.rand(5, 8).astype("float32")
        >>> bool(np.allclose(kp.onnx_predict("/tmp/m.onnx", x), model.predict(x, verbose=0),
        ...                  atol=1e-5))
        True
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a str or path-like, got {type(path).__name__}.")
    check_int("batch_size", batch_size, minimum=1, allow_none=True)
    check_int("num_threads", num_threads, minimum=1, allow_none=True)
    _onnx_export.require_onnx("onnx_predict")
    if not os.path.isfile(path):
        raise ValueError(f"`path` {str(path)!r} is not a file.")
    sess = _session(path, num_threads)
    outputs = _onnx_session.run(sess, feeds(sess, x), batch_size)
    keys = stored_outputs(sess)
    if keys is not None and len(keys) == len(outputs):
        return dict(zip(keys, outputs))
    return outputs[0] if len(outputs) == 1 else outputs


def _session(path, num_threads):
    """ONNX Runtime's session of `path`, or a `ValueError` for a file it cannot load."""
    try:
        return _onnx_session.session(path, num_threads)
    except Exception as e:  # protobuf's DecodeError, ORT's InvalidProtobuf/Fail...
        raise ValueError(
            f"`path` {str(path)!r} is not an ONNX model ONNX Runtime can load "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})"
            ". Pass a file written by `kp.export_onnx` (or `model.export(path, format='onnx')`)."
        ) from e


def stored_order(sess) -> list[str] | None:
    return _stored(sess, "inputs")


def stored_outputs(sess) -> list[str] | None:
    """A dict-output model's output keys, in the file's output order (`export_onnx`)."""
    return _stored(sess, "outputs")


def _stored(sess, key: str) -> list[str] | None:
    raw = sess.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
    try:
        return list(json.loads(raw)[key]) if raw else None
    except (ValueError, KeyError, TypeError):
        return None


def feeds(sess, x) -> dict[str, np.ndarray]:
    """{input name: checked array} from `x` as `model.predict` takes it."""
    inputs = sess.get_inputs()
    names = [i.name for i in inputs]
    order = stored_order(sess)
    if order is None or sorted(order) != sorted(names):
        order = names
    if isinstance(x, dict):
        if set(x) != set(names):
            raise ValueError(
                f"`x` is a dict with keys {sorted(map(str, x))}; the ONNX file's inputs are "
                f"named {order}: give exactly those keys."
            )
        by_name = dict(x)
    else:
        items = list(x) if isinstance(x, (list, tuple)) else [x]
        if len(items) != len(names):
            raise ValueError(
                f"The ONNX model has {len(names)} inputs ({', '.join(order)}); got "
                f"{len(items)} arrays."
            )
        by_name = dict(zip(order, items))
    out = {}
    for spec in inputs:
        label = f"input {spec.name!r}"
        try:
            a = np.asarray(by_name[spec.name])
        except Exception as e:
            raise ValueError(f"`x` for {label} cannot be read as an array ({e}).") from e
        if a.dtype.kind not in "biuf":
            raise ValueError(f"`x` for {label} has dtype {a.dtype}; expected numbers.")
        shape = spec.shape
        if a.ndim != len(shape) or any(
            isinstance(d, int) and d != g for d, g in zip(shape[1:], a.shape[1:])
        ):
            dims = ", ".join(str(d) if isinstance(d, int) else "None" for d in shape[1:])
            raise ValueError(f"`x` for {label}: expected shape (examples, {dims}), got {a.shape}.")
        dtype = {"tensor(float)": "float32", "tensor(float16)": "float16"}.get(spec.type)
        dtype = dtype or spec.type[len("tensor(") : -1]  # int64, double, bool...
        with np.errstate(over="ignore", invalid="ignore"):
            out[spec.name] = a.astype(dtype, copy=False)
    counts = {len(a) for a in out.values()}
    if len(counts) != 1:
        raise ValueError(
            f"Every input of `x` needs the same number of examples; got {sorted(counts)}."
        )
    if counts == {0}:
        raise ValueError("`x` holds no examples.")
    return out
