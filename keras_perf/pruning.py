"""Magnitude pruning for Keras 3 as a plain callback: no wrapping, cloning or recompiling.

tensorflow-model-optimization (tfmot) prunes only legacy tf_keras models, wraps every layer and
cannot reach into subclassed or nested models. Here the model is left as it is:

- every prunable weight gets a 0/1 mask in a non-trainable `keras.Variable`, and the mask is
  installed as that weight's *constraint*. Keras' optimizers apply constraints right after each
  update inside the compiled train step, so pruned entries are exactly zero after every step,
  whatever the optimizer (momentum, Adam, weight decay) does, with no Python work per batch;
- the callback recomputes the masks (tfmot's rule: keep the k = max(round(n * (1 - s)), 1)
  largest magnitudes) only at the steps the schedule names, the step being the optimizer's
  iteration count;
- nothing is added to the model: saved weights carry the zeros, and a resumed run rebuilds the
  masks from them, so `model.save`/`load_model` and `BackupAndRestore` keep the pattern.

Public names: `PolynomialDecay`, `ConstantSparsity`, `PruningSchedule`, `PruningCallback`,
`sparsity_report`, `strip_pruning`, `prune_low_magnitude`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import re
import sys
import weakref
from dataclasses import dataclass, field

import keras
import numpy as np
from keras import ops

from keras_perf import backend as _backend
from keras_perf._tensorboard import ScalarWriter, require_writer
from keras_perf._utils import check_choice, check_int, check_number, iter_layers, warn

__all__ = [
    "ConstantSparsity",
    "PolynomialDecay",
    "PruningCallback",
    "PruningSchedule",
    "prune_low_magnitude",
    "sparsity_report",
    "strip_pruning",
]


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------


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


def _f32(x) -> float:
    """`x` rounded to float32, as tfmot's TF ops compute it, returned as a Python float."""
    return float(np.float32(x))


def _load_powf():
    """The C library's `powf`: what TensorFlow's scalar `Pow` kernel computes (`std::pow`).

    Looked up on first use: the process's own symbols first (POSIX; Python links libm), then
    the math library by name.
    """
    if sys.platform == "win32":
        candidates = [lambda: ctypes.CDLL("ucrtbase"), lambda: ctypes.CDLL("msvcrt")]
    else:
        candidates = [lambda: ctypes.CDLL(None), lambda: ctypes.CDLL(ctypes.util.find_library("m"))]
    for load in candidates:
        try:
            fn = load().powf
        except (OSError, AttributeError, TypeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
        return fn
    return None


_POWF: list = []  # [powf or None], filled on first use


def _powf(x: np.float32, y: np.float32) -> np.float32:
    """float32 `x ** y` exactly as TensorFlow's scalar `Pow` gives it (the C `powf`).

    NumPy's float32 `power` is not that function (it differs on about a third of inputs), and
    neither is the double `pow` rounded to float32 (about 1 in 1,000). Without a C `powf` (no
    such platform is known) the double result rounded to float32 is used.
    """
    if not _POWF:
        _POWF.append(_load_powf())
    if _POWF[0] is not None:
        return np.float32(_POWF[0](float(x), float(y)))
    return np.float32(math.pow(float(x), float(y)))


def _polynomial_sparsity(schedule, step: int, in_graph: bool = True) -> float:
    """tfmot's `PolynomialDecay` sparsity at `step`, bit for bit, as a Python float.

    tfmot computes, in float32, `p = min(1, max(0, float(step - begin) / (end - begin)))` and
    `(initial - final) * pow(1 - p, power) + final`. TensorFlow evaluates that in two ways:

    - eagerly (`in_graph=False`): as written; `pow` is the C `powf`;
    - inside a `tf.function` (`in_graph=True`, how tfmot evaluates it during `fit`), Grappler
      rewrites the graph first: the division by the constant span becomes a multiplication by
      its float32 reciprocal; `pow(d, 2)` becomes `(p - 1)**2`, `pow(d, 0.5)` `sqrt(d)`,
      `pow(d, 3)` `d * d**2` with the constant factor pushed into it,
      `((initial - final) * d) * d**2`, `pow(d, 1)` `d`.

    The two differ by one float32 ulp on a few percent of steps.
    """
    f32 = np.float32
    begin, end = schedule.begin_step, schedule.end_step
    span = f32(end - begin)
    num = f32(step - begin)
    if span == 0:  # tfmot: 0/0 = nan at begin_step; we jump to `final` there (documented).
        p = f32(1.0 if step >= begin else 0.0)
    elif in_graph:
        p = num * (f32(1.0) / span)
    else:
        p = num / span
    p = min(f32(1.0), max(f32(0.0), p))
    d = f32(1.0) - p
    power = f32(schedule.power)
    scale = f32(schedule.initial_sparsity - schedule.final_sparsity)
    final = f32(schedule.final_sparsity)
    if in_graph and power == 3:
        return float((scale * d) * (d * d) + final)
    if in_graph and power == 2:
        decay = (p - f32(1.0)) * (p - f32(1.0))
    elif in_graph and power == 0.5:
        decay = np.sqrt(d)
    elif power == 1:
        decay = d
    else:
        decay = _powf(d, power)
    return float(scale * f32(decay) + final)


@keras.saving.register_keras_serializable(package="keras_perf")
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
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"ConstantSparsity({args})"


@keras.saving.register_keras_serializable(package="keras_perf")
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
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"PolynomialDecay({args})"


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


# --------------------------------------------------------------------------------------------
# Which weights are pruned
# --------------------------------------------------------------------------------------------

# Layer class -> (weight names, axis along which an m-by-n block runs: the input dimension).
# Looked up by isinstance, so subclasses of these layers are pruned too.
_CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
_CONV_T = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)
_SEP = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
_RNN_CELLS = (keras.layers.SimpleRNNCell, keras.layers.LSTMCell, keras.layers.GRUCell)

#: What is pruned, per layer kind, and the axis of the m-by-n blocks (the input dimension).
PRUNABLE = (
    (keras.layers.Dense, ("kernel",), 0),  # kernel (in, out): blocks along `in`
    (_CONV, ("kernel",), -2),  # (*spatial, in, out): blocks along `in`
    (_CONV_T, ("kernel",), -1),  # (*spatial, out, in): blocks along `in`
    (_SEP, ("pointwise_kernel",), -2),  # (1.., in, out): blocks along `in`
    (keras.layers.Embedding, ("embeddings",), -1),  # (vocab, dim): blocks along `dim`
    (_RNN_CELLS, ("kernel", "recurrent_kernel"), 0),  # (in|units, gates*units)
    (keras.layers.EinsumDense, ("kernel",), None),  # last contracted axis, from the equation
)


@dataclass
class _Target:
    layer: keras.layers.Layer
    variable: keras.Variable
    axis: int
    mask: keras.Variable | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        return self.variable.path


def _einsum_input_axis(layer) -> int:
    # "abc,cde->abde": the kernel axes also found in the input are contracted (the input
    # dimensions); m-by-n blocks run along the last of them.
    try:
        inputs, _ = layer.equation.split("->")
        x_spec, k_spec = inputs.split(",")
        shared = [i for i, c in enumerate(k_spec) if c in x_spec]
        return shared[-1] if shared else 0
    except (AttributeError, ValueError):
        return 0


def _own_variables(layer) -> list:
    nested = {id(v) for sub in iter_layers(layer) for v in sub.weights}
    return [v for v in layer.weights if id(v) not in nested]


def _prunable_in(layer) -> list[_Target]:
    for classes, names, axis in PRUNABLE:
        if isinstance(layer, classes):
            if axis is None:
                axis = _einsum_input_axis(layer)
            return [
                _Target(layer, v, axis)
                for v in _own_variables(layer)
                if v.name in names and v.trainable and layer.trainable
            ]
    return []


def _all_prunable(model) -> list[_Target]:
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built; call it on data (or `model.build(shape)`) "
            "before pruning, so its weights exist."
        )
    targets, seen = [], set()
    for layer in [model, *iter_layers(model)]:
        for t in _prunable_in(layer):
            if id(t.variable) not in seen:
                seen.add(id(t.variable))
                targets.append(t)
    return targets


def _check_selectors(name: str, value) -> tuple:
    """Normalise include/exclude: None, or one or a list of names, regexes, classes."""
    if value is None:
        return ()
    items = tuple(value) if isinstance(value, (list, tuple, set)) else (value,)
    for item in items:
        if isinstance(item, str):
            continue
        if isinstance(item, re.Pattern):
            continue
        if isinstance(item, type) and issubclass(item, keras.layers.Layer):
            continue
        raise TypeError(
            f"`{name}` items must be layer names, regular expressions (str or re.Pattern) or "
            f"keras.layers.Layer subclasses; got {item!r}."
        )
    return items


def _matches_layer(item, layer) -> bool:
    if isinstance(item, type):
        return isinstance(layer, item)
    if isinstance(item, re.Pattern):
        return bool(item.search(layer.name))
    return item == layer.name or _fullmatch(item, layer.name)


def _matches_path(item, path: str) -> bool:
    if isinstance(item, type):
        return False
    if isinstance(item, re.Pattern):
        return bool(item.search(path))
    return item == path or _fullmatch(item, path)


def _fullmatch(pattern: str, text: str) -> bool:
    try:
        return re.fullmatch(pattern, text) is not None
    except re.error:  # not a valid regex: compared as a plain name only
        return False


def _describe(targets) -> str:
    return ", ".join(f"{t.layer.name} ({type(t.layer).__name__}: {t.path})" for t in targets)


def _select(model, include=(), exclude=()) -> list[_Target]:
    """The prunable weights of `model`, filtered by `include`/`exclude` (layer or any parent)."""
    targets = _all_prunable(model)
    if not targets:
        raise ValueError(
            f"Model {model.name!r} has no prunable weights. Pruned are the kernels of Dense, "
            "EinsumDense (MultiHeadAttention), Conv*, Conv*Transpose, the pointwise kernels of "
            "SeparableConv*, Embedding embeddings and RNN cell kernels; never biases, "
            "normalisation or non-trainable weights."
        )
    layers = [model, *iter_layers(model)]

    def covered(item) -> set:
        """ids of the target variables selected by `item` (matching layer or an ancestor)."""
        ids = set()
        for layer in layers:
            if _matches_layer(item, layer):
                for sub in [layer, *iter_layers(layer)]:
                    ids.update(id(t.variable) for t in _prunable_in(sub))
            else:
                ids.update(
                    id(t.variable) for t in _prunable_in(layer) if _matches_path(item, t.path)
                )
        return ids & {id(t.variable) for t in targets}

    if include:
        chosen = set()
        for item in include:
            ids = covered(item)
            if not ids:
                raise ValueError(
                    f"`include` item {item!r} matches no prunable weight of model "
                    f"{model.name!r}. Prunable layers: {_describe(targets)}."
                )
            chosen |= ids
        targets = [t for t in targets if id(t.variable) in chosen]
    for item in exclude:
        ids = covered(item)
        if not ids:
            raise ValueError(
                f"`exclude` item {item!r} matches no prunable weight of model "
                f"{model.name!r}. Prunable layers: {_describe(_all_prunable(model))}."
            )
        targets = [t for t in targets if id(t.variable) not in ids]
    if not targets:
        raise ValueError(
            f"`exclude` leaves no weight to prune in model {model.name!r}. "
            f"Prunable layers: {_describe(_all_prunable(model))}."
        )
    return targets


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def _keep_count(n: int, sparsity: float) -> int:
    """tfmot's k = max(round(n * (1 - s)), 1), in float32 with round-half-to-even."""
    kept = np.float32(n) * (np.float32(1.0) - np.float32(sparsity))
    return max(int(np.round(kept)), 1)


def _threshold(abs_flat: np.ndarray, sparsity: float) -> np.float32:
    """The k-th largest magnitude: elements >= it are kept (tfmot's threshold)."""
    n = abs_flat.shape[0]
    k = _keep_count(n, sparsity)
    return np.partition(abs_flat, n - k)[n - k]


def _magnitude_masks(weights, sparsity: float, scope: str):
    """Masks keeping the largest magnitudes, per weight or with one global threshold.

    Computed on the host with NumPy: a partition is linear in the weight count, and it needs
    no compiled kernel per sparsity (`top_k(k)` on a jitted backend compiles again for each new
    k, about 50 ms each on a CPU). The weights come over once per mask update (every
    `frequency` steps); the masks go back as the mask variables' new values.
    """
    absolute = [np.abs(np.asarray(ops.convert_to_numpy(w), dtype=np.float32)) for w in weights]
    if scope == "global":
        flat = np.concatenate([a.ravel() for a in absolute])
        thresholds = [_threshold(flat, sparsity)] * len(absolute)
    else:
        thresholds = [_threshold(a.ravel(), sparsity) for a in absolute]
    masks = [(a >= t).astype(np.float32) for a, t in zip(absolute, thresholds)]
    return masks, thresholds


def _m_by_n_mask(weight, m: int, n: int, axis: int):
    """Keep the n - m largest magnitudes of every block of n consecutive entries along `axis`.

    A trailing partial block of length L keeps its min(L, n - m) largest.
    """
    x = ops.moveaxis(ops.abs(ops.cast(weight, "float32")), axis, -1)
    shape = tuple(x.shape)
    length = shape[-1]
    pad = (-length) % n
    x = ops.reshape(x, (-1, length))
    if pad:
        x = ops.pad(x, [[0, 0], [0, pad]], constant_values=-1.0)
    blocks = ops.reshape(x, (-1, n))
    _, idx = ops.top_k(blocks, n - m, sorted=False)
    mask = ops.minimum(ops.sum(ops.one_hot(idx, n), axis=-2), 1.0)
    mask = ops.reshape(mask, (-1, length + pad))[:, :length]
    mask = ops.moveaxis(ops.reshape(mask, shape), -1, axis)
    return ops.cast(mask, weight.dtype)


def _compute_masks(targets, sparsity: float, scope: str, m_by_n):
    """(masks, thresholds): thresholds are None under m-by-n."""
    weights = [t.variable.value for t in targets]
    if m_by_n is not None:
        m, n = m_by_n
        return [_m_by_n_mask(w, m, n, t.axis) for w, t in zip(weights, targets)], None
    return _magnitude_masks(weights, sparsity, scope)


def _relative_path(model, target) -> str:
    """The weight's path without the model-name prefix (a reloaded model may be renamed)."""
    prefix = f"{model.name}/"
    path = target.path
    return path[len(prefix) :] if model is not None and path.startswith(prefix) else path


class _MaskConstraint:
    """Variable constraint `w -> mask * original(w)`: run by the optimizer after each update.

    Not a public class and never serialized: layers serialize their own `kernel_constraint`,
    not the variable's, so a saved model stays a plain Keras model.
    """

    def __init__(self, mask: keras.Variable, original=None):
        self.mask = mask
        self.original = original

    def __call__(self, w):
        if self.original is not None:
            w = self.original(w)
        return ops.multiply(w, ops.cast(self.mask, w.dtype))


def _refresh_train_step(
    model, masks_changed: bool, constraints_changed: bool, masks_carried: bool = False
) -> None:
    """Make the next `fit` step see new constraints (all backends) or new mask values.

    A TF or torch step reads the mask variables when it runs. A jitted JAX step bakes in the
    values of variables it does not receive as state, so after a mask change it is retraced,
    unless the masks travel with the optimizer state (`masks_carried`, set by the callback
    through `kp.backend.carry_in_step_state`).
    """
    stale_masks = masks_changed and not masks_carried
    if constraints_changed or (stale_masks and not _backend.STEP_READS_EXTERNAL_VARIABLES):
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)


def _install(targets, initial=None, derive_from_zeros: bool = False) -> bool:
    """Give every target a mask variable and the masking constraint; True if any was new.

    The mask comes, in order of preference, from a constraint already installed (same
    process), from `initial` (path -> array, e.g. a loaded `state_dict`), from the zeros of the
    weight when `derive_from_zeros` (resuming a run whose pruning has begun), else all ones.
    """
    changed = False
    for t in targets:
        current = t.variable.constraint
        if isinstance(current, _MaskConstraint):
            t.mask = current.mask
            continue
        if initial is not None and t.path in initial:
            value = np.asarray(initial[t.path]).astype(t.variable.dtype)
        else:
            value = np.ones(t.variable.shape, dtype=t.variable.dtype)
            if derive_from_zeros:
                nonzero = ops.convert_to_numpy(t.variable.value) != 0
                if nonzero.any():
                    value = nonzero.astype(t.variable.dtype)
        t.mask = keras.Variable(
            value, dtype=t.variable.dtype, trainable=False, autocast=False, name="prune_mask"
        )
        t.variable.constraint = _MaskConstraint(t.mask, current)
        changed = True
    return changed


def _guard_set_weights(model) -> None:
    """Make `model.set_weights` keep pruned entries zero while masks are installed.

    `EarlyStopping(restore_best_weights=True)` (Keras' and ours) and `TimeLimit` put back an
    earlier epoch's weights with `model.set_weights` in their `on_train_end`, which may run
    after ours; those weights were masked with the masks of their epoch, and the masks have
    pruned more since. The latest masks apply: restored weights are masked again, so the
    model has the sparsity logged last. Removed by `strip_pruning`.
    """
    if getattr(vars(model).get("set_weights"), "_kp_pruning_guard", False):
        return
    plain = type(model).set_weights

    def set_weights(weights):
        plain(model, weights)
        for v in model.weights:
            if isinstance(v.constraint, _MaskConstraint):
                v.assign(ops.multiply(v.value, ops.cast(v.constraint.mask.value, v.dtype)))

    set_weights._kp_pruning_guard = True
    set_weights.__doc__ = plain.__doc__
    object.__setattr__(model, "set_weights", set_weights)


def _apply_masks(targets, masks=None) -> None:
    """Set each mask (if given) and zero the pruned entries of its weight now."""
    for i, t in enumerate(targets):
        if masks is not None:
            t.mask.assign(masks[i])
        t.variable.assign(ops.multiply(t.variable.value, ops.cast(t.mask.value, t.variable.dtype)))


def _mask_sparsity(targets) -> tuple[float, dict]:
    """Overall and per-weight fraction of masked entries."""
    zeros, size, per = 0, 0, {}
    for t in targets:
        kept = float(ops.convert_to_numpy(ops.sum(ops.cast(t.mask.value, "float32"))))
        n = int(np.prod(t.variable.shape))
        per[t.path] = 1.0 - kept / n
        zeros += n - kept
        size += n
    return (zeros / size if size else 0.0), per


def _check_m_by_n(m_by_n):
    if m_by_n is None:
        return None
    if not isinstance(m_by_n, (tuple, list)) or len(m_by_n) != 2:
        raise ValueError(f"`m_by_n` must be None or a pair (m, n) such as (2, 4); got {m_by_n!r}.")
    m = check_int("m_by_n[0]", m_by_n[0], minimum=1)
    n = check_int("m_by_n[1]", m_by_n[1], minimum=2)
    if m >= n:
        raise ValueError(
            f"`m_by_n` (m, n) must have 1 <= m < n (m zeros in every n entries); got {m_by_n!r}."
        )
    return (m, n)


# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------


def _serialize_selectors(items) -> list | None:
    if not items:
        return None
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, re.Pattern):
            out.append({"regex": item.pattern})
        else:
            out.append({"class_name": item.__name__, "registered_name": None})
            name = keras.saving.get_registered_name(item)
            out[-1]["registered_name"] = name
    return out


def _deserialize_selectors(items):
    if items is None:
        return None
    out = []
    for item in items:
        if isinstance(item, dict) and "regex" in item:
            out.append(re.compile(item["regex"]))
        elif isinstance(item, dict):
            cls = keras.saving.get_registered_object(item.get("registered_name"))
            cls = cls or getattr(keras.layers, item["class_name"], None)
            if cls is None:
                raise ValueError(
                    f"Unknown layer class {item['class_name']!r} in `include`/`exclude`."
                )
            out.append(cls)
        else:
            out.append(item)
    return out


@keras.saving.register_keras_serializable(package="keras_perf")
class PruningCallback(keras.callbacks.Callback):
    """Magnitude pruning during `fit`, on the model as it is: no wrapping or recompiling.

    At the first epoch the callback finds the prunable weights (tfmot's defaults: kernels of
    Dense, EinsumDense (so MultiHeadAttention projections), Conv*, Conv*Transpose, the
    pointwise kernels of SeparableConv*, Embedding embeddings, RNN cell kernel and
    recurrent_kernel; never biases, normalisation or non-trainable weights), in Sequential,
    Functional, subclassed and nested models alike. Each gets a 0/1 mask in a non-trainable
    variable, installed as the weight's constraint, which Keras' optimizer applies inside the
    compiled step after every update: pruned entries stay exactly zero whatever the optimizer.

    The step is the optimizer's iteration count at the start of the batch (read once per
    epoch, counted in Python in between). tfmot counts batches per wrapped layer from 0 when
    the wrapped model starts training; the two agree whenever the optimizer is fresh when
    pruning starts. When the schedule says so, the masks are recomputed before that step runs:
    per weight (`scope="layer"`, tfmot's rule: keep the k = max(round(n * (1 - s)), 1) largest
    magnitudes), with one threshold over all weights (`scope="global"`), or in m-by-n blocks.

    Resuming: nothing is stored in the model. The saved weights carry the zeros, and when the
    optimizer's step shows the schedule has already pruned, the masks are rebuilt from them,
    so `model.save`/`load_model` and `keras.callbacks.BackupAndRestore` continue with the same
    pattern. `state_dict()`/`load_state_dict()` carry the masks explicitly as well.

    Restored weights: `EarlyStopping`/`TimeLimit` with `restore_best_weights=True` put back an
    earlier epoch's weights with `model.set_weights`. While masks are installed, a pruned
    model's `set_weights` masks what it sets with the *latest* masks, so after `fit` the model
    has the sparsity logged last (`history["sparsity"][-1]`) and every pruned entry is zero.

    At the first epoch, when `fit` knows its length, a warning says if this fit ends before
    the schedule reaches its target (e.g. `end_step` beyond the planned steps), with the
    numbers: steps planned, `end_step`, and the sparsity the last mask update will reach.

    A model Keras builds only in its first train step (a subclassed model never called before
    `fit`, on TensorFlow) has no weights before that step: its masks are installed right
    after it, and a mask update due at that first step runs then.

    Logs `sparsity` (the fraction of pruned entries over all target weights) in the epoch logs;
    a `keras.callbacks.TensorBoard` placed after this callback records it as a scalar, and
    `log_dir` writes per-weight sparsity at every mask update.

    Args:
        schedule: When and how much to prune: `kp.PolynomialDecay`, `kp.ConstantSparsity`, a
            tfmot schedule (converted) or any callable `step -> (should_prune, sparsity)`.
        scope: `"layer"` (a threshold per weight, as tfmot) or `"global"` (one threshold
            across all target weights, so layers end with different sparsities).
            Defaults to `"layer"`.
        m_by_n: `None`, or `(m, n)`: zero the m smallest of every n consecutive entries along
            the input dimension (tfmot's `sparsity_m_by_n`; `(2, 4)` keeps 2 of 4). Axis per
            kind: Dense and RNN kernels axis 0 (inputs), Conv* axis -2 (input channels),
            Conv*Transpose axis -1, SeparableConv pointwise axis -2, Embedding axis -1,
            EinsumDense the last contracted kernel axis. The schedule's sparsity is then
            ignored; it only says when to recompute. Defaults to `None`.
        include: Prune only these: layer names, regexes (fully matching a layer name or a
            weight path) or layer classes; a match on an enclosing layer or sub-model selects
            everything prunable inside it. Defaults to `None` (everything prunable).
        exclude: Leave these out (same forms as `include`). Defaults to `None`.
        verbose: 1 prints a line at each mask update. Defaults to `0`.
        log_dir: Directory for TensorBoard scalars `pruning/sparsity`,
            `pruning/target_sparsity` and `pruning/<weight path>` at each mask update
            (TensorFlow, else tensorboardX: the `tensorboard` extra). Defaults to `None`.

    Raises:
        ImportError: `log_dir` given but neither TensorFlow nor tensorboardX is installed.
        ValueError: bad `scope`, `m_by_n`, `verbose`; at the start of `fit`: a model without
            prunable weights, an `include` or `exclude` item that matches none (the message
            lists them), a model without an optimizer, or a second PruningCallback on the same
            model in the same `fit` (the message names both).
        TypeError: a `schedule` that is not a schedule, bad `include`/`exclude` items.

    Example:

    >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
    ...                           keras.layers.Dense(10)])
    >>> model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> pruning = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.8, 0, 20, frequency=5))
    >>> x, y = np.random.rand(320, 64), np.random.randint(0, 10, 320)
    >>> history = model.fit(x, y, epochs=3, callbacks=[pruning], verbose=0)
    >>> round(history.history["sparsity"][-1], 2)
    0.8
    """

    def __init__(
        self,
        schedule,
        scope: str = "layer",
        m_by_n: tuple[int, int] | None = None,
        include=None,
        exclude=None,
        verbose: int = 0,
        log_dir: str | None = None,
    ):
        super().__init__()
        self.schedule = _as_schedule(schedule)
        self.scope = check_choice("scope", scope, ("layer", "global"))
        self.m_by_n = _check_m_by_n(m_by_n)
        if self.m_by_n is not None and self.scope == "global":
            raise ValueError(
                "`m_by_n` prunes inside each block of every weight; it cannot be combined with "
                '`scope="global"`. Pass `scope="layer"` (the default).'
            )
        self.include = _check_selectors("include", include)
        self.exclude = _check_selectors("exclude", exclude)
        self.verbose = check_int("verbose", verbose, minimum=0)
        if log_dir is not None and not isinstance(log_dir, str):
            raise TypeError(f"`log_dir` must be None or a directory path; got {log_dir!r}.")
        if log_dir is not None:
            require_writer("PruningCallback(log_dir=...)")  # TensorFlow, else tensorboardX
        self.log_dir = log_dir
        # Only on_train_batch_begin is overridden, which Keras always calls in line; the batch
        # end hooks stay asynchronous.
        self.async_safe = True
        self.targets: list[_Target] = []
        self.history: list[dict] = []
        self.sparsity = 0.0
        self.thresholds: dict = {}
        self._targets_model = None
        self._ready = False
        self._carried = False
        self._step = 0
        self._spe = 1
        self._pending_state: dict | None = None
        self._writer = None
        self._plan_checked = False
        self._missed = None

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Pruning state: the step, the overall sparsity, and each weight's mask.

        Masks are keyed by weight path without the model's name (`"hidden/kernel"`), so the
        state loads into a rebuilt or reloaded copy of the model.
        """
        return {
            "step": self._step,
            "sparsity": self.sparsity,
            "masks": {
                _relative_path(self._targets_model, t): ops.convert_to_numpy(t.mask.value)
                for t in self.targets
                if t.mask is not None
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; masks are installed at the next `fit`'s first epoch."""
        self._pending_state = dict(state)
        self.sparsity = float(state.get("sparsity", 0.0))
        self._step = int(state.get("step", 0))

    def get_config(self) -> dict:
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "scope": self.scope,
            "m_by_n": list(self.m_by_n) if self.m_by_n else None,
            "include": _serialize_selectors(self.include),
            "exclude": _serialize_selectors(self.exclude),
            "verbose": self.verbose,
            "log_dir": self.log_dir,
        }

    @classmethod
    def from_config(cls, config: dict):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        config["include"] = _deserialize_selectors(config.get("include"))
        config["exclude"] = _deserialize_selectors(config.get("exclude"))
        if config.get("m_by_n") is not None:
            config["m_by_n"] = tuple(config["m_by_n"])
        return cls(**config)

    def __repr__(self) -> str:
        args = [repr(self.schedule), f"scope={self.scope!r}"]
        for name in ("m_by_n", "include", "exclude"):
            if getattr(self, name):
                args.append(f"{name}={getattr(self, name)!r}")
        return f"PruningCallback({', '.join(args)})"

    # -- hooks --------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self._model
        if getattr(model, "optimizer", None) is None:
            raise ValueError("PruningCallback needs a compiled model (it counts optimizer steps).")
        self._claim(model)
        # An unbuilt model (subclassed, never called) is built by Keras before this hook on
        # JAX and torch, but only inside the first train step on TensorFlow: its weights are
        # found as soon as they exist (see `on_train_batch_begin`).
        if model.built and self._targets_model is not model:
            self.targets = _select(model, self.include, self.exclude)
            self._targets_model = model
        _guard_set_weights(model)
        self._spe = int(getattr(model, "steps_per_execution", 1) or 1)
        self.history = []
        self._ready = False
        self._plan_checked = False
        self._missed = None

    def _claim(self, model) -> None:
        """Refuse a second PruningCallback on the same model in the same `fit`.

        Keras gives every callback of one `fit` the same `params` dict, which tells a second
        callback of this fit from one left over from an earlier (possibly interrupted) fit.
        """
        owner = vars(model).get("_kp_pruning_owner")
        if owner is not None:
            other, params = owner[0](), owner[1]
            if other is not None and other is not self and params is self.params:
                raise ValueError(
                    f"Two PruningCallbacks prune model {model.name!r} in the same fit: "
                    f"{other!r} and {self!r}. Each would overwrite the other's masks (the last "
                    "one silently winning). Pass one PruningCallback per model; to prune "
                    "layers differently, run one fit per phase, or use `include`/`exclude` "
                    "and `scope` of a single callback."
                )
        object.__setattr__(model, "_kp_pruning_owner", (weakref.ref(self), self.params))

    def on_epoch_begin(self, epoch, logs=None):
        model = self.model  # on JAX this attaches the latest state to the variables
        self._step = int(ops.convert_to_numpy(model.optimizer.iterations))
        if not self._plan_checked:
            # At the first epoch: BackupAndRestore has restored the step and epoch by now.
            self._plan_checked = True
            self._check_plan(epoch)
        if not self._ready and model.built:
            self._setup(model, pruned_before=self._pruned_before())

    def _setup(self, model, pruned_before: bool) -> None:
        """Find the weights (if not yet) and install the masks; once per fit."""
        if self._targets_model is not model:
            self.targets = _select(model, self.include, self.exclude)
            self._targets_model = model
        state = self._pending_state or {}
        initial = state.get("masks")
        if initial is not None:
            initial = {t.path: initial[_relative_path(model, t)] for t in self.targets
                       if _relative_path(model, t) in initial}  # fmt: skip
        changed = _install(self.targets, initial, derive_from_zeros=pruned_before)
        self._pending_state = None
        self.sparsity, per = _mask_sparsity(self.targets)
        # JAX: the masks join the optimizer state, so mask updates need no retrace.
        self._carried = _backend.carry_in_step_state(model, [t.mask for t in self.targets])
        _refresh_train_step(model, masks_changed=False, constraints_changed=changed)
        self._ready = True

    def _pruned_before(self) -> bool:
        """Whether the schedule has named a prune step before the current step."""
        if isinstance(self.schedule, (ConstantSparsity, PolynomialDecay)):
            return self._step > self.schedule.begin_step
        # Any other schedule: look back over (at most) the last 100k steps.
        return any(self.schedule(s)[0] for s in range(max(0, self._step - 100_000), self._step))

    def _check_plan(self, epoch: int) -> None:
        """Warn when this fit ends before the schedule reaches its target sparsity."""
        schedule, steps, epochs = self.schedule, self.params.get("steps"), self.params.get("epochs")
        if not steps or not epochs or not isinstance(schedule, (PolynomialDecay, ConstantSparsity)):
            return  # unknown length, or a schedule we cannot reason about
        n = (epochs - epoch) * steps
        if n <= 0:
            return
        first, last = self._step, self._step + n - 1
        begin, end, frequency = schedule.begin_step, schedule.end_step, schedule.frequency
        plan = (
            f"this fit runs {n} steps ({epochs - epoch} epochs x {steps}"
            + (f" from epoch {epoch}" if epoch else "")
            + f"), steps {first}-{last}"
        )
        if end != -1 and first > end:
            return  # pruning ended before this fit: fine-tuning
        if begin > last:
            warn(
                f"PruningCallback: no mask update in this fit: {plan}, but begin_step={begin}. "
                "Nothing will be pruned; lower `begin_step` or train for more steps."
            )
            return
        if isinstance(schedule, ConstantSparsity):
            return
        last_prune = begin + ((min(end, last) - begin) // frequency) * frequency
        reached, target = schedule(last_prune)[1], schedule(end)[1]
        if last_prune >= end or reached == target:
            return
        why = (
            f"but the schedule's end_step={end} lies beyond them"
            if end > last
            else f"but end_step={end} is not begin_step={begin} plus a multiple of "
            f"frequency={frequency}"
        )
        warn(
            f"PruningCallback: the schedule will not reach its target: {plan}, {why}: the last "
            f"mask update, at step {last_prune}, prunes to {reached:.4f}, not "
            f"final_sparsity={schedule.final_sparsity!r}. Set `end_step` <= {last} (and equal "
            "to `begin_step` plus a multiple of `frequency`), or train for more steps."
        )

    def on_train_batch_begin(self, batch, logs=None):
        step = self._step
        self._step += self._spe
        due = None
        for s in range(step, step + self._spe):
            should, sparsity = self.schedule(s)
            if should:
                due = (s, sparsity)
        if not self._ready:
            # TensorFlow builds an unbuilt model inside its first train step: no weights to
            # prune before it. A prune step due then runs as soon as the weights exist.
            if not self._model.built:
                self._missed = due or self._missed
                return
            self._setup(self.model, pruned_before=False)
            due = due or self._missed
            self._missed = None
        if due is not None:
            self._update(*due)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["sparsity"] = self.sparsity

    def on_train_end(self, logs=None):
        if not self._ready and self._model.built and self._missed is not None:
            # A one-batch fit of a model built in that batch (TensorFlow): prune now.
            self._setup(self.model, pruned_before=False)
            self._update(*self._missed)
            self._missed = None
        # Weight EMA (`use_ema=True`) overwrites the weights after the last step: mask again.
        if self._ready:
            model = self.model  # on JAX this attaches the latest state to the variables
            _apply_masks(self.targets)
            if self._carried:
                _backend.release_step_state(model, [t.mask for t in self.targets])
                self._carried = False

    # -- mask update --------------------------------------------------------------------------
    def _update(self, step: int, target_sparsity: float) -> None:
        model = self.model  # on JAX this attaches the latest state to the variables
        masks, thresholds = _compute_masks(self.targets, target_sparsity, self.scope, self.m_by_n)
        _apply_masks(self.targets, masks)
        self.sparsity, per = _mask_sparsity(self.targets)
        if thresholds is not None:
            self.thresholds = {
                t.path: float(ops.convert_to_numpy(th)) for t, th in zip(self.targets, thresholds)
            }
        self.history.append(
            {"step": step, "target_sparsity": target_sparsity, "sparsity": self.sparsity}
        )
        _refresh_train_step(
            model, masks_changed=True, constraints_changed=False, masks_carried=self._carried
        )
        if self.verbose:
            print(
                f"PruningCallback: step {step}: target sparsity {target_sparsity:.4f}, "
                f"pruned {self.sparsity:.4f} of {len(self.targets)} weights"
            )
        if self.log_dir:
            self._write_summaries(step, target_sparsity, per)

    def _write_summaries(self, step, target_sparsity, per) -> None:
        if self._writer is None:
            self._writer = ScalarWriter(self.log_dir)  # keras_perf/_tensorboard.py
        self._writer.scalar("pruning/sparsity", self.sparsity, step)
        self._writer.scalar("pruning/target_sparsity", target_sparsity, step)
        for path, value in per.items():
            self._writer.scalar(f"pruning/{path}", value, step)
        self._writer.flush()


# --------------------------------------------------------------------------------------------
# Functions
# --------------------------------------------------------------------------------------------


def sparsity_report(model, include=None, exclude=None) -> dict:
    """Sparsity of each prunable weight of `model`, counted from its exact zeros.

    Args:
        model: A built Keras model (pruned or not).
        include: Report only these (layer names, regexes or classes, as in
            `kp.PruningCallback`). Defaults to `None` (every prunable weight).
        exclude: Leave these out. Defaults to `None`.

    Returns:
        `{"weights": [{"path", "layer", "shape", "size", "nonzero", "sparsity"}, ...],
        "total": {"size", "nonzero", "sparsity"}}`.

    Raises:
        ValueError: an unbuilt model, or one without prunable weights.

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> report = kp.sparsity_report(kp.prune_low_magnitude(model, sparsity=0.5))
    >>> report["total"]["sparsity"]
    0.5
    """
    targets = _select(
        model, _check_selectors("include", include), _check_selectors("exclude", exclude)
    )
    rows, size, nonzero = [], 0, 0
    for t in targets:
        value = ops.convert_to_numpy(t.variable.value)
        nz = int(np.count_nonzero(value))
        rows.append(
            {
                "path": t.path,
                "layer": t.layer.name,
                "shape": tuple(int(d) for d in value.shape),
                "size": int(value.size),
                "nonzero": nz,
                "sparsity": 1.0 - nz / value.size,
            }
        )
        size += value.size
        nonzero += nz
    total = {"size": int(size), "nonzero": nonzero, "sparsity": 1.0 - nonzero / size}
    return {"weights": rows, "total": total}


def strip_pruning(model):
    """Make the pruning permanent and remove its state: the model becomes plain Keras again.

    Each pruned weight is multiplied by its mask one last time and gets its original
    constraint back; the masks are dropped, and the next `fit` traces a fresh train step.
    Calling it on a model that is not pruned changes nothing.

    Args:
        model: A model pruned by `kp.PruningCallback` or `kp.prune_low_magnitude`.

    Returns:
        The same model object, for chaining.

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> model = kp.strip_pruning(kp.prune_low_magnitude(model, sparsity=0.5))
    >>> model.layers[0].kernel.constraint is None
    True
    """
    stripped = False
    for v in model.weights:
        c = v.constraint
        if isinstance(c, _MaskConstraint):
            v.assign(ops.multiply(v.value, ops.cast(c.mask.value, v.dtype)))
            v.constraint = c.original
            stripped = True
    if stripped and getattr(model, "train_function", None) is not None:
        model.train_function = None
    if getattr(vars(model).get("set_weights"), "_kp_pruning_guard", False):
        object.__delattr__(model, "set_weights")
    return model


def prune_low_magnitude(
    model,
    sparsity: float = 0.5,
    scope: str = "layer",
    m_by_n: tuple[int, int] | None = None,
    include=None,
    exclude=None,
):
    """One-shot magnitude pruning, no training: zero the smallest weights now.

    Unlike tfmot's function of the same name this neither wraps nor returns a new model: the
    masks are installed on the weights (as `kp.PruningCallback` does), so a later `fit` keeps
    the pruned entries at zero until `kp.strip_pruning`.

    Args:
        model: A built Keras model.
        sparsity: Fraction of each weight to zero, in `[0, 1)`. Defaults to `0.5`.
        scope: `"layer"` or `"global"`, as in `kp.PruningCallback`. Defaults to `"layer"`.
        m_by_n: `(m, n)` block pattern instead of a sparsity, as in `kp.PruningCallback`.
            Defaults to `None`.
        include: Prune only these layers (names, regexes or classes). Defaults to `None`.
        exclude: Leave these layers out. Defaults to `None`.

    Returns:
        The same model, pruned.

    Raises:
        ValueError: `sparsity` outside `[0, 1)`, a bad `scope`/`m_by_n`, an unbuilt model, no
            prunable weights, or an `include` that matches none.

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> model = kp.prune_low_magnitude(model, sparsity=0.75)
    >>> int((model.layers[0].kernel.numpy() == 0).sum())
    24
    """
    sparsity = _check_sparsity("sparsity", sparsity)
    scope = check_choice("scope", scope, ("layer", "global"))
    m_by_n = _check_m_by_n(m_by_n)
    targets = _select(
        model, _check_selectors("include", include), _check_selectors("exclude", exclude)
    )
    changed = _install(targets)
    _guard_set_weights(model)
    masks, _ = _compute_masks(targets, sparsity, scope, m_by_n)
    _apply_masks(targets, masks)
    _refresh_train_step(model, masks_changed=True, constraints_changed=changed)
    return model
