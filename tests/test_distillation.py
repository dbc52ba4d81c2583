"""Tests of kp.DistillationModel and kp.precompute_teacher_logits (keras_perf/distillation/)."""

import os

import keras
import numpy as np
import pytest
from keras import ops

import keras_perf as kp
from tests import models


def mlp(widths, classes=10, inputs=64, name=None, activation=None, **dense_kwargs):
    hidden_names = [f"hidden{i}" for i in range(len(widths))]
    return models.mlp(
        widths,
        inputs,
        classes,
        name=name,
        hidden_names=hidden_names,
        out_name="out",
        out_activation=activation,
        **dense_kwargs,
    )


def np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_reference(t, s, labels, temperature, alpha, from_logits):
    """float64 NumPy: alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(y, s)."""
    t, s = t.astype("float64"), s.astype("float64")
    tiny = np.finfo("float32").tiny
    zt = t if from_logits else np.log(np.clip(t, tiny, 1.0))
    zs = s if from_logits else np.log(np.clip(s, tiny, 1.0))
    log_t, log_s = np_log_softmax(zt / temperature), np_log_softmax(zs / temperature)
    kl = (np.exp(log_t) * (log_t - log_s)).sum(-1).mean() * temperature**2
    if from_logits:
        log_p = np_log_softmax(s)
    else:  # Keras' probability cross-entropy: clip to [1e-7, 1 - 1e-7] after normalising
        log_p = np.log(np.clip(s / s.sum(-1, keepdims=True), 1e-7, 1 - 1e-7))
    ce = -np.take_along_axis(log_p, labels[..., None].astype(int), -1).mean()
    return alpha * kl + (1 - alpha) * ce, kl, ce


def scalar(x):
    return float(ops.convert_to_numpy(x))


def offline_distiller(shape, **kwargs):
    """A distiller without a teacher (offline), compiled, for evaluating compute_loss."""
    activation = None if kwargs.get("from_logits", True) else "softmax"
    student = mlp([], classes=shape[-1], inputs=4, activation=activation)
    model = kp.DistillationModel(student, None, **kwargs)
    model.compile("sgd")
    return model


# -- the loss against a float64 reference ----------------------------------------------------
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize("from_logits", [True, False])
@pytest.mark.parametrize("shape", [(16, 5), (4, 3, 7)])
def test_loss_matches_float64_numpy_reference(policy, from_logits, shape):
    keras.mixed_precision.set_global_policy(policy)
    rng = np.random.default_rng(0)
    t = rng.normal(0, 3, shape)
    s = rng.normal(0, 3, shape)
    if not from_logits:
        t, s = np.exp(np_log_softmax(t)), np.exp(np_log_softmax(s))
    dtype = "float16" if policy == "mixed_float16" else "float32"
    t, s = t.astype(dtype), s.astype(dtype)  # what the models would output under the policy
    labels = rng.integers(0, shape[-1], shape[:-1])
    model = offline_distiller(shape, temperature=3.0, alpha=0.7, from_logits=from_logits)
    loss = model.compute_loss(y=(labels, t), y_pred=ops.convert_to_tensor(s), training=True)
    total, kl, ce = np_reference(t, s, labels, 3.0, 0.7, from_logits)
    assert ops.convert_to_numpy(loss).dtype == np.float32
    np.testing.assert_allclose(scalar(loss), total, rtol=2e-5)
    np.testing.assert_allclose(scalar(model.distillation_loss_tracker.result()), kl, rtol=2e-5)
    np.testing.assert_allclose(scalar(model.student_loss_tracker.result()), ce, rtol=2e-5)


def test_probabilities_with_exact_zeros_give_a_finite_loss():
    t = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]], "float32")
    s = np.array([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]], "float32")
    model = offline_distiller(t.shape, temperature=2.0, alpha=1.0, from_logits=False)
    loss = scalar(model.compute_loss(y=(np.array([0, 1]), t), y_pred=ops.convert_to_tensor(s)))
    assert np.isfinite(loss)
    np.testing.assert_allclose(
        loss, np_reference(t, s, np.array([0, 1]), 2.0, 1.0, False)[0], rtol=1e-5
    )


def test_multi_teacher_soft_target_is_mean_of_probabilities():
    rng = np.random.default_rng(1)
    t1, t2, s = (rng.normal(0, 2, (8, 6)).astype("float32") for _ in range(3))
    model = offline_distiller(s.shape, temperature=2.0, alpha=1.0)
    loss = scalar(
        model.compute_loss(y=(np.zeros(8, "int32"), [t1, t2]), y_pred=ops.convert_to_tensor(s))
    )
    p_t = (np.exp(np_log_softmax(t1 / 2.0)) + np.exp(np_log_softmax(t2 / 2.0))) / 2
    log_s = np_log_softmax(s.astype("float64") / 2.0)
    expected = (p_t * (np.log(p_t) - log_s)).sum(-1).mean() * 4.0
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


# -- training: frozen teacher, train step integration -----------------------------------------
def _teacher_with_dropout_and_bn():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10),
        ],
        name="teacher",
    )


def test_teacher_frozen_and_only_student_weights_train(digits):
    (x, y), _ = digits
    teacher = _teacher_with_dropout_and_bn()
    before = [w.copy() for w in teacher.get_weights()]
    student = mlp([8])
    model = kp.DistillationModel(student, teacher)
    assert {id(v) for v in model.trainable_weights} == {id(v) for v in student.trainable_weights}
    model.compile("adam", metrics=["accuracy"])
    h = model.fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0)
    for a, b in zip(before, teacher.get_weights()):  # BN moving stats included
        np.testing.assert_array_equal(a, b)
    assert not teacher.trainable
    assert {"loss", "student_loss", "distillation_loss", "accuracy"} <= set(h.history)
    np.testing.assert_allclose(
        h.history["loss"][-1],
        0.7 * h.history["distillation_loss"][-1] + 0.3 * h.history["student_loss"][-1],
        rtol=1e-4,
    )


def test_microbatches_give_the_same_update(digits):
    (x, y), _ = digits
    teacher = mlp([32])
    results = []
    for k in (1, 4):
        keras.utils.set_random_seed(7)
        student = mlp([8])
        model = kp.DistillationModel(student, teacher, microbatches=k)
        model.compile("sgd")
        model.fit(x[:64], y[:64], batch_size=64, epochs=1, shuffle=False, verbose=0)
        results.append(student.get_weights())
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_mixed_float16_fit_scales_loss_and_keeps_teacher(digits):
    (x, y), _ = digits
    keras.mixed_precision.set_global_policy("mixed_float16")
    teacher, student = mlp([32]), mlp([8])
    before = [w.copy() for w in teacher.get_weights()]
    model = kp.DistillationModel(student, teacher, microbatches=2)
    model.compile("adam")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    h = model.fit(x[:128], y[:128], batch_size=64, epochs=2, verbose=0)
    assert np.isfinite(h.history["loss"]).all() and "loss_scale" in h.history
    assert h.history["skipped_steps"][-1] == 0
    for a, b in zip(before, teacher.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_teacher_with_float32_student(digits):
    (x, y), _ = digits
    teacher = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, "relu", dtype="bfloat16"),
            keras.layers.Dense(10, dtype="bfloat16"),
        ]
    )
    assert teacher.outputs[0].dtype == "bfloat16"
    student = mlp([8])
    model = kp.DistillationModel(student, teacher, alpha=1.0)
    model.compile("adam")
    h = model.fit(x[:128], y[:128], batch_size=64, epochs=2, verbose=0)
    assert np.isfinite(h.history["distillation_loss"]).all()
    assert h.history["distillation_loss"][1] < h.history["distillation_loss"][0]


class CountingTeacher(keras.Model):
    """A teacher that counts its forward calls (traces, in graph mode)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(10)
        self.calls = 0

    def call(self, x, training=None):
        self.calls += 1
        return self.dense(x)


def test_evaluate_and_predict_do_not_run_the_teacher(digits):
    (x, y), (xv, yv) = digits
    teacher = CountingTeacher()
    teacher(x[:2])
    model = kp.DistillationModel(mlp([8]), teacher)
    model.compile("adam", metrics=["accuracy"])
    model.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)
    calls = teacher.calls
    assert calls > 0
    logs = model.evaluate(xv, yv, verbose=0, return_dict=True)
    pred = model.predict(xv, verbose=0)
    assert teacher.calls == calls
    assert set(logs) == {"loss", "student_loss", "accuracy"}
    np.testing.assert_allclose(logs["loss"], logs["student_loss"], rtol=1e-5)
    np.testing.assert_allclose(pred, model.student.predict(xv, verbose=0), rtol=1e-6)
    model.compile("adam", metrics=["accuracy"], evaluate_distillation=True)
    logs = model.evaluate(xv, yv, verbose=0, return_dict=True)
    assert teacher.calls > calls and "distillation_loss" in logs
    np.testing.assert_allclose(
        logs["loss"], 0.7 * logs["distillation_loss"] + 0.3 * logs["student_loss"], rtol=1e-4
    )


def test_multi_teacher_fit(digits):
    (x, y), _ = digits
    t1, t2, student = mlp([16]), mlp([32]), mlp([8])
    model = kp.DistillationModel(student, [t1, t2], alpha=0.5)
    model.compile("adam")
    assert {id(v) for v in model.trainable_weights} == {id(v) for v in student.trainable_weights}
    h = model.fit(x[:128], y[:128], batch_size=64, epochs=2, verbose=0)
    assert np.isfinite(h.history["distillation_loss"]).all()


# -- real data: label-free transfer -------------------------------------------------------------
def test_label_free_distillation_matches_labelled_student_on_digits(digits):
    (x, y), (xv, yv) = digits
    teacher = mlp([128, 128], name="teacher")
    teacher.compile(
        keras.optimizers.Adam(5e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    teacher.fit(x, y, batch_size=256, epochs=12, verbose=0)

    def acc(m):
        return float(np.mean(np.argmax(m.predict(xv, verbose=0), -1) == yv))

    keras.utils.set_random_seed(3)
    alone = mlp([16])
    alone.compile(
        keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    alone.fit(x, y, batch_size=256, epochs=20, verbose=0)

    keras.utils.set_random_seed(3)
    student = mlp([16])
    model = kp.DistillationModel(student, teacher, temperature=3.0, alpha=1.0)
    model.compile(keras.optimizers.Adam(1e-2))
    model.fit(x, None, batch_size=256, epochs=20, verbose=0)  # no labels at all
    a_teacher, a_alone, a_kd = acc(teacher), acc(alone), acc(student)
    assert a_teacher > 0.93
    assert a_alone > 0.85
    assert a_kd >= a_alone - 0.03, (a_teacher, a_alone, a_kd)


# -- offline distillation ---------------------------------------------------------------------
def test_offline_equals_online_first_epoch_loss(digits):
    (x, y), _ = digits
    x, y = x[:256], y[:256]
    teacher = mlp([32])
    logits = kp.precompute_teacher_logits(teacher, x, batch_size=100)
    assert logits.shape == (256, 10) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, teacher.predict(x, verbose=0), atol=1e-5)
    student = mlp([8])
    init = student.get_weights()
    losses = []
    for offline in (False, True):
        student.set_weights(init)
        model = kp.DistillationModel(student, None if offline else teacher)
        model.compile("sgd")
        target = (y, logits) if offline else y
        h = model.fit(x, target, batch_size=64, epochs=1, shuffle=False, verbose=0)
        losses.append((h.history["loss"][0], h.history["distillation_loss"][0]))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_precompute_teacher_logits_for_a_list():
    teachers = [mlp([], inputs=4, classes=3), mlp([], inputs=4, classes=3)]
    out = kp.precompute_teacher_logits(teachers, np.ones((5, 4), "float32"), batch_size=2)
    assert isinstance(out, list) and [o.shape for o in out] == [(5, 3), (5, 3)]


# -- features ---------------------------------------------------------------------------------
def test_feature_distillation_with_projection(digits):
    (x, y), _ = digits
    teacher, student = mlp([32], name="t"), mlp([8], name="s")
    model = kp.DistillationModel(
        student, teacher, features=[("hidden0", "hidden0")], feature_weight=0.5
    )
    proj = model.projections[0]
    assert proj is not None and tuple(proj.kernel.shape) == (8, 32)
    assert {id(v) for v in model.trainable_weights} == {
        id(v) for v in student.trainable_weights + [proj.kernel]
    }
    model.compile("adam")
    h = model.fit(x[:256], y[:256], batch_size=64, epochs=3, verbose=0)
    assert h.history["feature_loss"][-1] < h.history["feature_loss"][0]
    assert model.predict(x[:4], verbose=0).shape == (4, 10)


# -- saving -----------------------------------------------------------------------------------
def test_save_load_round_trip_and_student_saves_alone(digits, tmp_path):
    (x, y), _ = digits
    teacher, student = mlp([32], name="big_teacher"), mlp([8], name="small_student")
    model = kp.DistillationModel(student, teacher, temperature=4.0, alpha=0.6, microbatches=2)
    model.compile("adam", metrics=["accuracy"])
    model.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)
    path = str(tmp_path / "distiller.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kp.DistillationModel)
    assert (loaded.temperature, loaded.alpha, loaded.microbatches) == (4.0, 0.6, 2)
    np.testing.assert_allclose(
        loaded.predict(x[:8], verbose=0), model.predict(x[:8], verbose=0), rtol=1e-6
    )
    for a, b in zip(loaded.teacher.get_weights(), teacher.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert not loaded.teacher.trainable
    loaded.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)  # compiled on load

    spath = str(tmp_path / "student.keras")
    model.student.save(spath)
    alone = keras.saving.load_model(spath)
    assert type(alone) is keras.Sequential
    assert alone.count_params() == student.count_params() < teacher.count_params()
    assert os.path.getsize(spath) < os.path.getsize(path)


def test_config_round_trip():
    model = kp.DistillationModel(
        mlp([8]), [mlp([16]), mlp([16])], temperature=2.0, alpha=0.3, from_logits=True, clipnorm=1.0
    )
    clone = kp.DistillationModel.from_config(model.get_config())
    assert isinstance(clone.teacher, list) and len(clone.teacher) == 2
    assert (clone.temperature, clone.alpha, clone.clipnorm) == (2.0, 0.3, 1.0)
    assert clone.count_params() == model.count_params()


# -- bad arguments ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"alpha": -0.1}, ValueError, r"`alpha` must be in \[0.0, 1.0\]"),
        ({"alpha": 1.5}, ValueError, r"`alpha` must be in \[0.0, 1.0\]"),
        ({"temperature": 0.0}, ValueError, r"`temperature` must be in \(0.0, inf\)"),
        ({"temperature": -2}, ValueError, r"`temperature`"),
        ({"temperature": float("inf")}, ValueError, r"`temperature` must be in \(0.0, inf\)"),
        ({"temperature": float("nan")}, ValueError, r"`temperature`"),
        ({"from_logits": 1}, TypeError, "`from_logits` must be True or False"),
        ({"feature_weight": -1.0}, ValueError, "`feature_weight`"),
        ({"features": [("nope", "hidden0")]}, ValueError, "student layer 'nope'"),
        ({"features": ["hidden0"]}, ValueError, "pairs"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kp.DistillationModel(mlp([8]), mlp([16]), **kwargs)


def test_bad_models():
    student = mlp([8])
    with pytest.raises(ValueError, match="teacher is the student itself"):
        kp.DistillationModel(student, student)
    with pytest.raises(ValueError, match=r"outputs shape \(None, 5\).*\(None, 10\)"):
        kp.DistillationModel(student, mlp([16], classes=5))
    with pytest.raises(TypeError, match="`student` must be a keras.Model"):
        kp.DistillationModel("student", mlp([16]))
    with pytest.raises(TypeError, match="`teacher` must be a keras.Model"):
        kp.DistillationModel(student, [mlp([16]), 3])
    with pytest.raises(ValueError, match="empty list"):
        kp.DistillationModel(student, [])
    with pytest.raises(ValueError, match="distillation_loss"):
        kp.DistillationModel(student, mlp([16])).compile("adam", distillation_loss="js")
    with pytest.raises(TypeError, match="batch_size"):
        kp.precompute_teacher_logits(mlp([16]), np.ones((2, 64)), batch_size=2.5)


def test_missing_labels_or_stored_outputs_raise_with_the_fix():
    rng = np.random.default_rng(0)
    s = ops.convert_to_tensor(rng.normal(size=(4, 10)).astype("float32"))
    model = kp.DistillationModel(mlp([8]), mlp([16]), alpha=0.5)
    model.compile("sgd")
    with pytest.raises(ValueError, match="unless alpha=1.0"):
        model.compute_loss(x=np.zeros((4, 64), "float32"), y=None, y_pred=s)
    offline = kp.DistillationModel(mlp([8]), None)
    offline.compile("sgd")
    with pytest.raises(ValueError, match="precompute_teacher_logits"):
        offline.compute_loss(y=np.zeros(4, "int32"), y_pred=s)
    with pytest.raises(ValueError, match=r"Teacher outputs of shape \(4, 5\)"):
        offline.compute_loss(y=(np.zeros(4, "int32"), np.zeros((4, 5), "float32")), y_pred=s)


@pytest.mark.backends("tensorflow")
def test_fit_inside_a_mirrored_strategy_scope(digits):
    # The distiller under a strategy scope (API §1); the train step handles the merge call.
    import tensorflow as tf

    (x, y), _ = digits
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        teacher, student = mlp([16]), mlp([8])
        before = [w.copy() for w in teacher.get_weights()]
        model = kp.DistillationModel(student, teacher)
        model.compile("adam", metrics=["accuracy"])
    init = [w.copy() for w in student.get_weights()]
    h = model.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)
    assert np.isfinite(h.history["loss"]).all()
    assert any(not np.array_equal(a, b) for a, b in zip(init, student.get_weights()))
    for a, b in zip(before, teacher.get_weights()):
        np.testing.assert_array_equal(a, b)


# -- models that cannot be distilled as given: refused at construction ------------------------
def _student_calling_the_teacher(teacher):
    inp = keras.Input((64,))
    return keras.Model(inp, keras.layers.Dense(10, name="head")(teacher(inp)), name="student")


def _student_sharing_a_layer(teacher):
    inp = keras.Input((64,))
    h = teacher.get_layer("hidden0")(inp)
    return keras.Model(inp, keras.layers.Dense(10, name="head")(h), name="student")


@pytest.mark.parametrize(
    "make_student, match",
    [
        (_student_calling_the_teacher, "contains layer 'teacher', which is the teacher"),
        (_student_sharing_a_layer, "contains layer 'hidden0', which is a layer of teacher"),
    ],
)
def test_regression_student_sharing_teacher_layers_is_refused(make_student, match):
    # Before: accepted; the teacher was frozen and with it the shared part of the student,
    # so fit trained the head only (2 of 4 student weights) without a word.
    teacher = mlp([16], name="teacher")
    student = make_student(teacher)
    with pytest.raises(ValueError, match=match):
        kp.DistillationModel(student, teacher)
    with pytest.raises(ValueError, match=match):
        kp.DistillationModel(student, [mlp([16], name="other"), teacher])
    assert teacher.trainable and len(student.trainable_weights) == len(student.weights)


def test_student_cloned_from_teacher_part_trains_every_weight(digits):
    # The fix the error suggests: a clone with the teacher's values trains all its weights.
    (x, y), _ = digits
    teacher = mlp([16], name="teacher")
    body = keras.models.clone_model(teacher.get_layer("hidden0"))
    student = keras.Sequential([keras.Input((64,)), body, keras.layers.Dense(10)])
    body.set_weights(teacher.get_layer("hidden0").get_weights())
    model = kp.DistillationModel(student, teacher)
    model.compile("adam")
    before = [w.copy() for w in student.get_weights()]
    model.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)
    assert all(not np.array_equal(a, b) for a, b in zip(before, student.get_weights()))


class DictOutput(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(10)

    def call(self, x):
        return {"logits": self.dense(x)}


def _functional_dict():
    inp = keras.Input((64,))
    return keras.Model(inp, {"logits": keras.layers.Dense(10)(inp)}, name="dict_model")


def _functional_two_heads():
    inp = keras.Input((64,))
    return keras.Model(inp, [keras.layers.Dense(10)(inp), keras.layers.Dense(10)(inp)], name="two")


@pytest.mark.parametrize("role", ["student", "teacher"])
@pytest.mark.parametrize(
    "make, match",
    [
        (_functional_dict, r"dict of outputs \(keys \['logits'\]\)"),
        (_functional_two_heads, "has 2 outputs"),
    ],
)
def test_regression_multi_output_model_is_refused_at_construction(role, make, match):
    # Before: accepted, then a TypeError about tensors deep inside fit.
    other = mlp([8])
    student, teacher = (make(), other) if role == "student" else (other, make())
    with pytest.raises(ValueError, match=f"The {role} .*{match}.*distils one output"):
        kp.DistillationModel(student, teacher)


def test_regression_subclassed_dict_output_is_refused_before_any_update(digits):
    # Before: a TypeError about tensors deep inside fit.
    (x, y), _ = digits
    model = kp.DistillationModel(DictOutput(), mlp([8]))  # unknown until called on data
    model.compile("adam")
    with pytest.raises(ValueError, match="The student 'dict_output' has a dict of outputs"):
        model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    assert not model.optimizer.built or int(ops.convert_to_numpy(model.optimizer.iterations)) == 0
    # An unbuilt teacher is called on the student's inputs at construction, so refused there.
    with pytest.raises(ValueError, match="The teacher 'dict_output_1' has a dict of outputs"):
        kp.DistillationModel(mlp([8]), DictOutput())


def _softmax_dense():
    return mlp([16], name="probs", activation="softmax")


def _softmax_layer():
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(10), keras.layers.Softmax()], name="probs"
    )


def _mobilenet_style_tail():
    # keras.applications.MobileNet(classifier_activation="softmax"): Conv, Reshape, Activation.
    inp = keras.Input((64,))
    h = keras.layers.Reshape((1, 1, 64))(inp)
    h = keras.layers.Conv2D(10, 1)(h)
    h = keras.layers.Reshape((10,))(h)
    return keras.Model(inp, keras.layers.Activation("softmax", name="predictions")(h), name="probs")


def _nested_softmax_after_dropout():
    inner = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    inp = keras.Input((64,))
    return keras.Model(inp, keras.layers.Dropout(0.1)(inner(inp)), name="probs")


def _sigmoid_dense():
    return mlp([16], name="probs", activation="sigmoid")


PROBABILITY_MODELS = [
    _softmax_dense,
    _softmax_layer,
    _mobilenet_style_tail,
    _nested_softmax_after_dropout,
    _sigmoid_dense,
]


@pytest.mark.parametrize("make", PROBABILITY_MODELS)
def test_regression_probability_teacher_with_from_logits_true_is_refused(make):
    # Before: accepted; the soft targets were softmax(p / T) of probabilities p in [0, 1],
    # near uniform, and the student learned from them silently.
    with pytest.raises(
        ValueError, match="teacher 'probs' outputs probabilities.*from_logits=False"
    ):
        kp.DistillationModel(mlp([8]), make())
    with pytest.raises(
        ValueError, match="student 'probs' outputs probabilities.*from_logits=False"
    ):
        kp.DistillationModel(make(), mlp([8]))
    with pytest.raises(ValueError, match="student 'probs' outputs probabilities"):
        kp.DistillationModel(make(), None)  # offline: the student alone is checked


def test_regression_logit_model_with_from_logits_false_is_refused():
    with pytest.raises(
        ValueError,
        match=r"teacher 'teacher' outputs logits: .*'out' \(Dense, activation 'linear'\).*from_logits=True",
    ):
        kp.DistillationModel(
            mlp([8], activation="softmax"), mlp([16], name="teacher"), from_logits=False
        )
    with pytest.raises(ValueError, match="student 'student' outputs logits"):
        kp.DistillationModel(
            mlp([8], name="student"), mlp([16], activation="softmax"), from_logits=False
        )


def test_output_kind_unknown_or_matching_is_accepted(digits):
    (x, y), _ = digits
    # Probabilities with from_logits=False: the matching setting, trains.
    model = kp.DistillationModel(_softmax_layer(), _mobilenet_style_tail(), from_logits=False)
    model.compile("adam")
    h = model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    assert np.isfinite(h.history["loss"][0])
    # log_softmax outputs are logits up to a shift; a Lambda cannot be told: both accepted.
    log_probs = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(10, activation="log_softmax")]
    )
    kp.DistillationModel(mlp([8]), log_probs)
    lam = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(10), keras.layers.Lambda(lambda z: z * 2)]
    )
    kp.DistillationModel(mlp([8]), lam)
    kp.DistillationModel(lam, mlp([8], activation="softmax"), from_logits=False)


class Subclassed(keras.Model):
    def __init__(self, classes=10, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(classes)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_regression_unbuilt_teacher_is_built_at_construction(kind, digits):
    # Before: on JAX the teacher's weights were created inside the first traced train step,
    # and fit failed ("None is not a valid value for jnp.array"); a width mismatch surfaced
    # only in fit.
    (x, y), _ = digits

    def make(classes):
        if kind == "subclassed":
            return Subclassed(classes)
        return keras.Sequential(
            [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(classes)]
        )

    teacher = make(10)
    model = kp.DistillationModel(mlp([8]), teacher)
    assert teacher.built and len(teacher.weights) == 4 and not teacher.trainable_weights
    model.compile("adam")
    h = model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    assert np.isfinite(h.history["distillation_loss"][0])
    with pytest.raises(ValueError, match=r"outputs shape \(None, 5\) but student .* \(None, 10\)"):
        kp.DistillationModel(mlp([8]), make(5))


def test_unbuilt_student_and_teacher_fit(digits):
    (x, y), _ = digits
    student = keras.Sequential([keras.layers.Dense(10)])
    teacher = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    model = kp.DistillationModel(student, teacher)
    model.compile("adam")
    h = model.fit(x[:64], y[:64], batch_size=32, epochs=2, verbose=0)
    assert h.history["loss"][1] < h.history["loss"][0]
    assert {id(v) for v in model.trainable_weights} == {id(v) for v in student.trainable_weights}


def test_unbuildable_teacher_error_says_what_was_tried():
    teacher = keras.Sequential([keras.layers.Reshape((3, 3)), keras.layers.Dense(10)])  # 64 != 9
    with pytest.raises(
        ValueError,
        match=r"Teacher 'sequential.*' is not built, and calling it on the student's inputs \(shape \(None, 64\)\) failed",
    ):
        kp.DistillationModel(mlp([8]), teacher)


def test_probability_models_config_and_keras_file_round_trip(digits, tmp_path):
    (x, y), _ = digits
    model = kp.DistillationModel(
        _softmax_dense(), _mobilenet_style_tail(), temperature=2.5, alpha=0.4, from_logits=False
    )
    clone = kp.DistillationModel.from_config(model.get_config())
    assert (clone.temperature, clone.alpha, clone.from_logits) == (2.5, 0.4, False)
    model.compile("adam")
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    path = str(tmp_path / "d.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.from_logits is False
    np.testing.assert_allclose(
        loaded.predict(x[:8], verbose=0), model.predict(x[:8], verbose=0), rtol=1e-6
    )
    np.testing.assert_allclose(loaded.predict(x[:8], verbose=0).sum(-1), 1.0, rtol=1e-5)


def test_microbatches_refuse_a_label_loss_that_is_not_a_batch_mean(digits):
    # A sum-reduced label loss cannot be combined slice by slice as a share of a mean: refused
    # before any update rather than trained on a different one.
    (x, y), _ = digits
    student = mlp([8])
    before = [w.copy() for w in student.get_weights()]
    model = kp.DistillationModel(student, mlp([32]), microbatches=2)
    model.compile(
        "sgd",
        student_loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"),
    )
    with pytest.raises(ValueError, match="reduction='sum'.*microbatches=1"):
        model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)
    if keras.backend.backend() != "jax":  # JAX's fit leaves its state unsynced when it raises
        for a, b in zip(before, student.get_weights()):
            np.testing.assert_array_equal(a, b)
