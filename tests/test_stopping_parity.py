"""kp.EarlyStopping with Keras' arguments decides exactly as keras.callbacks.EarlyStopping."""

import math
import warnings

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keras_perf as kp


def _model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    return model


def _weights_for(epoch):
    return [np.full((2, 1), float(epoch), "float32"), np.full((1,), -float(epoch), "float32")]


def run(cb, values, model, key):
    """Drive `cb` over `values` (None: key missing); the model's weights encode the epoch."""
    model.stop_training = False
    cb.set_model(model)
    cb.on_train_begin()
    epoch = -1
    for epoch, value in enumerate(values):
        model.set_weights(_weights_for(epoch))
        cb.on_epoch_begin(epoch)
        logs = {"loss": 0.5} if key != "loss" else {}
        if value is not None:
            logs[key] = value
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the missing-key warnings differ in wording
            cb.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    cb.on_train_end()
    return epoch, float(model.get_weights()[0][0, 0])


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    a, b = float(np.asarray(a).reshape(())), float(np.asarray(b).reshape(()))
    return (math.isnan(a) and math.isnan(b)) or a == b


VALUES = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, 0.5, 0.25]),
    st.floats(-4, 4, allow_nan=False, width=32),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
)
ARGS = st.fixed_dictionaries(
    {
        "key_mode": st.sampled_from(
            [
                ("val_loss", "auto"),
                ("loss", "auto"),
                ("val_loss", "min"),
                ("val_loss", "max"),
                ("val_accuracy", "max"),
                ("val_accuracy", "min"),
            ]
        ),
        "min_delta": st.one_of(
            st.just(0.0), st.sampled_from([0.25, 1e-3]), st.floats(0, 2, allow_nan=False)
        ),
        "patience": st.integers(0, 4),
        "baseline": st.one_of(st.none(), st.floats(-3, 3, allow_nan=False)),
        "start_from_epoch": st.integers(0, 3),
        "restore_best_weights": st.booleans(),
    }
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(VALUES, min_size=1, max_size=12), args=ARGS)
def test_property_same_decisions_as_keras(values, args):
    args = dict(args)
    key, mode = args.pop("key_mode")
    ours = kp.EarlyStopping(monitor=key, mode=mode, **args)
    theirs = keras.callbacks.EarlyStopping(monitor=key, mode=mode, **args)
    # Keras' public attributes, before any fit.
    for name in (
        "monitor",
        "mode",
        "patience",
        "baseline",
        "min_delta",
        "start_from_epoch",
        "restore_best_weights",
        "verbose",
        "monitor_op",
        "best_weights",
        "wait",
        "stopped_epoch",
    ):
        assert (
            _same(getattr(ours, name), getattr(theirs, name))
            if name in ("min_delta", "baseline")
            else getattr(ours, name) == getattr(theirs, name)
        ), name
    try:
        want = run(theirs, values, _model(), key)
    except Exception as e:  # e.g. TF cannot compare a float64 beyond float32's range
        with pytest.raises(type(e)):
            run(ours, values, _model(), key)
        return
    got = run(ours, values, _model(), key)
    assert got == want  # same last epoch trained, same final (restored) weights
    assert ours.stopped_epoch == theirs.stopped_epoch
    assert ours.best_epoch == theirs.best_epoch
    assert ours.wait == theirs.wait
    assert _same(ours.best, theirs.best)
    assert ours.monitor_op is theirs.monitor_op  # keras.ops.less / keras.ops.greater
    assert ours.min_delta == theirs.min_delta  # negated in "min" mode, as Keras does
    if theirs.best_weights is None:
        assert ours.best_weights is None
    else:
        assert all(np.array_equal(a, b) for a, b in zip(ours.best_weights, theirs.best_weights))
    assert ours.stop_reason == ("patience" if theirs.model.stop_training else None)


def test_float32_ties_rank_as_in_keras():
    # 1 + 1e-9 and 1.0 are equal in float32 (Keras compares in float32): no improvement.
    values = [1.0, 1.0 - 1e-9, 1.0 - 2e-9]
    ours, theirs = kp.EarlyStopping(monitor="loss"), keras.callbacks.EarlyStopping(monitor="loss")
    assert run(ours, values, _model(), "loss") == run(theirs, values, _model(), "loss") == (1, 1.0)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda v: np.array([v], "float32"),  # F1Score(average=None) on one class
        lambda v: np.array([[[v]]]),  # Lightning-style nested single value
        lambda v: keras.ops.convert_to_tensor([[v]]),
        np.float32,
    ],
    ids=["1-elem", "nested", "tensor", "np.float32"],
)
def test_one_element_arrays_work_like_keras(wrap):
    values = [0.5, 0.25, 0.375, 0.125, 0.25, 0.5, 0.625]
    ours = kp.EarlyStopping("val_f1", mode="max", patience=1, restore_best_weights=True)
    theirs = keras.callbacks.EarlyStopping(
        "val_f1", mode="max", patience=1, restore_best_weights=True
    )
    got = run(ours, [wrap(v) for v in values], _model(), "val_f1")
    assert got == run(theirs, values, _model(), "val_f1") == (1, 0.0)
    assert isinstance(ours.best, float) and ours.best == theirs.best == 0.5


def test_multi_element_array_is_a_clear_error():
    es = kp.EarlyStopping("val_f1", mode="max")
    with pytest.raises(ValueError, match=r"`val_f1` is logged as an array of shape \(3,\)"):
        run(es, [np.array([0.1, 0.2, 0.3])], _model(), "val_f1")


def test_fit_with_one_class_f1_matches_keras():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    results = []
    for cls in (kp.EarlyStopping, keras.callbacks.EarlyStopping):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(
            "sgd",
            "binary_crossentropy",
            metrics=[keras.metrics.F1Score(average=None, threshold=0.5)],
        )
        es = cls("val_f1_score", mode="max", patience=1, restore_best_weights=True)
        hist = model.fit(x, y, validation_data=(x, y), epochs=8, callbacks=[es], verbose=0)
        # NumPy 2 refuses float() of a 1-element array: the logs hold an array of shape (1,).
        assert np.shape(hist.history["val_f1_score"][0]) == (1,)
        best = float(np.asarray(es.best).reshape(()))
        results.append((len(hist.history["loss"]), es.best_epoch, best, model.get_weights()))
    assert results[0][:3] == results[1][:3]
    assert all(np.array_equal(a, b) for a, b in zip(results[0][3], results[1][3]))
