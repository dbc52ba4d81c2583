"""The loss-scaling, micro-batching train step: mixin `LossScaleTrainStep` and `loss_scaled`.

The mechanics (slicing, gradient accumulation, loss scaling, skipping non-finite steps,
clipping) live here and in one small module per backend (`keras_perf/backend/train_step_*.py`,
chosen once at import). The loss always comes from the model's `compute_loss`, so a subclass
changes the loss, never the mechanics.

Loss-scale state is Keras' own: under `mixed_float16` the optimizer is a
`keras.optimizers.LossScaleOptimizer` (we wrap a plain optimizer at `compile` time), whose
`dynamic_scale` and `step_counter` are optimizer variables. They are therefore saved with the
model, restored by `BackupAndRestore` and snapshotted with the optimizer by
`fit_with_oom_retry`.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_perf import backend as _backend
from keras_perf._utils import (
    check_int,
    check_number,
    in_training_step,
    metric_results_are_deferred,
)

__all__ = ["LossScaleTrainStep", "LossScaledModel", "loss_scaled"]

_STEP_METRICS = ("grad_norm", "skipped_steps")


def _check_microbatches(value) -> int:
    return check_int("microbatches", value, minimum=1)


def _check_clipnorm(value):
    return check_number("clipnorm", value, low=0.0, low_inclusive=False, allow_none=True)


class LossScaleTrainStep(_backend.TrainStepBase):
    """Mixin giving a `keras.Model` subclass keras-perf's train step.

    Subclass it before `keras.Model`: `class MyModel(kp.LossScaleTrainStep, keras.Model)`.
    The model trains with plain `fit`; the step adds:

    - dynamic loss scaling under a `mixed_float16` policy, also when `compile` was given a
      plain optimizer (it is wrapped in `keras.optimizers.LossScaleOptimizer` with
      `initial_scale` and `dynamic_growth_steps`: the scale doubles after that many finite
      steps and halves on overflow); no scaling under bfloat16 or float32;
    - skipping of any step whose gradients are not finite: weights, optimizer slots and
      `optimizer.iterations` stay exactly as they were (and the scale backs off);
    - `microbatches=k`: each batch is cut into k slices inside the compiled step and their
      gradients are accumulated, weighted by slice size, into one optimizer update equal to the
      full-batch update. Peak activation memory drops about k-fold; the effective batch, the
      number of optimizer steps and the learning-rate schedule do not change. A batch with
      fewer than k examples (say, a short last batch) is cut into fewer slices;
    - `clipnorm`: clipping of the global norm of the *unscaled* gradients.

    The logs gain `grad_norm` (mean global norm of the unscaled gradients over this epoch's
    applied steps), `skipped_steps` (non-finite steps skipped this epoch) and, under float16,
    `loss_scale` (the current scale).

    BatchNormalization and other batch-dependent layers see each slice as a batch: with
    `microbatches=k` they normalise with slice statistics and update their moving statistics
    k times per step, as gradient accumulation does in any framework.

    On the PyTorch backend, skipping a non-finite step without a `LossScaleOptimizer` needs
    one host synchronisation per step (the same one Keras' `LossScaleOptimizer` does there);
    TensorFlow and JAX decide inside the compiled step.

    Args:
        microbatches: Number of slices each batch is cut into. Defaults to `1`.
        clipnorm: Maximum global norm of the unscaled gradients, or `None` for no clipping.
            Defaults to `None`.
        initial_scale: Loss scale to start from under float16. Defaults to `2**15`.
        dynamic_growth_steps: Finite steps after which the scale doubles. Defaults to `2000`.
        **kwargs: Passed on to `keras.Model`.

    Raises:
        TypeError: `microbatches` or `dynamic_growth_steps` is not an int.
        ValueError: `microbatches` < 1, `clipnorm` <= 0, `initial_scale` <= 0 or
            `dynamic_growth_steps` < 1.

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> class MLP(kp.LossScaleTrainStep, keras.Model):
        ...     def __init__(self, **kwargs):
        ...         super().__init__(**kwargs)
        ...         self.hidden = keras.layers.Dense(16, activation="relu")
        ...         self.out = keras.layers.Dense(3)
        ...     def call(self, x):
        ...         return self.out(self.hidden(x))
        >>> model = MLP(microbatches=2, clipnorm=1.0)
        >>> model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        >>> h = model.fit(np.zeros((8, 4)), np.zeros(8), batch_size=4, verbose=0)
        >>> sorted(k for k in h.history if k != "loss")
        ['grad_norm', 'skipped_steps']
    """

    # Read by kp.check_mixed_precision: this model scales its loss itself.
    _keras_perf_scales_loss = True

    def __init__(
        self,
        *args,
        microbatches: int = 1,
        clipnorm: float | None = None,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        **kwargs,
    ):
        self._microbatches = _check_microbatches(microbatches)
        self._clipnorm = _check_clipnorm(clipnorm)
        self.initial_scale = check_number("initial_scale", initial_scale, low=0.0, low_inclusive=False)
        self.dynamic_growth_steps = check_int("dynamic_growth_steps", dynamic_growth_steps, minimum=1)
        super().__init__(*args, **kwargs)
        self.grad_norm_tracker = keras.metrics.Mean(name="grad_norm")
        self.skipped_steps_tracker = keras.metrics.Sum(name="skipped_steps", dtype="int32")

    # -- settings -----------------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        """Slices per batch; setting it rebuilds the compiled train function."""
        return self._microbatches

    @microbatches.setter
    def microbatches(self, value: int) -> None:
        value = _check_microbatches(value)
        if value != self._microbatches:
            self._microbatches = value
            self.train_function = None  # Keras rebuilds it on the next fit.

    @property
    def clipnorm(self) -> float | None:
        """Global-norm clip of the unscaled gradients; setting it rebuilds the train function."""
        return self._clipnorm

    @clipnorm.setter
    def clipnorm(self, value) -> None:
        value = _check_clipnorm(value)
        if value != self._clipnorm:
            self._clipnorm = value
            self.train_function = None

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
        config.update(
            {
                "microbatches": self._microbatches,
                "clipnorm": self._clipnorm,
                "initial_scale": self.initial_scale,
                "dynamic_growth_steps": self.dynamic_growth_steps,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_perf")
class LossScaledModel(LossScaleTrainStep, keras.Model):
    """A Functional model with keras-perf's train step; what `kp.loss_scaled` returns."""


def loss_scaled(
    model: keras.Model,
    microbatches: int = 1,
    clipnorm: float | None = None,
    *,
    initial_scale: float = 2.0**15,
    dynamic_growth_steps: int = 2000,
) -> keras.Model:
    """Give a Sequential or Functional model keras-perf's loss-scaling train step.

    The returned model shares the same layers and weights (nothing is copied): it is the same
    graph behind a `LossScaledModel`. If `model` was compiled, the result is compiled the same
    way with the same optimizer instance (its state is kept); otherwise compile the result.
    If `model` already has the train step, its settings are updated and it is returned.

    See `kp.LossScaleTrainStep` for what the step does and logs.

    Args:
        model: A built Sequential or Functional `keras.Model`.
        microbatches: Slices each batch is cut into. Defaults to `1`.
        clipnorm: Global-norm clip of the unscaled gradients, or `None`. Defaults to `None`.
        initial_scale: Initial loss scale under float16. Defaults to `2**15`.
        dynamic_growth_steps: Finite steps after which the scale doubles. Defaults to `2000`.

    Returns:
        A `keras.Model` (a `kp.LossScaledModel`) that trains with the train step and saves and
        loads as `.keras`.

    Raises:
        TypeError: `model` is not a Keras model, or is a subclassed model (subclass
            `kp.LossScaleTrainStep` instead).
        ValueError: a Sequential model that has no input shape yet, or bad settings.

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model = kp.loss_scaled(base, microbatches=2)
        >>> model.layers[-1] is base.layers[-1]
        True
        >>> model.compile("adam", "mse")
        >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    settings = dict(microbatches=microbatches, clipnorm=clipnorm)
    if isinstance(model, LossScaleTrainStep):
        # Validate everything first, then apply (no half-updated model on error).
        _check_microbatches(microbatches)
        _check_clipnorm(clipnorm)
        model.microbatches, model.clipnorm = microbatches, clipnorm
        return model
    if not isinstance(model, keras.Sequential) and not _backend.is_functional(model):
        raise TypeError(
            f"kp.loss_scaled() takes Sequential and Functional models; {type(model).__name__} is "
            "a subclassed model. Add the train step by subclassing the mixin instead: "
            f"`class {type(model).__name__}(kp.LossScaleTrainStep, keras.Model): ...`."
        )
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs:
        raise ValueError(
            f"Model '{model.name}' has no inputs yet: give the Sequential model an input shape "
            "(`keras.Input(shape)` as first layer) or call it on data before kp.loss_scaled()."
        )
    # Under the strategy `model` was made in (TF), so that the twin trains on its replicas too.
    with _backend.model_scope(model):
        new = LossScaledModel(
            # A single input as a tensor, not a one-element list: Keras warns when the structure
            # of the data (one array) differs from that of the inputs.
            inputs=inputs[0] if len(inputs) == 1 else inputs,
            outputs=outputs,
            name=model.name,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            **settings,
        )
        if getattr(model, "compiled", False) and model.optimizer is not None:
            config = keras.saving.deserialize_keras_object(model.get_compile_config())
            config["optimizer"] = model.optimizer
            new.compile(**config)
    return new

