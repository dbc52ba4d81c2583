"""Calibration data of an `"int8"` export: `representative_data` read, checked and fed.

`_calibration` turns `representative_data` (arrays, a list or dict per input, or a callable
yielding samples) into one array per input in `model.inputs` order; `_check_calibration`
checks it against the model's inputs (shapes, counts, finite values and outputs) before
TFLite's calibrator sees it; `_dataset` feeds it to the converter. Not here: the conversion
(`_convert`, `keras_perf.export._tflite_lib`).
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np


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
                    f"{where[0]}). Calibration needs finite ranges (in TFLite an Inf crashes "
                    "the converter, NaN gives a float file): clean or drop those examples."
                )
    counts = {len(a) for a in arrays}
    if len(counts) != 1:
        raise ValueError(
            "`representative_data` must hold the same number of examples for every input; got "
            f"{ {name: len(a) for name, a in zip(names, arrays)} }."
        )
    _check_varied(arrays, names)
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


def _check_varied(arrays: list[np.ndarray], names: list[str]) -> None:
    """A `ValueError` when every input's calibration data is one constant value (all zeros):
    every activation range then collapses to one point and the int8 file agrees with the
    model on next to nothing (0 to 17 % of argmaxes were seen); a `KerasPerfWarning` when
    only some inputs are constant (a mask of ones can be, but its range is one value)."""
    constant = [k for k, a in enumerate(arrays) if a.size and a.min() == a.max()]
    if not constant:
        return
    labels = [
        f"input {_input_label(names, k)} (all {float(arrays[k].flat[0]):g})" for k in constant
    ]
    if len(constant) == len(arrays):
        raise ValueError(
            f"`representative_data` is constant ({'; '.join(labels)}): calibration would "
            "give every activation a one-value range, and the int8 file would disagree with the "
            "model on nearly every example. Pass ~100-500 real training examples "
            "(`representative_data=x_train[:200]`), or use quantization='dynamic', which needs "
            "no data."
        )
    from keras_perf._utils import warn

    warn(
        f"`representative_data` is constant for {'; '.join(labels)}: its int8 range holds one "
        "value, so the file will treat any other value of that input as this one. Pass real "
        "examples if that input varies in use.",
        stacklevel=5,
    )
