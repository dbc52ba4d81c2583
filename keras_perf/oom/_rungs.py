"""The rungs of the ladder: how a model gets more pieces per batch after an OOM.

Read top to bottom: `_rung` (which rung a model takes: micro-batches, or smaller batches with
gradient accumulation, or none), `_cannot_climb` (why a model can take neither), then the
accumulation rung itself: `_Accumulation` (an optimizer copy with
`gradient_accumulation_steps=k`, its state handed back at the end), `_copy_optimizer_state`,
`PerUpdateSchedule` and the loss reductions that rule accumulation out; last the ladder
(`ladder`: remat, micro-batches, both, in the order that keeps a model's training exact).
Not here: the
micro-batch rung (`kp.loss_scaled`, `kp.LossScaleTrainStep` in keras_perf/train_step.py),
the loop that climbs (`_retry`).
"""

from __future__ import annotations

import keras

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf._utils import iter_layers
from keras_perf.quantization import ActivationQuantizer
from keras_perf.train_step import LossScaleTrainStep

MICROBATCH = "microbatch"  # keras-perf's train step cuts each batch into micro-batches
ACCUMULATE = "accumulate"  # half the batch size, twice the batches per optimizer update


def _rung(model, array_input: bool) -> str | None:
    """The rung `model` climbs at an OOM: `MICROBATCH`, `ACCUMULATE` or None (neither).

    Micro-batches for a model with keras-perf's train step, or a stock Sequential or
    Functional model (which gets a `kp.loss_scaled` twin); a subclassed model without the
    mixin can only be given smaller batches, which `fit` makes from arrays alone.
    """
    if isinstance(model, (LossScaleTrainStep, keras.Sequential)) or _backend.is_functional(model):
        return MICROBATCH
    return ACCUMULATE if array_input else None


def _microbatches(model) -> int:
    return model.microbatches if isinstance(model, LossScaleTrainStep) else 1


def _cannot_climb(model, array_input, weighted) -> str | None:
    """Why `model` can be given neither more micro-batches nor accumulation (None: it can)."""
    rung = _rung(model, array_input)
    if rung == MICROBATCH:
        return None
    if rung == ACCUMULATE:
        refusal = _Accumulation.refuses(model, weighted)
        if refusal is None:
            return None
        data = f"Smaller batches with gradient accumulation are not possible either: {refusal}"
    else:
        data = (
            "tf.data datasets, PyDatasets and generators cannot be re-batched, so micro-batching "
            "is the only way to keep the batch."
        )
    return (
        f"{type(model).__name__} is a subclassed model without keras-perf's train step, so its "
        f"batch cannot be cut into micro-batches. {data} Subclass the mixin: "
        f"`class {type(model).__name__}(kp.LossScaleTrainStep, keras.Model): ...`."
    )


# The accumulation route below reads three private attributes of Keras optimizers, through
# keras_perf/backend/keras_internals.py: the raw batch counter behind `iterations`, the schedule
# behind `learning_rate` and the gradient accumulators.
def _plain_variables(optimizer) -> list:
    """The optimizer's variables other than its step counter and gradient accumulators."""
    skip = {id(a) for a in keras_internals.accumulated_gradients(optimizer)}
    skip.add(id(keras_internals.optimizer_iterations(optimizer)))
    return [v for v in optimizer.variables if id(v) not in skip]


def _copy_optimizer_state(source, target) -> None:
    """Copy slots, learning rate and step count from `source` into `target` (same variables).

    Either may accumulate gradients (Keras' `gradient_accumulation_steps`, whose counter
    counts accumulated batches); the optimizer-step count is carried over, and `target`'s
    accumulators are left at zero.
    """
    src, dst = _plain_variables(source), _plain_variables(target)
    if len(src) != len(dst) or any(tuple(a.shape) != tuple(b.shape) for a, b in zip(src, dst)):
        raise RuntimeError(
            f"fit_with_oom_retry: cannot carry the state of optimizer '{source.name}' over to an "
            "accumulating copy (its variables differ)."
        )
    for a, b in zip(src, dst):
        b.assign(a.value)
    steps = int(keras.ops.convert_to_numpy(keras_internals.optimizer_iterations(source))) // (
        source.gradient_accumulation_steps or 1
    )
    keras_internals.optimizer_iterations(target).assign(
        steps * (target.gradient_accumulation_steps or 1)
    )
    for acc in keras_internals.accumulated_gradients(target):
        acc.assign(keras.ops.zeros(acc.shape, acc.dtype))


@keras.saving.register_keras_serializable(package="keras_perf")
class PerUpdateSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule read at the update count of an accumulating optimizer.

    Keras' optimizer with `gradient_accumulation_steps=k` evaluates its schedule at the count
    of accumulated batches (k per update), which would run the schedule k times too fast;
    this reads `schedule` at `step // k`, the number of updates.
    """

    def __init__(self, schedule, steps: int):
        self.schedule, self.steps = schedule, int(steps)

    def __call__(self, step):
        return self.schedule(step // self.steps)

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule), "steps": self.steps}

    @classmethod
    def from_config(cls, config):
        return cls(keras.saving.deserialize_keras_object(config["schedule"]), config["steps"])


def _loss_reductions(model) -> list:
    """The reductions of the compiled losses ("sum_over_batch_size" for a function or name)."""
    losses = keras.tree.flatten(getattr(model, "loss", None))
    return [
        getattr(loss, "reduction", "sum_over_batch_size") for loss in losses if loss is not None
    ]


class _Accumulation:
    """Gradient accumulation for a stock model fed arrays: batches of batch_size/k, k per update.

    The user's optimizer is not changed in structure: while the run needs accumulation the
    model trains with a copy built with `gradient_accumulation_steps=k` (Keras averages the k
    gradients and applies them once; its `iterations` counts updates, and a learning-rate
    schedule is read at the update count too, see `PerUpdateSchedule`), and the state is
    handed back to the user's optimizer when the run ends.
    """

    def __init__(self, model):
        self.model = model
        self.original = model.optimizer
        self.k = 1

    @staticmethod
    def refuses(model, weighted: bool = False) -> str | None:
        """Why accumulation would change the update (None: it gives the full-batch update).

        Keras averages the k gradients. That is the full-batch gradient when each batch's
        loss is its sum divided by the batch size ("sum_over_batch_size", "mean", with or
        without sample weights): it is not for "sum" (1/k of the update) nor, with
        sample weights (`weighted`), for "mean_with_sample_weight" (each batch divided by
        its own weight total).
        """
        for reduction in _loss_reductions(model):
            if reduction == "sum" or (reduction == "mean_with_sample_weight" and weighted):
                return (
                    f'its loss has reduction="{reduction}"'
                    + (" and the data has sample weights" if weighted else "")
                    + ", and averaging the gradients of smaller batches would not give the "
                    "full-batch update."
                )
        if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
            return (
                "its optimizer is a LossScaleOptimizer (mixed_float16), which Keras does not let "
                "accumulate gradients."
            )
        if model.optimizer.gradient_accumulation_steps and not getattr(
            model.optimizer, "_kp_copy", False
        ):
            return "its optimizer already accumulates gradients (gradient_accumulation_steps)."
        return None

    def set(self, k: int) -> None:
        """Train with k accumulated batches per update from the next `fit` call on."""
        current = self.model.optimizer
        if k == 1:
            target = self.original
        else:
            config = dict(self.original.get_config(), gradient_accumulation_steps=k)
            with _backend.model_scope(self.model):
                target = type(self.original).from_config(config)
            schedule = keras_internals.learning_rate_source(self.original)
            if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
                keras_internals.set_learning_rate_source(target, PerUpdateSchedule(schedule, k))
            target._kp_copy = True
        if current.built and not target.built:
            # (Unbuilt when the OOM came before the first update: Keras builds it then.)
            with _backend.model_scope(self.model):
                target.build(self.model.trainable_variables)
        _copy_optimizer_state(current, target)
        self.model.optimizer = target
        self.model.train_function = None  # rebuilt by the next fit, with the new optimizer
        self.k = k

    def finish(self) -> None:
        if self.k != 1:
            self.set(1)


# -- the ladder: which setting each out-of-memory error leads to ---------------------------
REMAT, MICROBATCHES, BOTH = "remat", "microbatches", "remat+microbatches"
STRATEGIES = (REMAT, MICROBATCHES)


def check_strategies(strategies) -> tuple | None:
    """Validate `strategies` (None, or a non-empty list/tuple of distinct rung names)."""
    if strategies is None:
        return None
    if (
        not isinstance(strategies, (list, tuple))
        or not strategies
        or any(s not in STRATEGIES for s in strategies)
        or len(set(strategies)) != len(strategies)
    ):
        raise ValueError(
            f"`strategies` must be None or a non-empty list or tuple of distinct names from "
            f"{list(STRATEGIES)}, in the order to try them; got {strategies!r}."
        )
    return tuple(strategies)


# Layers whose training call reads the batch as a whole: BatchNormalization normalises with
# the batch's statistics and moves its own; a `kp.quantize_aware` activation quantizer moves
# its range towards the batch's min and max. Micro-batches would do either once per slice,
# with the slice's values, so remat (the batch kept whole) is the closer rung for them: exact
# with BatchNormalization; on a QAT model on TensorFlow and JAX not to the bit (recomputed
# activations round differently and fake quantization amplifies it; docs/oom.md measures
# remat 3-7x closer than micro-batches).
_BATCH_DEPENDENT = (keras.layers.BatchNormalization, ActivationQuantizer)


def batch_dependent(model) -> bool:
    """Whether a layer of `model` computes with the batch as a whole (`_BATCH_DEPENDENT`)."""
    return any(isinstance(layer, _BATCH_DEPENDENT) for layer in iter_layers(model))


def ladder(model, strategies):
    """The settings to try after each OOM: yields (strategy, remat, microbatches).

    Micro-batching `model` (a loss-scaled twin for a stock model) starting from its current
    settings. The rung closest to plain training comes first: remat (the batch stays whole)
    for a model with batch-dependent layers, micro-batches (each update is the full-batch
    update) otherwise; then the other rung; then both, the micro-batches doubling from there
    on. A model whose `remat` is already on has no remat rung (it stays on).
    """
    k = _microbatches(model)
    own = getattr(model, "remat", None)
    if strategies is None:
        strategies = (REMAT, MICROBATCHES) if batch_dependent(model) else (MICROBATCHES, REMAT)
    if own is not None:
        strategies = tuple(s for s in strategies if s != REMAT)
    if not strategies:
        return
    if strategies == (REMAT,):
        yield REMAT, "full", k
        return
    if strategies == (MICROBATCHES,):
        while True:
            k *= 2
            yield MICROBATCHES, own, k
    for strategy in strategies:
        yield (strategy, "full", k) if strategy == REMAT else (strategy, None, 2 * k)
    while True:
        k *= 2
        yield BOTH, "full", k
