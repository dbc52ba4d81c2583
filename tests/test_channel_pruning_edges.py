"""Channel pruning with the other pieces' state: BackupAndRestore, restored best weights."""

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf.channel_pruning import ChannelGraphError

X = np.random.default_rng(0).random((64, 8, 8, 3)).astype("float32")
Y = np.random.default_rng(1).integers(0, 4, 64)


def cnn():
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(inputs)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c2")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(16, activation="relu", name="d1")(x)
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(x))
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    return model


def schedule():
    return kp.PolynomialDecay(0.0, 0.75, begin_step=0, end_step=12, frequency=3)  # 4 steps/epoch


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def fit(model, callbacks, epochs=4):
    return model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                     validation_data=(X[:32], Y[:32]), callbacks=callbacks)  # fmt: skip


def weights(model):
    return [keras.ops.convert_to_numpy(w) for w in model.weights]


@pytest.mark.slow
@pytest.mark.parametrize("first", ["pruning", "backup"])
def test_backup_and_restore_resume_is_exact_in_both_orders(first, tmp_path):
    def run(extra, directory):
        keras.utils.set_random_seed(2)
        model = cnn()
        cb = kp.ChannelPruningCallback(schedule())
        backup = keras.callbacks.BackupAndRestore(str(directory))
        order = [cb, backup] if first == "pruning" else [backup, cb]
        fit(model, [*order, *extra])
        return model, cb

    reference, ref_cb = run([], tmp_path / "reference")
    with pytest.raises(RuntimeError, match="interrupted"):
        run([Interrupt()], tmp_path / "backup")
    resumed, cb = run([], tmp_path / "backup")
    assert ref_cb.sparsity == pytest.approx(0.75, abs=0.01)
    assert cb.sparsity == ref_cb.sparsity and cb.removed == ref_cb.removed
    for a, b in zip(weights(resumed), weights(reference)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _zero_channel_share(model):
    """The share of the 32 prunable channels (c1, c2, d1) whose kernel slice is all zero."""
    zero = 0
    for name in ("c1", "c2", "d1"):
        kernel = keras.ops.convert_to_numpy(model.get_layer(name).kernel)
        zero += int((np.abs(kernel.reshape(-1, kernel.shape[-1])).sum(axis=0) == 0).sum())
    return zero / 32


@pytest.mark.parametrize("stopper", ["keras", "kp"])
@pytest.mark.parametrize("first", ["pruning", "early_stopping"])
def test_restore_best_weights_is_exactly_the_best_epoch(first, stopper):
    keras.utils.set_random_seed(4)
    model = cnn()
    cb = kp.ChannelPruningCallback(schedule())
    # mode="max": the best epoch is an early one, pruned less than the last.
    es = (keras.callbacks.EarlyStopping if stopper == "keras" else kp.EarlyStopping)(
        "val_loss", mode="max", patience=10, restore_best_weights=True
    )
    fit(model, [cb, es] if first == "pruning" else [es, cb], epochs=3)
    assert es.best_epoch < 2
    val_loss = model.evaluate(X[:32], Y[:32], verbose=0)
    assert val_loss == pytest.approx(es.best, abs=1e-6)
    for got, best in zip(model.get_weights(), es.best_weights):
        np.testing.assert_array_equal(got, best)
    # Regression (issue 41, item 11): `sparsity` reported the last epoch's schedule (0.66)
    # where the model holds the best epoch's weights and masks; in either callback order it
    # is now what the model holds.
    held = _zero_channel_share(model)
    assert cb.sparsity == pytest.approx(held)
    assert len(cb.removed) == round(held * 32)
    assert cb.sparsity < cb.history[-1]["sparsity"]
    # The next fit (without the callback) trains every channel of the best weights: no mask
    # of the last epoch is left on the weights.
    kernel = model.get_layer("c1").kernel
    trained = np.abs(keras.ops.convert_to_numpy(kernel)).sum(axis=(0, 1, 2)) > 0
    assert all(getattr(w, "constraint", None) is None for w in model.trainable_weights)
    model.fit(X[:16], Y[:16], batch_size=16, epochs=1, verbose=0)
    after = np.abs(keras.ops.convert_to_numpy(kernel)).sum(axis=(0, 1, 2)) > 0
    assert np.all(after[trained])


def test_shrink_rebuilds_raw_ops_on_symbolic_tensors():
    # A Transformer-like input: position ids from `ops.arange`, `+` and `ops.ones_like` on
    # symbolic tensors. The callback accepts them (they carry no prunable channel), so
    # shrink must rebuild them too (it failed: "'Add' object has no attribute 'weights'").
    ids = keras.Input((6,), dtype="int32")
    tok = keras.layers.Embedding(20, 8)(ids)
    x = tok + keras.layers.Embedding(6, 8)(keras.ops.arange(6))
    x = x * keras.ops.ones_like(x)
    x = keras.layers.Dense(16, activation="relu", name="h")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(ids, keras.layers.Dense(4, name="out")(x))
    model.compile("adam", "mse")
    ids_data = np.random.default_rng(0).integers(0, 20, (32, 6))
    cb = kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, begin_step=0, frequency=1))
    model.fit(ids_data, Y[:32, None] * np.ones((1, 4)), epochs=1, callbacks=[cb], verbose=0)
    small = kp.shrink(model)
    assert small.get_layer("h").units == 8
    np.testing.assert_allclose(
        small.predict(ids_data, verbose=0), model.predict(ids_data, verbose=0), atol=1e-5
    )


def test_channels_first_convolution_is_a_clear_error():
    inputs = keras.Input((3, 8, 8))
    x = keras.layers.Conv2D(8, 3, data_format="channels_first", name="cf")(inputs)
    x = keras.layers.Flatten()(keras.layers.Conv2D(4, 1, data_format="channels_first")(x))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile("adam", "mse")
    with pytest.raises(ChannelGraphError, match="'cf'.*channels_first.*channels_last"):
        kp.channel_report(model)
    cb = kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, begin_step=0))
    with pytest.raises(ChannelGraphError, match="'cf'"):
        model.fit(np.ones((4, 3, 8, 8)), np.ones((4, 2)), callbacks=[cb], verbose=0)


class MyDense(keras.layers.Dense):
    pass


def test_a_dense_subclass_is_a_reason_and_an_error_when_nothing_else_is_prunable():
    model = keras.Sequential([keras.Input((8,)), MyDense(16, name="mine"), MyDense(2)])
    model.compile("adam", "mse")
    report = kp.channel_report(model)
    assert report["skipped"][0]["name"] == "mine"
    assert "subclass of Dense" in report["skipped"][0]["reason"]
    cb = kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, begin_step=0))
    with pytest.raises(ChannelGraphError, match="no channel to prune.*'mine'.*subclass of Dense"):
        model.fit(np.ones((4, 8)), np.ones((4, 2)), callbacks=[cb], verbose=0)


def test_quantization_aware_model_names_the_order_prune_shrink_quantize():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="h"),
                              keras.layers.Dense(2, name="out")])  # fmt: skip
    model.compile("adam", "mse")
    cb = kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, begin_step=0, frequency=1))
    model.fit(np.ones((8, 8)), np.ones((8, 2)), callbacks=[cb], verbose=0)
    qat = kp.quantize_aware(model)
    qat.compile("adam", "mse")
    with pytest.raises(ChannelGraphError, match="Shrink before quantizing"):
        kp.shrink(qat)  # it returned a same-size copy
    assert "quantize_aware" in kp.channel_report(qat)["skipped"][0]["reason"]
    with pytest.raises(ChannelGraphError, match="no channel to prune.*quantization-aware"):
        qat.fit(np.ones((8, 8)), np.ones((8, 2)), callbacks=[kp.ChannelPruningCallback(
            kp.ConstantSparsity(0.5, begin_step=0))], verbose=0)  # fmt: skip
    # The order that works: prune, shrink, then quantize.
    assert kp.quantize_aware(kp.shrink(model)).get_layer("h").units == 8


XS = np.random.default_rng(2).random((64, 12)).astype("float32")
YS = np.random.default_rng(3).random((64, 3)).astype("float32")


def piece(name):
    if name == "channel":
        return kp.ChannelPruningCallback(kp.PolynomialDecay(0.0, 0.5, 0, 8, frequency=2))
    if name == "magnitude":
        return kp.PruningCallback(kp.PolynomialDecay(0.0, 0.6, 0, 8, frequency=2))
    return keras.callbacks.EarlyStopping("loss", patience=5, restore_best_weights=True)


class InterruptAtEpoch2(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


@pytest.mark.slow
@pytest.mark.parametrize("backup_first", [True, False])
@pytest.mark.parametrize(
    "pair",
    [("channel", "magnitude"), ("magnitude", "channel"), ("channel", "early_stopping"),
     ("early_stopping", "channel"), ("magnitude", "early_stopping")],
)  # fmt: skip
def test_pairs_of_pieces_resume_as_the_uninterrupted_run(pair, backup_first, tmp_path):
    # Every piece keeps every other piece's state: two pieces, in either order, with
    # BackupAndRestore first or last, killed at an epoch boundary and resumed with new
    # callbacks, end with the weights of the uninterrupted run.
    def run(directory, extra=()):
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, name="a"),
                                  keras.layers.Dense(16, activation="relu", name="b"),
                                  keras.layers.Dense(3, name="out")])  # fmt: skip
        model.compile(keras.optimizers.SGD(0.05), "mse")
        backup = keras.callbacks.BackupAndRestore(str(directory))
        pieces = [piece(name) for name in pair]
        callbacks = [backup, *pieces] if backup_first else [*pieces, backup]
        model.fit(XS, YS, batch_size=16, epochs=3, shuffle=False, verbose=0,
                  callbacks=[*callbacks, *extra])  # fmt: skip
        return weights(model)

    reference = run(tmp_path / "reference")
    with pytest.raises(RuntimeError, match="interrupted"):
        run(tmp_path / "resumed", [InterruptAtEpoch2()])
    resumed = run(tmp_path / "resumed")
    for a, b in zip(resumed, reference):
        np.testing.assert_allclose(a, b, atol=1e-6)
