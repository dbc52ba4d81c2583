"""`inference_report`: one model, exported to every deployment format available here, timed.

Each format is exported (ONNX float/int8 with `export_onnx`, TFLite float/int8 with
`export_tflite`) and run on the same batches. Latency is measured per call, formats
alternated round by round (forward, then backward order) after a warm-up, with a pause
between formats (ONNX Runtime runs with thread spinning off, so that idle threads of one
format do not steal the CPU from the next). Agreement with the Keras model and accuracy are
computed on the whole of `x`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

import keras
import numpy as np

from keras_perf import _keras_internals as keras_internals
from keras_perf._imports import require
from keras_perf._utils import check_int, check_number

_COLUMNS = (
    "format",
    "batch_size",
    "latency_ms_p50",
    "latency_ms_p90",
    "examples_per_s",
    "bytes",
    "agreement",
    "accuracy",
)


class InferenceReport:
    """What `inference_report` measured: `rows` (one dict per format and batch size), the
    `threads` the runtimes used and the machine's `load` (1-minute average) at the start."""

    def __init__(self, rows: list[dict], threads: int, load: float | None, backend: str):
        self.rows, self.threads, self.load, self.backend = rows, threads, load, backend

    def to_dict(self) -> dict:
        return {
            "rows": [dict(r) for r in self.rows],
            "threads": self.threads,
            "load": self.load,
            "backend": self.backend,
        }

    def __str__(self) -> str:
        head = ("format", "batch", "p50 ms", "p90 ms", "examples/s", "size", "agreement", "acc")
        lines = []
        for r in self.rows:
            acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
            agree = "-" if r["agreement"] is None else f"{r['agreement']:.4g}"
            lines.append(
                (
                    r["format"],
                    str(r["batch_size"]),
                    f"{r['latency_ms_p50']:.3g}",
                    f"{r['latency_ms_p90']:.3g}",
                    f"{r['examples_per_s']:.4g}",
                    f"{r['bytes'] / 1024:.1f} KiB",
                    agree,
                    acc,
                )
            )
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        load = "" if self.load is None else f", load {self.load:.1f}"
        out = [
            f"Inference on {self.backend} (CPU, {self.threads} runtime threads{load}; "
            "latency per call, warm-up excluded):",
            fmt.format(*head),
        ]
        out += [fmt.format(*line) for line in lines]
        return "\n".join(out)

    __repr__ = __str__

    def plot(self, path=None):
        """Bar chart of the p50 latency per format, one group per batch size; saved to `path`
        when given. Returns the matplotlib figure."""
        require("matplotlib", "InferenceReport.plot")
        import matplotlib

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        sizes = sorted({r["batch_size"] for r in self.rows})
        fig, axes = plt.subplots(1, len(sizes), figsize=(4 * len(sizes), 3), squeeze=False)
        for ax, b in zip(axes[0], sizes):
            rows = [r for r in self.rows if r["batch_size"] == b]
            ax.bar([r["format"] for r in rows], [r["latency_ms_p50"] for r in rows])
            ax.set_title(f"batch {b}")
            ax.set_ylabel("p50 latency (ms)")
            ax.tick_params(axis="x", rotation=45)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path)
        return fig


def available_formats(model) -> list[str]:
    """The formats `inference_report` can measure for `model` here."""
    from keras_perf import quantization as _quantization

    qat = _quantization.is_quantized_model(model)
    return [f.name for f in _FORMATS if f.available(qat)]


def inference_report(
    model: keras.Model,
    x,
    y=None,
    batch_sizes=(1, 64),
    formats=None,
    representative_data=None,
    *,
    repeats: int = 20,
    threads: int | None = None,
    pause: float = 0.02,
) -> InferenceReport:
    """Export `model` to each deployment format and measure latency, size and agreement.

    Args:
        model: A built Sequential or Functional model (a `kp.quantize_aware` model exports
            int8 formats only, from its learned ranges).
        x: Inputs, as `model.predict` takes them (one array, or a list/dict per input).
        y: Labels of the model's first output for `accuracy`, as Keras' `"accuracy"` metric
            takes them: integer classes of shape `(n,)` or `(n, 1)`, one-hot rows, or 0/1 for
            a one-unit output. Defaults to `None` (no accuracy).
        batch_sizes: Batch sizes to time (batches are the first examples of `x`, repeated
            when `x` is shorter). Defaults to `(1, 64)`.
        formats: Any of `"keras"` (`predict_on_batch`), `"onnx"`, `"onnx-int8"`, `"tflite"`,
            `"tflite-int8"`. Defaults to `None`: every format available here.
        representative_data: Calibration data of the int8 formats. Defaults to `None`: the
            first 200 examples of `x`.
        repeats: Timed calls per format and batch size. Defaults to `20`.
        threads: Threads of ONNX Runtime and TFLite. Defaults to `None`: one per CPU core.
        pause: Seconds of sleep between two formats' calls. Defaults to `0.02`.

    Returns:
        An `InferenceReport`: `rows` (dicts with `format`, `batch_size`, `latency_ms_p50`,
        `latency_ms_p90`, `examples_per_s`, `bytes`, `agreement` (for a classifier the share
        of examples given the Keras model's class: argmax, or threshold 0.5 for one unit;
        else the max abs difference), `accuracy` (Keras' `"accuracy"` for these shapes));
        prints as a table; `to_dict()`, `plot(path)`.

    Raises:
        TypeError: a bad argument type (`pause` not a number, `y` a dict).
        ValueError: an unknown or unavailable format, `formats` empty, a bad batch size or
            `pause`, `x` with no examples or a dict `x` without an input, `y` whose length
            or shape does not fit the model's output.
        ImportError: a format's package is missing (named with its extra).

    Example:
        >>> import keras, numpy as np, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> x = np.random.rand(64, 8).astype("float32")
        >>> r = kp.inference_report(model, x, formats=["keras", "onnx"], repeats=3)
        >>> [row["format"] for row in r.rows]
        ['keras', 'onnx', 'keras', 'onnx']
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    check_int("repeats", repeats, minimum=1)
    check_int("threads", threads, minimum=1, allow_none=True)
    sizes = [batch_sizes] if isinstance(batch_sizes, int) else list(batch_sizes)
    for b in sizes:
        check_int("batch_sizes", b, minimum=1)
    if not sizes:
        raise ValueError("`batch_sizes` is empty; give at least one batch size.")
    pause = check_number("pause", pause, low=0)
    available = available_formats(model)
    if formats is None:
        formats = available
    formats = [formats] if isinstance(formats, str) else list(formats)
    if not formats:
        raise ValueError(
            f"`formats` is empty; give at least one of {available} (or None for all of them)."
        )
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"`formats` item {f!r} is not one of {FORMATS}.")
        if f not in available:
            raise ValueError(
                f"Format {f!r} is not available here for this model (available: {available}): "
                "ONNX needs the `onnx` extra, TFLite TensorFlow; a quantization-aware model "
                "exports int8 only."
            )
    arrays = _arrays(model, x)
    n = len(arrays[0])
    threads = threads or os.cpu_count() or 1
    calib = representative_data
    if calib is None:
        calib = [a[:200] for a in arrays]
        calib = calib[0] if len(calib) == 1 else calib
    labels = _labels(y, n)
    reference = model.predict(_pack(model, arrays), verbose=0, batch_size=64)
    reference = np.asarray(keras.tree.flatten(reference)[0])
    kind = _output_kind(model, reference)
    cut = _binary_threshold(model)  # the class boundary of a one-unit or sigmoid output
    if labels is not None:
        _accuracy(reference, labels)  # The labels' shape against the output's, before exporting.

    with tempfile.TemporaryDirectory() as tmp:
        runners = {f: _BY_NAME[f].runner(f, model, calib, tmp, threads) for f in formats}
        rows = []
        for b in sizes:
            index = np.arange(b) % n
            batch = [a[index] for a in arrays]
            calls = {f: runners[f][0](batch) for f in formats}
            for call in calls.values():  # Warm-up (first runs allocate and compile).
                call()
                call()
            times = {f: [] for f in formats}
            for r in range(repeats):
                for f in formats if r % 2 == 0 else reversed(formats):
                    time.sleep(pause)
                    t0 = time.perf_counter()
                    calls[f]()
                    times[f].append(time.perf_counter() - t0)
            for f in formats:
                out = runners[f][1](arrays)
                p50 = statistics.median(times[f])
                rows.append(
                    {
                        "format": f,
                        "batch_size": b,
                        "latency_ms_p50": 1e3 * p50,
                        "latency_ms_p90": 1e3 * float(np.percentile(times[f], 90)),
                        "examples_per_s": b / p50,
                        "bytes": runners[f][2],
                        "agreement": _agreement(out, reference, kind, cut),
                        "accuracy": None if labels is None else _accuracy(out, labels),
                    }
                )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return InferenceReport(rows, threads, load, keras.backend.backend())


def _arrays(model, x) -> list[np.ndarray]:
    """`x` as one array per input, in `model.inputs` order (checked before any work)."""
    names = [t.name for t in model.inputs]
    try:
        structure = model.input
    except (AttributeError, ValueError):
        structure = None
    if isinstance(x, dict):
        keys = list(structure) if isinstance(structure, dict) else names
        missing = [k for k in keys if k not in x]
        if missing:
            raise ValueError(
                f"`x` is a dict without the model's input(s) {missing}: give one array per "
                f"input, keyed {keys} (got keys {sorted(map(str, x))})."
            )
        if isinstance(structure, dict):
            arrays = [np.asarray(a) for a in keras.tree.flatten({k: x[k] for k in keys})]
        else:
            arrays = [np.asarray(x[k]) for k in names]
    elif isinstance(x, (list, tuple)):
        arrays = [np.asarray(a) for a in x]
    else:
        arrays = [np.asarray(x)]
    if len(arrays) != len(names):
        raise ValueError(f"The model has {len(names)} inputs ({names}); `x` gives {len(arrays)}.")
    if not len(arrays[0]):
        raise ValueError("`x` holds no examples.")
    return arrays


def _pack(model, arrays):
    from keras_perf.export._checks import pack_inputs

    return pack_inputs(model, arrays)


def _labels(y, n: int):
    """`y` as an array with `n` examples (checked before any work), or None."""
    if y is None:
        return None
    why = (
        "`y` must be one array of labels for the model's first output (integer classes, "
        "one-hot rows, or 0/1 for a one-unit output)"
    )
    if isinstance(y, dict):
        raise TypeError(f"{why}; got a dict.")
    try:
        labels = np.asarray(y)
    except ValueError as e:  # A ragged list (labels of several outputs).
        raise TypeError(f"{why}; got a {type(y).__name__} that is not one array ({e}).") from e
    if labels.ndim == 0 or len(labels) != n:
        raise ValueError(
            f"`y` must hold one label per example of `x` ({n}); got shape {labels.shape}."
        )
    if labels.dtype.kind not in "biuf":
        raise ValueError(f"`y` must hold numbers (class labels); got dtype {labels.dtype}.")
    return labels


_CLASSIFIER_ACTIVATIONS = ("softmax", "sigmoid", "log_softmax")


def _output_kind(model, reference) -> str:
    """`"binary"` (thresholded at 0.5: one unit, or sigmoid units), `"classes"` (argmax) or
    `"values"`.

    A classifier is a model whose first output comes from a softmax or sigmoid activation, or
    that is compiled with a crossentropy (or hinge) loss (its output may be logits), or whose
    outputs are rows of probabilities summing to 1. Anything else is a regression: its
    agreement is the max absolute difference.
    """
    activation = _output_activation(model)
    classifier = activation in _CLASSIFIER_ACTIVATIONS or _classifier_loss(model)
    if not classifier and reference.ndim >= 2 and reference.shape[-1] > 1:
        rows = reference.reshape(-1, reference.shape[-1])
        classifier = bool(
            rows.min() >= 0 and np.allclose(rows.sum(-1), 1.0, atol=1e-3) and len(rows) > 1
        )
    if not classifier or reference.ndim == 0:
        return "values"
    if reference.ndim == 1 or reference.shape[-1] == 1 or activation == "sigmoid":
        return "binary"  # Sigmoid units (multi-label): every unit's class must agree.
    return "classes"


def _output_activation(model) -> str | None:
    """The name of the activation that makes `model`'s first output, if one is found."""
    try:
        layer = keras_internals.producer(model.outputs[0])
    except (AttributeError, IndexError, TypeError, ValueError):
        layer = None
    if layer is None:
        layers = getattr(model, "layers", None)
        layer = layers[-1] if layers else None
    while isinstance(layer, keras.Model) and layer.layers:  # A nested model: its last layer.
        layer = layer.layers[-1]
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", None)
    if name is None and isinstance(activation, str):
        name = activation
    return name


def _first_loss(model):
    loss = getattr(model, "loss", None)
    return keras.tree.flatten(loss)[0] if isinstance(loss, (list, tuple, dict)) else loss


def _binary_threshold(model) -> float:
    """Where a one-unit or sigmoid output's class changes, for `agreement`: 0 for logits (no
    sigmoid or softmax makes the output and the loss takes `from_logits=True`), else 0.5.
    (`accuracy` is Keras' `"accuracy"`, whose `BinaryAccuracy` cuts at 0.5 whatever the
    output: docs/differences.md.)"""
    if _output_activation(model) in _CLASSIFIER_ACTIVATIONS:
        return 0.5
    config = getattr(_first_loss(model), "get_config", lambda: {})()
    return 0.0 if isinstance(config, dict) and config.get("from_logits") else 0.5


def _classifier_loss(model) -> bool:
    loss = _first_loss(model)
    if loss is None:
        return False
    name = (
        loss
        if isinstance(loss, str)
        else getattr(loss, "name", None) or getattr(loss, "__name__", type(loss).__name__)
    )
    name = str(name).lower()
    return "crossentropy" in name or "hinge" in name or name in ("ce", "kl_divergence")


def _agreement(out, reference, kind: str, cut: float = 0.5) -> float:
    """Share of examples classified as the Keras model does (`"binary"`: thresholded at `cut`,
    `"classes"`: argmax), or the max absolute difference (`"values"`)."""
    out = np.asarray(out, dtype=np.float32).reshape(reference.shape)
    if kind == "binary":
        same = (out > cut) == (reference > cut)
        return float(same.reshape(len(same), -1).all(-1).mean())
    if kind == "classes":
        return float((out.argmax(-1) == reference.argmax(-1)).mean())
    return float(np.abs(out - reference).max())


def _accuracy(out, labels) -> float:
    """Keras' `"accuracy"` for these shapes (`compile_utils.get_metric`): binary accuracy
    (threshold 0.5, logits too, as Keras) for a one-unit output, sparse categorical for
    integer labels of shape `(n,)` or `(n, 1)`, categorical for one-hot labels."""
    out = np.asarray(out, dtype=np.float32)
    if out.ndim == 1 or out.shape[-1] == 1:  # BinaryAccuracy
        predicted = (out.reshape(len(out), -1) > 0.5).astype(np.float32)
        truth = labels.reshape(len(labels), -1).astype(np.float32)
        if truth.shape != predicted.shape:
            raise ValueError(
                f"`y` has shape {labels.shape}; the model's output {out.shape}: give one 0/1 "
                "label per example."
            )
        return float((predicted == truth).mean())
    if labels.ndim < out.ndim or labels.shape[-1] == 1:  # SparseCategoricalAccuracy
        truth = labels.reshape(out.shape[:-1]) if labels.size == out[..., 0].size else None
        if truth is None:
            raise ValueError(
                f"`y` has shape {labels.shape}; the model's output {out.shape}: give integer "
                "classes (one per example) or one-hot rows."
            )
        return float((out.argmax(-1) == truth.astype(np.int64)).mean())
    if labels.shape != out.shape:
        raise ValueError(
            f"`y` has shape {labels.shape}; the model's output {out.shape}: give integer "
            "classes (one per example) or one-hot rows of the output's width."
        )
    return float((out.argmax(-1) == labels.argmax(-1)).mean())  # CategoricalAccuracy


def _keras_runner(fmt, model, calib, tmp, threads):
    """(batch -> zero-argument call, arrays -> first output, file bytes) for one format."""
    size = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights)

    def keras_call(batch):
        data = _pack(model, batch)
        return lambda: model.predict_on_batch(data)

    def keras_all(arrays):
        out = model.predict(_pack(model, arrays), verbose=0, batch_size=64)
        return keras.tree.flatten(out)[0]

    return keras_call, keras_all, size


def _onnx_runner(fmt, model, calib, tmp, threads):
    from keras_perf.export import _onnx_session
    from keras_perf.export._onnx import export_onnx
    from keras_perf.export._onnx_predict import feeds

    path = os.path.join(tmp, f"{fmt}.onnx")
    int8 = fmt == "onnx-int8"
    from keras_perf import quantization as _quantization

    data = None if not int8 or _quantization.is_quantized_model(model) else calib
    report = export_onnx(model, path, "int8" if int8 else None, data)
    sess = _onnx_session.session(path, threads)

    def onnx_call(batch):
        f = feeds(sess, batch)
        return lambda: sess.run(None, f)

    def onnx_all(arrays):
        return _onnx_session.run(sess, feeds(sess, arrays), 64)[0]

    return onnx_call, onnx_all, report["bytes"]


def _tflite_runner(fmt, model, calib, tmp, threads):
    from keras_perf import quantization as _quantization
    from keras_perf.export import _tflite_lib as _tflite
    from keras_perf.export._convert import export_tflite
    from keras_perf.export._metadata import _stored_input_order
    from keras_perf.export._predict import _feeds, tflite_predict

    path = os.path.join(tmp, f"{fmt}.tflite")
    if fmt == "tflite":
        report = export_tflite(model, path)
    elif _quantization.is_quantized_model(model):
        report = export_tflite(model, path, "int8", int8_io=False)
    else:
        report = export_tflite(model, path, "int8", representative_data=calib, int8_io=False)
    content = open(path, "rb").read()
    details = _tflite.describe(content)[0]
    order = _stored_input_order(content)

    def tflite_call(batch):
        interp = _tflite.interpreter(content, num_threads=threads, allocate=False)
        fed = _feeds(batch if len(batch) > 1 else batch[0], details, order)
        for index, a in fed.items():
            interp.resize_tensor_input(index, list(a.shape), strict=False)
        interp.allocate_tensors()
        for index, a in fed.items():
            interp.set_tensor(index, a)
        out = interp.get_output_details()[0]["index"]

        def call():
            interp.invoke()
            return interp.get_tensor(out)

        return call

    def tflite_all(arrays):
        out = tflite_predict(content, arrays if len(arrays) > 1 else arrays[0], 64, threads)
        return keras.tree.flatten(out)[0]

    return tflite_call, tflite_all, report["bytes"]


def _onnx_available(qat: bool) -> bool:
    import importlib.util

    from keras_perf.export._onnx_export import EXPORTERS

    exporter = EXPORTERS.get(keras.backend.backend())  # Keras' ONNX exporter of the backend
    return all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime", exporter or "onnx"))


def _tflite_available(qat: bool) -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None


class _Format(NamedTuple):
    """One format of the report: `available(qat)` says whether it can run here (for a
    quantization-aware model when `qat`); `runner(fmt, model, calib, tmp, threads)` writes the
    file and returns (batch -> zero-argument call, arrays -> first output, file bytes)."""

    name: str
    available: Callable[[bool], bool]
    runner: Callable


# The formats, in report order. A new format: one module that writes and runs it, and one entry.
_FORMATS = (
    _Format("keras", lambda qat: True, _keras_runner),
    _Format("onnx", lambda qat: not qat and _onnx_available(qat), _onnx_runner),
    _Format("onnx-int8", _onnx_available, _onnx_runner),
    _Format("tflite", lambda qat: not qat and _tflite_available(qat), _tflite_runner),
    _Format("tflite-int8", _tflite_available, _tflite_runner),
)
_BY_NAME = {f.name: f for f in _FORMATS}
FORMATS = tuple(_BY_NAME)
