"""The train step's settings, declared once: `SETTINGS` (plus the `remat` pair).

One entry is one keyword of `kp.LossScaleTrainStep(...)` and `kp.loss_scaled(...)`, one key of
`get_config()`, one validated property of the model, and one value that the models keras-perf
rebuilds (`kp.quantize_aware`, `kp.shrink`) and the twins it measures (`diagnose`,
`accelerate`) carry over (`settings` / `apply_settings`). `TrainStepBase.__init__`,
`get_config` and its properties, `loss_scaled` and `keras_perf._carry_over` all read this
table, so a new setting is one entry here, its keyword in `loss_scaled`'s signature and
docstring (tests/test_train_step.py checks both), and its semantics.

`remat` and `remat_threshold` are one pair, validated together (`_remat.check_remat`, which
also reads the model's layer names) and set with `set_remat`: `REMAT` names them beside the
table, and `settings` / `apply_settings` handle them. Backend-neutral, like `_base.py`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import keras

from keras_perf._utils import KerasPerfWarning, check_int, check_number
from keras_perf.train_step._remat import check_remat, check_remat_names

KEEP = "keep"  # `loss_scaled`'s default for "the model's own setting (the default for a new one)"


def check_microbatches(value) -> int:
    return check_int("microbatches", value, minimum=1)


def check_clipnorm(value):
    return check_number("clipnorm", value, low=0.0, low_inclusive=False, allow_none=True)


def check_initial_scale(value):
    return check_number("initial_scale", value, low=0.0, low_inclusive=False)


def check_dynamic_growth_steps(value) -> int:
    return check_int("dynamic_growth_steps", value, minimum=1)


TRACED_STEP_VALUES = (False, True, "inductor")


def check_traced_step(value):
    """Validate `traced_step`; on TensorFlow and JAX a `KerasPerfWarning` says it changes
    nothing there (their train step is already one compiled graph)."""
    if not any(value is v or (isinstance(v, str) and value == v) for v in TRACED_STEP_VALUES):
        raise ValueError(f"`traced_step` must be False, True or 'inductor'; got {value!r}.")
    if value is not False and keras.backend.backend() != "torch":
        warnings.warn(
            f"traced_step={value!r} applies to the PyTorch backend only: on "
            f"{keras.backend.backend()} keras-perf's train step is already traced into one "
            "compiled graph (tf.function / jax.jit), so the setting changes nothing here. It is "
            "kept in the model's config for PyTorch.",
            KerasPerfWarning,
            stacklevel=3,
        )
    return value


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of the train step.

    Attributes:
        name: The keyword, `get_config` key and property name (stored as `_<name>`).
        default: The value of a model built without it.
        check: Validates a value and returns it normalised; raises `ValueError`/`TypeError`
            naming the argument.
        doc: The property's docstring.
        at_compile: Read only when `compile` wraps the optimizer (the loss-scale settings):
            setting it does not re-make the train function, and `loss_scaled` on a model that
            already has the step leaves it as it is.
        keep: `loss_scaled`'s default for this keyword, meaning "the model's own setting (the
            default for a new model)": `"keep"`, or None (`microbatches=None`). Not used
            where `at_compile` (the keyword has a plain default).
    """

    name: str
    default: object
    check: Callable
    doc: str
    at_compile: bool = False
    keep: object = KEEP

    @property
    def attr(self) -> str:
        return "_" + self.name

    def kept(self, value) -> bool:
        """Whether `value` passed to `loss_scaled` means "keep the model's own setting"."""
        if self.at_compile:
            return False  # a plain default: passed as it is
        if self.keep is None:
            return value is None
        return isinstance(value, str) and value == self.keep

    def as_property(self) -> property:
        """The model's property: validated on assignment; a change re-makes the train function
        (Keras rebuilds it on the next fit) unless the setting is read at compile time."""
        setting = self

        def get(model):
            return getattr(model, setting.attr)

        def set_(model, value):
            value = setting.check(value)
            current = getattr(model, setting.attr)
            if value is not current and value != current:
                setattr(model, setting.attr, value)
                if not setting.at_compile:
                    model.train_function = None

        return property(get, set_, doc=self.doc)


SETTINGS = (
    Setting(
        "microbatches",
        1,
        check_microbatches,
        "Slices per batch; setting it rebuilds the compiled train function.",
        keep=None,  # loss_scaled's `microbatches=None` keeps the model's own
    ),
    Setting(
        "clipnorm",
        None,
        check_clipnorm,
        "Global-norm clip of the unscaled gradients; setting it rebuilds the train function.",
    ),
    Setting(
        "initial_scale",
        2.0**15,
        check_initial_scale,
        "Loss scale to start from under float16 (read when `compile` wraps the optimizer).",
        at_compile=True,
    ),
    Setting(
        "dynamic_growth_steps",
        2000,
        check_dynamic_growth_steps,
        "Finite steps after which the loss scale doubles (read when `compile` wraps the "
        "optimizer).",
        at_compile=True,
    ),
    Setting(
        "traced_step",
        False,
        check_traced_step,
        'Whether the step runs traced (PyTorch): False, True or "inductor"; setting it '
        "rebuilds the train function (see keras_perf/train_step/torch_traced.py).",
    ),
)
BY_NAME = {s.name: s for s in SETTINGS}
# The remat pair (keras_perf/train_step/_remat.py: `RematSettings`), validated together.
REMAT = ("remat", "remat_threshold")
NAMES = tuple(BY_NAME) + REMAT


def settings(model) -> dict:
    """Every setting of `model`'s train step, by name (`NAMES`): what a twin must carry."""
    return {name: getattr(model, name) for name in NAMES}


def apply_settings(model, values: dict) -> None:
    """Set `values` (a subset of `NAMES`) on `model`, a `kp.LossScaleTrainStep` model: all
    validated first, so that on error the model is unchanged."""
    unknown = sorted(set(values) - set(NAMES))
    if unknown:
        raise ValueError(f"Unknown train-step settings {unknown}; known: {list(NAMES)}.")
    checked = {name: BY_NAME[name].check(v) for name, v in values.items() if name in BY_NAME}
    remat = None
    if any(name in values for name in REMAT):
        remat = check_remat(
            values.get("remat", model.remat), values.get("remat_threshold", model.remat_threshold)
        )
        check_remat_names(model, remat[0])
    for name, value in checked.items():
        setattr(model, name, value)
    if remat is not None:
        model.set_remat(*remat)
