"""export_tflite / tflite_predict / compression_report.

Every quantization mode is converted from a model trained on digits, loaded back in the TFLite
interpreter and compared with the Keras model's own predictions on the held-out split.
On the PyTorch backend each conversion starts a TensorFlow child process (~20 s), so only the
int8 mode (the one that also ships calibration data across) is converted there.
"""

import gzip
import os

import keras
import numpy as np
import pytest

import keras_perf as kp

BACKEND = keras.backend.backend()
MODES = [None, "dynamic", "float16", "int8"]
AGREEMENT = {None: 0.99, "dynamic": 0.99, "float16": 0.99, "int8": 0.95}


def _mlp(hidden=32):
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)]
    )


@pytest.fixture(scope="module")
def trained(digits):
    (x, y), (xv, yv) = digits
    keras.utils.set_random_seed(0)
    model = _mlp()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=128, epochs=15, verbose=0)
    logits = model.predict(xv, verbose=0)
    return model, logits


@pytest.fixture(scope="module")
def exported(trained, digits, tmp_path_factory):
    model, _ = trained
    (x, _), (xv, _) = digits
    out = tmp_path_factory.mktemp("tflite")
    modes = ["int8"] if BACKEND == "torch" else MODES
    results = {}
    for mode in modes:
        path = out / f"m_{mode}.tflite"
        data = x[:200] if mode == "int8" else None
        report = kp.export_tflite(model, path, mode, representative_data=data)
        results[mode] = (report, kp.tflite_predict(path, xv))
    return results


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_loads_and_agrees_with_keras(mode, trained, exported, digits):
    if mode not in exported:
        pytest.skip("torch backend: each conversion is a TensorFlow child process; int8 only")
    _, logits = trained
    (_, _), (_, yv) = digits
    report, tfl = exported[mode]
    assert report["quantization"] == mode
    assert report["bytes"] == os.path.getsize(report["path"]) > 0
    assert tfl.shape == logits.shape and tfl.dtype == np.float32
    agreement = np.mean(np.argmax(tfl, 1) == np.argmax(logits, 1))
    assert agreement >= AGREEMENT[mode], agreement
    keras_acc = np.mean(np.argmax(logits, 1) == yv)
    tflite_acc = np.mean(np.argmax(tfl, 1) == yv)
    assert keras_acc > 0.9
    assert abs(tflite_acc - keras_acc) <= 0.03
    if mode in (None, "float16"):
        np.testing.assert_allclose(tfl, logits, atol=2e-2 if mode else 1e-4)


def test_int8_is_full_integer_with_int8_io(exported):
    report, _ = exported["int8"]
    assert report["input_dtype"] == "int8" and report["output_dtype"] == "int8"
    scale, zero_point = report["input_quantization"]
    # Inputs live in [0, 1]: calibration maps them onto the int8 range with scale ~1/255.
    assert 0.5 / 255 < scale < 2 / 255 and -128 <= zero_point <= 127
    assert report["output_quantization"] is not None
    assert report["inputs"][0]["shape"] == [-1, 64]
    assert report["outputs"][0]["dtype"] == "int8"


@pytest.mark.backends("tensorflow", "jax")
def test_float_modes_keep_float_io_and_shrink_the_file(exported):
    sizes = {mode: exported[mode][0]["bytes"] for mode in MODES}
    for mode in (None, "dynamic", "float16"):
        report = exported[mode][0]
        assert report["input_dtype"] == report["output_dtype"] == "float32"
        assert report["input_quantization"] is None
    # 2,410 weights: 9.6 kB as float32, 4.8 kB as float16, 2.4 kB as int8 + the graph.
    assert sizes["float16"] < sizes[None] - 3_000
    assert sizes["dynamic"] < sizes["float16"] - 1_500
    assert sizes["int8"] < sizes["float16"] - 1_500


@pytest.mark.backends("tensorflow")
def test_int8_with_float_io_and_callable_calibration(trained, digits, tmp_path):
    model, logits = trained
    (x, _), (xv, _) = digits
    calls = []

    def representative():
        calls.append(1)
        for i in range(50):
            yield [x[i : i + 1]]

    report = kp.export_tflite(
        model, tmp_path / "m.tflite", "int8", representative_data=representative, int8_io=False
    )
    assert calls, "the callable was never used for calibration"
    assert report["input_dtype"] == report["output_dtype"] == "float32"
    tfl = kp.tflite_predict(report["path"], xv, batch_size=100)  # 360 = 3 * 100 + 60
    assert np.mean(np.argmax(tfl, 1) == np.argmax(logits, 1)) >= 0.95


@pytest.mark.backends("torch")
def test_torch_refuses_a_callable_representative_dataset(trained, tmp_path):
    model, _ = trained
    with pytest.raises(ValueError, match="must be arrays, not a callable"):
        kp.export_tflite(model, tmp_path / "m.tflite", "int8", representative_data=lambda: iter([]))


@pytest.mark.backends("tensorflow", "jax")
def test_subclassed_model_called_once_exports(digits, tmp_path):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

    (x, _), _ = digits
    model = Net()
    expected = keras.ops.convert_to_numpy(model(x[:20]))
    report = kp.export_tflite(model, tmp_path / "net.tflite", "float16")
    np.testing.assert_allclose(kp.tflite_predict(report["path"], x[:20]), expected, atol=1e-2)
    assert kp.compression_report(model)["total"]["params"] == 64 * 8 + 8 + 8 * 3 + 3


@pytest.mark.backends("tensorflow")
def test_multi_input_model_keeps_input_order(tmp_path):
    # Names sort the other way round from the model's order, to catch a name-sorted file.
    a, b = keras.Input((5,), name="zeta"), keras.Input((3,), name="alpha")
    mixed = keras.layers.Concatenate()([keras.layers.Dense(6)(a), b * 10.0])
    model = keras.Model([a, b], keras.layers.Dense(4)(mixed))
    rng = np.random.default_rng(1)
    xa, xb = rng.random((64, 5), dtype="float32"), rng.random((64, 3), dtype="float32")
    expected = model.predict([xa, xb], verbose=0)
    report = kp.export_tflite(model, tmp_path / "two.tflite")
    assert [t["shape"] for t in report["inputs"]] == [[-1, 5], [-1, 3]]
    np.testing.assert_allclose(kp.tflite_predict(report["path"], [xa, xb]), expected, atol=1e-5)
    report = kp.export_tflite(
        model, tmp_path / "two8.tflite", "int8", representative_data=[xa, xb], int8_io=False
    )
    got = kp.tflite_predict(report["path"], [xa, xb])
    assert np.max(np.abs(got - expected)) < 0.05 * np.ptp(expected)
    with pytest.raises(ValueError, match="must be a list of 2 arrays"):
        kp.export_tflite(model, tmp_path / "x.tflite", "int8", representative_data=xa)


def test_int8_without_representative_data_is_a_clear_error(trained, tmp_path):
    model, _ = trained
    with pytest.raises(ValueError, match="int8.*needs `representative_data`"):
        kp.export_tflite(model, tmp_path / "m.tflite", quantization="int8")
    assert not (tmp_path / "m.tflite").exists()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"quantization": "int4"}, ValueError, "`quantization` must be one of"),
        ({"quantization": "dynamic", "representative_data": np.zeros((4, 64))}, ValueError,
         "only used with quantization='int8'"),
        ({"calibration_samples": 0}, ValueError, "`calibration_samples` must be an integer >= 1"),
        ({"int8_io": "yes"}, TypeError, "`int8_io` must be True or False"),
        ({"custom_modules": "my.layers"}, TypeError, "`custom_modules` must be a list"),
        ({"quantization": "int8", "representative_data": np.zeros((0, 64))}, ValueError,
         "at least one example"),
    ],
)
def test_bad_arguments(trained, tmp_path, kwargs, error, match):
    model, _ = trained
    with pytest.raises(error, match=match):
        kp.export_tflite(model, tmp_path / "m.tflite", **kwargs)


def test_bad_model_and_path(tmp_path):
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        kp.export_tflite(keras.layers.Dense(2), tmp_path / "m.tflite")
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not built"):
        kp.export_tflite(unbuilt, tmp_path / "m.tflite")
    with pytest.raises(ValueError, match="does not exist"):
        kp.export_tflite(_mlp(), tmp_path / "missing" / "m.tflite")


def test_tflite_predict_bad_arguments(exported, digits):
    report, _ = exported["int8"]
    (_, _), (xv, _) = digits
    with pytest.raises(ValueError, match="has 1 inputs"):
        kp.tflite_predict(report["path"], [xv, xv])
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1"):
        kp.tflite_predict(report["path"], xv, batch_size=0)
    # Bytes work as well as a path.
    with open(report["path"], "rb") as f:
        content = f.read()
    np.testing.assert_array_equal(
        kp.tflite_predict(content, xv[:7]), kp.tflite_predict(report["path"], xv[:7])
    )


# ----------------------------------------------------------------------------------------------
# compression_report
# ----------------------------------------------------------------------------------------------


def test_compression_report_counts_exactly():
    model = _mlp(hidden=16)
    kernel = model.layers[0].kernel
    w = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    w[:, :12] = 0.0  # 75 % of the first kernel pruned
    kernel.assign(w)
    report = kp.compression_report(model)
    first, second = report["layers"]
    assert (first["name"], first["class"]) == (model.layers[0].name, "Dense")
    assert first["params"] == 64 * 16 + 16 and second["params"] == 16 * 10 + 10
    # Dense biases start at zero: only the 4 live kernel columns are non-zero.
    assert first["nonzero"] == 64 * 4
    assert second["nonzero"] == 16 * 10
    assert first["bytes"] == 4 * first["params"]
    assert first["sparsity"] == pytest.approx(1 - 256 / 1040)
    total = report["total"]
    assert total["params"] == model.count_params() == 1040 + 170
    assert total["nonzero"] == 256 + 160
    assert total["bytes"] == 4 * total["params"]
    # gzip of exactly the weight bytes, in variable order.
    raw = b"".join(keras.ops.convert_to_numpy(v.value).tobytes() for v in model.weights)
    assert total["gzip_bytes"] == len(gzip.compress(raw, compresslevel=9, mtime=0))
    assert total["compression_ratio"] == pytest.approx(total["bytes"] / total["gzip_bytes"])


def test_pruned_weights_compress_better():
    dense, pruned = _mlp(hidden=64), _mlp(hidden=64)
    pruned.set_weights(dense.get_weights())
    kernel = pruned.layers[0].kernel
    w = np.array(keras.ops.convert_to_numpy(kernel.value))
    w[np.abs(w) < np.quantile(np.abs(w), 0.8)] = 0.0
    kernel.assign(w)
    a = kp.compression_report(dense)["layers"][0]
    b = kp.compression_report(pruned)["layers"][0]
    assert a["bytes"] == b["bytes"]
    # 80 % of the kernel plus the (zero-initialised) bias.
    assert b["sparsity"] == pytest.approx((0.8 * 4096 + 64) / (4096 + 64), abs=1e-3)
    # Random float32 barely compresses; 80 % zeros should take gzip well under half.
    assert a["gzip_bytes"] > 0.85 * a["bytes"]
    assert b["gzip_bytes"] < 0.45 * a["gzip_bytes"]


def test_nested_models_and_non_trainable_weights_counted_once():
    inner = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(4), keras.layers.BatchNormalization()],
        name="inner",
    )
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(2, name="head")(inner(inputs))
    model = keras.Model(inputs, outputs)
    report = kp.compression_report(model)
    names = [r["name"] for r in report["layers"]]
    assert len(names) == len(set(names)) == 3  # inner Dense, BatchNorm, head
    bn = next(r for r in report["layers"] if r["class"] == "BatchNormalization")
    assert bn["params"] == 4 * 4  # gamma, beta, moving mean and variance
    assert report["total"]["params"] == model.count_params() == 36 + 16 + 10
    assert sum(r["bytes"] for r in report["layers"]) == report["total"]["bytes"]


def test_compression_report_bad_arguments():
    with pytest.raises(TypeError, match="`model` must be a Keras model or layer"):
        kp.compression_report("model.keras")
    with pytest.raises(ValueError, match=r"`compresslevel` must be an integer in \[1, 9\]"):
        kp.compression_report(_mlp(), compresslevel=10)
    with pytest.raises(ValueError, match="`compresslevel` must be an integer >= 1"):
        kp.compression_report(_mlp(), compresslevel=0)
    with pytest.raises(ValueError, match="not built"):
        kp.compression_report(keras.Sequential([keras.layers.Dense(2)]))
