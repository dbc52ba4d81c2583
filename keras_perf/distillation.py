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
        temperature: Softmax temperature `T` > 0 of the soft targets. Defaults to `3.0`.
        alpha: Weight in [0, 1] of the distillation term; `1 - alpha` weights the label loss.
            With `alpha=1.0` labels are not used (pass `y=None` for unlabelled data, or any
            labels: they only feed the logged `student_loss` and the metrics).
            Defaults to `0.7`.
        from_logits: Whether student and teacher output logits (True) or probabilities
            (False). Defaults to `True`.
        features: Optional pairs `(student_layer_name, teacher_layer_name)` of Functional or
            Sequential models whose activations are matched by mean squared error; a learned
            linear projection (a bias-free `Dense`) maps the student's width to the teacher's
            when they differ. Defaults to `None`.
        feature_weight: Weight of the feature loss. Defaults to `1.0`.
        **kwargs: `microbatches`, `clipnorm`, `initial_scale`, `dynamic_growth_steps` of
            `kp.LossScaleTrainStep`, and `keras.Model` arguments such as `name`.

    Raises:
        TypeError: `student` or a teacher is not a `keras.Model`; a non-bool `from_logits`.
        ValueError: `alpha` outside [0, 1], `temperature` <= 0, `feature_weight` < 0, a
            teacher that is the student, teacher and student output shapes that disagree, a
            feature layer that does not exist.

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
        self.temperature = check_number("temperature", temperature, low=0.0, low_inclusive=False)
        self.alpha = check_number("alpha", alpha, low=0.0, high=1.0)
        self.from_logits = check_bool("from_logits", from_logits)
        self.feature_weight = check_number("feature_weight", feature_weight, low=0.0)
        if not isinstance(student, keras.Model):
            raise TypeError(f"`student` must be a keras.Model, got {type(student).__name__}.")
        teachers = _check_teachers(student, teacher)
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
        super().compile(optimizer, loss=student_loss, metrics=metrics, **kwargs)

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
        outs = [ops.stop_gradient(t(x, training=False)) for t in self._teacher_list]
        return (outs if isinstance(self.teacher, list) else outs[0]), None

    # -- the loss --------------------------------------------------------------------------
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """Total loss of one batch (see the class docstring); updates the loss trackers."""
        if y_pred is None:
            y_pred = self(x, training=training)
        s_out, s_feats = self._split_y_pred(y_pred)
        y_true, stored = self._split_y(y)
        batch = ops.shape(s_out)[0]
        distill = training or self.evaluate_distillation
        zero = ops.zeros((), "float32")

        terms = []
        if y_true is not None:
            student_loss = ops.cast(self._compile_loss(y_true, s_out, sample_weight), "float32")
            self.student_loss_tracker.update_state(student_loss, sample_weight=batch)
            if not distill or self.alpha < 1.0:
                weight = 1.0 if not distill else 1.0 - self.alpha
                terms.append(student_loss * weight)
        elif training and self.alpha < 1.0:
            # (Without labels outside training there is no label loss to report; Keras' JAX
            # trainer also builds the metrics once with training=False.)
            raise ValueError(
                "Labels are missing: they are needed unless alpha=1.0 (soft targets only) during "
                "training. Pass y, or use alpha=1.0 for label-free distillation."
            )

        if distill and (self.alpha > 0.0 or s_feats is not None):
            t_feats = None
            if stored is not None:
                t_out = stored
            elif self._teacher_list is None:
                raise ValueError(
                    "Offline distillation (teacher=None) trains on (x, (y, teacher_outputs)); "
                    "the batch has no stored teacher outputs. Compute them once with "
                    "kp.precompute_teacher_logits(teacher, x) and pass y=(labels, outputs)."
                )
            else:
                t_out, t_feats = self._run_teachers(x, s_feats is not None)
            self._check_output_shapes(t_out, s_out)
            if self.alpha > 0.0:
                if isinstance(self._distill_loss, _SoftTargetKL):
                    target = _teacher_log_probs(t_out, self.temperature, self.from_logits)
                else:
                    target = keras.tree.map_structure(lambda t: ops.cast(t, "float32"), t_out)
                d_loss = self._distill_loss(target, s_out, sample_weight=sample_weight)
                self.distillation_loss_tracker.update_state(d_loss, sample_weight=batch)
                terms.append(d_loss * self.alpha)
            if s_feats is not None and t_feats is not None:
                f_loss = zero
                for s_f, t_f, proj in zip(s_feats, t_feats, self.projections):
                    if proj is not None:
                        s_f = proj(s_f)
                    diff = ops.cast(s_f, "float32") - ops.cast(t_f, "float32")
                    f_loss = f_loss + ops.mean(ops.square(diff))
                self.feature_loss_tracker.update_state(f_loss, sample_weight=batch)
                terms.append(f_loss * self.feature_weight)

        for extra in self.student.losses:
            terms.append(ops.cast(self._aggregate_additional_loss(extra), "float32"))
        if not terms:
            return zero
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

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
            raise TypeError(f"`teacher` must be a keras.Model or a list of them, got {type(t).__name__}.")
        if t is student:
            raise ValueError(
                "The teacher is the student itself: distil from a separately trained teacher "
                "(e.g. `keras.models.clone_model(model)` trained first), not the model being trained."
            )
        t_shape = _output_shape(t)
        if s_shape is not None and t_shape is not None and (
            len(s_shape) != len(t_shape) or s_shape[1:] != t_shape[1:]
        ):
            raise ValueError(
                f"Teacher '{t.name}' outputs shape {t_shape} but student '{student.name}' outputs "
                f"{s_shape}: both must give the same classes on the last axis."
            )
    return teachers


def _check_feature_pairs(features, teachers):
    if not features:
        return None
    if teachers is None or len(teachers) != 1:
        raise ValueError("`features` needs exactly one teacher model (not None and not a list).")
    pairs = []
    for pair in features:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
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
        raise TypeError(f"`teacher` must be a keras.Model or a list of them, got {type(teacher).__name__}.")
    out = teacher.predict(x, batch_size=batch_size, verbose=verbose)
    return np.asarray(ops.convert_to_numpy(ops.cast(out, "float32")))
