"""`StepSpy`: runs code around calls of Keras' train function during `fit` (JAX and torch).

Backend-neutral and private to `keras_perf.backend`: the JAX and torch implementation modules
measure one training step of a `fit` through it (`epoch_memory`). Keras' trainers call the
public attribute `model.train_function` once per step (JAX: ``(state, iterator)``, torch:
``([batch])``), after `make_train_function` and before `on_train_begin`; a callback can put a
function of the same signature in its place and take it out again, which is what this does.
"""

from __future__ import annotations


def _original(fn):
    # A spy left in place by a `fit` that raised before its callbacks could remove it.
    while getattr(fn, "_kp_original", None) is not None:
        fn = fn._kp_original
    return fn


class StepSpy:
    """Puts `self.call(original, *args)` in place of `model.train_function` until `remove()`.

    `install()` (again at each epoch: a callback may have rebuilt the train function) wraps
    whatever train function the model holds now; `remove()` puts the original back if the
    model still holds the wrapper. Subclasses define `call`.
    """

    def __init__(self, model) -> None:
        self.model = model
        self._wrapper = None

    def install(self) -> bool:
        current = getattr(self.model, "train_function", None)
        if current is None:
            return False
        if current is self._wrapper:
            return True
        original = _original(current)

        def wrapper(*args):
            return self.call(original, *args)

        wrapper._kp_original = original
        self._wrapper = wrapper
        self.model.train_function = wrapper
        return True

    def remove(self) -> None:
        wrapper, self._wrapper = self._wrapper, None
        if wrapper is not None and getattr(self.model, "train_function", None) is wrapper:
            self.model.train_function = wrapper._kp_original

    def call(self, original, *args):  # pragma: no cover - subclasses define it
        raise NotImplementedError
