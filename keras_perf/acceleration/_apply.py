"""Setting the chosen execution settings on the user's model, in place.

`jit_compile` and `steps_per_execution` are the Trainer's own attributes (Keras 3.15): set, the
cached train/test/predict functions dropped so that the next `fit` traces them anew with the
same model, optimizer (its variables and `iterations`), loss and metrics. They are also written
into the compile config Keras keeps (`model.get_compile_config()`), so that `model.save` /
`load_model` and the models keras-perf rebuilds from that config (`kp.loss_scaled`, as
`kp.fit_with_oom_retry`'s rungs call it) keep them. `model.compile(...)` again replaces all of
it: the model is plain Keras again.

`traced_step` installs keras-perf's traced torch train step (`install_traced_step`). On torch
`steps_per_execution` comes only with it (Keras' torch backend refuses values above 1; the
installed step runs them): it is set on the model, not in the compile config, so that a saved
or rebuilt model is plain Keras that runs.
"""

from __future__ import annotations

import warnings

import keras

from keras_perf import _keras_internals as keras_internals
from keras_perf._utils import KerasPerfWarning

COMPILE_SETTINGS = ("jit_compile", "steps_per_execution")
# Settings `accelerate` can apply; the others (dtype_policy, batch_size) are the user's to make.
KNOWN = COMPILE_SETTINGS + ("traced_step",)


def applicable(settings) -> bool:
    return all(k in KNOWN for k in settings)


NOT_AVAILABLE = "not available in this build"


class Unavailable(Exception):
    """A candidate that cannot run (or be applied) on this model; the message says why."""


def torch_traced():
    """keras-perf's traced torch train step module, or None when this build lacks it."""
    try:
        from keras_perf.train_step import torch_traced as module
    except ImportError:
        return None
    return module


def install_traced(model, mode=True) -> None:
    """Install keras-perf's traced step (`mode` "inductor": through torch.compile)."""
    module = torch_traced()
    if module is None:
        raise Unavailable(NOT_AVAILABLE)
    with warnings.catch_warnings():
        # A fallback known at once (say, micro-batches) is this candidate's row note.
        warnings.simplefilter("ignore", KerasPerfWarning)
        module.install_traced_step(model, inductor=(mode == "inductor"))
    state = module.traced_step_state(model)
    if not state.get("active"):
        raise Unavailable(f"keras-perf's traced step fell back: {state.get('reason')}")


def check_traced(model, settings) -> None:
    """Raise `Unavailable` with the reason where keras-perf's traced step, asked for in
    `settings`, fell back to the model's own step (found at the first step it traced)."""
    if not settings.get("traced_step"):
        return
    state = torch_traced().traced_step_state(model)
    if not state.get("active"):
        raise Unavailable(f"keras-perf's traced step fell back: {state.get('reason')}")


def apply(model, settings) -> None:
    """Set `settings` on `model` in place (the traced step first: installing it can fail)."""
    if settings.get("traced_step"):
        install_traced(model, settings["traced_step"])
    for key in COMPILE_SETTINGS:
        if key in settings:
            setattr(model, key, settings[key])
    stored = keras_internals.compile_config(model)
    config = getattr(stored, "config", None)
    if isinstance(config, dict):
        for key in COMPILE_SETTINGS:
            if key in settings and not (key == "steps_per_execution" and is_torch()):
                config[key] = settings[key]
    model.train_function = None
    model.test_function = None
    model.predict_function = None


def is_torch() -> bool:
    return keras.backend.backend() == "torch"
