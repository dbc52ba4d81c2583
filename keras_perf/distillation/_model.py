"""`DistillationModel`: construction, compile, the forward pass and the distillation loss.

The class puts the parts together: the loss terms of `compute_loss` (labels, soft targets,
features, regularisation), the teachers' frozen forward pass, and the logs. Not here: the
losses themselves (`_losses`), the model checks (`_checks`, `_output_kind`), feature
distillation (`_features`, a mixin), the configs (`_serialization`, a mixin), offline
targets (`_precompute`), and the train step (`kp.LossScaleTrainStep`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import keras
from keras import ops

from keras_perf import _keras_internals as keras_internals
from keras_perf._utils import check_bool, check_number, in_training_step
from keras_perf.distillation._checks import (
    _check_one_tensor,
    _check_single_output,
    _check_teachers,
    _output_shape,
)
from keras_perf.distillation._features import _check_feature_pairs, _FeatureDistillation
from keras_perf.distillation._losses import (
    _CustomDistillationLoss,
    _SoftTargetKL,
    _teacher_log_probs,
)
from keras_perf.distillation._output_kind import _check_from_logits
from keras_perf.distillation._serialization import _deserialize_model, _DistillationConfig
from keras_perf.train_step import LossScaleTrainStep

_DISTILL_METRICS = ("distillation_loss", "feature_loss")


# Saved configs name it "keras_perf>DistillationModel" (Keras looks that up, not the module).
@keras.saving.register_keras_serializable(package="keras_perf", name="DistillationModel")
class DistillationModel(_FeatureDistillation, _DistillationConfig, LossScaleTrainStep, keras.Model):
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
        ['distillation_loss', 'loss', 'loss_scale', 'student_loss']
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
