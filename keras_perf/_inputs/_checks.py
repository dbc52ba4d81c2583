"""Checks of the training data a tool takes "as `fit` takes it", before any work is done.

Keras finds these problems only inside `fit` (after a tool has made twins, saved state or
traced a step), and says them in its own words: no examples is a `ZeroDivisionError` in its
array adapter, a dict missing one of a Functional model's inputs an error from inside the
model's call. Each check here names the tool, the argument and the fix. Also here: a
generator refused where a probe batch would consume it (`check_not_consumable`), the
`memory_limit_bytes` a tool caps a step's peak at (`check_memory_limit`), and train-step
settings set on a plain model, which Keras ignores (`check_no_ignored_settings`).
"""

from __future__ import annotations

import math
import types

import keras

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf._inputs._kinds import is_array_input, is_tf_dataset
from keras_perf._utils import check_number


def _inputs_of(x):
    """The inputs part of `x` where it can be read without consuming anything: the arrays
    themselves, or a tf.data dataset's element spec (its first item when it yields tuples)."""
    if is_tf_dataset(x):
        spec = x.element_spec
        return spec[0] if isinstance(spec, tuple) else spec
    return x


def required_input_names(model) -> list[str] | None:
    """The keys a dict `x` must have for a Functional model with several inputs: the keys of
    its input dict, or its inputs' names (Keras matches a dict to a list of inputs by name);
    None where the model does not say (subclassed models, a single input)."""
    if not keras_internals.is_functional(model):
        return None
    struct = keras_internals.input_structure(model)
    if isinstance(struct, dict):
        return list(struct)
    inputs = getattr(model, "inputs", None) or []
    if len(inputs) < 2:
        return None
    return [getattr(t, "name", None) for t in inputs]


def check_fit_data(caller: str, model, x) -> None:
    """Raise a `ValueError` naming `x` and the fix where `x` holds no examples (arrays, an empty
    tf.data dataset or PyDataset) or is a dict (or a tf.data dataset of dicts) without one of
    `model`'s inputs. Anything else is left to `fit`'s own checks."""
    if is_array_input(x):
        leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
        shape = getattr(leaves[0], "shape", ())
        if len(shape) > 0 and shape[0] is not None and int(shape[0]) == 0:
            raise ValueError(
                f"{caller}: `x` holds no examples (its arrays have 0 rows); pass the training "
                "data as for `model.fit`, at least one batch of it."
            )
    elif is_tf_dataset(x) and int(x.cardinality()) == 0:
        raise ValueError(
            f"{caller}: the tf.data dataset `x` is empty (cardinality 0); pass the training "
            "data as for `model.fit`, at least one batch of it."
        )
    elif isinstance(x, keras.utils.PyDataset):
        try:
            empty = len(x) == 0
        except TypeError:  # an infinite PyDataset has no length
            empty = False
        if empty:
            raise ValueError(f"{caller}: the PyDataset `x` is empty (`len(x) == 0`).")
    inputs = _inputs_of(x)
    required = required_input_names(model)
    if not required:
        return
    if isinstance(inputs, (list, tuple)) and isinstance(
        keras_internals.input_structure(model), list
    ):
        if len(inputs) != len(required):
            raise ValueError(
                f"{caller}: `x` is a {type(inputs).__name__} of {len(inputs)} arrays, but the "
                f"model has {len(required)} inputs {required}: give one array per input, in "
                "that order (or a dict keyed by those names)."
            )
        return
    if not isinstance(inputs, dict):
        return
    missing = [name for name in required if name not in inputs]
    if missing:
        raise ValueError(
            f"{caller}: `x` is a dict without the model's input(s) {missing} (it has the keys "
            f"{sorted(map(str, inputs))}): give `x` one array per model input, keyed by the "
            f"names of its keras.Input layers {required}."
        )


def check_not_consumable(x, caller: str) -> None:
    """Refuse a generator or iterator `x`, which reading a probe batch would consume."""
    if isinstance(x, types.GeneratorType) or (hasattr(x, "__next__") and iter(x) is x):
        raise TypeError(
            f"{caller}: `x` is a generator or iterator, which the probe would "
            "consume. Pass arrays, a `tf.data.Dataset`, a `keras.utils.PyDataset` or a torch "
            "DataLoader."
        )


def check_memory_limit(caller: str, memory_limit_bytes) -> int:
    """`memory_limit_bytes` (not None) as an int: a finite number of bytes above 0, on a backend
    that can measure a step's peak here (a `ValueError` naming `caller` where it cannot)."""
    limit = check_number("memory_limit_bytes", memory_limit_bytes, low=0, low_inclusive=False)
    if not math.isfinite(limit):
        raise ValueError(f"`memory_limit_bytes` must be finite, got {memory_limit_bytes!r}.")
    problem = _backend.step_memory_unavailable()
    if problem is not None:
        raise ValueError(f"{caller}(memory_limit_bytes=...): {problem}")
    return int(limit)


# keras-perf's train-step settings: attributes a plain Keras model has no use for.
_TRAIN_STEP_SETTINGS = ("remat", "remat_threshold", "microbatches")


def check_no_ignored_settings(caller: str, model) -> None:
    """Raise a `ValueError` where `model` is a plain Keras model (without keras-perf's train
    step) on which `remat`, `remat_threshold` or `microbatches` was set as an attribute: Keras
    never reads it, so the user's model would not recompute or slice what they think it does.
    A plain attribute on a plain model cannot be intercepted when it is set; it is caught
    here, where a keras-perf tool first sees the model."""
    from keras_perf.train_step import LossScaleTrainStep

    if isinstance(model, LossScaleTrainStep):
        return
    found = {
        name: vars(model)[name]
        for name in _TRAIN_STEP_SETTINGS
        if vars(model).get(name) is not None
    }
    if not found:
        return
    settings = ", ".join(f"{name}={value!r}" for name, value in found.items())
    raise ValueError(
        f"{caller}: `model.{next(iter(found))}` is set on a plain {type(model).__name__}, whose "
        f"Keras train step ignores it: nothing is recomputed or sliced. Wrap it with "
        f"`model = kp.loss_scaled(model, {settings})` (it keeps the compile settings), or "
        "delete the attribute."
    )
