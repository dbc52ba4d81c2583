"""Pruning schedules: when to recompute the masks, and at which sparsity (tfmot semantics)."""

from __future__ import annotations

import math

import keras
import numpy as np

from keras_perf._utils import check_int, check_number
from keras_perf.pruning._polynomial import _f32, _polynomial_sparsity


class PruningSchedule:
    """Base class of pruning schedules: when to recompute the masks, and at which sparsity.

    A schedule is called with an integer training step (the optimizer's iteration count at
    the start of the batch) and returns `(should_prune, sparsity)`: a Python bool and a
    Python float. Subclasses implement `__call__` and `get_config`.

    Example:

    >>> schedule = kp.ConstantSparsity(0.5, begin_step=0, frequency=100)
    >>> schedule(200)
    (True, 0.5)
    """

    def __call__(self, step: int) -> tuple[bool, float]:
        raise NotImplementedError("A PruningSchedule subclass must implement `__call__(step)`.")

    def get_config(self) -> dict:
        raise NotImplementedError("A PruningSchedule subclass must implement `get_config()`.")

    @classmethod
    def from_config(cls, config: dict):
        """Create a schedule from the dict `get_config` returned.

        tfmot's nested form, `{"class_name": ..., "config": {...}}` (what tfmot's own
        `get_config` returns), is accepted as well.
        """
        if "config" in config and "class_name" in config:
            config = config["config"]
        return cls(**config)

    @staticmethod
    def _should_prune_in_step(step: int, begin_step: int, end_step: int, frequency: int) -> bool:
        # tfmot: begin <= step and (step <= end or end < 0) and (step - begin) % frequency == 0
        in_range = step >= begin_step and (step <= end_step or end_step < 0)
        return bool(in_range and (step - begin_step) % frequency == 0)

    @staticmethod
    def _check_steps(begin_step, end_step, frequency, allow_forever: bool):
        begin_step = check_int("begin_step", begin_step, minimum=0)
        end_step = check_int("end_step", end_step)
        frequency = check_int("frequency", frequency, minimum=1)
        if end_step == -1 and not allow_forever:
            raise ValueError(
                "`end_step` cannot be -1 for a decaying schedule: the sparsity needs a step to "
                "reach `final_sparsity`; pass an `end_step` >= `begin_step`."
            )
        if end_step != -1 and end_step < begin_step:
            raise ValueError(
                f"`end_step` must be >= `begin_step` ({begin_step})"
                + (" or -1 (prune until training ends)" if allow_forever else "")
                + f"; got {end_step}."
            )
        return int(begin_step), int(end_step), int(frequency)


def _check_sparsity(name: str, value) -> float:
    return check_number(name, value, low=0.0, high=1.0, high_inclusive=False)


def _config_repr(name: str, config: dict) -> str:
    """`Name(key=value, ...)` from a schedule's config."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in config.items())})"


@keras.saving.register_keras_serializable(package="keras_perf", name="ConstantSparsity")
class ConstantSparsity(PruningSchedule):
    """Constant sparsity every `frequency` steps in `[begin_step, end_step]` (tfmot semantics).

    Args:
        target_sparsity: Fraction of each weight to set to zero, in `[0, 1)`.
        begin_step: First step at which the masks are computed. Defaults to `0`.
        end_step: Last step at which the masks may be recomputed, or `-1` for no end.
            Defaults to `-1`.
        frequency: Recompute the masks every `frequency` steps from `begin_step`.
            Defaults to `100`.

    Returns:
        Called with a step: `(should_prune, sparsity)`, where `should_prune` is
        `begin_step <= step <= end_step` (or `end_step == -1`) and
        `(step - begin_step) % frequency == 0`, and `sparsity` is `target_sparsity` (as float32).

    Raises:
        ValueError: `target_sparsity` outside `[0, 1)`, `begin_step < 0`,
            `end_step < begin_step` (other than -1) or `frequency < 1`.
        TypeError: a step argument that is not an integer.

    Example:

    >>> schedule = kp.ConstantSparsity(0.5, begin_step=100, frequency=50)
    >>> schedule(150), schedule(160)[0]
    ((True, 0.5), False)
    """

    def __init__(
        self,
        target_sparsity: float,
        begin_step: int = 0,
        end_step: int = -1,
        frequency: int = 100,
    ):
        self.target_sparsity = _check_sparsity("target_sparsity", target_sparsity)
        self.begin_step, self.end_step, self.frequency = self._check_steps(
            begin_step, end_step, frequency, allow_forever=True
        )

    def __call__(self, step: int) -> tuple[bool, float]:
        step = int(step)
        should = self._should_prune_in_step(step, self.begin_step, self.end_step, self.frequency)
        return should, _f32(self.target_sparsity)

    def get_config(self) -> dict:
        return {
            "target_sparsity": self.target_sparsity,
            "begin_step": self.begin_step,
            "end_step": self.end_step,
            "frequency": self.frequency,
        }

    def __repr__(self) -> str:
        return _config_repr("ConstantSparsity", self.get_config())


@keras.saving.register_keras_serializable(package="keras_perf", name="PolynomialDecay")
class PolynomialDecay(PruningSchedule):
    """Sparsity rising from `initial_sparsity` to `final_sparsity` (tfmot semantics).

    At step `t`, with `p = clip((t - begin_step) / (end_step - begin_step), 0, 1)`:
    `s = final + (initial - final) * (1 - p) ** power`. The value is tfmot's bit for bit, as
    tfmot computes it during `fit` (in float32, inside a `tf.function`, where TensorFlow's
    graph optimizer multiplies by `1 / (end_step - begin_step)` instead of dividing; tfmot's
    schedule called eagerly can be one float32 ulp away on a few percent of steps). The
    masks are recomputed every `frequency` steps in `[begin_step, end_step]`.

    Args:
        initial_sparsity: Sparsity at `begin_step`, in `[0, 1)`.
        final_sparsity: Sparsity from `end_step` on, in `[0, 1)`.
        begin_step: First step at which the masks are computed (>= 0).
        end_step: Step at which `final_sparsity` is reached; must be >= `begin_step`.
        power: Exponent of the decay, a finite number > 0; 3 rises fast, then levels off.
            Defaults to `3`.
        frequency: Recompute the masks every `frequency` steps from `begin_step`.
            Defaults to `100`.

    Returns:
        Called with a step: `(should_prune, sparsity)`.

    Raises:
        ValueError: a sparsity outside `[0, 1)`, `begin_step < 0`, `end_step < begin_step`
            (`-1` is not accepted here), `frequency < 1` or `power` not finite and > 0.
        TypeError: a non-numeric argument.

    Example:

    >>> schedule = kp.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=1000, frequency=100)
    >>> [round(schedule(t)[1], 3) for t in (0, 500, 1000, 5000)]
    [0.0, 0.7, 0.8, 0.8]
    """

    def __init__(
        self,
        initial_sparsity: float,
        final_sparsity: float,
        begin_step: int,
        end_step: int,
        power: float = 3,
        frequency: int = 100,
    ):
        self.initial_sparsity = _check_sparsity("initial_sparsity", initial_sparsity)
        self.final_sparsity = _check_sparsity("final_sparsity", final_sparsity)
        self.power = check_number("power", power, low=0.0, low_inclusive=False)
        if math.isinf(self.power):
            raise ValueError(f"`power` must be a finite number > 0; got {power!r}.")
        self.begin_step, self.end_step, self.frequency = self._check_steps(
            begin_step, end_step, frequency, allow_forever=False
        )

    def __call__(self, step: int) -> tuple[bool, float]:
        step = int(step)
        should = self._should_prune_in_step(step, self.begin_step, self.end_step, self.frequency)
        return should, _polynomial_sparsity(self, step)

    def get_config(self) -> dict:
        return {
            "initial_sparsity": self.initial_sparsity,
            "final_sparsity": self.final_sparsity,
            "begin_step": self.begin_step,
            "end_step": self.end_step,
            "power": self.power,
            "frequency": self.frequency,
        }

    def __repr__(self) -> str:
        return _config_repr("PolynomialDecay", self.get_config())


class _CallableSchedule(PruningSchedule):
    """Adapter for any schedule object returning tensors (e.g. a custom tfmot schedule)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, step: int) -> tuple[bool, float]:
        should, sparsity = self.fn(int(step))
        return bool(np.asarray(should)), float(np.asarray(sparsity))

    def get_config(self) -> dict:
        raise NotImplementedError(
            f"A PruningCallback built on {type(self.fn).__name__} cannot be serialized; use "
            "kp.PolynomialDecay or kp.ConstantSparsity (tfmot's own are converted to them)."
        )

    def __repr__(self) -> str:
        return repr(self.fn)


def _as_schedule(schedule) -> PruningSchedule:
    """Our schedule as is; tfmot's built-in schedules converted exactly; any callable wrapped."""
    if isinstance(schedule, PruningSchedule):
        return schedule
    cls = type(schedule)
    if cls.__module__.startswith("tensorflow_model_optimization") and hasattr(
        schedule, "get_config"
    ):
        config = schedule.get_config().get("config", {})
        if cls.__name__ == "PolynomialDecay":
            return PolynomialDecay(**config)
        if cls.__name__ == "ConstantSparsity":
            return ConstantSparsity(**config)
    if callable(schedule):
        return _CallableSchedule(schedule)
    raise TypeError(
        "`schedule` must be a kp.PolynomialDecay, kp.ConstantSparsity, a tfmot pruning schedule "
        f"or a callable step -> (should_prune, sparsity); got {schedule!r}."
    )


def scheduled(schedule, step: int) -> tuple[bool, float]:
    """`schedule(step)`, its sparsity checked: a callable or a user's `PruningSchedule` can
    return anything, and a sparsity outside `[0, 1)` would prune silently wrong amounts."""
    should, sparsity = schedule(step)
    sparsity = float(np.asarray(sparsity))
    if not 0.0 <= sparsity < 1.0:  # also false for NaN
        raise ValueError(
            f"The pruning schedule {schedule!r} returned sparsity {sparsity!r} at step {step}; "
            "a sparsity must be in [0, 1) (the fraction of each weight set to zero)."
        )
    return bool(np.asarray(should)), sparsity
