"""Everything a `fit` changes in a model, saved before the range test and put back after it.

Lives here: `ModelState` (values of the model's variables, seed states included, the
optimizer's variables, `iterations` among them, and the metrics' variables; the model
attributes `fit` sets; the host random generators). Not here: when it is taken (at the start of
the test's `fit`, once Keras has built the model, its metrics and the optimizer, so an optimizer
unbuilt before comes back built with the values its first step would have started from) and
the learning-rate swap (`_finder`).
"""

from __future__ import annotations

import random
import sys

import numpy as np

from keras_perf._utils import host_copy, warn

_ABSENT = object()
_MODEL_ATTRIBUTES = ("history", "stop_training")


def _state_variables(model) -> list:
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    found, seen = [], set()
    for group in (
        model.variables,
        optimizer.variables,
        inner.variables if inner is not None else [],
        model.metrics_variables,
    ):
        for v in group:
            if id(v) not in seen:
                seen.add(id(v))
                found.append(v)
    return found


def host_random_state() -> tuple:
    """Python's, NumPy's and torch's global generators: they shuffle arrays and PyDatasets."""
    torch = sys.modules.get("torch")
    torch_state = torch.random.get_rng_state() if torch is not None else None
    return random.getstate(), np.random.get_state(), torch_state


def set_host_random_state(state: tuple) -> None:
    python_state, numpy_state, torch_state = state
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    if torch_state is not None:
        sys.modules["torch"].random.set_rng_state(torch_state)


class ModelState:
    """The state of `model` a `fit` changes: `save_attributes()` before the `fit`,
    `save_variables()` once it has built everything, `restore()` after it."""

    def __init__(self, model):
        self.model = model
        self._attributes = None
        self._values = None
        self._random = None

    def save_attributes(self) -> None:
        self._attributes = {a: getattr(self.model, a, _ABSENT) for a in _MODEL_ATTRIBUTES}
        self._random = host_random_state()

    def save_train_function(self) -> None:
        """Also put back the compiled step and `steps_per_execution` (when the test replaces
        them; otherwise the test's `fit` uses, or makes, the step the user's would)."""
        for name in ("train_function", "steps_per_execution"):
            self._attributes[name] = getattr(self.model, name, _ABSENT)

    def save_variables(self) -> None:
        self._values = [(v, host_copy(v)) for v in _state_variables(self.model)]

    def restore(self) -> None:
        """Put back what was saved (variables only if `save_variables` ran).

        Metrics built during the test (TensorFlow builds them in the first traced step) are
        reset, as a `fit` starts them; any other variable created during the test cannot be
        put back and is named in a warning.
        """
        if self._values is not None:
            for variable, value in self._values:
                variable.assign(value)
            saved = {id(v) for v, _ in self._values}
            for metric in self.model.metrics:
                if any(id(v) not in saved for v in metric.variables):
                    metric.reset_state()
            metric_ids = {id(v) for v in self.model.metrics_variables}
            created = [
                v.path
                for v in _state_variables(self.model)
                if id(v) not in saved and id(v) not in metric_ids
            ]
            if created:
                warn(
                    f"find_learning_rate: {len(created)} variables were created during the "
                    f"test and keep the values it left ({', '.join(created[:5])}"
                    f"{', ...' if len(created) > 5 else ''}). Build the model and its "
                    "optimizer before the test.",
                    stacklevel=4,
                )
        for name, value in (self._attributes or {}).items():
            if value is _ABSENT:
                if name in vars(self.model):
                    delattr(self.model, name)
            else:
                setattr(self.model, name, value)
        if self._random is not None:
            set_host_random_state(self._random)
