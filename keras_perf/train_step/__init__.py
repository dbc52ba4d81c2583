"""The loss-scaling, micro-batching train step: mixin `LossScaleTrainStep` and `loss_scaled`.

Layered as Keras layers `keras.Model` over its trainers (`keras/src/trainers/trainer.py`
below `keras/src/backend/<backend>/trainer.py`, picked once by `keras/src/models/model.py`):

- `_base.py`: `TrainStepBase`, the backend-neutral mechanics (settings, slicing, exact
  per-slice loss, gradient processing, step metrics); its docstring is the hook contract. It
  imports `keras.ops`, `keras_perf._utils` and `keras_perf._keras_internals` only, never
  `keras_perf.backend`.
- `tensorflow.py`, `jax.py`, `torch.py`: one small `TrainStep(TrainStepBase)` per backend
  with that backend's `train_step`. They are the train step's backend modules, as Keras'
  backend trainers are: the framework calls they need (`tf.while_loop`, `jax.lax.scan`,
  torch's `backward`, the tf.distribute all-reduce) stay in them, not behind
  `keras_perf.backend`; from that package they use only their own backend's implementation
  module (`keras_perf.backend.tensorflow.is_multi_worker`).
- This `__init__`: the public API. `LossScaleTrainStep` subclasses the `TrainStep` of the
  backend Keras runs on, chosen once at import; `LossScaledModel` and `loss_scaled` build on
  it.

Nothing below this package imports it (`keras_perf.backend` included; tests/test_imports.py
checks the layering). The loss always comes from the model's `compute_loss`, so a subclass
changes the loss, never the mechanics.
"""

from __future__ import annotations

import keras

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf.train_step._remat import check_remat, check_remat_names
from keras_perf.train_step._settings import KEEP as _KEEP
from keras_perf.train_step._settings import SETTINGS

# For keras-perf's own packages (keras_perf/_carry_over.py), not the public API: every
# train-step setting of a model by name, and setting them.
from keras_perf.train_step._settings import apply_settings as apply_settings
from keras_perf.train_step._settings import settings as settings

# The backend's train step, chosen once (as keras/src/models/model.py picks its Trainer).
if _backend.BACKEND == "tensorflow":
    from keras_perf.train_step.tensorflow import TrainStep
elif _backend.BACKEND == "jax":
    from keras_perf.train_step.jax import TrainStep
else:  # torch: keras_perf.backend refuses any other backend at import
    from keras_perf.train_step.torch import TrainStep

__all__ = ["LossScaleTrainStep", "LossScaledModel", "loss_scaled"]


class LossScaleTrainStep(TrainStep):
    """Mixin giving a `keras.Model` subclass keras-perf's train step.

    Subclass it before `keras.Model`: `class MyModel(kp.LossScaleTrainStep, keras.Model)`.
    The model trains with plain `fit`; the step adds:

    - dynamic loss scaling under a `mixed_float16` policy, also when `compile` was given a
      plain optimizer (it is wrapped in `keras.optimizers.LossScaleOptimizer` with
      `initial_scale` and `dynamic_growth_steps`: the scale doubles after that many finite
      steps and halves on overflow); no scaling under bfloat16 or float32;
    - skipping of any step whose gradients are not finite: weights, optimizer slots,
      `optimizer.iterations` and every non-trainable variable the forward pass wrote
      (BatchNormalization's moving statistics, quantizer ranges; every slice's) stay exactly
      as they were, the random seed generators excepted (and the scale backs off);
    - `microbatches=k`: each batch is cut into k slices inside the compiled step and their
      gradients are accumulated into one optimizer update equal to the full-batch update, for
      every loss reduction, sample and class weights, several outputs and `loss_weights`
      (each loss term of a slice is divided by the whole batch's normaliser); the logged
      loss, per-output losses, metrics and `grad_norm` are the full batch's. Peak activation
      memory drops about k-fold; the effective batch, the number of optimizer steps and the
      learning-rate schedule do not change. A batch with fewer than k examples (say, a short
      last batch) is cut into fewer slices. What cannot be split exactly is refused with a
      `ValueError` at the first step (docs/train_step.md): reduction `"none"`, a masked
      output under a normalising reduction, `add_loss()` in `call()`, and an overridden
      `compute_loss` unless the class sets `compute_loss_reduction = "sum_over_batch_size"`;
    - `clipnorm`: clipping of the global norm of the *unscaled* gradients;
    - `remat`: gradient checkpointing of the model as it is (built or not, trained or not):
      the selected layers' activations are recomputed in the backward pass instead of kept,
      for that step only (the model, its weights and its saved form are unchanged). `"full"`
      recomputes every layer, `"activations"` the activation functions only,
      `"larger_than"` the layers whose output has more than `remat_threshold` elements per
      example, a list of names those layers. A layer that owns non-trainable variables
      (BatchNormalization, Dropout's seed, quantizers) is never recomputed, its stateless
      sublayers are: so the loss, gradients and moving statistics are those without remat.
      Changeable between fits (`model.remat = "full"`) and saved with the model.
    - `traced_step` (PyTorch): each step runs as one aten graph traced once per input
      signature (forward, backward, Keras' optimizer, metrics), which removes Keras' per-layer
      Python; the same weights and logs as the eager step. `"inductor"` also compiles the
      graph with `torch.compile`. A model the trace refuses (Python control flow on tensor
      values, Dropout, loss scaling, `microbatches > 1`, `remat`) keeps the eager step, with
      one `KerasPerfWarning` and the reason in
      `keras_perf.train_step.torch_traced.traced_step_state(model)`. On TensorFlow and JAX
      the step is already one compiled graph: the setting changes nothing there (a
      `KerasPerfWarning` says so).

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
        remat: `None`, `"full"`, `"activations"`, `"larger_than"` or a list of layer names.
            Defaults to `None`.
        remat_threshold: Elements per example of a layer's output above which
            `"larger_than"` recomputes it (only with that mode). Defaults to `None` (1024).
        **kwargs: Passed on to `keras.Model`.

    Raises:
        TypeError: `microbatches` or `dynamic_growth_steps` is not an int; or, when the class
            is created, the mixin is listed after `keras.Model` in its bases.
        ValueError: `microbatches` < 1, `clipnorm` <= 0, `initial_scale` <= 0,
            `dynamic_growth_steps` < 1, an unknown `remat` mode, `remat_threshold` <= 0 or
            without `remat="larger_than"`, or `traced_step` not False, True or "inductor".

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
        ['grad_norm', 'loss_scale', 'skipped_steps']
    """


@keras.saving.register_keras_serializable(package="keras_perf")
class LossScaledModel(LossScaleTrainStep, keras.Model):
    """A Functional model with keras-perf's train step; what `kp.loss_scaled` returns."""


def _kept(value) -> bool:
    return isinstance(value, str) and value == _KEEP


def installed_traced_step(model) -> bool | str:
    """The traced step installed on a plain `model` (`install_traced_step`, as `kp.accelerate`
    applies it) as a `traced_step` setting: `True`, `"inductor"`, or `False` where none is
    installed (or it fell back, or the model was compiled again)."""
    step = model.__dict__.get("_kp_traced_step")  # torch_traced._ATTR; no torch import here
    if step is None or not step.installed or model.__dict__.get("train_step") is not step:
        return False
    if not step.check_compiled():  # fell back, or compiled again since
        return False
    return "inductor" if step.inductor else True


def loss_scaled(
    model: keras.Model,
    microbatches: int | None = None,
    clipnorm: float | None | str = _KEEP,
    *,
    initial_scale: float = 2.0**15,
    dynamic_growth_steps: int = 2000,
    remat=_KEEP,
    remat_threshold: float | None = None,
    traced_step=_KEEP,
) -> keras.Model:
    """Give a Sequential or Functional model keras-perf's loss-scaling train step.

    The returned model shares the same layers and weights (nothing is copied): it is the same
    graph behind a `LossScaledModel`. If `model` was compiled, the result is compiled the same
    way with the same optimizer instance (its state is kept); otherwise compile the result.
    The model's input and output structures (dicts, lists, nesting) are kept.
    If `model` already has the train step, it is returned with the settings passed here
    applied and every setting not passed kept as it was.

    See `kp.LossScaleTrainStep` for what the step does and logs.

    Args:
        model: A built Sequential or Functional `keras.Model`.
        microbatches: Slices each batch is cut into. Defaults to `None`: `1`, or the model's
            own setting if it already has the train step.
        clipnorm: Global-norm clip of the unscaled gradients, or `None` for none. Defaults to
            `"keep"`: no clipping, or the model's own setting if it already has the train
            step.
        initial_scale: Initial loss scale under float16. Defaults to `2**15`.
        dynamic_growth_steps: Finite steps after which the scale doubles. Defaults to `2000`.
        remat: Gradient checkpointing: `None`, `"full"`, `"activations"`, `"larger_than"` or a
            list of layer names (see `kp.LossScaleTrainStep`). Defaults to `"keep"`: `None`,
            or the model's own setting if it already has the train step.
        remat_threshold: Elements per example of a layer's output above which
            `"larger_than"` recomputes it. Defaults to `None` (1024, or the model's own
            threshold when `remat` is kept).
        traced_step: `True` runs each step as one traced torch graph (PyTorch backend; see
            `kp.LossScaleTrainStep`), `"inductor"` also compiles that graph with
            `torch.compile`, `False` runs the eager step. Defaults to `"keep"`: `False`, or
            the model's own setting if it already has the train step or a traced step
            installed (`install_traced_step`, as `kp.accelerate` applies it).

    Returns:
        A `keras.Model` (a `kp.LossScaledModel`) that trains with the train step and saves and
        loads as `.keras`.

    Raises:
        TypeError: `model` is not a Keras model, or is a subclassed model (subclass
            `kp.LossScaleTrainStep` instead).
        ValueError: a Sequential model that has no input shape yet, or bad settings (an
            unknown `remat` mode, a layer name `model` does not have, a `remat_threshold`
            <= 0 or without `"larger_than"`).

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model = kp.loss_scaled(base, microbatches=2)
        >>> model.layers[-1] is base.layers[-1]
        True
        >>> model.compile("adam", "mse")
        >>> h = model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
        >>> sorted(h.history)
        ['grad_norm', 'loss', 'loss_scale', 'skipped_steps']
        >>> model = kp.loss_scaled(model, remat="full")  # same model, now with remat
        >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
    """
    given = dict(locals())  # the keywords as passed, before any other name is bound
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    # The keywords of `SETTINGS` (keras_perf/train_step/_settings.py), as passed.
    passed = {s.name: given[s.name] for s in SETTINGS}
    if isinstance(model, LossScaleTrainStep):
        # Settings not passed are kept (re-wrapping must not silently turn a feature off);
        # the loss-scale settings are the model's own (read when it was compiled).
        # Validated all first, then applied (no half-updated model on error).
        values = {
            s.name: passed[s.name] for s in SETTINGS if not (s.at_compile or s.kept(passed[s.name]))
        }
        if _kept(remat):
            remat = model.remat
            if remat_threshold is None and remat == "larger_than":
                remat_threshold = model.remat_threshold
        values.update(remat=remat, remat_threshold=remat_threshold)
        apply_settings(model, values)
        return model
    values = {s.name: s.default if s.kept(passed[s.name]) else passed[s.name] for s in SETTINGS}
    remat, remat_threshold = check_remat(None if _kept(remat) else remat, remat_threshold)
    check_remat_names(model, remat)
    if _kept(traced_step):  # a traced step installed on the plain model is kept
        values["traced_step"] = installed_traced_step(model)
    if not isinstance(model, keras.Sequential) and not keras_internals.is_functional(model):
        raise TypeError(
            f"kp.loss_scaled() takes Sequential and Functional models; {type(model).__name__} is "
            "a subclassed model. Add the train step by subclassing the mixin instead: "
            f"`class {type(model).__name__}(kp.LossScaleTrainStep, keras.Model): ...`."
        )
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs:  # the flat lists (a structure may be a single tensor)
        raise ValueError(
            f"Model '{model.name}' has no inputs yet: give the Sequential model an input shape "
            "(`keras.Input(shape)` as first layer) or call it on data before kp.loss_scaled()."
        )
    if keras_internals.is_functional(model):
        # The nested structures (dict, list, nesting), not the flat lists: a dict-output
        # model keeps its output names, so its dict losses, loss_weights and data still fit.
        inputs = keras_internals.input_structure(model, inputs)
        outputs = keras_internals.output_structure(model, outputs)
    # Under the strategy `model` was made in (TF), so that the twin trains on its replicas too.
    with _backend.model_scope(model):
        new = LossScaledModel(
            # A single input as a tensor, not a one-element list: Keras warns when the structure
            # of the data (one array) differs from that of the inputs.
            inputs=inputs[0] if isinstance(inputs, list) and len(inputs) == 1 else inputs,
            outputs=outputs,
            name=model.name,
            remat=remat,
            remat_threshold=remat_threshold,
            **values,
        )
        if getattr(model, "compiled", False) and model.optimizer is not None:
            config = keras.saving.deserialize_keras_object(model.get_compile_config())
            config["optimizer"] = model.optimizer
            new.compile(**config)
    return new
