"""Checks `export_tflite` makes before converting: the output path and the model's inputs.

`_check_path` refuses a path TFLite's converter could not write; `_model_inputs`,
`_input_count` and `_input_specs` read the model's input signature (`None` specs for a
subclassed model, whose signature is read from the SavedModel on export). The quantization-
aware export (`_qat`) uses them too. Not here: the checks of the
calibration data (`_calibration`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import keras

from keras_perf._utils import check_choice, check_int


def _check_export_arguments(model, path, quantization, quantizations, calibration_samples):
    """The arguments every exporter (TFLite, ONNX) takes, checked before anything is written."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a str or path-like, got {type(path).__name__}.")
    if quantization is not None and not isinstance(quantization, str):
        raise TypeError(
            f"`quantization` must be None or one of {quantizations[1:]}, got "
            f"{type(quantization).__name__}."
        )
    check_choice("quantization", quantization, quantizations)
    check_int("calibration_samples", calibration_samples, minimum=1)


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
