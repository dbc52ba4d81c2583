"""The execution settings `accelerate` tries: a plug-in table per backend.

Each offer is a function `offer(ctx, notes)` returning a `Candidate`, a list of them, or None
(with a note where the reason is worth knowing). `candidates(ctx)` walks the table of the
current backend; a new setting is one new function in one of the tuples at the bottom.
`pairs(ctx, measured)` proposes the combinations of the single settings that paid.

A candidate makes its own twin of the user's model (`make`): a clone with the model's weights
and compile arguments, recompiled with the candidate's settings. `apply(model)` sets them on the
user's model in place (see `_apply.py`); `exact_lever` is False for the levers that change the
arithmetic or the optimisation (mixed precision, a larger batch): those are measured and listed,
and applied only with `exact=False`.
"""

from __future__ import annotations

import keras

from keras_perf import backend as _backend
from keras_perf._fit_measure import (
    TORCH_COMPILE_MIN_SECONDS,
    TORCH_SPE,
    compile_twin,
    make_twin,
    policy_twin,
)
from keras_perf.acceleration import _apply
from keras_perf.acceleration._apply import NOT_AVAILABLE, Unavailable, torch_traced

# `steps_per_execution` values tried (capped by the steps of one measurement).
SPE_VALUES = (4, 16, 64)


class Candidate:
    """One execution setting to time.

    `settings` is what `r.chosen` reports (and `_apply.apply` sets); `make()` returns the model
    to time (a twin) or raises `Unavailable`; `batch_size` the examples per step.
    """

    def __init__(
        self, name, settings, make, batch_size, exact_lever=True, note=None, steps_multiple=1
    ):
        self.name = name
        self.settings = settings
        self.make = make
        self.batch_size = batch_size
        self.exact_lever = exact_lever
        self.note = note
        self.steps_multiple = steps_multiple


def recompiled_twin(ctx, **changes):
    """A twin of the user's model compiled with its own arguments and `changes`, with its
    keras-perf train-step settings (`make_twin` keeps them: Keras' clone of a `kp.loss_scaled`
    model alone is a `LossScaledModel` with the default settings).
    """

    def make():
        twin = make_twin(ctx.model, ctx.start)
        if twin is None:
            raise Unavailable("Keras could not clone this model")
        if changes:
            with _backend.model_scope(twin):
                compile_twin(twin, ctx.compile_args, **changes)
        if changes.get("jit_compile") and not twin.jit_compile:
            raise Unavailable("Keras says this model does not support jit_compile=True")
        return twin

    return make


def settings_twin(ctx, settings):
    """A twin with `settings` (keys of `_apply.KNOWN`) on top of the model's own."""
    changes = {k: v for k, v in settings.items() if k in ("jit_compile", "steps_per_execution")}
    base = recompiled_twin(ctx, **changes)

    def make():
        twin = base()
        if settings.get("traced_step"):
            _apply.install_traced(twin, settings["traced_step"])
        return twin

    return make


def _label(settings) -> str:
    if not settings:
        return "model's own settings"
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def single(ctx, settings, **kw) -> Candidate:
    return Candidate(
        _label(settings),
        dict(settings),
        settings_twin(ctx, settings),
        ctx.batch_size,
        steps_multiple=int(settings.get("steps_per_execution", 1)),
        **kw,
    )


def baseline(ctx) -> Candidate:
    return Candidate(_label({}), {}, recompiled_twin(ctx), ctx.batch_size)


# -- TensorFlow and JAX -----------------------------------------------------------------------


def _spe(ctx, notes):
    """`steps_per_execution` in SPE_VALUES above the model's own, up to the steps measured."""
    if ctx.compile_args.get("run_eagerly"):
        notes.append("steps_per_execution not tried: the model runs eagerly (run_eagerly=True).")
        return None
    current = int(ctx.model.steps_per_execution or 1)
    values = [k for k in SPE_VALUES if k > current and k <= ctx.steps]
    if not values:
        notes.append(
            f"steps_per_execution not tried: {ctx.steps} steps per measurement (one epoch of "
            f"this data) leave no value above the model's {current}."
        )
        return None
    return [single(ctx, {"steps_per_execution": k}) for k in values]


def _jit(ctx, notes):
    """XLA toggled: on where the model has it off; off where it is on (TensorFlow: on a CPU
    XLA is not always faster)."""
    if ctx.compile_args.get("run_eagerly"):
        return None
    current = bool(ctx.model.jit_compile)
    if current and keras.backend.backend() == "jax":
        return None  # JAX without jit runs op by op: never faster
    return single(ctx, {"jit_compile": not current})


# -- torch --------------------------------------------------------------------------------------


def _torch_compile(ctx, notes):
    """Keras' `jit_compile=True` on torch: `torch.compile` of the train step."""
    if ctx.model.jit_compile or ctx.compile_args.get("run_eagerly"):
        return None
    if ctx.max_seconds < TORCH_COMPILE_MIN_SECONDS:
        notes.append(
            f"jit_compile=True (torch.compile) not tried: with max_seconds below "
            f"{TORCH_COMPILE_MIN_SECONDS} its compile (tens of seconds to minutes on a CPU) "
            "would dwarf the measurement."
        )
        return None
    return single(
        ctx,
        {"jit_compile": True},
        note="torch.compile: its first compile can take tens of seconds (not counted)",
    )


def _torch_traced(ctx, notes):
    """keras-perf's traced train step (`keras_perf.train_step.torch_traced`)."""
    module = torch_traced()
    if module is None:
        return Candidate(
            "traced_step=True", {"traced_step": True}, _missing, ctx.batch_size, note=NOT_AVAILABLE
        )
    if module.traced_step_state(ctx.model).get("active"):
        return None
    # The twins are clones (a `kp.loss_scaled` model's clone may not keep its settings): what
    # the user's own model would fall back on is read from the model itself.
    reason = module.traced_step_unsupported(ctx.model)
    if reason is not None:
        return Candidate(
            "traced_step=True",
            {"traced_step": True},
            _unavailable(f"keras-perf's traced step would fall back: {reason}"),
            ctx.batch_size,
        )
    found = [single(ctx, {"traced_step": True})]
    if ctx.compile_args.get("run_eagerly"):
        return found
    if ctx.max_seconds < TORCH_COMPILE_MIN_SECONDS:
        notes.append(
            f'traced_step="inductor" not tried: with max_seconds below '
            f"{TORCH_COMPILE_MIN_SECONDS} inductor's compile of the traced step (seconds per "
            "input signature on a CPU) would dwarf the measurement."
        )
        return found
    found.append(
        single(
            ctx,
            {"traced_step": "inductor"},
            note="the traced step through torch.compile (inductor): compiles once per batch shape",
        )
    )
    return found


def _missing():
    raise Unavailable(NOT_AVAILABLE)


def _unavailable(reason):
    def make():
        raise Unavailable(reason)

    return make


def _cuda_notes(ctx, notes):
    if _backend.has_accelerator():
        notes.append(
            "CUDA graphs and channels_last: applied inside keras-perf's traced step where it "
            "captures the step; not offered as separate settings."
        )
    return None


# -- non-exact levers (every backend) ----------------------------------------------------------


def _mixed_precision(ctx, notes):
    """A half-precision twin where it may pay (as `kp.diagnose` decides)."""
    from keras_perf.mixed_precision import auto_policy
    from keras_perf.precision import cpu_policy_to_try

    if ctx.model.dtype_policy.name != "float32":
        return None
    if _backend.has_accelerator():
        policy = auto_policy()
    else:
        policy, reason = cpu_policy_to_try()
        if policy is None:
            notes.append(f"mixed precision not tried on this CPU: {reason}.")
            return None
    if policy == "float32":
        return None

    def make(policy=policy):
        try:
            twin = policy_twin(ctx.model, policy, ctx.start)
        except Exception as e:  # noqa: BLE001 - any clone failure: not measurable
            raise Unavailable(f"Keras could not clone this model ({e})") from e
        previous = keras.mixed_precision.global_policy()
        try:
            keras.mixed_precision.set_global_policy(policy)
            with _backend.model_scope(ctx.model):
                compile_twin(twin, ctx.compile_args)
        finally:
            keras.mixed_precision.set_global_policy(previous)
        return twin

    return Candidate(
        f"mixed precision ({policy})",
        {"dtype_policy": policy},
        make,
        ctx.batch_size,
        exact_lever=False,
        note="changes the arithmetic: set kp.setup_mixed_precision before building the model",
    )


def _larger_batch(ctx, notes):
    """Twice the batch size (arrays with at least 4 such batches)."""
    if ctx.source.kind != "arrays" or ctx.examples // (2 * ctx.batch_size) < 4:
        return None
    return Candidate(
        f"batch_size={2 * ctx.batch_size}",
        {"batch_size": 2 * ctx.batch_size},
        recompiled_twin(ctx),
        2 * ctx.batch_size,
        exact_lever=False,
        note="changes the optimisation (retune the learning rate): pass it to fit yourself",
    )


TENSORFLOW = (_jit, _spe)
JAX = (_jit, _spe)
TORCH = (_torch_compile, _torch_traced, _cuda_notes)
NOT_EXACT = (_mixed_precision, _larger_batch)
TABLES = {"tensorflow": TENSORFLOW, "jax": JAX, "torch": TORCH}


def candidates(ctx) -> tuple[list[Candidate], list[str]]:
    """The candidates that apply to this backend, model and data; and notes on the others."""
    out, notes = [], []
    for offer in TABLES.get(keras.backend.backend(), ()) + NOT_EXACT:
        found = offer(ctx, notes)
        if isinstance(found, list):
            out.extend(found)
        elif found is not None:
            out.append(found)
    return out, notes


def _torch_spe(ctx) -> int | None:
    """The `steps_per_execution` to pair with the traced step on torch: one that divides the
    steps of an epoch (Keras' torch epoch iterator warns "Your input ran out of data" at every
    epoch whose last execution is short), or None."""
    if ctx.compile_args.get("run_eagerly"):
        return None
    steps, _ = ctx.epoch(ctx.batch_size)
    return next((k for k in TORCH_SPE if steps % k == 0 and k <= steps), None)


def pairs(ctx, winners) -> list[Candidate]:
    """Combinations of the exact single settings that each beat the baseline: the best
    `jit_compile` or `traced_step` setting with the best `steps_per_execution`. On torch,
    where `steps_per_execution` runs only inside keras-perf's traced step, the best traced
    step with `TORCH_SPE` (fit's loop and the callbacks once per that many steps)."""
    spe = [c for c in winners if set(c.settings) == {"steps_per_execution"}]
    other = [c for c in winners if "steps_per_execution" not in c.settings]
    if keras.backend.backend() == "torch":
        traced = [c for c in other if c.settings.get("traced_step")]
        k = _torch_spe(ctx)
        if not traced or k is None:
            return []
        return [single(ctx, {**traced[0].settings, "steps_per_execution": k})]
    if not spe or not other:
        return []
    return [single(ctx, {**other[0].settings, **spe[0].settings})]
