"""A skipped step (non-finite gradients) leaves every model variable as it was.

Not only the trainable weights and the optimizer slots: the forward pass's updates too
(BatchNormalization's moving statistics, a QAT model's activation ranges), of every slice
under micro-batching. Keras' own LossScaleOptimizer keeps those of a skipped step.
"""

import keras
import numpy as np
import pytest

import keras_perf as kp


def _bn_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(3),
        ]
    )


def _qat_model(seed=0):
    keras.utils.set_random_seed(seed)
    base = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3),
        ]
    )
    return kp.quantize_aware(base)


def _dropout_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.5, seed=1),
            keras.layers.Dense(3),
        ]
    )


def _data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def _values(variables):
    return [keras.ops.convert_to_numpy(v).copy() for v in variables]


def _compiled(builder, microbatches):
    model = kp.loss_scaled(builder(), microbatches=microbatches)
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.mark.parametrize("builder", [_bn_model, _qat_model], ids=["batchnorm", "qat"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_skipped_step_leaves_every_variable(builder, microbatches):
    model = _compiled(builder, microbatches)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # moves the state
    before = _values(model.variables)
    slots = _values(model.optimizer.variables)
    assert any(not v.trainable for v in model.variables)  # there is forward-pass state

    bad = x.copy()
    bad[-1, 0] = np.inf  # the last example: in the second slice when microbatches=2
    h = model.fit(bad, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert h.history["skipped_steps"] == [1]
    for v, a in zip(model.variables, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), a, err_msg=v.path)
    for v, a in zip(model.optimizer.variables, slots):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), a, err_msg=v.path)

    assert np.isfinite(model.predict(x, verbose=0)).all()
    h = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert h.history["skipped_steps"] == [0] and np.isfinite(h.history["loss"][0])
    moved = [
        float(np.max(np.abs(keras.ops.convert_to_numpy(v) - a)))
        for v, a in zip(model.variables, before)
        if not v.trainable
    ]
    assert max(moved) > 0  # a finite step still updates the forward-pass state


def test_skipped_step_advances_the_random_generators_only():
    # The seed generators' state is the one variable a skipped step does not restore: the
    # next step draws new dropout masks instead of replaying the skipped step's.
    model = _compiled(_dropout_model, 1)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    before = _values(model.variables)
    bad = x.copy()
    bad[0, 0] = np.nan
    h = model.fit(bad, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert h.history["skipped_steps"] == [1]
    changed = [
        v.path
        for v, a in zip(model.variables, before)
        if not np.array_equal(keras.ops.convert_to_numpy(v), a)
    ]
    assert changed and all("seed_generator" in path for path in changed), changed


def test_finite_steps_update_batchnorm_as_plain_fit():
    x, y = _data(n=40, seed=1)
    ref = _bn_model()
    ref.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = _compiled(_bn_model, 1)
    h = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert h.history["skipped_steps"] == [0, 0]
    for a, b in zip(ref.variables, model.variables):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(b), keras.ops.convert_to_numpy(a), atol=1e-6
        )


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_skipped_step_is_left_out_of_the_logged_loss_and_metrics(microbatches):
    """A skipped step changes nothing, so a run with one poisoned batch per epoch is the run
    without that batch: its logged loss and accuracy are that run's (finite), and Keras'
    `TerminateOnNaN` does not stop it. `grad_norm` and `skipped_steps` still count it."""
    from tests import models

    rng = np.random.default_rng(0)
    x, y = rng.random((64, 8), dtype="float32"), rng.integers(0, 3, 64)
    sw = np.ones(64, "float32")
    sw[20] = np.nan  # the second batch of 16: a NaN loss, a skipped step

    def run(x, y, sw, **kwargs):
        model = kp.loss_scaled(models.mlp([8], 8, 3, seed=0), microbatches=microbatches)
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])  # fmt: skip
        history = model.fit(x, y, sample_weight=sw, batch_size=16, epochs=3, shuffle=False,
                            verbose=0, **kwargs)  # fmt: skip
        return history.history

    poisoned = run(x, y, sw, callbacks=[keras.callbacks.TerminateOnNaN()])
    keep = np.r_[0:16, 32:64]
    clean = run(x[keep], y[keep], sw[keep])
    assert len(poisoned["loss"]) == 3 and np.isfinite(poisoned["loss"]).all()
    np.testing.assert_allclose(poisoned["loss"], clean["loss"], rtol=1e-5)
    np.testing.assert_allclose(poisoned["accuracy"], clean["accuracy"])
    assert poisoned["skipped_steps"] == [1.0] * 3 and clean["skipped_steps"] == [0.0] * 3
