"""Quantization-aware training: kernels, ranges, gradients, export, save/load, composition."""

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf.quantization import ActivationQuantizer, QuantizedConv2D, QuantizedDense
from keras_perf.quantization._quantizers import fake_quant_kernel
from tests import models

BACKEND = keras.backend.backend()
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn(seed=0):
    return models.digits_cnn(seed)


def mlp():
    return models.mlp([6], 8, 3)


def images(digits):
    (x, y), (xv, yv) = digits
    return (x.reshape(-1, 8, 8, 1), y), (xv.reshape(-1, 8, 8, 1), yv)


def fit(model, x, y, epochs=1, **kw):
    model.compile(keras.optimizers.Adam(3e-3), LOSS, metrics=["accuracy"])
    return model.fit(x, y, epochs=epochs, batch_size=32, verbose=0, **kw)


def np_(t):
    return keras.ops.convert_to_numpy(t)


def quantizers(model):
    return {q.name: q for q in model._flatten_layers() if isinstance(q, ActivationQuantizer)}


def tf_quant_params(lo, hi, bits=8):
    """(scale, int8 zero point) that TF's FakeQuant nudging gives a range."""
    scale = (hi - lo) / (2**bits - 1)
    zero = np.clip(np.round(-lo / scale), 0, 2**bits - 1)
    return scale, int(zero) - 2 ** (bits - 1)


# ---------------------------------------------------------------------------------------------
# Kernels, numerics, gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("per_channel", [True, False])
def test_quantized_kernel_takes_at_most_2_pow_bits_values(bits, per_channel):
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(5)])
    qat = kp.quantize_aware(model, weight_bits=bits, per_channel=per_channel)
    layer = qat.get_layer("dense")
    k = np_(layer.kernel)
    q = np_(layer.quantized_kernel())
    levels = 2 ** (bits - 1) - 1
    for c in range(k.shape[1]):
        m = np.abs(k[:, c]).max() if per_channel else np.abs(k).max()
        ints = q[:, c] / (m / levels)
        np.testing.assert_allclose(ints, np.round(ints), atol=1e-3)  # on the integer grid
        assert np.abs(np.round(ints)).max() <= levels  # narrow symmetric range
        assert len(np.unique(q[:, c])) <= 2**bits - 1
        np.testing.assert_allclose(q[:, c], k[:, c], atol=m / levels / 2 + 1e-6)


def _nudged(lo, hi):
    scale = (hi - lo) / 255.0
    zero = np.clip(np.round(-lo / scale), 0, 255)
    return scale, zero


def _int8_layer(x_q, sx, zx, kernel, bias, so, zo, relu):
    """Integer arithmetic of an int8 FullyConnected op (per-channel weights)."""
    s_w = np.maximum(np.abs(kernel).max(axis=0), 1e-12) / 127.0
    w_q = np.round(kernel / s_w)
    acc = (x_q - zx) @ w_q + np.round(bias / (sx * s_w))  # int32 accumulator
    real = acc * sx * s_w
    if relu:
        real = np.maximum(real, 0)
    return np.clip(np.round(real / so) + zo, 0, 255)  # uint8 form of the int8 range


def test_outputs_equal_numpy_int8_simulation_within_one_step():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = rng.integers(0, 3, 256)
    qat = kp.quantize_aware(mlp())
    fit(qat, x, y, epochs=2)
    qs = quantizers(qat)
    params = {n: _nudged(float(np_(q.min)), float(np_(q.max))) for n, q in qs.items()}
    sx, zx = params["input_quant"]
    x_q = np.clip(np.round(x / sx) + zx, 0, 255)
    d1, d2 = qat.get_layer("dense"), qat.get_layer("dense_1")
    s1, z1 = params["dense_quant"]
    h = _int8_layer(x_q, sx, zx, np_(d1.kernel), np_(d1.bias), s1, z1, relu=True)
    s2, z2 = params["dense_1_quant"]
    out = _int8_layer(h, s1, z1, np_(d2.kernel), np_(d2.bias), s2, z2, relu=False)
    simulated = (out - z2) * s2
    keras_out = qat.predict(x, verbose=0)
    err = np.abs(simulated - keras_out)
    assert err.max() <= s2 * 1.01, err.max() / s2  # within one quantization step
    assert (err < s2 / 2).mean() > 0.95


def _grad(fn, x):
    if BACKEND == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = keras.ops.sum(fn(x))
        return tape.gradient(out, x).numpy()
    if BACKEND == "jax":
        import jax

        return np.asarray(jax.grad(lambda t: keras.ops.sum(fn(t)))(x))
    import torch

    t = torch.tensor(x, requires_grad=True)
    keras.ops.sum(fn(t)).backward()
    return t.grad.numpy()


def test_straight_through_gradient_is_zero_outside_the_range():
    q = ActivationQuantizer()
    q.build((None, 6))
    q.min.assign(-1.0)
    q.max.assign(1.0)
    x = np.array([[-3.0, -1.5, -0.5, 0.2, 0.9, 2.0]], "float32")
    g = _grad(lambda t: q(t, training=False), x)
    np.testing.assert_array_equal(g, [[0, 0, 1, 1, 1, 0]])
    # Kernels: the range is the kernel's own max, so every weight gets the gradient as is.
    k = np.random.default_rng(1).normal(size=(4, 3)).astype("float32")
    np.testing.assert_array_equal(_grad(lambda t: fake_quant_kernel(t, 4, (1,)), k), 1.0)


def test_ranges_learn_by_moving_average_and_freeze_at_inference():
    q = ActivationQuantizer(ema_decay=0.9)
    q(np.zeros((1, 3), "float32"))
    q(np.array([[-2.0, 0.0, 4.0]], "float32"), training=True)  # first batch sets the range
    assert (float(np_(q.min)), float(np_(q.max))) == (-2.0, 4.0)
    q(np.array([[1.0, 2.0, 3.0]], "float32"), training=True)  # min widened to 0
    np.testing.assert_allclose([np_(q.min), np_(q.max)], [-1.8, 3.9], rtol=1e-6)
    q(np.array([[-100.0, 100.0]], "float32"), training=False)
    np.testing.assert_allclose([np_(q.min), np_(q.max)], [-1.8, 3.9], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The clone
# ---------------------------------------------------------------------------------------------


def test_clone_keeps_weights_and_leaves_the_float_model_alone():
    model = cnn()
    before = [w.copy() for w in model.get_weights()]
    qat = kp.quantize_aware(model)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert isinstance(model.get_layer("conv2d"), keras.layers.Conv2D)
    assert not isinstance(model.get_layer("conv2d"), QuantizedConv2D)
    conv = qat.get_layer("conv2d")
    assert isinstance(conv, QuantizedConv2D) and isinstance(conv, keras.layers.Conv2D)
    np.testing.assert_array_equal(np_(conv.kernel), np_(model.get_layer("conv2d").kernel))
    np.testing.assert_array_equal(np_(conv.bias), np_(model.get_layer("conv2d").bias))
    bn = qat.get_layer("batch_normalization")
    np.testing.assert_array_equal(
        np_(bn.moving_variance), np_(model.get_layer("batch_normalization").moving_variance)
    )
    # Placement as TFLite fuses: input, after Conv+BN+ReLU, after each Dense; none after
    # MaxPooling/Flatten, none between Conv, BN and ReLU.
    assert sorted(quantizers(qat)) == ["dense_1_quant", "dense_quant", "image_quant", "re_lu_quant"]
    assert conv.activation_quantizer == "re_lu_quant"


def test_nested_model_and_split_activation():
    inner = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(8, activation="relu", name="dense_1")],
        name="inner",
    )
    inp = keras.Input((4,))
    h = keras.layers.Dense(16, activation="tanh", name="dense")(inp)
    out = keras.layers.Dense(3, activation="softmax", name="dense_2")(inner(h))
    qat = kp.quantize_aware(keras.Model(inp, out))
    assert isinstance(qat.get_layer("inner").get_layer("dense_1"), QuantizedDense)
    names = set(quantizers(qat))
    # tanh/softmax are ops of their own in TFLite: a range before and after each.
    assert {"dense_activation_quant", "dense_quant", "dense_2_activation_quant"} <= names
    assert "dense_1_quant" in names  # inside the nested model
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    np.testing.assert_allclose(qat.predict(x, verbose=0).sum(1), 1.0, atol=0.05)


def test_include_and_exclude():
    model = mlp()
    qat = kp.quantize_aware(model, include=["dense_1"])
    assert type(qat.get_layer("dense")) is keras.layers.Dense
    assert isinstance(qat.get_layer("dense_1"), QuantizedDense)
    qat = kp.quantize_aware(model, exclude="dense")
    assert type(qat.get_layer("dense")) is keras.layers.Dense
    assert "dense_quant" in quantizers(qat)  # its output still has a range for the int8 file


def test_report():
    qat = kp.quantize_aware(cnn(), weight_bits=4)
    report = kp.quantization_report(qat)
    row = {r["name"]: r for r in report}
    assert row["conv2d"]["weight_bits"] == 4 and row["conv2d"]["activation_bits"] == 8
    m = np.abs(np_(qat.get_layer("conv2d").kernel)).max()
    np.testing.assert_allclose(row["conv2d"]["weight_range"], (-m, m), rtol=1e-6)
    assert row["conv2d"]["activation_range"] == (-6.0, 6.0)  # untrained
    assert row["image_quant"]["weight_bits"] is None
    text = str(report)
    assert "conv2d" in text and "weight_range" in text


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"weight_bits": 1}, ValueError, "weight_bits"),
        ({"weight_bits": 9}, ValueError, "weight_bits"),
        ({"weight_bits": 16}, ValueError, "weight_bits"),
        ({"activation_bits": 12}, ValueError, "activation_bits"),
        ({"weight_bits": 8.0}, TypeError, "weight_bits"),
        ({"per_channel": 1}, TypeError, "per_channel"),
        ({"include": ["nope"]}, ValueError, "`include` item 'nope'"),
        ({"exclude": [keras.layers.Dense]}, ValueError, "exclude"),
        ({"include": [3]}, TypeError, "include"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kp.quantize_aware(mlp(), **kwargs)


def test_bad_models():
    with pytest.raises(ValueError, match="nothing to quantize"):
        kp.quantize_aware(keras.Sequential([keras.Input((4,)), keras.layers.ReLU()]))
    sub = models.OneDense(3, name="subclassed")
    sub(np.zeros((1, 4), "float32"))
    with pytest.raises(ValueError, match="subclassed model.*functional API"):
        kp.quantize_aware(sub)
    with pytest.raises(TypeError, match="model"):
        kp.quantize_aware(keras.layers.Dense(3))
    assert kp.quantize_aware(mlp(), activation_bits=16) is not None


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(digits, tmp_path_factory):
    (x, y), (xv, yv) = images(digits)
    keras.utils.set_random_seed(0)
    model = cnn()
    fit(model, x, y, epochs=3)
    qat = kp.quantize_aware(model)
    fit(qat, x, y, epochs=2)
    path = str(tmp_path_factory.mktemp("qat") / "m.tflite")
    report = kp.export_tflite(qat, path, "int8")
    return qat, path, report, (xv, yv)


def test_export_uses_the_learned_ranges(exported):
    qat, path, report, _ = exported
    qs = quantizers(qat)
    assert report["input_dtype"] == "int8" and report["output_dtype"] == "int8"
    for name, got in (
        ("image_quant", report["input_quantization"]),
        ("dense_1_quant", report["output_quantization"]),
    ):
        scale, zero = tf_quant_params(float(np_(qs[name].min)), float(np_(qs[name].max)))
        np.testing.assert_allclose(got[0], scale, rtol=1e-5)
        assert got[1] == zero
    # Every hidden activation range is in the file too.
    interp = kp.export._tflite_lib.interpreter(open(path, "rb").read(), allocate=False)
    scales = [t["quantization"][0] for t in interp.get_tensor_details()]
    for name in ("re_lu_quant", "dense_quant"):
        scale, _ = tf_quant_params(float(np_(qs[name].min)), float(np_(qs[name].max)))
        assert np.isclose(scales, scale, rtol=1e-5).any(), name


def test_interpreter_accuracy_matches_keras_on_digits(exported):
    qat, path, _, (xv, yv) = exported
    k = qat.predict(xv, verbose=0)
    t = kp.tflite_predict(path, xv)
    acc_k, acc_t = (k.argmax(1) == yv).mean(), (t.argmax(1) == yv).mean()
    assert acc_k > 0.8
    assert abs(acc_k - acc_t) <= 0.005, (acc_k, acc_t)
    out_scale = exported[2]["output_quantization"][0]
    assert np.mean(np.abs(k - t) <= out_scale * 1.01) > 0.97


def test_export_refuses_calibration_data_and_other_modes(exported, tmp_path):
    qat, _, _, (xv, _) = exported
    with pytest.raises(ValueError, match="representative_data"):
        kp.export_tflite(qat, tmp_path / "m.tflite", "int8", representative_data=xv)
    with pytest.raises(ValueError, match="quantization='int8'"):
        kp.export_tflite(qat, tmp_path / "m.tflite", "dynamic")
    q16 = kp.quantize_aware(mlp(), activation_bits=16)
    with pytest.raises(ValueError, match="8-bit activations"):
        kp.export_tflite(q16, tmp_path / "m.tflite", "int8")


# ---------------------------------------------------------------------------------------------
# Saving and resuming
# ---------------------------------------------------------------------------------------------


def test_save_load_round_trip_keeps_ranges(tmp_path, digits):
    (x, y), (xv, _) = images(digits)
    qat = kp.quantize_aware(cnn(), weight_bits=4)
    fit(qat, x[:256], y[:256])
    qat.save(tmp_path / "q.keras")
    loaded = keras.saving.load_model(tmp_path / "q.keras")
    for name, q in quantizers(qat).items():
        r = quantizers(loaded)[name]
        assert (np_(r.min), np_(r.max)) == (np_(q.min), np_(q.max))
        assert float(np_(q.min)) != -6.0 or float(np_(q.max)) != 6.0  # learned, not initial
    assert loaded.get_layer("conv2d").weight_bits == 4
    np.testing.assert_array_equal(loaded.predict(xv, verbose=0), qat.predict(xv, verbose=0))


QUANTIZED_LAYERS = [
    ("Dense", (6,), lambda: keras.layers.Dense(4, activation="relu")),
    ("EinsumDense", (3, 6), lambda: keras.layers.EinsumDense("abc,cd->abd", (3, 4), bias_axes="d")),
    ("Conv1D", (6, 2), lambda: keras.layers.Conv1D(3, 3, padding="causal")),
    ("Conv2D", (5, 5, 2), lambda: keras.layers.Conv2D(3, 3, activation="relu")),
    ("Conv3D", (4, 4, 4, 2), lambda: keras.layers.Conv3D(3, 2)),
    ("DepthwiseConv2D", (5, 5, 2), lambda: keras.layers.DepthwiseConv2D(3, depth_multiplier=2)),
    ("Conv2DTranspose", (4, 4, 2), lambda: keras.layers.Conv2DTranspose(3, 3, strides=2)),
]


@pytest.mark.parametrize(
    "kind, shape, make", QUANTIZED_LAYERS, ids=[k[0] for k in QUANTIZED_LAYERS]
)
def test_each_quantized_layer_saves_and_loads_with_its_sparsity_mask(tmp_path, kind, shape, make):
    keras.utils.set_random_seed(0)
    float_layer = make()
    model = keras.Sequential([keras.Input(shape), float_layer])
    kernel = np_(float_layer.kernel)
    kernel[np.random.default_rng(0).random(kernel.shape) < 0.5] = 0.0
    float_layer.kernel.assign(kernel)
    qat = kp.quantize_aware(model)
    layer = qat.get_layer(float_layer.name)
    assert type(layer).__name__ == f"Quantized{kind}"
    assert keras.saving.get_registered_name(type(layer)) == f"keras_perf>Quantized{kind}"
    assert set(layer.get_config()) == set(float_layer.get_config()) | {
        "weight_bits",
        "per_channel",
        "sparsity_mask",
        "activation_quantizer",
    }
    np.testing.assert_array_equal(np_(layer.kernel_mask), (kernel != 0).astype("float32"))
    layer.kernel.assign(np.where(kernel == 0, 0.5, kernel))  # only the mask keeps them at 0
    x = np.random.default_rng(1).normal(size=(4, *shape)).astype("float32")
    qat.save(tmp_path / "q.keras")
    loaded = keras.saving.load_model(tmp_path / "q.keras")
    np.testing.assert_array_equal(
        np_(loaded.get_layer(layer.name).kernel_mask), np_(layer.kernel_mask)
    )
    np.testing.assert_array_equal(np_(loaded(x)), np_(qat(x)))


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            self.ranges = {n: float(np_(q.max)) for n, q in quantizers(self.model).items()}
            raise RuntimeError("interrupted")


class _Record(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.ranges = {n: float(np_(q.max)) for n, q in quantizers(self.model).items()}


def test_backup_and_restore_resumes_with_the_ranges(tmp_path, digits):
    (x, y), _ = images(digits)
    backup = str(tmp_path / "backup")
    model = cnn()
    qat = kp.quantize_aware(model)
    stop = _Interrupt()
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(
            qat,
            x[:256],
            y[:256],
            epochs=3,
            callbacks=[keras.callbacks.BackupAndRestore(backup), stop],
        )
    fresh = kp.quantize_aware(model)
    record = _Record()
    fit(
        fresh,
        x[:256],
        y[:256],
        epochs=3,
        callbacks=[keras.callbacks.BackupAndRestore(backup), record],
    )
    assert record.ranges == pytest.approx(stop.ranges, rel=1e-6)
    assert record.ranges["dense_quant"] != 6.0


# ---------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pruned_weights_stay_exactly_zero_through_qat(digits):
    (x, y), _ = images(digits)
    model = cnn()
    fit(model, x[:256], y[:256])
    kp.prune_low_magnitude(model, sparsity=0.6)
    zeros = {m.name: np_(m.kernel) == 0 for m in model.layers if hasattr(m, "kernel")}
    qat = kp.quantize_aware(model)
    fit(qat, x, y, epochs=2)
    for name, z in zeros.items():
        layer = qat.get_layer(name)
        assert z.mean() > 0.55
        assert np.all(np_(layer.kernel)[z] == 0), name
        assert np.all(np_(layer.quantized_kernel())[z] == 0), name
        assert np.any(np_(layer.kernel)[~z] != np_(model.get_layer(name).kernel)[~z])  # trained
    unpruned = kp.quantize_aware(model, preserve_sparsity=False)
    fit(unpruned, x, y)
    assert not np.all(np_(unpruned.get_layer("dense").kernel)[zeros["dense"]] == 0)


@pytest.mark.slow
def test_loss_scaled_microbatches_train_a_qat_model(digits):
    (x, y), _ = images(digits)
    qat = kp.loss_scaled(kp.quantize_aware(cnn()), microbatches=2)
    h = fit(qat, x[:512], y[:512], epochs=2)
    assert np.isfinite(h.history["loss"]).all()
    assert h.history["loss"][-1] < h.history["loss"][0]
    assert float(np_(quantizers(qat)["dense_quant"].max)) != 6.0


@pytest.mark.slow
def test_qat_student_in_distillation_trains_and_exports(digits, tmp_path):
    (x, y), (xv, yv) = images(digits)
    teacher = cnn(seed=1)
    fit(teacher, x, y, epochs=2)
    student = kp.quantize_aware(cnn(seed=2))
    distiller = kp.DistillationModel(student, teacher)
    distiller.compile(keras.optimizers.Adam(3e-3), metrics=["accuracy"])
    h = distiller.fit(x, y, epochs=2, batch_size=32, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0]
    report = kp.export_tflite(distiller.student, tmp_path / "s.tflite", "int8")
    assert report["input_dtype"] == "int8"
    t = kp.tflite_predict(tmp_path / "s.tflite", xv)
    k = distiller.student.predict(xv, verbose=0)
    # A briefly trained student has many near-ties: a one-step flip can change a prediction.
    assert abs((t.argmax(1) == yv).mean() - (k.argmax(1) == yv).mean()) <= 0.02
    step = report["output_quantization"][0]
    assert np.mean(np.abs(k - t) <= step * 1.01) > 0.95


@pytest.mark.backends("torch")
@pytest.mark.parametrize("bits,narrow", [(2, True), (4, True), (8, True), (8, False), (5, False)])
def test_torch_fused_fake_quant_equals_keras_values_and_gradients(bits, narrow):
    """On torch the fake quantization runs in torch's fused ops: same outputs and the same
    straight-through gradient as `keras.quantizers.fake_quant_with_min_max_vars`."""
    import torch

    from keras_perf.quantization._quantizers import fake_quant

    rng = np.random.default_rng(bits)
    for shape, axis in [((64, 6, 6, 8), None), ((3, 3, 8, 16), 3), ((12, 10), 1)]:
        x = torch.tensor(rng.normal(size=shape).astype("float32"), requires_grad=True)
        if axis is None:
            lo, hi = torch.tensor(-1.3), torch.tensor(2.1)
        else:
            m = 0.6 * x.detach().abs().amax(dim=[d for d in range(len(shape)) if d != axis])
            lo, hi = -m, m
        ours = fake_quant(x, lo, hi, bits, narrow, axis)
        ref = keras.quantizers.fake_quant_with_min_max_vars(
            x, lo, hi, num_bits=bits, narrow_range=narrow, axis=axis
        )
        np.testing.assert_array_equal(ours.detach().numpy(), ref.detach().numpy())
        (g_ours,) = torch.autograd.grad((ours * ours).sum(), x)
        (g_ref,) = torch.autograd.grad((ref * ref).sum(), x)
        np.testing.assert_array_equal(g_ours.numpy(), g_ref.numpy())
        assert 0 < int((g_ref == 0).sum()) < g_ref.numel()  # some values fall outside
