"""Small shared helpers: argument validation, warnings, layer traversal.

Every public piece validates its arguments with these helpers so that errors read the same
everywhere: they name the argument, show the value received and say what is accepted.

Backend-neutral, on the ground floor of the package: it imports Keras and
`keras_perf._keras_internals` only, never `keras_perf.backend` (tests/test_imports.py checks).
"""

from __future__ import annotations

import contextlib
import numbers
import threading
import warnings
from collections.abc import Iterator, Mapping

import keras
import numpy as np

from keras_perf import _keras_internals as keras_internals

_LOCAL = threading.local()


@contextlib.contextmanager
def _thread_flag(name: str):
    """Set a flag of this thread for the duration of a `with` block (nesting restores it).

    Thread-local because tf.distribute.MirroredStrategy runs the replicas' steps in threads.
    """
    previous = getattr(_LOCAL, name, False)
    setattr(_LOCAL, name, True)
    try:
        yield
    finally:
        setattr(_LOCAL, name, previous)


def training_step():
    """Marks the current thread as inside a keras-perf train step."""
    return _thread_flag("in_train_step")


def in_training_step() -> bool:
    return getattr(_LOCAL, "in_train_step", False)


def metric_results_deferred():
    """Inside it, `kp.LossScaleTrainStep.get_metrics_result()` returns `{}` at once.

    Keras' `compute_metrics` updates the metrics and then returns `get_metrics_result()`. The
    train step calls it once per slice and reads the results once at the end; without this it
    would compute every result once per slice plus once more, for nothing (eagerly on
    PyTorch; traced into the compiled step on TensorFlow and JAX).
    """
    return _thread_flag("defer_results")


def metric_results_are_deferred() -> bool:
    return getattr(_LOCAL, "defer_results", False)


class ReadOnlyReport(Mapping):
    """A read-only mapping over `self._data`: the base of the reports that print as tables."""

    _data: dict

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class KerasPerfWarning(UserWarning):
    """Category of every warning keras-perf emits (tests turn it into an error)."""


def warn(message: str, stacklevel: int = 3) -> None:
    """Emit a `KerasPerfWarning` pointing at the user's call site."""
    warnings.warn(message, KerasPerfWarning, stacklevel=stacklevel)


def check_int(name: str, value, *, minimum: int | None = None, allow_none: bool = False):
    """Return `value` if it is an int (not a bool) >= `minimum`; raise otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be an integer, got {value!r} of type {type(value).__name__}."
        )
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def check_number(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_none: bool = False,
):
    """Return `value` as a float if it is a real number inside the given interval."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a number, got {value!r} of type {type(value).__name__}.")
    value = float(value)
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high or value != value:  # value != value: NaN
        lo = "-inf" if low is None else repr(low)
        hi = "inf" if high is None else repr(high)
        interval = f"{'[' if low_inclusive and low is not None else '('}{lo}, {hi}{']' if high_inclusive and high is not None else ')'}"
        raise ValueError(f"`{name}` must be in {interval}, got {value!r}.")
    return value


def check_bool(name: str, value) -> bool:
    """Return `value` if it is a bool; raise `TypeError` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {value!r}.")
    return value


def check_choice(name: str, value, choices):
    """Return `value` if it is one of `choices`; raise `ValueError` listing them otherwise."""
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {options}; got {value!r}.")
    return value


def iter_layers(model: keras.layers.Layer) -> Iterator[keras.layers.Layer]:
    """Yield every layer nested inside `model` (depth first, each once, `model` excluded).

    Works for Sequential, Functional and subclassed models and for layers nested in layers,
    because it walks Keras' own layer tracking rather than `model.layers` alone.
    """
    seen = {id(model)}
    stack = list(reversed(_direct_sublayers(model)))
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield layer
        stack.extend(reversed(_direct_sublayers(layer)))


def _direct_sublayers(layer) -> list:
    sub = keras_internals.direct_sublayers(layer)
    return [s for s in sub if isinstance(s, keras.layers.Layer)]


def host_copy(variable) -> np.ndarray:
    """A NumPy copy of a Keras variable's value, to put back later.

    `copy=True`: on a CPU, torch and JAX may hand out views of the live buffers. `numpy()`
    rather than `convert_to_numpy(v.value)`: under a tf.distribute strategy a metric's
    variables are sync-on-read, which `numpy()` reads (aggregated) and the other raises on.
    """
    return np.array(variable.numpy(), copy=True)


def sum_of_squares(tensors):
    """Sum of the squares of all entries of `tensors`, in float32: a dot product per tensor,
    so no squared temporary (flattened: torch's vdot takes only 1-D tensors; reshape is a
    view, no copy)."""
    flat = [keras.ops.reshape(keras.ops.cast(t, "float32"), (-1,)) for t in tensors]
    return keras.ops.sum(keras.ops.stack([keras.ops.vdot(t, t) for t in flat]))


def all_finite(sum_sq, tensors):
    """Whether every entry of `tensors` is finite, given their float32 sum of squares.

    A NaN or inf anywhere makes `sum_sq` non-finite; only then is each tensor checked, to tell
    a real non-finite entry from finite ones whose squared sum overflows float32. Decided
    inside the compiled step (a backend `cond`, no host synchronisation).
    """
    ops = keras.ops
    return ops.cond(
        ops.isfinite(sum_sq),
        lambda: ops.ones((), "bool"),
        lambda: ops.all(ops.stack([ops.all(ops.isfinite(t)) for t in tensors])),
    )


def update_step_metrics(model, norm, finite):
    """Record a step's gradient norm (finite steps only) and a skip if not finite.

    The generic form of the train step's `_kp_update_step_metrics` hook: Keras metric updates,
    traced into the compiled step on TensorFlow and JAX.
    """
    ops = keras.ops
    finite_f = ops.cast(finite, "float32")
    model.grad_norm_tracker.update_state(ops.where(finite, norm, 0.0), sample_weight=finite_f)
    model.skipped_steps_tracker.update_state(1 - ops.cast(finite, "int32"))


def map_batch(fn, structure):
    """Apply `fn` to every tensor of a (nested) batch structure, leaving `None` entries alone."""
    return keras.tree.map_structure(lambda t: None if t is None else fn(t), structure)


def first_tensor(structure):
    """The first non-None tensor of a (nested) batch structure (its batch size is the batch's)."""
    return next(t for t in keras.tree.flatten(structure) if t is not None)
