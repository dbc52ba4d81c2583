"""Knowledge distillation: `DistillationModel` and `precompute_teacher_logits`.

The distiller customises only the loss (`compute_loss`); the mechanics — loss scaling under
`mixed_float16`, micro-batching, skipping non-finite steps, clipping — are the loss-scaling
train step's (`kp.LossScaleTrainStep`). The soft-target loss is computed in float32 from
log-softmax values, so no probability is ever passed through `log` (no `log(0)`), and the
teacher runs frozen, in inference mode, outside the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import keras
import numpy as np
from keras import ops

from keras_perf._utils import check_bool, check_int, check_number, in_training_step
from keras_perf.backend import keras_internals
from keras_perf.train_step import LossScaleTrainStep

__all__ = ["DistillationModel", "precompute_teacher_logits"]

# Smallest normal float32: probabilities are clipped here before `log` when the models output
# probabilities (from_logits=False). A probability below it has underflowed already.
_TINY = float(np.finfo("float32").tiny)
_DISTILL_METRICS = ("distillation_loss", "feature_loss")


def _log_probs(outputs, temperature: float, from_logits: bool):
    """log softmax(z / T) in float32, where z are logits or log-probabilities."""
    z = ops.cast(outputs, "float32")
    if not from_logits:
        z = ops.log(ops.clip(z, _TINY, 1.0))
    if temperature != 1.0:
        z = z / temperature
    return ops.log_softmax(z, axis=-1)


def _teacher_log_probs(teacher_outputs, temperature: float, from_logits: bool):
    """log of the soft target: one teacher's, or the mean of several teachers' probabilities."""
    if isinstance(teacher_outputs, (list, tuple)):
        logs = [_log_probs(t, temperature, from_logits) for t in teacher_outputs]
        if len(logs) == 1:
            return logs[0]
        return ops.logsumexp(ops.stack(logs, axis=0), axis=0) - math.log(len(logs))
    return _log_probs(teacher_outputs, temperature, from_logits)


class _SoftTargetKL(keras.losses.Loss):
    """T² · KL(softmax(t/T) ‖ softmax(s/T)) per position; y_true is log softmax(t/T)."""

    def __init__(self, temperature: float, from_logits: bool, name: str = "distillation_loss"):
        super().__init__(name=name, dtype="float32")
        self.temperature = temperature
        self.from_logits = from_logits

    def call(self, y_true, y_pred):
        log_t = y_true
        log_s = _log_probs(y_pred, self.temperature, self.from_logits)
        kl = ops.sum(ops.exp(log_t) * (log_t - log_s), axis=-1)
        return kl * (self.temperature**2)


class _CustomDistillationLoss(keras.losses.Loss):
    """Wraps a user callable `fn(teacher_outputs, student_outputs)` (float32 inputs)."""

    def __init__(self, fn: Callable, name: str = "distillation_loss"):
        super().__init__(name=name, dtype="float32")
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, ops.cast(y_pred, "float32"))


def _output_shape(model):
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    if not outputs or len(outputs) != 1:
        return None
    return tuple(outputs[0].shape)


def _nested_layers(model) -> list:
    """`model` and every layer inside it, depth first (through nested models' `layers`)."""
    out, stack, seen = [], [model], set()
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        out.append(layer)
        stack.extend(reversed(list(getattr(layer, "layers", None) or ())))
    return out


def _check_not_shared(student, teacher) -> None:
    """Raise if the student and a teacher share a layer or a variable.

    The teacher is frozen (`trainable = False`); a layer it shares with the student would be
    frozen in the student too, and its weights would silently stop training.
    """
    teacher_layers = {id(layer): layer for layer in _nested_layers(teacher)}
    for layer in _nested_layers(student):
        if id(layer) in teacher_layers:
            what = (
                "is the teacher" if layer is teacher else f"is a layer of teacher '{teacher.name}'"
            )
            raise ValueError(
                f"The student '{student.name}' contains layer '{layer.name}', which {what}. "
                "The teacher is frozen, so the student's copy would be frozen too and never "
                "train. Give the student its own layers (e.g. `keras.models.clone_model(...)` "
                "for a part taken from the teacher, with `set_weights` to start from the "
                "teacher's values)."
            )
    teacher_vars = {id(v): v for v in teacher.weights}
    for v in student.weights:
        if id(v) in teacher_vars:
            raise ValueError(
                f"The student '{student.name}' and teacher '{teacher.name}' share the variable "
                f"'{v.path}'. The teacher is frozen, so this weight would never train in the "
                "student. Give the student its own variables."
            )


def _output_structure_problem(output) -> str | None:
    """Why `output` (a model's output structure) is not one tensor, or None."""
    if isinstance(output, dict):
        return f"a dict of outputs (keys {sorted(map(str, output))})"
    if isinstance(output, (list, tuple)) and len(output) != 1:
        return f"{len(output)} outputs"
    return None


def _multi_output_error(model_name: str, role: str, problem: str) -> ValueError:
    return ValueError(
        f"The {role} '{model_name}' has {problem}; DistillationModel distils one output "
        "(class axis last). Distil each head with its own DistillationModel over a model that "
        "outputs that head alone (e.g. `keras.Model(m.inputs, m.outputs[i])`)."
    )


def _check_one_tensor(output, model_name: str, role: str) -> None:
    """At the first batch: refuse what `_check_single_output` could not see before."""
    problem = _output_structure_problem(output)
    if problem is None and isinstance(output, (list, tuple)):
        problem = "a list of one output"
    if problem is not None:
        raise _multi_output_error(model_name, role, problem)


def _check_single_output(model, role: str) -> None:
    """Refuse a Functional model with several outputs or a dict output (known at build)."""
    try:
        output = model.output
    except (AttributeError, ValueError, RuntimeError):
        return  # not built / subclassed: checked on the first batch (compute_loss)
    problem = _output_structure_problem(output)
    if problem is not None:
        raise _multi_output_error(model.name, role, problem)


# Layers that pass values through unchanged (up to shape) at inference: the output's nature
# (logits or probabilities) is the one of the layer before them.
_PASSTHROUGH = (
    keras.layers.Reshape,
    keras.layers.Flatten,
    keras.layers.Dropout,
    keras.layers.Identity,
    keras.layers.Permute,
    keras.layers.GaussianNoise,
    keras.layers.GaussianDropout,
    keras.layers.AlphaDropout,
    keras.layers.ActivityRegularization,
)
# Layers whose output is an affine function of their input when `activation` is linear.
_AFFINE = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
)


def _activation_name(layer) -> str | None:
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    fn = getattr(layer, "activation", None)
    if fn is None:
        return None
    try:
        name = keras.activations.serialize(fn)
    except (ValueError, TypeError):
        return None
    return name if isinstance(name, str) else None


def _producer(model, tensor):
    """The layer of `model` whose (single) output is `tensor`, or None."""
    for layer in getattr(model, "layers", None) or ():
        try:
            if layer.output is tensor:
                return layer
        except (AttributeError, ValueError, RuntimeError):  # unbuilt or called several times
            continue
    return None


def _output_kind(model, depth: int = 0) -> tuple[str | None, str | None]:
    """("probabilities" | "logits" | None, layer description) from the output layer's config.

    `None` when it cannot be told for certain (subclassed or unbuilt models, custom or
    Lambda layers, several outputs).
    """
    try:
        outputs = model.outputs
    except (AttributeError, ValueError, RuntimeError):
        return None, None
    if not outputs or len(outputs) != 1 or depth > 8:
        return None, None
    layer = _producer(model, outputs[0])
    while layer is not None:
        if isinstance(layer, keras.Model):
            return _output_kind(layer, depth + 1)
        name = _activation_name(layer)
        where = f"layer '{layer.name}' ({type(layer).__name__}"
        where += ")" if isinstance(layer, keras.layers.Softmax) else f", activation {name!r})"
        if name in ("softmax", "sigmoid"):
            return "probabilities", where
        if name == "linear" and isinstance(layer, _AFFINE):
            return "logits", where
        if name == "log_softmax":
            return "logits", where
        if isinstance(layer, _PASSTHROUGH) or (
            isinstance(layer, keras.layers.Activation) and name == "linear"
        ):
            try:
                layer = _producer(model, layer.input)
            except (AttributeError, ValueError, RuntimeError):
                return None, None
            continue
        return None, None
    return None, None


def _check_from_logits(model, role: str, from_logits: bool) -> None:
    """Raise when the output layer's config contradicts `from_logits`."""
    kind, where = _output_kind(model)
    if kind == "probabilities" and from_logits:
        raise ValueError(
            f"The {role} '{model.name}' outputs probabilities: its output {where} ends in a "
            "probability activation, but `from_logits=True` treats outputs as logits, so the "
            "soft targets would be softened twice (wrong targets, no error). Pass "
            "`from_logits=False` (both models then output probabilities), or build the model "
            "without the final softmax (e.g. `keras.applications.*(classifier_activation="
            "None)`) for logits."
        )
    if kind == "logits" and not from_logits:
        raise ValueError(
            f"The {role} '{model.name}' outputs logits: its output {where} has no probability "
            "activation, but `from_logits=False` treats outputs as probabilities. Pass "
            "`from_logits=True` (both models then output logits), or end the model in a "
            "softmax."
        )


def _layer_output(model, name: str, role: str):
    try:
        return model.get_layer(name).output
    except (ValueError, AttributeError) as exc:
        raise ValueError(
            f"Feature distillation needs the {role} layer {name!r} and its symbolic output: "
            f"{role} '{model.name}' must be a Functional or Sequential model with an input shape "
            f"that contains a layer of that name ({exc})."
        ) from None


def _serialize_model(model):
    # Without the compile config: a compiled teacher (or student) is loaded as a plain model,
    # and the distiller's file does not carry that model's optimizer.
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    return config


def _deserialize_model(obj):
    if obj is None or isinstance(obj, keras.Model):
        return obj
    return keras.saving.deserialize_keras_object(obj)


@keras.saving.register_keras_serializable(package="keras_perf")
class DistillationModel(LossScaleTrainStep, keras.Model):
    """Trains a student model to match a frozen teacher's softened outputs (and the labels).

    The loss on each batch is

        loss = alpha · T² · KL(softmax(t/T) ‖ softmax(s/T)) + (1 − alpha) · student_loss(y, s)

    with `t` the teacher's and `s` the student's outputs (class axis last, any rank), plus the
    student's regularisation losses and, when `features` are given, `feature_weight` times a
    mean squared error between (projected) student and teacher activations. The soft targets
    and the KL are computed in float32 from log-softmax values under any dtype policy, so a
    float16 or bfloat16 model (or a teacher of another dtype than the student) is cast at the
    boundary and nothing overflows or takes `log(0)`.

    The teacher is frozen (`teacher.trainable` is set to False), called with `training=False`
    (dropout off, BatchNormalization on its moving statistics) and its outputs are wrapped in
    `stop_gradient`; its weights are never in `trainable_weights` and are never updated.
    `call`, `predict` and `evaluate` use the student only (see `compile(evaluate_distillation=)`
    to include the distillation loss in `evaluate`). `distiller.student` is a plain Keras model:
    save it alone to deploy it without the teacher.

    Training runs on keras-perf's train step (`kp.LossScaleTrainStep`): dynamic loss scaling
    under `mixed_float16`, `microbatches`, `clipnorm`, and the logs `loss`, `student_loss`,
    `distillation_loss` (and `feature_loss`), the compiled metrics of the student, `grad_norm`,
    `skipped_steps` and, under float16, `loss_scale`.

    Offline distillation: pass `teacher=None` and train on `(x, (y, teacher_outputs))`, where
    `teacher_outputs` come from `kp.precompute_teacher_logits` (a list of arrays for several
    teachers). The teacher's forward pass is then paid once instead of once per epoch. Do not
    use it when the inputs change from epoch to epoch (data augmentation, random crops, noise):
    the stored targets would belong to the un-augmented inputs.

    Args:
        student: The model to train, a `keras.Model` with one output (class axis last).
        teacher: The trained teacher: a `keras.Model`, a list of them (the soft target is the
            mean of their probabilities), or `None` for offline distillation from stored
            outputs. Defaults to `None` only when given by keyword.
        temperature: Softmax temperature `T` of the soft targets, finite and > 0.
            Defaults to `3.0`.
        alpha: Weight in [0, 1] of the distillation term; `1 - alpha` weights the label loss.
            With `alpha=1.0` labels are not used (pass `y=None` for unlabelled data, or any
            labels: they only feed the logged `student_loss` and the metrics).
            Defaults to `0.7`.
        from_logits: Whether student and teacher output logits (True) or probabilities
            (False); one setting for both models. Defaults to `True`.
        features: Optional pairs `(student_layer_name, teacher_layer_name)` of Functional or
            Sequential models whose activations are matched by mean squared error; a learned
            linear projection (a bias-free `Dense`) maps the student's width to the teacher's
            when they differ. Defaults to `None`.
        feature_weight: Weight of the feature loss. Defaults to `1.0`.
        **kwargs: `microbatches`, `clipnorm`, `initial_scale`, `dynamic_growth_steps` of
            `kp.LossScaleTrainStep`, and `keras.Model` arguments such as `name`.

    Checked at construction (as far as the models' configs tell):

    - the student shares no layer or variable with a teacher (a student that calls the
      teacher as a layer, or reuses one of its layers, would be frozen with it);
    - each model has one output (a tensor; not a dict, not several heads): refused, not
      distilled per head. A subclassed or unbuilt model is checked on the first batch,
      before any weight changes;
    - `from_logits` agrees with the output layer: a softmax or sigmoid at the end (a
      `Softmax` layer, an `Activation`, or a layer's `activation`, also behind Reshape,
      Flatten, Dropout or inside a nested model) is probabilities, a `Dense`/`Conv` with a
      linear activation is logits. Every `keras.applications` classifier ends in softmax by
      default: pass `from_logits=False`, or build it with `classifier_activation=None`.
      Outputs the config cannot tell (a `Lambda`, a custom layer, a subclassed model) are
      not checked.

    Raises:
        TypeError: `student` or a teacher is not a `keras.Model`; a non-bool `from_logits`.
        ValueError: `alpha` outside [0, 1], `temperature` not in (0, inf), `feature_weight`
            < 0, a teacher that is the student or shares a layer or variable with it,
            teacher and student output shapes that disagree, a model with several outputs
            or a dict output, an output layer that contradicts `from_logits`, a feature
            layer that does not exist.

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> teacher = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, "relu"),
        ...                             keras.layers.Dense(3)])
        >>> student = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> distiller = kp.DistillationModel(student, teacher, temperature=3.0, alpha=0.7)
        >>> distiller.compile("adam", metrics=["accuracy"])
        >>> x, y = np.random.rand(64, 8).astype("float32"), np.random.randint(0, 3, 64)
        >>> h = distiller.fit(x, y, batch_size=32, epochs=1, verbose=0)
        >>> sorted(k for k in h.history if "loss" in k)
        ['distillation_loss', 'loss', 'student_loss']
        >>> distiller.predict(x, verbose=0).shape
        (64, 3)
    """

    # Every term of `compute_loss` is a mean over the examples (checked per fit in
    # `_kp_check_microbatching`): micro-batch slices combine by their share of the batch.
    compute_loss_reduction = "sum_over_batch_size"

    def __init__(
        self,
        student: keras.Model,
        teacher: keras.Model | Sequence[keras.Model] | None = None,
        temperature: float = 3.0,
        alpha: float = 0.7,
        from_logits: bool = True,
        features: Sequence[tuple[str, str]] | None = None,
        feature_weight: float = 1.0,
        **kwargs,
    ):
        student = _deserialize_model(student)
        if isinstance(teacher, (list, tuple)):
            teacher = [_deserialize_model(t) for t in teacher]
        else:
            teacher = _deserialize_model(teacher)
        self.temperature = check_number(
            "temperature",
            temperature,
            low=0.0,
            high=math.inf,
            low_inclusive=False,
            high_inclusive=False,
        )
        self.alpha = check_number("alpha", alpha, low=0.0, high=1.0)
        self.from_logits = check_bool("from_logits", from_logits)
        self.feature_weight = check_number("feature_weight", feature_weight, low=0.0)
        if not isinstance(student, keras.Model):
            raise TypeError(f"`student` must be a keras.Model, got {type(student).__name__}.")
        _check_single_output(student, "student")
        teachers = _check_teachers(student, teacher)
        _check_from_logits(student, "student", self.from_logits)
        for t in teachers or ():
            _check_from_logits(t, "teacher", self.from_logits)
        pairs = _check_feature_pairs(features, teachers)
        super().__init__(**kwargs)
        self.student = student
        self._teacher_list = teachers
        if teachers is None:
            self.teacher = None
        elif isinstance(teacher, (list, tuple)):
            self.teacher = list(teachers)
        else:
            self.teacher = teachers[0]
        for t in teachers or ():
            t.trainable = False
        self.features = pairs
        self._setup_features()

        self.student_loss_tracker = keras.metrics.Mean(name="student_loss")
        self.distillation_loss_tracker = keras.metrics.Mean(name="distillation_loss")
        self.feature_loss_tracker = keras.metrics.Mean(name="feature_loss") if pairs else None
        self.evaluate_distillation = False
        self._distill_loss = _SoftTargetKL(self.temperature, self.from_logits)
        self._distillation_loss_config = "kl"
        if _output_shape(student) is not None:
            self.built = True

    # -- features -------------------------------------------------------------------------
    def _setup_features(self):
        self.projections = []
        models = None
        if self.features:
            s_out = [self.student.outputs[0]]
            t_out = [self._teacher_list[0].outputs[0]]
            for s_name, t_name in self.features:
                s_feat = _layer_output(self.student, s_name, "student")
                t_feat = _layer_output(self._teacher_list[0], t_name, "teacher")
                s_out.append(s_feat)
                t_out.append(t_feat)
                s_width, t_width = s_feat.shape[-1], t_feat.shape[-1]
                if s_width == t_width:
                    self.projections.append(None)
                else:
                    proj = keras.layers.Dense(t_width, use_bias=False, name=f"projection_{s_name}")
                    proj.build(tuple(s_feat.shape))
                    self.projections.append(proj)
            models = (
                keras.Model(self.student.inputs, s_out, name=f"{self.student.name}_features"),
                keras.Model(self._teacher_list[0].inputs, t_out, name="teacher_features"),
            )
        # Not tracked as attributes: they share the student's and teacher's layers, whose
        # weights are saved once, through `student` and `teacher`.
        object.__setattr__(self, "_feature_models", models)

    # -- compile ---------------------------------------------------------------------------
    def compile(
        self,
        optimizer="adam",
        metrics=None,
        student_loss=None,
        distillation_loss="kl",
        evaluate_distillation: bool = False,
        loss=None,
        **kwargs,
    ):
        """Configure training; the loss is built from `student_loss` and `distillation_loss`.

        Args:
            optimizer: Optimizer (name or instance). Under `mixed_float16` a plain optimizer is
                wrapped in a `LossScaleOptimizer`. Defaults to `"adam"`.
            metrics: Metrics of the student's outputs against the labels. Defaults to `None`.
            student_loss: Label loss of the student, or `None` for sparse categorical
                cross-entropy with the distiller's `from_logits`. Defaults to `None`.
            distillation_loss: `"kl"` (T² · KL of the softened distributions) or a callable
                `fn(teacher_outputs, student_outputs)` returning per-example (or scalar)
                losses; it receives float32 outputs (a list for several teachers) and its
                value is used as is (no T²). Defaults to `"kl"`.
            evaluate_distillation: Whether `evaluate` (and validation) also runs the teacher
                to report `distillation_loss` and include it in `loss`. If False, `evaluate`
                runs the student only and its `loss` is the student's label loss (plus
                regularisation). Defaults to `False`.
            loss: Alias of `student_loss` (what a saved compile config holds).
                Defaults to `None`.
            **kwargs: Other `keras.Model.compile` arguments (`weighted_metrics`,
                `jit_compile`, `steps_per_execution`, ...).

        Raises:
            ValueError: both `loss` and `student_loss` given, or an unknown
                `distillation_loss` name.
        """
        if loss is not None and student_loss is not None:
            raise ValueError("Pass the label loss as `student_loss` (or `loss`), not both.")
        student_loss = student_loss if student_loss is not None else loss
        if student_loss is None:
            student_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=self.from_logits)
        self.evaluate_distillation = check_bool("evaluate_distillation", evaluate_distillation)
        if isinstance(distillation_loss, str):
            if distillation_loss != "kl":
                raise ValueError(
                    f"`distillation_loss` must be 'kl' or a callable fn(teacher_outputs, "
                    f"student_outputs); got {distillation_loss!r}."
                )
            self._distill_loss = _SoftTargetKL(self.temperature, self.from_logits)
        elif callable(distillation_loss):
            self._distill_loss = _CustomDistillationLoss(distillation_loss)
        else:
            raise TypeError(
                "`distillation_loss` must be 'kl' or a callable fn(teacher_outputs, "
                f"student_outputs); got {type(distillation_loss).__name__}."
            )
        self._distillation_loss_config = distillation_loss
        self._label_loss_reduction = getattr(student_loss, "reduction", "sum_over_batch_size")
        super().compile(optimizer, loss=student_loss, metrics=metrics, **kwargs)

    def _kp_check_microbatching(self, data):
        # Each term of the loss is a mean over the batch's examples, so the train step can
        # weight each micro-batch slice by its share of the batch (`compute_loss_reduction`).
        # A label loss of another reduction is not such a mean: refuse it, never train on a
        # different update.
        super()._kp_check_microbatching(data)
        reduction = getattr(self, "_label_loss_reduction", "sum_over_batch_size")
        if reduction not in ("sum_over_batch_size", "mean"):
            raise ValueError(
                f"microbatches={self.microbatches}: the student's label loss has "
                f"reduction={reduction!r}, which is not a mean over the batch, so the slices "
                "cannot be combined into the full-batch distillation loss exactly. Use a label "
                "loss with reduction='sum_over_batch_size', or microbatches=1."
            )

    def get_compile_config(self):
        config = super().get_compile_config()
        if config is not None:
            config = dict(config)
            config["distillation_loss"] = keras.saving.serialize_keras_object(
                self._distillation_loss_config
            )
            config["evaluate_distillation"] = self.evaluate_distillation
        return config

    # -- forward ---------------------------------------------------------------------------
    def call(self, inputs, training=None):
        for t in self._teacher_list or ():
            if not t.built:
                # Reached in Keras' symbolic build before the first step when the student had
                # no known inputs at construction: create the teacher's weights now, not inside
                # the first traced step (which fails on JAX).
                _check_one_tensor(t(inputs, training=False), t.name, "teacher")
        if training and self._feature_models is not None:
            outputs = self._feature_models[0](inputs, training=True)
            return outputs[0], list(outputs[1:])
        return self.student(inputs, training=training)

    def _split_y_pred(self, y_pred):
        if self._feature_models is not None and isinstance(y_pred, tuple) and len(y_pred) == 2:
            return y_pred
        return y_pred, None

    def _split_y(self, y):
        """(labels, stored teacher outputs or None)."""
        if self._teacher_list is None and isinstance(y, (list, tuple)) and len(y) == 2:
            return y[0], y[1]
        return y, None

    def _run_teachers(self, x, need_features: bool):
        if need_features:
            outs = self._feature_models[1](x, training=False)
            outs = [ops.stop_gradient(o) for o in outs]
            return outs[0], outs[1:]
        outs = []
        for t in self._teacher_list:
            out = t(x, training=False)
            _check_one_tensor(out, t.name, "teacher")
            outs.append(ops.stop_gradient(out))
        return (outs if isinstance(self.teacher, list) else outs[0]), None

    # -- the loss --------------------------------------------------------------------------
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """Total loss of one batch (see the class docstring); updates the loss trackers.

        The sum of `_label_term` (weighted `1 - alpha` when distilling), `_soft_target_term`
        (weighted `alpha`), `_feature_term` (weighted `feature_weight`) and the student's
        regularisation losses, each in float32.
        """
        if y_pred is None:
            y_pred = self(x, training=training)
        s_out, s_feats = self._split_y_pred(y_pred)
        _check_one_tensor(s_out, self.student.name, "student")
        y_true, stored = self._split_y(y)
        batch = ops.shape(s_out)[0]
        distill = training or self.evaluate_distillation

        terms = self._label_term(y_true, s_out, sample_weight, batch, distill, training)
        if distill and (self.alpha > 0.0 or s_feats is not None):
            t_out, t_feats = self._teacher_outputs(x, stored, need_features=s_feats is not None)
            self._check_output_shapes(t_out, s_out)
            if self.alpha > 0.0:
                terms.append(self._soft_target_term(t_out, s_out, sample_weight, batch))
            if s_feats is not None and t_feats is not None:
                terms.append(self._feature_term(s_feats, t_feats, batch))
        for extra in self.student.losses:
            terms.append(
                ops.cast(keras_internals.aggregate_additional_loss(self, extra), "float32")
            )
        if not terms:
            return ops.zeros((), "float32")
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

    def _label_term(self, y_true, s_out, sample_weight, batch, distill, training) -> list:
        """[(1 - alpha) · student_loss] (or [student_loss] without distillation), or []."""
        if y_true is None:
            if training and self.alpha < 1.0:
                # (Without labels outside training there is no label loss to report; Keras'
                # JAX trainer also builds the metrics once with training=False.)
                raise ValueError(
                    "Labels are missing: they are needed unless alpha=1.0 (soft targets only) "
                    "during training. Pass y, or use alpha=1.0 for label-free distillation."
                )
            return []
        compile_loss = keras_internals.compiled_loss(self)
        student_loss = ops.cast(compile_loss(y_true, s_out, sample_weight), "float32")
        self.student_loss_tracker.update_state(student_loss, sample_weight=batch)
        if not distill:
            return [student_loss]
        if self.alpha < 1.0:
            return [student_loss * (1.0 - self.alpha)]
        return []

    def _teacher_outputs(self, x, stored, need_features: bool):
        """(teacher outputs, teacher features or None): stored ones, or a frozen forward pass."""
        if stored is not None:
            return stored, None
        if self._teacher_list is None:
            raise ValueError(
                "Offline distillation (teacher=None) trains on (x, (y, teacher_outputs)); "
                "the batch has no stored teacher outputs. Compute them once with "
                "kp.precompute_teacher_logits(teacher, x) and pass y=(labels, outputs)."
            )
        return self._run_teachers(x, need_features)

    def _soft_target_term(self, t_out, s_out, sample_weight, batch):
        """alpha · distillation_loss(teacher outputs, student outputs)."""
        if isinstance(self._distill_loss, _SoftTargetKL):
            target = _teacher_log_probs(t_out, self.temperature, self.from_logits)
        else:
            target = keras.tree.map_structure(lambda t: ops.cast(t, "float32"), t_out)
        d_loss = self._distill_loss(target, s_out, sample_weight=sample_weight)
        self.distillation_loss_tracker.update_state(d_loss, sample_weight=batch)
        return d_loss * self.alpha

    def _feature_term(self, s_feats, t_feats, batch):
        """feature_weight · sum of MSE(projected student feature, teacher feature)."""
        f_loss = ops.zeros((), "float32")
        for s_f, t_f, proj in zip(s_feats, t_feats, self.projections):
            if proj is not None:
                s_f = proj(s_f)
            diff = ops.cast(s_f, "float32") - ops.cast(t_f, "float32")
            f_loss = f_loss + ops.mean(ops.square(diff))
        self.feature_loss_tracker.update_state(f_loss, sample_weight=batch)
        return f_loss * self.feature_weight

    def _check_output_shapes(self, t_out, s_out):
        s_shape = tuple(s_out.shape)
        for t in t_out if isinstance(t_out, (list, tuple)) else [t_out]:
            t_shape = tuple(t.shape)
            if len(t_shape) != len(s_shape) or any(
                a is not None and b is not None and a != b for a, b in zip(t_shape, s_shape)
            ):
                raise ValueError(
                    f"Teacher outputs of shape {t_shape} do not match the student's outputs of "
                    f"shape {s_shape}: both must give the same classes on the last axis."
                )

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        s_out, _ = self._split_y_pred(y_pred)
        y_true, _ = self._split_y(y)
        if y_true is None:  # label-free training: only the loss trackers
            return self.get_metrics_result()
        return super().compute_metrics(x, y_true, s_out, sample_weight=sample_weight)

    def get_metrics_result(self):
        results = super().get_metrics_result()
        if not in_training_step() and not self.evaluate_distillation:
            for name in _DISTILL_METRICS:
                results.pop(name, None)
        return results

    # -- serialisation ----------------------------------------------------------------------
    def get_config(self):
        config = super().get_config()
        teacher = self.teacher
        if isinstance(teacher, list):
            teacher = [_serialize_model(t) for t in teacher]
        elif teacher is not None:
            teacher = _serialize_model(teacher)
        config.update(
            {
                "student": _serialize_model(self.student),
                "teacher": teacher,
                "temperature": self.temperature,
                "alpha": self.alpha,
                "from_logits": self.from_logits,
                "features": [list(p) for p in self.features] if self.features else None,
                "feature_weight": self.feature_weight,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["student"] = _deserialize_model(config["student"])
        teacher = config.get("teacher")
        if isinstance(teacher, list):
            config["teacher"] = [_deserialize_model(t) for t in teacher]
        else:
            config["teacher"] = _deserialize_model(teacher)
        return cls(**config)


def _check_teachers(student, teacher):
    if teacher is None:
        return None
    teachers = list(teacher) if isinstance(teacher, (list, tuple)) else [teacher]
    if not teachers:
        raise ValueError("`teacher` is an empty list: give at least one teacher model, or None.")
    s_shape = _output_shape(student)
    for t in teachers:
        if not isinstance(t, keras.Model):
            raise TypeError(
                f"`teacher` must be a keras.Model or a list of them, got {type(t).__name__}."
            )
        if t is student:
            raise ValueError(
                "The teacher is the student itself: distil from a separately trained teacher "
                "(e.g. `keras.models.clone_model(model)` trained first), not the model being trained."
            )
        _check_not_shared(student, t)
        symbolic = _build_on_student_inputs(t, student)
        _check_single_output(t, "teacher")
        if symbolic is not None:
            _check_one_tensor(symbolic, t.name, "teacher")
        t_shape = _output_shape(t)
        if t_shape is None and symbolic is not None:
            t_shape = tuple(symbolic.shape)
        if (
            s_shape is not None
            and t_shape is not None
            and (len(s_shape) != len(t_shape) or s_shape[1:] != t_shape[1:])
        ):
            raise ValueError(
                f"Teacher '{t.name}' outputs shape {t_shape} but student '{student.name}' outputs "
                f"{s_shape}: both must give the same classes on the last axis."
            )
    return teachers


def _build_on_student_inputs(teacher, student):
    """Build an unbuilt teacher by calling it on symbolic copies of the student's inputs.

    Its weights must exist before training: on JAX a teacher whose weights would be created
    inside the first (traced, stateless) train step fails there. Returns the symbolic output,
    or None when the teacher was built already or the student's inputs are not known yet
    (then Keras' symbolic build before the first step builds both).
    """
    if teacher.built:
        return None
    inputs = None
    for attr in ("input", "inputs"):  # Functional: its input structure; Sequential: a list
        try:
            inputs = getattr(student, attr)
            break
        except (AttributeError, ValueError, RuntimeError):
            continue
    if isinstance(inputs, list) and len(inputs) == 1:
        inputs = inputs[0]
    if inputs is None or (isinstance(inputs, (list, tuple, dict)) and not inputs):
        return None
    fresh = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=tuple(t.shape), dtype=t.dtype), inputs
    )
    try:
        return teacher(fresh, training=False)
    except Exception as exc:  # the model's own error, re-raised with what was tried
        shapes = keras.tree.map_structure(lambda t: tuple(t.shape), inputs)
        raise ValueError(
            f"Teacher '{teacher.name}' is not built, and calling it on the student's inputs "
            f"(shape {shapes}) failed: {type(exc).__name__}: {exc}. Build the teacher for "
            "the student's inputs first (e.g. `teacher.build(input_shape)`, or train it)."
        ) from exc


def _check_feature_pairs(features, teachers):
    if not features:
        return None
    if teachers is None or len(teachers) != 1:
        raise ValueError("`features` needs exactly one teacher model (not None and not a list).")
    pairs = []
    for pair in features:
        if not (
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and all(isinstance(n, str) for n in pair)
        ):
            raise ValueError(
                f"`features` must be pairs (student_layer_name, teacher_layer_name); got {pair!r}."
            )
        pairs.append((pair[0], pair[1]))
    return pairs


def precompute_teacher_logits(teacher, x, batch_size: int = 256, verbose=0):
    """Run a teacher once over `x` and return its outputs, for offline distillation.

    Train a `kp.DistillationModel(student, teacher=None, ...)` on `(x, (y, outputs))` with
    the same `temperature`/`from_logits` as an online distiller: the teacher's forward pass is
    paid once instead of once per epoch. Not for augmented or otherwise randomised inputs:
    the stored outputs belong to the exact inputs given here.

    Args:
        teacher: A `keras.Model` or a list of them.
        x: Inputs (anything `teacher.predict` accepts, in the order used for training).
        batch_size: Batch size of the forward pass. Defaults to `256`.
        verbose: `predict` verbosity. Defaults to `0`.

    Returns:
        A float32 NumPy array of the teacher's outputs (logits, or probabilities for
        probability-output teachers); a list of arrays for a list of teachers.

    Raises:
        TypeError: `teacher` is not a model or a list of models, or a bad `batch_size`.
        ValueError: `batch_size` < 1.

    Example:
        >>> import keras, keras_perf as kp, numpy as np
        >>> teacher = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> kp.precompute_teacher_logits(teacher, np.ones((10, 4)), batch_size=4).shape
        (10, 3)
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if isinstance(teacher, (list, tuple)):
        return [precompute_teacher_logits(t, x, batch_size, verbose) for t in teacher]
    if not isinstance(teacher, keras.Model):
        raise TypeError(
            f"`teacher` must be a keras.Model or a list of them, got {type(teacher).__name__}."
        )
    out = teacher.predict(x, batch_size=batch_size, verbose=verbose)
    return np.asarray(ops.convert_to_numpy(ops.cast(out, "float32")))
