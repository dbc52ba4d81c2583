"""Quantization-aware training combined with other pieces and edge inputs: each test is a case
that once gave a wrong model with no error (state dropped, settings dropped, frozen or blind
layers)."""

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf.quantization import ActivationQuantizer
from tests import models

BACKEND = keras.backend.backend()


def np_(t):
    return keras.ops.convert_to_numpy(t)


def quantizers(model):
    return {q.name: q for q in model._flatten_layers() if isinstance(q, ActivationQuantizer)}


def save_load(model, path):
    model.save(path)
    return keras.saving.load_model(path)


# ---------------------------------------------------------------------------------------------
# Every layer's state survives quantize_aware, shrink and save/load
# ---------------------------------------------------------------------------------------------


def stateful_model():
    """Adapted Normalization (inputs around 3 +- 2), Dense, BatchNormalization with moving
    statistics far from the defaults, ReLU, Dense; channel 0 of the hidden Dense is pruned
    (all its weights zero), so `kp.shrink` removes it and slices BatchNormalization."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(64, 4)).astype("float32")
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(x)
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, name="hidden")(norm(inp))
    h = keras.layers.BatchNormalization(name="bn")(h)
    out = keras.layers.Dense(2, name="head")(keras.layers.ReLU()(h))
    model = keras.Model(inp, out)
    bn = model.get_layer("bn")
    bn.moving_mean.assign(np.linspace(-1.0, 1.0, 6).astype("float32"))
    bn.moving_variance.assign(np.linspace(0.5, 3.0, 6).astype("float32"))
    for layer, zero in [("hidden", np.s_[:, 0]), ("head", np.s_[0, :])]:
        kernel = np_(model.get_layer(layer).kernel)
        kernel[zero] = 0.0
        model.get_layer(layer).kernel.assign(kernel)
    for v in (model.get_layer("hidden").bias, bn.gamma, bn.beta):
        v.assign(np.r_[0.0, np_(v)[1:] + 0.5].astype("float32"))
    return model, x


def test_adapted_normalization_and_batchnorm_statistics_survive_shrink(tmp_path):
    model, x = stateful_model()
    expected = np_(model(x))
    assert np.abs(expected).max() > 1.0  # the check below is not about tiny numbers
    small = kp.shrink(model)
    assert small.get_layer("hidden").units == 5  # channel 0 removed, BN sliced
    np.testing.assert_allclose(np_(small(x)), expected, atol=1e-5)
    loaded = save_load(small, tmp_path / "small.keras")
    np.testing.assert_allclose(np_(loaded(x)), expected, atol=1e-5)


def test_adapted_normalization_and_batchnorm_statistics_survive_quantize_aware(tmp_path):
    model, x = stateful_model()
    qat = kp.quantize_aware(model)
    norm_out = np_(model.get_layer("norm")(x))
    assert abs(norm_out.mean()) < 0.1 and abs(norm_out.std() - 1.0) < 0.1
    np.testing.assert_allclose(np_(qat.get_layer("norm")(x)), norm_out, atol=1e-6)
    h = np_(model.get_layer("hidden")(norm_out))
    np.testing.assert_allclose(
        np_(qat.get_layer("bn")(h)), np_(model.get_layer("bn")(h)), atol=1e-6
    )
    # Ranges from a batch (BN frozen: its moving statistics are what is checked), then the
    # QAT model computes the float model up to quantization.
    qat.get_layer("bn").trainable = False
    qat(x, training=True)
    expected = np_(model(x))
    step = 0.05 * np.abs(expected).max()  # 8-bit rounding of 4 tensors; the bug: ~100%
    np.testing.assert_allclose(np_(qat(x)), expected, atol=step)
    loaded = save_load(qat, tmp_path / "qat.keras")
    np.testing.assert_array_equal(np_(loaded(x)), np_(qat(x)))
    # and through both: shrink, then quantize_aware
    small_qat = kp.quantize_aware(kp.shrink(model))
    small_qat.get_layer("bn").trainable = False
    small_qat(x, training=True)
    np.testing.assert_allclose(np_(small_qat(x)), expected, atol=step)


# ---------------------------------------------------------------------------------------------
# The train step's settings survive quantize_aware and shrink
# ---------------------------------------------------------------------------------------------


def test_quantize_aware_and_shrink_keep_the_loss_scaled_train_step_settings(tmp_path):
    # Regression: `remat` and `remat_threshold` came back as None from both transforms.
    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="h"),
                             keras.layers.Dense(3)])  # fmt: skip
    model = kp.loss_scaled(
        base, microbatches=2, clipnorm=1.0, remat="larger_than", remat_threshold=3
    )
    model.initial_scale, model.dynamic_growth_steps = 64.0, 7
    for new in (kp.quantize_aware(model), kp.shrink(model), kp.quantize_aware(kp.shrink(model))):
        assert isinstance(new, kp.LossScaledModel)
        settings = (new.microbatches, new.clipnorm, new.initial_scale, new.dynamic_growth_steps)
        assert settings == (2, 1.0, 64.0, 7)
        assert (new.remat, new.remat_threshold) == ("larger_than", 3.0)
        loaded = save_load(new, tmp_path / "m.keras")
        assert (loaded.microbatches, loaded.clipnorm) == (2, 1.0)
        assert (loaded.remat, loaded.remat_threshold) == ("larger_than", 3.0)
    named = kp.loss_scaled(base, remat=["h"])
    assert kp.shrink(named).remat == kp.quantize_aware(named).remat == ("h",)
    # and it trains with them: clipnorm=1 bounds the first step's gradient norm
    qat = kp.quantize_aware(model)
    qat.compile(keras.optimizers.SGD(1.0), "mse")
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    before = [np_(w) for w in qat.trainable_weights]
    qat.fit(x, 100.0 * np.ones((16, 3), "float32"), batch_size=16, epochs=1, verbose=0)
    moved = [np_(w) - b for w, b in zip(qat.trainable_weights, before)]
    assert np.sqrt(sum((m**2).sum() for m in moved)) == pytest.approx(1.0, rel=1e-3)


def test_a_remat_list_the_qat_model_cannot_keep_is_a_clear_error():
    # A pruned kernel gets a sparsity mask (a non-trainable variable) in the QAT model, and
    # remat never recomputes a layer with state: the setting cannot be kept as it is.
    base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="h"),
                             keras.layers.Dense(3)])  # fmt: skip
    kernel = np_(base.get_layer("h").kernel)
    kernel[:2] = 0.0
    base.get_layer("h").kernel.assign(kernel)
    model = kp.loss_scaled(base, remat=["h"])
    with pytest.raises(ValueError, match=r"remat=\('h',\), which the new model cannot keep.*"
                       r"\['h'\].*Set `model.remat` to a mode"):  # fmt: skip
        kp.quantize_aware(model)
    model.remat = "full"
    assert kp.quantize_aware(model).remat == "full"


# ---------------------------------------------------------------------------------------------
# A schedule's sparsity is checked where the callbacks read it
# ---------------------------------------------------------------------------------------------


class _BadSchedule(kp.PruningSchedule):
    def __init__(self, sparsity):
        self.sparsity = sparsity

    def __call__(self, step):
        return step >= 2, self.sparsity if step >= 2 else 0.25

    def get_config(self):
        return {"sparsity": self.sparsity}

    def __repr__(self):
        return f"_BadSchedule({self.sparsity})"


@pytest.mark.parametrize("sparsity", [-0.5, 1.0, 1.5, float("nan")])
@pytest.mark.parametrize("callback", [kp.PruningCallback, kp.ChannelPruningCallback])
def test_schedule_sparsity_outside_0_1_is_refused_naming_the_schedule_and_step(callback, sparsity):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    with pytest.raises(ValueError, match=r"_BadSchedule.*returned sparsity .* at step 2.*\[0, 1\)"):
        model.fit(x, y, batch_size=2, callbacks=[callback(_BadSchedule(sparsity))], verbose=0)


def test_callable_schedule_sparsity_is_checked():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
    model.compile("sgd", "mse")
    schedule = lambda step: (True, -0.5)  # noqa: E731
    with pytest.raises(ValueError, match=r"<function .*lambda.* returned sparsity -0.5 at step 0"):
        model.fit(
            np.ones((4, 4), "float32"),
            np.ones((4, 8), "float32"),
            callbacks=[kp.PruningCallback(schedule)],
            verbose=0,
        )
    assert not np.any(np_(model.layers[0].kernel) == 0)  # nothing was pruned


# ---------------------------------------------------------------------------------------------
# Activation ranges of width 0
# ---------------------------------------------------------------------------------------------


def _use_keras_fake_quant(monkeypatch):
    """On torch, run the Keras-ops path of ActivationQuantizer instead of torch's fused ops."""
    from keras_perf import backend as _backend

    monkeypatch.setattr(_backend, "moving_average_fake_quant", None)
    monkeypatch.setattr(_backend, "fake_quant", None)


@pytest.mark.parametrize("path", ["default", "keras_ops"])
def test_an_all_zero_first_batch_does_not_set_the_range(path, monkeypatch):
    if path == "keras_ops":
        if BACKEND != "torch":
            pytest.skip("the fused path exists on torch only")
        _use_keras_fake_quant(monkeypatch)
    q = ActivationQuantizer(ema_decay=0.9)
    zeros = np.zeros((2, 3), "float32")
    y = np_(q(zeros, training=True))
    np.testing.assert_array_equal(y, zeros)  # 0 is exact, nothing is NaN
    lo, hi = float(np_(q.min)), float(np_(q.max))
    assert lo == 0.0 and 0.0 < hi < 1e-4  # a usable range, at least eps * 255 wide
    assert float(np_(q.initialized)) == 0.0
    np.testing.assert_array_equal(np_(q(zeros)), zeros)  # inference too
    q(np.array([[-2.0, 0.0, 4.0]], "float32"), training=True)  # this batch sets the range
    assert (float(np_(q.min)), float(np_(q.max))) == (-2.0, 4.0)
    q(zeros, training=True)  # later all-zero batches move the average as usual
    np.testing.assert_allclose([np_(q.min), np_(q.max)], [-1.8, 3.6], rtol=1e-6)
    x = np.array([[-1.0, 0.5, 3.0]], "float32")
    np.testing.assert_allclose(np_(q(x)), x, atol=5.4 / 255)


@pytest.mark.parametrize("path", ["default", "keras_ops"])
def test_a_stored_range_of_width_0_quantizes_without_nan(path, monkeypatch):
    if path == "keras_ops":
        if BACKEND != "torch":
            pytest.skip("the fused path exists on torch only")
        _use_keras_fake_quant(monkeypatch)
    q = ActivationQuantizer()
    x = np.array([[0.0, 1.0, -1.0]], "float32")
    q(x)
    q.min.assign(0.0)
    q.max.assign(0.0)  # e.g. a file written before ranges were widened
    y = np_(q(x))
    assert np.all(np.isfinite(y)) and y[0, 0] == 0.0 and abs(y[0, 1]) < 1e-4


@pytest.mark.slow
def test_a_model_whose_first_batch_is_all_zero_takes_its_ranges_from_the_next_batch():
    """No biases: an all-zero first batch makes every activation of it zero. The ranges come
    from the next batch (was: NaN from the first epoch on JAX; on TF and torch ranges of ~0.05
    and below, the model blind to its inputs)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 4.0, size=(256, 4)).astype("float32")
    y = (x @ np.array([1.0, -1.0, 0.5, 2.0], "float32"))[:, None]
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(16, activation="relu", use_bias=False),
            keras.layers.Dense(1, use_bias=False),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(x, y, batch_size=32, epochs=10, verbose=0)
    float_loss = model.evaluate(x[32:], y[32:], verbose=0)
    x[:32], y[:32] = 0.0, 0.0
    qat = kp.quantize_aware(model)
    qat.compile(keras.optimizers.Adam(1e-3), "mse")
    h = qat.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert np.all(np.isfinite(h.history["loss"]))
    ranges = {n: (float(np_(q.min)), float(np_(q.max))) for n, q in quantizers(qat).items()}
    assert ranges["input_quant"][0] == 0.0 and 3.9 < ranges["input_quant"][1] <= 4.0, ranges
    assert ranges["dense_quant"][1] > 1.0 and ranges["dense_1_quant"][1] > 1.0, ranges
    assert qat.evaluate(x[32:], y[32:], verbose=0) < 3 * float_loss


# ---------------------------------------------------------------------------------------------
# preserve_sparsity keeps pruning's zeros, not accidental ones
# ---------------------------------------------------------------------------------------------


def _regression_data(n=128):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, np.stack([x[:, 0] - x[:, 1], x[:, 2] * 0.5, -x[:, 3]], axis=1)


@pytest.mark.slow
def test_a_zero_initialised_head_trains_under_qat():
    x, y = _regression_data()
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, kernel_initializer="zeros", name="head"),
        ]
    )
    # ema_decay=0.9: the head's output range (set from its first non-zero outputs, which are
    # small) follows the growing outputs within these 40 steps; at 0.999 it takes thousands.
    qat = kp.quantize_aware(model, ema_decay=0.9)
    assert qat.get_layer("head").kernel_mask is None
    qat.compile(keras.optimizers.Adam(1e-2), "mse")
    h = qat.fit(x, y, batch_size=32, epochs=10, verbose=0)
    assert np.all(np.isfinite(h.history["loss"]))
    assert np.mean(np_(qat.get_layer("head").kernel) != 0) > 0.9  # was: all 0, frozen
    assert h.history["loss"][-1] < 0.5 * h.history["loss"][0]


def test_one_exact_zero_in_a_trained_kernel_trains():
    x, y = _regression_data()
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    kernel = np_(model.layers[0].kernel)
    kernel[2, 3] = 0.0
    model.layers[0].kernel.assign(kernel)
    qat = kp.quantize_aware(model)
    assert qat.layers[1].kernel_mask is None
    qat.compile(keras.optimizers.SGD(0.1), "mse")
    qat.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert np_(qat.layers[1].kernel)[2, 3] != 0.0


@pytest.mark.parametrize("how", ["masked", "stripped", "saved"])
def test_pruned_kernels_keep_their_zeros(how, tmp_path):
    x, y = _regression_data()
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    kp.prune_low_magnitude(model, sparsity=0.5 if how != "masked" else 0.05)
    if how == "stripped":
        kp.strip_pruning(model)
    elif how == "saved":
        model = save_load(model, tmp_path / "pruned.keras")
    zeros = np_(model.layers[0].kernel) == 0
    assert zeros.any()
    qat = kp.quantize_aware(model)
    # a pruning mask (even at 5 %), or at least 10 % zeros
    np.testing.assert_array_equal(np_(qat.layers[1].kernel_mask), (~zeros).astype("float32"))
    qat.compile(keras.optimizers.SGD(0.1), "mse")
    qat.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert np.all(np_(qat.layers[1].kernel)[zeros] == 0)
    assert np.mean(np_(qat.layers[1].kernel)[~zeros] != np_(model.layers[0].kernel)[~zeros]) > 0.5


# ---------------------------------------------------------------------------------------------
# QAT on graphs tfmot handles: shared layers, Conv2DTranspose, raw ops; argument types
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, error", [(None, TypeError), ("0.9", TypeError), (1.0, ValueError), (-0.1, ValueError)]
)
def test_ema_decay_is_checked_by_name(value, error):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(error, match="`ema_decay`"):
        kp.quantize_aware(model, ema_decay=value)
    with pytest.raises(error, match="`ema_decay`"):
        ActivationQuantizer(ema_decay=value)


@pytest.mark.slow
def test_a_shared_layer_is_one_quantized_layer_with_a_range_per_call(tmp_path):
    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(4, activation="relu", name="shared")
    merged = keras.layers.Dense(4, activation="relu", name="merged")  # shared, into a Concatenate
    inp = keras.Input((4,), name="x")
    a = shared(inp)
    b = shared(a)
    joined = keras.layers.Concatenate(name="concat")([merged(a), merged(b)])
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(joined))
    qat = kp.quantize_aware(model)  # was: ValueError "shared_quant" is used 2 times
    assert isinstance(qat.get_layer("shared"), kp.quantization.QuantizedDense)
    names = [layer.name for layer in qat.layers]
    assert names.count("shared") == 1 and {"shared_quant", "shared_quant_1"} <= set(names)
    assert not any(n.startswith("merged_quant") for n in names)  # none before a Concatenate
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(64, 2)).astype("float32")
    qat.compile(keras.optimizers.Adam(1e-2), "mse")
    qat.fit(x, y, batch_size=16, epochs=2, verbose=0)
    q = quantizers(qat)
    assert float(np_(q["shared_quant"].max)) != float(np_(q["shared_quant_1"].max))
    loaded = save_load(qat, tmp_path / "shared.keras")
    np.testing.assert_array_equal(np_(loaded(x)), np_(qat(x)))
    if BACKEND == "tensorflow":
        report = kp.export_tflite(qat, tmp_path / "shared.tflite", quantization="int8")
        t = kp.tflite_predict(tmp_path / "shared.tflite", x)
        step = report["output_quantization"][0]
        assert np.mean(np.abs(t - np_(qat(x))) <= step * 1.01) > 0.95


def test_raw_ops_on_symbolic_tensors_are_rebuilt_and_integer_tensors_stay_exact(tmp_path):
    """Position ids made with keras.ops in the graph (as a Transformer's): was KeyError
    'ones_like'. Integer tensors get no quantizer: 8 bits cannot hold ids up to 299."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,), name="x")
    ids = keras.ops.cumsum(keras.ops.ones_like(inp, dtype="int32"), axis=1) + 294  # 295..299
    emb = keras.layers.Flatten(name="flat")(keras.layers.Embedding(300, 3, name="emb")(ids))
    h = keras.layers.Dense(4, name="dense")(inp)
    out = keras.layers.Dense(2, name="head")(keras.layers.Concatenate()([h, emb]))
    model = keras.Model(inp, out)
    qat = kp.quantize_aware(model)
    ops = [op for op in qat.operations if not isinstance(op, keras.layers.Layer)]
    assert {type(op).__name__ for op in ops} >= {"OnesLike", "Cumsum"}
    assert not set(quantizers(qat)) & {"ones_like_quant", "cumsum_quant", "add_quant"}
    x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
    qat(x, training=True)
    table = np_(model.get_layer("emb").embeddings)
    rows = table[295:300].reshape(-1)
    sub = keras.Model(qat.input, qat.get_layer("flat").output)  # after emb's quantizer
    step = (rows.max() - min(rows.min(), 0)) / 255
    np.testing.assert_allclose(np_(sub(x)), np.tile(rows, (32, 1)), atol=step)  # the right rows
    assert np.abs(table[288:293] - table[295:300]).max() > 10 * step  # wrong rows would show
    expected = np_(model(x))
    np.testing.assert_allclose(np_(qat(x)), expected, atol=0.05 * np.abs(expected).max())
    loaded = save_load(qat, tmp_path / "ops.keras")
    np.testing.assert_array_equal(np_(loaded(x)), np_(qat(x)))


@pytest.mark.slow
def test_conv2d_transpose_is_quantized_per_output_channel(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((4, 4, 3), name="x")
    h = keras.layers.Conv2DTranspose(5, 3, strides=2, padding="same", name="up")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU(name="relu")(h)
    h = keras.layers.Conv2DTranspose(2, 2, name="up_1")(h)
    model = keras.Model(inp, keras.layers.Flatten()(h))
    qat = kp.quantize_aware(model)  # was: "nothing to quantize"
    up = qat.get_layer("up")
    assert isinstance(up, kp.quantization.QuantizedConv2DTranspose)
    assert up.activation_quantizer == "relu_quant"  # Conv2DTranspose + BN + ReLU: one block
    kernel, q = np_(up.kernel), np_(up.quantized_kernel())  # (h, w, out=5, in=3)
    for c in range(5):  # one scale per output channel: kernel axis -2
        scale = np.abs(kernel[:, :, c, :]).max() / 127
        ints = q[:, :, c, :] / scale
        np.testing.assert_allclose(ints, np.round(ints), atol=1e-3)
        assert np.abs(np.round(ints)).max() == 127
    x = np.random.default_rng(0).normal(size=(64, 4, 4, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(64, 2 * 9 * 9)).astype("float32")
    qat.compile(keras.optimizers.Adam(1e-2), "mse")
    qat.fit(x, y, batch_size=16, epochs=2, verbose=0)
    loaded = save_load(qat, tmp_path / "up.keras")
    np.testing.assert_array_equal(np_(loaded(x)), np_(qat(x)))
    if BACKEND == "tensorflow":
        report = kp.export_tflite(qat, tmp_path / "up.tflite", quantization="int8")
        t = kp.tflite_predict(tmp_path / "up.tflite", x)
        step = report["output_quantization"][0]
        assert np.mean(np.abs(t - np_(qat(x))) <= step * 1.01) > 0.95


@pytest.mark.backends("tensorflow")
def test_an_adapted_lookup_keeps_its_vocabulary_and_its_integer_output(tmp_path):
    """A Sequential model: IntegerLookup's vocabulary is an asset (not in its config, not a
    variable); its output is integer indices up to 300, which no quantizer may touch."""
    keras.utils.set_random_seed(0)
    lookup = keras.layers.IntegerLookup(name="lookup")
    lookup.adapt(np.arange(1000, 1300))
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="int64"),
            lookup,
            keras.layers.Embedding(302, 2, name="emb"),
            keras.layers.Flatten(),
            keras.layers.Dense(2, name="head"),
        ]
    )
    qat = kp.quantize_aware(model)
    assert "lookup_quant" not in quantizers(qat)
    x = np.array([[1000, 1150, 1299], [1299, 1001, 5]], "int64")
    np.testing.assert_array_equal(np_(qat.get_layer("lookup")(x)), np_(lookup(x)))
    qat(x, training=True)
    expected = np_(model(x))
    np.testing.assert_allclose(np_(qat(x)), expected, atol=0.05 * np.abs(expected).max())
    loaded = save_load(qat, tmp_path / "lookup.keras")
    np.testing.assert_array_equal(np_(loaded(x)), np_(qat(x)))


# ---------------------------------------------------------------------------------------------
# Export of a quantization-aware model: a right file, or a ValueError before any file
# ---------------------------------------------------------------------------------------------


def _fitted_qat(arch_name):
    arch = models.ARCHS[arch_name]
    keras.utils.set_random_seed(0)
    qat = kp.quantize_aware(arch.build())
    x, y, _ = models.make_data(arch, 32)
    models.compile_model(arch, qat).fit(x, y, batch_size=16, epochs=1, verbose=0)
    return qat, x


@pytest.mark.parametrize("exporter", ["tflite", "onnx"])
def test_an_unfitted_qat_model_is_refused_before_a_file_is_written(exporter, tmp_path):
    """Regression: `export_tflite` wrote an int8 file from the initial (-6, 6) ranges without a
    word. Both exporters share the check."""
    qat = kp.quantize_aware(models.mlp([6], 8, 3, seed=0, hidden_names=["hidden"], out_name="head"))
    path = tmp_path / f"m.{exporter}"
    export = kp.export_tflite if exporter == "tflite" else kp.export_onnx
    with pytest.raises(
        ValueError,
        match=r"\['input_quant', 'hidden_quant', 'head_quant'\] have never seen a "
        r"training batch.*\(-6, 6\).*train the model \(fit\)",
    ):
        export(qat, path, "int8")
    assert not path.exists()
    # One training batch that is all zero for a tensor (a dead ReLU) sets its range to [0, tiny]
    # without counting as its first: that tensor is trained, not refused.
    from keras_perf.quantization._model import check_learned_ranges

    qat(np.zeros((4, 8), "float32"), training=True)
    assert {n: float(np_(q.initialized)) for n, q in quantizers(qat).items()} == dict.fromkeys(
        ["input_quant", "hidden_quant", "head_quant"], 0.0
    )
    check_learned_ranges(qat, "TFLite's int8 export")


@pytest.mark.slow  # TFLite conversions of an LSTM / a Transformer
@pytest.mark.backends("tensorflow")
def test_a_qat_bilstm_names_its_lstm_and_exports_with_select_tf_ops(tmp_path):
    """Regression: the converter's MLIR text was the whole error. The LSTM loop has no TFLite
    builtin ops: the error names the layer and the option, which writes the file."""
    qat, _ = _fitted_qat("bilstm")
    path = tmp_path / "m.tflite"
    with pytest.raises(
        ValueError, match=r"(?s)Bidirectional 'bilstm'.*allow_select_tf_ops=True"
    ) as e:
        kp.export_tflite(qat, path, "int8")
    # A short quote of the converter's errors, not its MLIR source locations.
    assert "'tf.TensorListReserve' op requires element_shape to be static" in str(e.value)
    assert "callsite" not in str(e.value) and len(str(e.value)) < 1000
    assert not path.exists()
    report = kp.export_tflite(qat, path, "int8", allow_select_tf_ops=True)
    assert "TensorListReserve" in report["select_tf_ops"]
    # The token ids stay int32 (they are exact); the Dense head after the loop is int8.
    assert report["input_dtype"] == "int32" and report["output_dtype"] == "int8"
    assert path.stat().st_size == report["bytes"]


@pytest.mark.slow  # TFLite conversions of an LSTM / a Transformer
@pytest.mark.backends("tensorflow")
def test_a_qat_transformer_is_refused_naming_the_layers_tflite_keeps_in_float(tmp_path):
    """Regression: "72 inner tensor(s) stayed float32 (encoder_1/ln2_1/Reshape, ...)". The
    insides of MultiHeadAttention and LayerNormalization have no learned range; the Dense
    layers on the sequence (ff1, ff2) convert and are not named."""
    qat, _ = _fitted_qat("transformer")
    path = tmp_path / "m.tflite"
    for select in (False, True):  # select TF ops do not make float layers acceptable
        with pytest.raises(ValueError) as e:
            kp.export_tflite(qat, path, "int8", allow_select_tf_ops=select)
        msg = str(e.value)
        assert "MultiHeadAttention 'mha'" in msg and "LayerNormalization 'ln1', 'ln2'" in msg
        assert "'ff1'" not in msg and "'ff2'" not in msg and "Reshape" not in msg
        assert "quantization='dynamic'" in msg
        assert not path.exists()


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_a_qat_dense_on_a_sequence_exports_full_integer(tmp_path):
    """Regression: a Dense on a (batch, steps, features) input stayed float in the file (its
    matmul became Reshape-MatMul-Reshape, the ranges learned after it did not reach it)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((models.SEQ_LEN, 16))
    h = keras.layers.Dense(8, activation="relu", name="ff")(inp)
    out = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling1D()(h))
    qat = kp.quantize_aware(keras.Model(inp, out))
    x = np.random.default_rng(0).normal(size=(64, models.SEQ_LEN, 16)).astype("float32")
    qat.compile("sgd", "mse")
    qat.fit(x, np.ones((64, 4), "float32"), epochs=1, verbose=0)
    report = kp.export_tflite(qat, tmp_path / "m.tflite", "int8")
    interp = kp.export._tflite_lib.interpreter((tmp_path / "m.tflite").read_bytes(), allocate=False)
    assert all(np.dtype(t["dtype"]) != np.float32 for t in interp.get_tensor_details())
    step = report["output_quantization"][0]
    got = kp.tflite_predict(tmp_path / "m.tflite", x)
    assert np.abs(got - np_(qat(x))).max() <= 2 * step + 1e-6


@pytest.mark.backends("jax", "torch")
def test_a_failed_qat_export_names_the_backend_in_use(tmp_path):
    """Regression: on JAX the child-process error spoke of "the PyTorch backend". A layer class
    local to this test cannot be loaded in the TensorFlow child process."""

    class Scale(keras.layers.Layer):
        def call(self, x):
            return 2.0 * x

    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(3)(Scale()(keras.layers.Dense(4)(inp))))
    qat = kp.quantize_aware(model)
    qat(np.ones((4, 8), "float32"), training=True)
    name = {"jax": "JAX", "torch": "PyTorch"}[BACKEND]
    with pytest.raises(RuntimeError, match=f"on the {name} backend") as e:
        kp.export_tflite(qat, tmp_path / "m.tflite", "int8")
    other = {"jax": "PyTorch", "torch": "JAX"}[BACKEND]
    assert other not in str(e.value) and "custom_modules" in str(e.value)
    assert not (tmp_path / "m.tflite").exists()
