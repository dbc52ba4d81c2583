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
from keras_perf.export import _convert
from tests import models

BACKEND = keras.backend.backend()
MODES = [None, "dynamic", "float16", "int8"]
AGREEMENT = {None: 0.99, "dynamic": 0.99, "float16": 0.99, "int8": 0.95}


def _mlp(hidden=32):
    return models.mlp([hidden])


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
def test_torch_takes_a_callable_representative_dataset(trained, digits, tmp_path):
    # The samples are drawn in this process and shipped to the TensorFlow child as arrays.
    model, logits = trained
    (x, _), (xv, _) = digits

    def representative():
        for i in range(50):
            yield [x[i : i + 1]]

    report = kp.export_tflite(
        model, tmp_path / "m.tflite", "int8", representative_data=representative
    )
    assert report["input_dtype"] == "int8"
    tfl = kp.tflite_predict(report["path"], xv)
    assert np.mean(np.argmax(tfl, 1) == np.argmax(logits, 1)) >= 0.95


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
        (
            {"quantization": "dynamic", "representative_data": np.zeros((4, 64))},
            ValueError,
            "only used with quantization='int8'",
        ),
        ({"calibration_samples": 0}, ValueError, "`calibration_samples` must be an integer >= 1"),
        ({"int8_io": "yes"}, TypeError, "`int8_io` must be True or False"),
        ({"custom_modules": "my.layers"}, TypeError, "`custom_modules` must be a list"),
        (
            {"quantization": "int8", "representative_data": np.zeros((0, 64))},
            ValueError,
            "at least one example",
        ),
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


# ----------------------------------------------------------------------------------------------
# What goes into the native converter is checked first (a bad input used to crash the process)
# ----------------------------------------------------------------------------------------------


def _two_inputs(names=("a", "b")):
    # Same shapes, not symmetric: swapping the inputs changes the result 100-fold. With the
    # names "a", "b" the converter orders the file's input tensors b, a.
    a, b = keras.Input((3,), name=names[0]), keras.Input((3,), name=names[1])
    return keras.Model([a, b], keras.layers.Add()([a, keras.layers.Rescaling(100.0)(b)]))


def _no_conversion(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the converter ran although the arguments were bad")

    monkeypatch.setattr(_convert._tflite, "convert_saved_model", fail)
    monkeypatch.setattr(_convert, "_export_via_tensorflow_process", fail)


def _calibration_cases():
    x = np.random.default_rng(0).random((32, 8), dtype="float32")
    inf, nan, part = x.copy(), np.full_like(x, np.nan), x.copy()
    inf[3, 2] = np.inf
    part[5, 1] = np.nan

    def gen(arrays):
        return lambda: iter(arrays)

    return [
        # Exit code 139 (segfault) before the fix.
        (
            inf,
            r"input 0 \('keras_tensor'\) has 1 non-finite value\(s\) \(Inf\), the first at "
            r"index \(3, 2\) \(example 3\)",
        ),
        # A float file labelled int8 before the fix.
        (nan, r"has 256 non-finite value\(s\) \(NaN\), the first at index \(0, 0\)"),
        (part, r"has 1 non-finite value\(s\) \(NaN\), the first at index \(5, 1\)"),
        # TFLite RuntimeErrors 15 frames deep before the fix.
        (
            x[:, :5],
            r"for input 0 \('keras_tensor'\): expected shape \(examples, 8\), got "
            r"\(32, 5\)",
        ),
        (
            gen([[x[i : i + 1, :5]] for i in range(4)]),
            r"expected shape \(examples, 8\), got "
            r"\(4, 5\)",
        ),
        (np.array([["a"] * 8] * 4), "has dtype <U1; calibration data must be numbers"),
        (x[:0], r"holds no examples \(shape \(0, 8\)\)"),
        # A float file labelled int8 before the fix.
        (gen([]), "yielded no samples"),
        (lambda: 5, "must return an iterable of samples"),
        (
            {"other": x},
            r"dict with keys \['other'\]; the model's inputs are named "
            r"\['keras_tensor'\]",
        ),
        # Finite inputs whose activations overflow float32: an unusable file before the fix.
        (x * 3e38, "output 0 is not finite on `representative_data`"),
    ]


@pytest.mark.parametrize("data, match", _calibration_cases())
def test_bad_calibration_data_is_a_value_error_before_converting(
    data, match, tmp_path, monkeypatch
):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,), name="keras_tensor"), keras.layers.Dense(3), keras.layers.Dense(2)]
    )
    _no_conversion(monkeypatch)
    error = TypeError if match.startswith("must return") else ValueError
    with pytest.raises(error, match=match):
        kp.export_tflite(model, tmp_path / "m.tflite", "int8", representative_data=data)
    assert not (tmp_path / "m.tflite").exists()


def test_calibration_of_a_two_input_model_names_the_input(tmp_path, monkeypatch):
    model = _two_inputs()
    x = np.ones((16, 3), "float32")
    _no_conversion(monkeypatch)
    bad = x.copy()
    bad[7, 0] = -np.inf
    with pytest.raises(ValueError, match=r"for input 1 \('b'\) has 1 non-finite .*index \(7, 0\)"):
        kp.export_tflite(model, tmp_path / "m.tflite", "int8", representative_data=[x, bad])
    with pytest.raises(
        ValueError,
        match=r"for input 0 \('a'\): expected shape \(examples, 3\), "
        r"got \(16, 4\)",
    ):
        kp.export_tflite(
            model,
            tmp_path / "m.tflite",
            "int8",
            representative_data={"a": np.ones((16, 4)), "b": x},
        )
    with pytest.raises(ValueError, match="must be a list of 2 arrays .* got 3 items"):
        kp.export_tflite(model, tmp_path / "m.tflite", "int8", representative_data=[x, x, x])
    with pytest.raises(ValueError, match="same number of examples for every input"):
        kp.export_tflite(model, tmp_path / "m.tflite", "int8", representative_data=[x, x[:5]])


@pytest.mark.backends("tensorflow", "jax")
def test_int8_file_that_fell_back_to_float_is_refused(tmp_path, monkeypatch):
    # All-NaN calibration gets past the converter as a float32 file; with the input check
    # switched off, the check on the converted file must still refuse it.
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    monkeypatch.setattr(_convert, "_check_calibration", lambda *args: None)
    with pytest.raises(
        ValueError, match="did not give a full-integer file.*(no tensor is int8|stayed float32)"
    ):
        kp.export_tflite(
            model,
            tmp_path / "m.tflite",
            "int8",
            representative_data=np.full((16, 8), np.nan, "float32"),
        )
    assert not (tmp_path / "m.tflite").exists()


@pytest.mark.parametrize(
    "where, match",
    [
        ("file/m.tflite", "is not a directory"),
        ("dir", "is a directory; give a file name"),
        ("missing/m.tflite", "does not exist; create it first"),
    ],
)
def test_bad_path_is_refused_before_converting(where, match, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    _no_conversion(monkeypatch)
    with pytest.raises(ValueError, match=match):
        kp.export_tflite(_mlp(), tmp_path / where)


@pytest.mark.skipif(
    not os.path.isdir("/proc"), reason="needs Linux /proc (unwritable, even for root)"
)
def test_unwritable_directory_is_refused_before_converting(monkeypatch):
    _no_conversion(monkeypatch)
    with pytest.raises(ValueError, match="`path`'s directory '/proc' is not writable"):
        kp.export_tflite(_mlp(), "/proc/m.tflite")


def test_unbuilt_subclassed_model_and_bad_quantization(tmp_path, monkeypatch):
    _no_conversion(monkeypatch)
    with pytest.raises(ValueError, match="not built"):
        kp.export_tflite(models.OneDense(3, name="net"), tmp_path / "m.tflite")
    with pytest.raises(ValueError, match="`quantization` must be one of None, 'dynamic'"):
        kp.export_tflite(_mlp(), tmp_path / "m.tflite", "INT8")
    with pytest.raises(TypeError, match="`quantization` must be None or one of"):
        kp.export_tflite(_mlp(), tmp_path / "m.tflite", np.array([8]))
    with pytest.raises(TypeError, match="`allow_select_tf_ops` must be True or False"):
        kp.export_tflite(_mlp(), tmp_path / "m.tflite", allow_select_tf_ops=1)


# ----------------------------------------------------------------------------------------------
# tflite_predict takes inputs as model.predict does and returns what it returns
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("names", [("a", "b"), ("b", "a"), (None, None)])
def test_tflite_predict_takes_inputs_in_model_order_or_by_name(names, tmp_path):
    if names[0] is None:  # Keras' own names.
        a, b = keras.Input((3,)), keras.Input((3,))
        model = keras.Model([a, b], keras.layers.Add()([a, keras.layers.Rescaling(100.0)(b)]))
    else:
        model = _two_inputs(names)
    xa = np.full((5, 3), 4.0, "float32")
    xb = np.random.default_rng(0).random((5, 3), dtype="float32")
    expected = model.predict([xa, xb], verbose=0)
    report = kp.export_tflite(model, tmp_path / "two.tflite")
    order = report["input_order"]
    if names[0] is not None or BACKEND != "torch":
        assert order == [t.name for t in model.inputs]
    else:  # The TensorFlow child reloads the .keras file: unnamed inputs get layer names.
        assert order == ["input_layer", "input_layer_1"]
    np.testing.assert_allclose(kp.tflite_predict(report["path"], [xa, xb]), expected, atol=1e-5)
    got = kp.tflite_predict(report["path"], {order[1]: xb, order[0]: xa})
    np.testing.assert_allclose(got, expected, atol=1e-5)
    with pytest.raises(ValueError, match=r"`x` is a dict with keys \['zz'\]"):
        kp.tflite_predict(report["path"], {"zz": xa})
    with pytest.raises(
        ValueError,
        match=rf"`x` for input '{order[1]}': expected shape "
        r"\(examples, 3\), got \(5, 4\)",
    ):
        kp.tflite_predict(report["path"], [xa, np.ones((5, 4))])
    with pytest.raises(ValueError, match="same number of examples"):
        kp.tflite_predict(report["path"], [xa, xb[:2]])


@pytest.mark.backends("tensorflow", "jax")
def test_tflite_predict_returns_outputs_as_model_predict(tmp_path):
    a, b = keras.Input((3,), name="zeta"), keras.Input((3,), name="alpha")
    first = keras.layers.Dense(2, name="first")(keras.layers.Concatenate()([a, b * 100.0]))
    second = keras.layers.Dense(4, name="second")(a - b)
    rng = np.random.default_rng(2)
    x = [rng.random((6, 3), dtype="float32"), rng.random((6, 3), dtype="float32")]
    listed = keras.Model([a, b], [first, second])
    keyed = keras.Model({"zeta": a, "alpha": b}, {"yy": first, "aa": second})
    for model, feed in ((listed, x), (keyed, {"zeta": x[0], "alpha": x[1]})):
        expected = model.predict(feed, verbose=0)
        path = kp.export_tflite(model, tmp_path / "m.tflite")["path"]
        got = kp.tflite_predict(path, feed)
        assert type(got) is type(expected)
        if isinstance(expected, dict):
            assert sorted(got) == sorted(expected) == ["aa", "yy"]
            for key in expected:
                np.testing.assert_allclose(got[key], expected[key], atol=1e-4)
        else:
            assert [y.shape for y in got] == [(6, 2), (6, 4)]
            for y, e in zip(got, expected):
                np.testing.assert_allclose(y, e, atol=1e-4)


@pytest.mark.backends("tensorflow")
def test_multi_input_file_from_elsewhere_needs_a_dict(tmp_path):
    import tensorflow as tf

    model = _two_inputs()
    model.export(str(tmp_path / "sm"), format="tf_saved_model", verbose=False)
    content = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "sm")).convert()
    x = [np.full((2, 3), 4.0, "float32"), np.zeros((2, 3), "float32")]
    with pytest.raises(ValueError, match=r"does not record the model's input order.*a, b"):
        kp.tflite_predict(content, x)
    got = kp.tflite_predict(content, {"a": x[0], "b": x[1]})
    np.testing.assert_allclose(got, model.predict(x, verbose=0), atol=1e-5)


@pytest.mark.backends("tensorflow", "jax")
def test_int8_calibration_in_model_order_list_dict_and_callable(tmp_path):
    # Input "a" lives in [0, 1], "b" in [0, 100]: calibrating one on the other's range
    # would clip it and miss the output by far more than 5 %.
    model = _two_inputs()
    rng = np.random.default_rng(3)
    xa, xb = rng.random((64, 3), dtype="float32"), 100 * rng.random((64, 3), dtype="float32")
    expected = model.predict([xa, xb], verbose=0)

    def samples():
        for i in range(64):
            yield [xa[i : i + 1], xb[i : i + 1]]

    for data in ([xa, xb], {"b": xb, "a": xa}, samples):
        report = kp.export_tflite(
            model, tmp_path / "m.tflite", "int8", representative_data=data, int8_io=False
        )
        got = kp.tflite_predict(report["path"], [xa, xb])
        assert np.max(np.abs(got - expected)) < 0.05 * np.ptp(expected), data


# ----------------------------------------------------------------------------------------------
# LSTM: TFLite's builtin ops do not cover it; select TF ops on request
# ----------------------------------------------------------------------------------------------


@pytest.mark.backends("tensorflow")
def test_lstm_needs_select_tf_ops_and_says_so(tmp_path):
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="Pass `allow_select_tf_ops=True`"):
        kp.export_tflite(model, tmp_path / "lstm.tflite")
    assert not (tmp_path / "lstm.tflite").exists()
    report = kp.export_tflite(model, tmp_path / "lstm.tflite", allow_select_tf_ops=True)
    assert report["bytes"] == os.path.getsize(tmp_path / "lstm.tflite") > 0
    assert "TensorListReserve" in report["select_tf_ops"]
    assert report["inputs"][0]["shape"] == [-1, 5, 3]
    x = np.random.default_rng(0).random((7, 5, 3), dtype="float32")
    try:
        got = kp.tflite_predict(report["path"], x)
    except RuntimeError as e:
        # TF 2.21's pip interpreter has no Flex delegate: the file is written and described,
        # and running it here is a clear error instead of TFLite's own.
        assert "no Flex delegate" in str(e) and "TensorListReserve" in str(e)
    else:
        np.testing.assert_allclose(got, model.predict(x, verbose=0), atol=1e-5)


def test_mixed_precision_model_exports_its_float32_computation(tmp_path):
    """Under a mixed policy the variables are float32 and TFLite has no bfloat16 kernels: the
    file computes in float32 (it used to fail with "the loop of an LSTM/GRU")."""
    mixed, plain = models.mixed_and_float32_twins()
    xs = [np.random.default_rng(1).random((16, n), dtype="float32") for n in (8, 4)]
    report = kp.export_tflite(mixed, tmp_path / "m.tflite")
    assert report["input_order"] == ["a", "b"]
    got = kp.tflite_predict(tmp_path / "m.tflite", xs)
    np.testing.assert_allclose(got, plain.predict(xs, verbose=0), atol=1e-5)
    # The model itself is untouched: still mixed, still the same weights.
    assert mixed.layers[-2].dtype_policy.name == "mixed_bfloat16"
    for u, v in zip(mixed.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(u, v)


@pytest.mark.backends("tensorflow", "jax")
def test_mixed_precision_subclassed_model_is_a_clear_error(tmp_path):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = Net()
        model(np.zeros((1, 8), "float32"))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    with pytest.raises(ValueError, match=r"subclassed.*'dense' \(mixed_float16\).*set_weights"):
        kp.export_tflite(model, tmp_path / "m.tflite")
    assert not (tmp_path / "m.tflite").exists()


@pytest.mark.backends("jax")
def test_jax_dropout_layers_export_as_identity(tmp_path):
    """Keras' JAX SavedModel writes the Dropout seed state back (uint32, no TFLite kernel)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            keras.layers.Dropout(0.3),
            keras.layers.GaussianNoise(0.1),
            keras.layers.Dense(3),
        ]
    )
    x = np.random.default_rng(0).random((16, 8), dtype="float32")
    kp.export_tflite(model, tmp_path / "m.tflite")
    got = kp.tflite_predict(tmp_path / "m.tflite", x)
    np.testing.assert_allclose(got, model.predict(x, verbose=0), atol=1e-5)


@pytest.mark.backends("jax")
def test_jax_seed_state_inside_a_layer_is_a_clear_error(tmp_path):
    a = keras.Input((4, 8))
    model = keras.Model(a, keras.layers.MultiHeadAttention(2, 4, dropout=0.2, name="mha")(a, a))
    with pytest.raises(ValueError, match=r"'mha/.*TensorFlow backend"):
        kp.export_tflite(model, tmp_path / "m.tflite")
    assert not (tmp_path / "m.tflite").exists()


# -- issue 41 ----------------------------------------------------------------------------------
@pytest.mark.backends("tensorflow", "jax")
def test_int8_of_a_batchnorm_model_converts_on_jax_as_on_tensorflow(digits, tmp_path):
    # Regression (issue 41): on JAX, Keras' SavedModel assigns BatchNormalization's moving
    # statistics back after each call, so they stayed float32 variables and the int8 file was
    # refused, blaming `representative_data`.
    (x, y), (xv, _) = digits
    x, xv = x.reshape(-1, 8, 8, 1), xv.reshape(-1, 8, 8, 1)
    model = models.digits_cnn(0)
    model.compile(
        keras.optimizers.Adam(3e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, epochs=2, batch_size=64, verbose=0)
    flags = [v.trainable for v in model.variables]
    kp.export_tflite(model, tmp_path / "m.tflite", "int8", representative_data=x[:200])
    assert [v.trainable for v in model.variables] == flags  # the flags are restored
    assert len(model.non_trainable_variables) == 2
    out = kp.tflite_predict(tmp_path / "m.tflite", xv)
    agreement = (out.argmax(1) == model.predict(xv, verbose=0).argmax(1)).mean()
    assert agreement >= 0.95


def test_constant_calibration_data_is_refused_by_export_tflite(trained, digits, tmp_path):
    # Issue 41: all-zero calibration data gave an int8 file with 0-17 % agreement, no warning.
    model, _ = trained
    (x, _), _ = digits
    with pytest.raises(ValueError, match=r"`representative_data` is constant.*all 0.*dynamic"):
        kp.export_tflite(
            model, tmp_path / "m.tflite", "int8", representative_data=np.zeros_like(x[:50])
        )
    assert not (tmp_path / "m.tflite").exists()
