"""The backend-neutral part of keras-perf's train step: `TrainStepBase`.

Layered as Keras layers its trainers (`keras/src/trainers/trainer.py` below
`keras/src/backend/<backend>/trainer.py`): this shared base sits below one small class per
backend (`keras_perf/train_step/<backend>.py`), and `kp.LossScaleTrainStep`
(`keras_perf/train_step/__init__.py`) subclasses the one chosen at import. The hook contract
is the docstring of `TrainStepBase`. Backend-neutral: it imports `keras.ops`,
`keras_perf._utils` and `keras_perf._keras_internals`, never `keras_perf.backend`.

Loss-scale state is Keras' own: under `mixed_float16` the optimizer is a
`keras.optimizers.LossScaleOptimizer` (we wrap a plain optimizer at `compile` time), whose
`dynamic_scale` and `step_counter` are optimizer variables. They are therefore saved with the
model, restored by `BackupAndRestore` and snapshotted with the optimizer by
`fit_with_oom_retry`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import weakref

import keras
from keras import ops

from keras_perf import _keras_internals as keras_internals
from keras_perf._utils import (
    all_finite,
    in_training_step,
    iter_layers,
    metric_results_are_deferred,
    sum_of_squares,
    update_step_metrics,
)
from keras_perf.train_step._remat import RematSettings
from keras_perf.train_step._settings import SETTINGS

_STEP_METRICS = ("grad_norm", "skipped_steps")
_REDUCTIONS = ("sum", "sum_over_batch_size", "mean", "mean_with_sample_weight")
# What the slice being traced needs to know about its whole batch (thread-local: the replicas
# of a tf.distribute strategy trace in threads).
_SLICE = threading.local()
# Copies of the compiled losses with reduction "none", made once per loss object.
_UNREDUCED = weakref.WeakKeyDictionary()


def _resolve(path, structure):
    for key in path:
        structure = structure[key]
    return structure


def _term_sample_weight(path, sample_weight):
    # How Keras' CompileLoss picks one loss term's sample weight (Keras 3.8-3.15).
    if sample_weight is not None and keras.tree.is_nested(sample_weight):
        return _resolve(path, sample_weight)
    return sample_weight


def _reduction(loss) -> str:
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    return "none" if reduction is None else reduction


def _weight_sums(terms, sample_weight):
    """Per compiled loss term, the sum of the whole batch's sample weights (for the terms
    reduced with `mean_with_sample_weight`), else None."""
    sums = []
    for path, loss, _, _ in terms:
        sw = None
        if _reduction(loss) == "mean_with_sample_weight":
            sw = _term_sample_weight(path, sample_weight)
        sums.append(None if sw is None else ops.sum(ops.cast(sw, "float32")))
    return sums


class _Slice:
    """The whole batch as one slice's loss sees it: sizes and per-term sample-weight sums."""

    def __init__(self, model, batch, size, sample_weight):
        self.model = model
        self.batch = batch  # examples in the whole batch (int or scalar tensor)
        self.size = size  # examples in this slice
        self.sample_weight = sample_weight  # the whole batch's
        self.terms = []  # the compiled loss terms (path, loss, weight, name)
        self._sums = None

    def weight_sum(self, index):
        """Sum of the whole batch's sample weights of compiled loss term `index`."""
        if self._sums is None:
            self._sums = _weight_sums(self.terms, self.sample_weight)
        return self._sums[index]

    def share(self, dtype):
        """This slice's share of the batch, n_i / B."""
        return ops.cast(self.size, dtype) / ops.cast(self.batch, dtype)

    def to_batch(self, dtype):
        """B / n_i: turns a slice's contribution into a value that, tracked with weight n_i,
        adds up over the slices to the full-batch value tracked with weight B."""
        return ops.cast(self.batch, dtype) / ops.cast(self.size, dtype)


class _ExactTerm:
    """One compiled loss term of one slice, normalised by the WHOLE batch's normaliser.

    Keras reduces a term to sum(w * values) / D with D = number of elements of `values`
    (`sum_over_batch_size`, `mean`, and `mean_with_sample_weight` without sample weights), the
    sum of the sample weights (`mean_with_sample_weight`), or 1 (`sum`). Each slice returns its
    un-normalised sum over the full batch's D, so the slices' terms add up to the full-batch
    term exactly, whatever the reductions, loss weights and sample weights.
    """

    def __init__(self, loss, index, ctx):
        self.loss, self.index, self.ctx = loss, index, ctx

    def _unreduced(self):
        copy_ = _UNREDUCED.get(self.loss)
        if copy_ is None:
            copy_ = copy.copy(self.loss)  # a copy: the user's loss object is left as it is
            copy_.reduction = "none"
            _UNREDUCED[self.loss] = copy_
        return copy_

    def __call__(self, y_true, y_pred, sample_weight=None):
        model, ctx = self.ctx.model, self.ctx
        name = getattr(self.loss, "name", type(self.loss).__name__)
        reduction = _reduction(self.loss)
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"microbatches={model.microbatches} cannot train on loss '{name}' with "
                f"reduction={reduction!r}: its per-example loss vector is not one number to "
                "differentiate (Keras' JAX and PyTorch steps refuse it; TensorFlow sums it). "
                "Use reduction='sum' for those gradients, or microbatches=1."
            )
        mask = keras_internals.get_keras_mask(y_pred)
        if mask is not None and reduction != "sum":
            raise ValueError(
                f"microbatches={model.microbatches} cannot split loss '{name}' exactly: the "
                f"output is masked and reduction={reduction!r} divides by the masked batch's "
                "count of valid entries, which no slice knows. Use reduction='sum' (and scale "
                "the learning rate), or microbatches=1."
            )
        values = self._unreduced()(y_true, y_pred, sample_weight)
        shape = tuple(values.shape)
        if len(shape) == 0:
            raise ValueError(
                f"microbatches={model.microbatches} cannot split loss '{name}' exactly: its "
                "`call()` returns one number per batch, so how it normalises over the batch "
                "is hidden. Return one value per example from `call()`, or use microbatches=1."
            )
        total = ops.sum(values)
        if reduction == "sum":
            return total
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            divisor = ctx.weight_sum(self.index)
        else:
            per_example = ops.prod(ops.convert_to_tensor(ops.shape(values)[1:], "int32"))
            divisor = ops.cast(per_example, "float32") * ops.cast(ctx.batch, "float32")
        term = ops.divide_no_nan(total, ops.cast(divisor, total.dtype))
        return model._kp_scale_for_distribution(term)


class _SliceMean:
    """Stands in for a per-output loss tracker of Keras' CompileLoss during one slice.

    Keras tracks each output's term with weight = batch size; a slice's term is its
    contribution to the full-batch term, so it is tracked as contribution * B / n_i with
    weight n_i: the slices add up to the full batch's (term * B, weight B).
    """

    def __init__(self, metric, ctx):
        self.metric, self.ctx = metric, ctx

    def update_state(self, values, sample_weight=None):
        # Keras weighs by the static batch size, None (weight 1) where it is dynamic (TF
        # graphs): then the full batch counts once, so each slice counts n_i / B.
        weight = self.ctx.size if sample_weight is not None else self.ctx.share("float32")
        return self.metric.update_state(
            values * self.ctx.to_batch(values.dtype), sample_weight=weight
        )


class TrainStepBase(RematSettings):
    """Shared base of the per-backend train steps of `kp.LossScaleTrainStep`.

    Hook contract (the one place it is written down):

    - A backend class (`keras_perf/train_step/<backend>.py`) subclasses this one and
      implements `train_step` with the signature Keras' trainer of that backend calls. It
      forwards each slice through `_compute_loss`/`compute_metrics`, tracks the slice's loss
      with `_kp_track_loss`, and hands the accumulated, still scaled gradients to
      `_kp_process_gradients` before applying them.
    - It may override these hooks, whose generic `keras.ops` versions are here:
      `_kp_sum_of_squares(tensors)`, `_kp_all_finite(sum_sq, tensors)`,
      `_kp_update_step_metrics(norm, finite)`, `_kp_scale_for_distribution(loss)` (the
      per-replica loss division of tf.distribute; identity) and
      `_kp_build_compile_loss(y, y_pred, sample_weight)` (build the compiled loss before the
      first slice reads its terms; a no-op where Keras builds it before the step).
    - This base provides the settings (`microbatches`, `clipnorm`, `initial_scale`,
      `dynamic_growth_steps`, `loss_scale_optimizer`, the float16 `compile`, `get_config`),
      the slicing (`_kp_slice_size`, `_kp_check_microbatching`, `_kp_slice`, and the exact
      per-slice loss through Keras' `_compute_loss`), the gradient processing
      (`_kp_process_gradients`: norm, finiteness, clipping) and the step metrics
      (`grad_norm_tracker`, `skipped_steps_tracker`, `get_metrics_result`).
    - A user's model may override Keras' public methods as on any `keras.Model` (`call`,
      `compute_metrics`, `get_metrics_result` calling `super()`), and `compute_loss` when it
      sets `compute_loss_reduction`; never the `_kp_` hooks.

    The hooks carry the `_kp_` prefix because they live on the user's model class, beside
    `keras.Model`'s own private names and the user's: the prefix keeps them from colliding.
    """

    # Read by kp.check_mixed_precision: this model scales its loss itself.
    _keras_perf_scales_loss = True

    #: How an overridden `compute_loss` normalises over the batch; `None` (unknown) makes
    #: `microbatches > 1` refuse it. Set it to `"sum_over_batch_size"` on a subclass whose
    #: `compute_loss` is a mean over the batch's examples plus batch-independent terms
    #: (regularisation): each slice's loss is then weighted by its share of the batch.
    compute_loss_reduction: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if keras.Model in mro and mro.index(keras.Model) < mro.index(TrainStepBase):
            raise TypeError(
                f"{cls.__name__} lists keras.Model before kp.LossScaleTrainStep in its bases, "
                "so Keras' own train step would run and loss scaling, micro-batching and "
                f"clipping would silently be off. List the mixin first: `class {cls.__name__}"
                "(kp.LossScaleTrainStep, keras.Model): ...`."
            )

    # -- hooks a backend may override (generic versions) ----------------------------------
    _kp_sum_of_squares = staticmethod(sum_of_squares)
    _kp_all_finite = staticmethod(all_finite)
    _kp_update_step_metrics = update_step_metrics

    @staticmethod
    def _kp_scale_for_distribution(loss):
        return loss  # only tf.distribute divides the loss by the replica count

    def _kp_build_compile_loss(self, y, y_pred, sample_weight):
        pass  # Keras builds the compiled loss symbolically before the first step

    def train_step(self, *args):
        raise NotImplementedError("implemented by keras_perf/train_step/<backend>.py")

    def __init__(self, *args, **kwargs):
        # The settings of `SETTINGS` (keras_perf/train_step/_settings.py), each validated;
        # `remat` and `remat_threshold` are RematSettings'.
        for setting in SETTINGS:
            value = kwargs.pop(setting.name, setting.default)
            setattr(self, setting.attr, setting.check(value))
        super().__init__(*args, **kwargs)
        self.grad_norm_tracker = keras.metrics.Mean(name="grad_norm")
        self.skipped_steps_tracker = keras.metrics.Sum(name="skipped_steps", dtype="int32")

    # The settings' properties (`microbatches`, `clipnorm`, `initial_scale`,
    # `dynamic_growth_steps`, `traced_step`) are made from `SETTINGS` below the class.

    # -- compile: wrap the optimizer for float16 -----------------------------------------
    def compile(self, optimizer="rmsprop", *args, auto_scale_loss: bool = True, **kwargs):
        super().compile(optimizer, *args, auto_scale_loss=False, **kwargs)
        if (
            auto_scale_loss
            and self.optimizer is not None
            and self._kp_uses_float16()
            and not isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        ):
            self.optimizer = keras.optimizers.LossScaleOptimizer(
                self.optimizer,
                initial_scale=self.initial_scale,
                dynamic_growth_steps=self.dynamic_growth_steps,
                name="loss_scale_optimizer",
            )

    def compile_from_config(self, config):
        # Keras skips compile-on-load for models that override compile(); ours only adds the
        # optimizer wrapping, so loading compiles as Keras would (then restores the optimizer
        # state, including the loss scale, into the re-wrapped optimizer).
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def _kp_uses_float16(self) -> bool:
        if self.dtype_policy.compute_dtype == "float16":
            return True
        return keras.mixed_precision.global_policy().compute_dtype == "float16"

    # -- helpers used by the backend train steps ------------------------------------------
    @property
    def loss_scale_optimizer(self):
        """The `LossScaleOptimizer` in use, or `None` when the loss is not scaled."""
        opt = getattr(self, "optimizer", None)
        return opt if isinstance(opt, keras.optimizers.LossScaleOptimizer) else None

    def _kp_slice_size(self, batch_size):
        """Slice length and slice count for a batch (Python ints or backend scalars)."""
        k = self._microbatches
        if isinstance(batch_size, int):
            size = max(1, math.ceil(batch_size / k))
            return size, math.ceil(batch_size / size)
        size = ops.maximum((batch_size + k - 1) // k, 1)
        return size, (batch_size + size - 1) // size

    def _kp_restored_on_skip(self):
        """Per entry of `self.non_trainable_variables`: whether a skipped step restores it.

        Every non-trainable variable is restored (BatchNormalization's moving statistics, a
        quantizer's ranges, anything a layer assigns in `call`) except the state of the
        random seed generators: a skipped step still advances them, so that the next step
        draws new dropout masks and noise instead of replaying the skipped step's. Cached on
        the variables' identities (read once per trace on TF and JAX, once per step on torch).
        """
        variables = self.non_trainable_variables
        key = tuple(id(v) for v in variables)
        cached = getattr(self, "_kp_restore_cache", None)
        if cached is None or cached[0] != key:
            rng = {
                id(value.state)
                for layer in [self, *iter_layers(self)]
                for value in vars(layer).values()
                if isinstance(value, keras.random.SeedGenerator)
            }
            cached = (key, tuple(id(v) not in rng for v in variables))
            self._kp_restore_cache = cached
        return cached[1]

    def _kp_metrics_restored_on_skip(self):
        """Per entry of `self.metrics_variables`: whether a skipped step restores it.

        Every metric's state (the loss tracker, the compiled metrics) is put back, so that the
        epoch's logs average the steps that were applied: a NaN batch the step skipped does not
        make the logged `loss` NaN for the rest of the epoch (which would stop
        `keras.callbacks.TerminateOnNaN` and never let `EarlyStopping` on `loss` improve).
        `grad_norm` and `skipped_steps` are the exceptions: they count the skipped step.
        """
        own = {
            id(v)
            for tracker in (self.grad_norm_tracker, self.skipped_steps_tracker)
            for v in tracker.variables
        }
        return tuple(id(v) not in own for v in self.metrics_variables)

    # -- exact micro-batched loss ---------------------------------------------------------
    def _kp_check_microbatching(self, data):
        """Refuse, before any update, what micro-batching cannot split exactly (at trace time)."""
        for t in keras.tree.flatten(data):
            if t is not None and len(t.shape) == 0:
                raise ValueError(
                    f"microbatches={self._microbatches} cuts each batch along its first axis, "
                    "but the data holds a value with no axis (shape ()). Is the dataset batched? "
                    "Call `dataset.batch(batch_size)` before fit()."
                )
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        specs = keras_internals.input_structure(self)
        if specs is not None:
            flat_x, flat_specs = keras.tree.flatten(x), keras.tree.flatten(specs)
            if len(flat_x) == len(flat_specs):
                for t, spec in zip(flat_x, flat_specs):
                    if t is not None and len(t.shape) == len(spec.shape) - 1:
                        raise ValueError(
                            f"microbatches={self._microbatches}: input '{spec.name}' expects "
                            f"shape {tuple(spec.shape)} but the data has {tuple(t.shape)}, one "
                            "axis short: is the dataset batched? Call `dataset.batch(batch_size)` "
                            "before fit()."
                        )
        if type(self).compute_loss is not keras.Model.compute_loss:
            if self.compute_loss_reduction is None:
                raise ValueError(
                    f"{type(self).__name__} overrides `compute_loss`, and microbatches="
                    f"{self._microbatches} cannot see how it normalises over the batch, so it "
                    "cannot combine the slices into the full-batch loss exactly. Set the class "
                    'attribute `compute_loss_reduction = "sum_over_batch_size"` if it is a mean '
                    "over the examples (plus regularisation), or use microbatches=1."
                )
            if self.compute_loss_reduction != "sum_over_batch_size":
                raise ValueError(
                    "`compute_loss_reduction` must be None or 'sum_over_batch_size'; got "
                    f"{self.compute_loss_reduction!r}."
                )

    @contextlib.contextmanager
    def _kp_slice(self, batch, size, sample_weight):
        """While tracing one slice of a cut batch: `_compute_loss` returns the slice's exact
        contribution to the full-batch loss. Yields the slice's `_Slice`."""
        previous = getattr(_SLICE, "ctx", None)
        _SLICE.ctx = _Slice(self, batch, size, sample_weight)
        try:
            yield _SLICE.ctx
        finally:
            _SLICE.ctx = previous

    def _kp_track_loss(self, loss, ctx, batch_size):
        """Track the (unscaled) loss in Keras' loss tracker, as Keras' steps do.

        With `ctx` (a slice of a cut batch), tracked so that the slices add up to the full
        batch's entry; without, the whole batch's loss with weight `batch_size`.
        """
        tracker = keras_internals.loss_tracker(self)
        if ctx is None:
            tracker.update_state(loss, sample_weight=batch_size)
        else:
            tracker.update_state(loss * ctx.to_batch(loss.dtype), sample_weight=ctx.size)

    def _kp_check_added_losses(self):
        for layer in [self, *iter_layers(self)]:
            if (
                keras_internals.added_losses(layer)
                and getattr(layer, "activity_regularizer", None) is None
            ):
                raise ValueError(
                    f"Layer '{layer.name}' adds a loss with `add_loss()` in `call()`; "
                    f"microbatches={self._microbatches} cannot tell whether it is a mean or a "
                    "sum over the batch, so it cannot count it exactly once. Move it into "
                    "`compute_loss` (and set `compute_loss_reduction`), or use microbatches=1. "
                    "(Weight and activity regularisers are fine: Keras makes them batch means.)"
                )

    def _compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        # An override of Keras' private wrapper of compute_loss (Keras 3.15): Keras' train
        # steps (and ours) compute the loss through it, so a slice's loss is made exact here.
        ctx = getattr(_SLICE, "ctx", None)
        if ctx is None or ctx.model is not self:
            return super()._compute_loss(
                x, y, y_pred, sample_weight=sample_weight, training=training
            )
        if type(self).compute_loss is not keras.Model.compute_loss:
            # Declared a mean over the batch (checked in _kp_check_microbatching).
            loss = super()._compute_loss(
                x, y, y_pred, sample_weight=sample_weight, training=training
            )
            return loss * ctx.share(loss.dtype)
        # Keras' default compute_loss, term by term exact: each compiled term over the whole
        # batch's normaliser, the regularisation losses by this slice's share (once per batch).
        self._kp_check_added_losses()
        losses = []
        compile_loss = keras_internals.compiled_loss(self)
        if compile_loss is not None:
            self._kp_build_compile_loss(y, y_pred, sample_weight)
            with keras_internals.loss_terms_replaced(
                compile_loss,
                lambda j, loss: _ExactTerm(loss, j, ctx),
                lambda metric: _SliceMean(metric, ctx),
            ) as terms:
                ctx.terms = terms
                loss = compile_loss(y, y_pred, sample_weight)
            if loss is not None:
                losses.append(loss)
        extra = [keras_internals.aggregate_additional_loss(self, loss) for loss in self.losses]
        if extra:
            reg = extra[0] if len(extra) == 1 else ops.sum(extra)
            losses.append(reg * ctx.share(reg.dtype))
        if not losses:
            if keras.backend.backend() == "jax":
                return ops.zeros(())
            raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
        return losses[0] if len(losses) == 1 else ops.sum(losses)

    def _kp_process_gradients(self, grads, scale):
        """Norm of the unscaled gradients, finiteness, and the (clipped) gradients to apply.

        `grads` are the accumulated, still scaled gradients (None where a variable is not
        connected); `scale` is the loss scale or None. Clipping multiplies the scaled
        gradients, so a `LossScaleOptimizer` unscales them exactly as before.
        """
        present = [g for g in grads if g is not None]
        if not present:
            zero = ops.zeros((), "float32")
            return grads, ops.ones((), "bool"), zero
        # One pass over the gradients (the backend's cheapest sum of squares), which also
        # tells whether they are all finite (see `_utils.all_finite`).
        sum_sq = self._kp_sum_of_squares(present)
        finite = self._kp_all_finite(sum_sq, present)
        norm = ops.sqrt(sum_sq)
        if scale is not None:
            norm = norm / ops.cast(scale, "float32")
        if self._clipnorm is not None:
            clip = ops.cast(self._clipnorm, "float32")
            factor = clip / ops.maximum(norm, clip)
            grads = [None if g is None else g * ops.cast(factor, g.dtype) for g in grads]
        return grads, finite, norm

    def get_metrics_result(self):
        # grad_norm and skipped_steps belong to training: keep them out of evaluate()'s logs
        # (and so out of the val_* keys). The flag is read while the step is traced.
        if metric_results_are_deferred():
            return {}
        results = super().get_metrics_result()
        if not in_training_step():
            for name in _STEP_METRICS:
                results.pop(name, None)
        return results

    # -- serialisation --------------------------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config.update({setting.name: getattr(self, setting.attr) for setting in SETTINGS})
        return config


for _setting in SETTINGS:
    setattr(TrainStepBase, _setting.name, _setting.as_property())
del _setting
