"""export_onnx / onnx_predict / inference_report, on every backend.

Models are trained on digits (8x8 images) and exported through Keras' own ONNX exporter of the
backend (tf2onnx, jax2onnx, torch.onnx); the files run in ONNX Runtime. On JAX the first
export in a process takes ~45 s (jax2onnx imports and traces all its plugins once), so the
files are made once per module and shared.
"""

import shutil
import sys

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf.export import _onnx_export, _onnx_graph, _onnx_quantize, _onnx_session
from keras_perf.quantization import ActivationQuantizer

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from tests import models  # noqa: E402

BACKEND = keras.backend.backend()
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn(seed=0):
    """Conv-BN-ReLU, MaxPool (jax2onnx's 6-D MaxPool, rewritten), Dense: digits images."""
    return models.digits_cnn(seed)


def fit(model, x, y, epochs):
    model.compile(keras.optimizers.Adam(3e-3), LOSS)
    model.fit(x, y, epochs=epochs, batch_size=64, verbose=0)
    return model


def accuracy(logits, y):
    return float((np.asarray(logits).argmax(1) == y).mean())


@pytest.fixture(scope="module")
def data(digits):
    (x, y), (xv, yv) = digits
    return (x.reshape(-1, 8, 8, 1), y), (xv.reshape(-1, 8, 8, 1), yv)


@pytest.fixture(scope="module")
def trained(data):
    (x, y), _ = data
    return fit(cnn(), x, y, epochs=3)


@pytest.fixture(scope="module")
def files(trained, data, tmp_path_factory):
    """The trained CNN exported float and int8 (the two exports most tests read)."""
    (x, _), _ = data
    tmp = tmp_path_factory.mktemp("onnx")
    return {
        None: kp.export_onnx(trained, tmp / "float.onnx"),
        "int8": kp.export_onnx(trained, tmp / "int8.onnx", "int8", representative_data=x),
    }


def test_float_round_trip(trained, files, data):
    _, (xv, _) = data
    report = files[None]
    out = kp.onnx_predict(report["path"], xv, batch_size=100)
    np.testing.assert_allclose(out, trained.predict(xv, verbose=0), atol=1e-4)
    assert report["input_order"] == ["image"]
    assert report["inputs"][0]["shape"][1:] == [8, 8, 1]
    assert report["bytes"] == len(open(report["path"], "rb").read())


def test_int8_agrees_on_digits(trained, files, data):
    _, (xv, yv) = data
    report = files["int8"]
    proto = onnx.load(report["path"])
    assert _onnx_graph.float_ops(proto) == []  # every Conv and Gemm runs in int8
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in proto.graph.node}
    keras_logits = trained.predict(xv, verbose=0)
    out = kp.onnx_predict(report["path"], xv)
    assert (out.argmax(1) == keras_logits.argmax(1)).mean() >= 0.97
    assert accuracy(out, yv) >= accuracy(keras_logits, yv) - 0.01
    assert report["bytes"] < files[None]["bytes"]


@pytest.mark.parametrize("mode", ["float16", "dynamic"])
def test_weight_modes_agree(trained, data, mode, tmp_path):
    _, (xv, _) = data
    report = kp.export_onnx(trained, tmp_path / "m.onnx", mode)
    out = kp.onnx_predict(report["path"], xv)
    keras_logits = trained.predict(xv, verbose=0)
    # "dynamic" flips 4 near-ties of 360 on JAX's model (0.9889 on an AVX2 EPYC, with or
    # without ORT's graph optimizations, so no saturation): the logits' bound is the claim.
    assert (out.argmax(1) == keras_logits.argmax(1)).mean() >= 0.98
    assert np.abs(out - keras_logits).max() < 0.1


def test_qat_file_has_the_learned_ranges(trained, data, tmp_path):
    (x, _), (xv, _) = data
    qat = kp.quantize_aware(trained)
    # One training-mode pass sets the moving-average ranges (the first batch sets them
    # directly): what `fit` does to them, without compiling a train step (~40 s on JAX).
    qat(x[:512], training=True)
    report = kp.export_onnx(qat, tmp_path / "qat.onnx", "int8")  # no calibration data
    params = _onnx_graph.quantization_params(onnx.load(report["path"]))
    file_scales = np.array([float(s) for s, _ in params.values()])
    quantizers = [q for q in qat.layers if isinstance(q, ActivationQuantizer)]
    assert len(quantizers) == 4  # input, conv block, dense 32, output
    for q in quantizers:
        lo, hi = float(q.min.numpy()), float(q.max.numpy())
        scale = (hi - lo) / 255
        zero = np.clip(np.round(-lo / scale), 0, 255)
        hits = [k for k, (s, z) in params.items() if np.isclose(float(s), scale, rtol=1e-6)]
        assert hits, f"{q.name}: scale {scale} not among the file's {file_scales}"
        assert all(int(params[k][1]) == zero for k in hits)
    # The file computes what the QAT model computes, within a few steps of the output scale.
    out_q = quantizers[-1]
    step = (float(out_q.max.numpy()) - float(out_q.min.numpy())) / 255
    diff = np.abs(kp.onnx_predict(report["path"], xv) - qat.predict(xv, verbose=0))
    assert diff.max() <= 3 * step + 1e-6


def int8_weights(proto) -> list[tuple[np.ndarray, int]]:
    """(int8 weight, channel axis) of each DequantizeLinear reading an int8 initializer."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    out = []
    for n in proto.graph.node:
        w = inits.get(n.input[0]) if n.op_type == "DequantizeLinear" else None
        if w is not None and w.dtype == np.int8:
            axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
            out.append((w, axis))
    return out


@pytest.mark.slow
def test_qat_4bit_file_keeps_4bit_weights_and_the_keras_accuracy(trained, data, tmp_path):
    (x, y), (xv, yv) = data
    qat = kp.quantize_aware(trained, weight_bits=4)
    qat.compile(keras.optimizers.Adam(3e-4), LOSS)
    qat.fit(x, y, epochs=2, batch_size=32, verbose=0)
    report = kp.export_onnx(qat, tmp_path / "qat4.onnx", "int8")
    weights = int8_weights(onnx.load(report["path"]))
    assert len(weights) == 3  # conv (BatchNormalization folded in), dense, dense
    for w, axis in weights:
        # int8 in [-64, 64] (ORT's reduce_range), and per output channel at most the 15
        # levels of a 4-bit kernel (the file re-rounds them to its 7-bit grid).
        assert np.abs(w).max() <= 64
        levels = [len(np.unique(c)) for c in np.moveaxis(w, axis, 0)]
        assert max(levels) <= 15, levels
    # The file classifies as the QAT model does: ONNX Runtime's integer arithmetic and the
    # model's fake quantization round a few borderline examples apart (measured 2026-11-28,
    # 360 examples: 98.9-99.4 % agreement on the three backends and with one or two compute
    # threads; accuracy 0.3-1.1 points apart, either way). At most 2 % of the examples differ.
    expected = qat.predict(xv, verbose=0)
    got = kp.onnx_predict(report["path"], xv)
    assert np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.98
    assert abs(accuracy(got, yv) - accuracy(expected, yv)) <= 0.02


def test_qat_argument_errors(trained, data, tmp_path):
    (x, _), _ = data
    qat = kp.quantize_aware(trained)
    with pytest.raises(ValueError, match="quantization='int8'"):
        kp.export_onnx(qat, tmp_path / "q.onnx")
    with pytest.raises(ValueError, match="learned in training"):
        kp.export_onnx(qat, tmp_path / "q.onnx", "int8", representative_data=x)
    with pytest.raises(ValueError, match="never seen a training batch"):
        kp.export_onnx(qat, tmp_path / "q.onnx", "int8")
    assert not (tmp_path / "q.onnx").exists()


def test_bad_calibration_data_is_refused_before_writing(trained, data, tmp_path):
    (x, _), _ = data
    path = tmp_path / "m.onnx"
    bad = x[:50].copy()
    bad[3, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        kp.export_onnx(trained, path, "int8", representative_data=bad)
    with pytest.raises(ValueError, match=r"expected shape \(examples, 8, 8, 1\)"):
        kp.export_onnx(trained, path, "int8", representative_data=x[:50, :4])
    with pytest.raises(ValueError, match="dtype"):
        kp.export_onnx(trained, path, "int8", representative_data=np.array([["a"]]))
    assert not path.exists()


def test_argument_errors(trained, data, tmp_path):
    (x, _), _ = data
    with pytest.raises(ValueError, match="`quantization` must be one of"):
        kp.export_onnx(trained, tmp_path / "m.onnx", "int4")
    with pytest.raises(ValueError, match="needs `representative_data`"):
        kp.export_onnx(trained, tmp_path / "m.onnx", "int8")
    with pytest.raises(ValueError, match="only used with quantization='int8'"):
        kp.export_onnx(trained, tmp_path / "m.onnx", "dynamic", representative_data=x)
    with pytest.raises(ValueError, match="does not exist"):
        kp.export_onnx(trained, tmp_path / "no" / "m.onnx")
    with pytest.raises(TypeError, match="keras.Model"):
        kp.export_onnx("model", tmp_path / "m.onnx")

    class Sub(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="Sequential or Functional"):
        kp.export_onnx(Sub(), tmp_path / "m.onnx")


def test_int8_file_left_in_float_is_refused(trained, data, tmp_path, monkeypatch):
    (x, _), _ = data

    def no_quantization(src, dst, *args, **kwargs):
        shutil.copy(src, dst)

    monkeypatch.setattr(_onnx_quantize, "quantize", no_quantization)
    path = tmp_path / "m.onnx"
    with pytest.raises(ValueError, match=r"left 3 weight op\(s\) in float"):
        kp.export_onnx(trained, path, "int8", representative_data=x[:64])
    assert not path.exists()


@pytest.mark.parametrize("module", ["onnxruntime", "onnx", _onnx_export.EXPORTERS[BACKEND]])
def test_missing_package_names_the_extra(files, module, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # import fails, find_spec raises
    extra = "onnx-jax" if module == "jax2onnx" else "onnx"
    with pytest.raises(ImportError, match=rf"keras-perf\[{extra}\]"):
        kp.export_onnx(
            keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), tmp_path / "m.onnx"
        )
    if module == "onnxruntime":
        with pytest.raises(ImportError, match=r"keras-perf\[onnx\]"):
            kp.onnx_predict(files[None]["path"], np.zeros((1, 8, 8, 1), "float32"))


@pytest.mark.skipif(BACKEND == "jax", reason="jax2onnx converts erfinv")
def test_unsupported_op_is_a_clear_error(tmp_path):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Lambda(lambda t: keras.ops.erfinv(keras.ops.tanh(t)))]
    )
    path = tmp_path / "m.onnx"
    with pytest.raises(ValueError, match="Keras' ONNX export .* (cannot convert|cannot load)"):
        kp.export_onnx(model, path)
    assert not path.exists()


def test_onnx_predict_takes_inputs_like_predict(tmp_path):
    keras.utils.set_random_seed(1)
    a, b = keras.Input((3,), name="a"), keras.Input((5,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(4)(b), a])
    model = keras.Model([a, b], [keras.layers.Dense(2)(h), keras.layers.Dense(1)(h)])
    report = kp.export_onnx(model, tmp_path / "two.onnx")
    assert report["input_order"] == ["a", "b"]
    xa, xb = np.random.rand(7, 3).astype("float32"), np.random.rand(7, 5).astype("float32")
    expected = model.predict([xa, xb], verbose=0)
    for x in ([xa, xb], {"b": xb, "a": xa}):
        out = kp.onnx_predict(report["path"], x, batch_size=3)
        assert len(out) == 2
        for o, e in zip(out, expected):
            np.testing.assert_allclose(o, e, atol=1e-5)
    with pytest.raises(ValueError, match="2 inputs"):
        kp.onnx_predict(report["path"], xa)
    with pytest.raises(ValueError, match=r"expected shape \(examples, 5\)"):
        kp.onnx_predict(report["path"], {"a": xa, "b": xa})
    with pytest.raises(ValueError, match="batch_size"):
        kp.onnx_predict(report["path"], [xa, xb], batch_size=0)


def test_pruned_zeros_survive_into_the_file(trained, tmp_path):
    model = keras.models.clone_model(trained)
    model.set_weights(trained.get_weights())
    dense = model.layers[-2]
    kernel = keras.ops.convert_to_numpy(dense.kernel).copy()
    kernel[np.abs(kernel) < np.median(np.abs(kernel))] = 0.0
    dense.kernel.assign(kernel)
    report = kp.export_onnx(model, tmp_path / "pruned.onnx")
    weights = [onnx.numpy_helper.to_array(i) for i in onnx.load(report["path"]).graph.initializer]
    zeros = max(int((w == 0).sum()) for w in weights if w.size == kernel.size)
    assert zeros == int((kernel == 0).sum())


def test_inference_report(trained, data, tmp_path):
    _, (xv, yv) = data
    r = kp.inference_report(
        trained,
        xv[:64],
        yv[:64],
        batch_sizes=(1, 8),
        formats=["keras", "onnx", "onnx-int8"],
        repeats=2,
        pause=0.0,
    )
    assert [(row["format"], row["batch_size"]) for row in r.rows] == [
        (f, b) for b in (1, 8) for f in ("keras", "onnx", "onnx-int8")
    ]
    by = {(row["format"], row["batch_size"]): row for row in r.rows}
    assert by["onnx", 1]["agreement"] == 1.0
    assert by["onnx-int8", 8]["agreement"] >= 0.95
    assert by["onnx-int8", 8]["bytes"] < by["onnx", 8]["bytes"]
    assert by["keras", 1]["accuracy"] == accuracy(trained.predict(xv[:64], verbose=0), yv[:64])
    for row in r.rows:
        assert 0 < row["latency_ms_p50"] <= row["latency_ms_p90"]
        assert row["examples_per_s"] == pytest.approx(
            row["batch_size"] / row["latency_ms_p50"] * 1e3
        )
    text = str(r)
    assert "onnx-int8" in text and "p50 ms" in text
    assert r.to_dict()["rows"] == r.rows
    r.plot(tmp_path / "inference.png")
    assert (tmp_path / "inference.png").stat().st_size > 0
    with pytest.raises(ValueError, match="not one of"):
        kp.inference_report(trained, xv, formats=["onnx-int4"])
    with pytest.raises(ValueError, match="batch_sizes"):
        kp.inference_report(trained, xv, batch_sizes=(0,))


def test_qat_sequential_with_softmax(tmp_path):
    # The softmax is split from its Dense by a quantizer (`quantize_aware`); ORT fixes a
    # softmax output's range to [0, 1], the learned one is close to it.
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(8, activation="softmax"),
        ]
    )
    x = np.random.rand(256, 16).astype("float32")
    qat = kp.quantize_aware(model)
    qat(x, training=True)
    report = kp.export_onnx(qat, tmp_path / "seq.onnx", "int8")
    diff = np.abs(kp.onnx_predict(report["path"], x) - qat.predict(x, verbose=0))
    assert diff.max() <= 2 / 255
    with pytest.raises(ValueError, match="8-bit activations"):
        kp.export_onnx(kp.quantize_aware(model, activation_bits=16), tmp_path / "a.onnx", "int8")


def nested_model():
    """Conv, then a nested Sequential and a nested Functional model (digits images)."""
    keras.utils.set_random_seed(0)
    body = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu", name="body_dense")],
        name="body",
    )
    head_in = keras.Input((32,))
    head = keras.Model(head_in, keras.layers.Dense(10, name="head_dense")(head_in), name="head")
    inp = keras.Input((8, 8, 1), name="image")
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(inp)
    h = keras.layers.Flatten()(keras.layers.MaxPooling2D()(h))
    return keras.Model(inp, head(body(h)))


def test_qat_with_nested_models_exports_its_learned_ranges(data, tmp_path):
    (x, _), (xv, _) = data
    model = nested_model()
    qat = kp.quantize_aware(model)
    qat(x[:512], training=True)
    inner = qat.get_layer("body").get_layer("body_dense")
    report = kp.export_onnx(qat, tmp_path / "nested.onnx", "int8")
    proto = onnx.load(report["path"])
    assert _onnx_graph.float_ops(proto) == []
    params = _onnx_graph.quantization_params(proto)
    # The quantizers inside the nested models are in the file, with their learned ranges.
    for name in ("body_dense_quant", "head_dense_quant"):
        q = qat.get_layer(name.split("_")[0]).get_layer(name)
        scale = (float(q.max.numpy()) - float(q.min.numpy())) / 255
        assert any(np.isclose(float(s), scale, rtol=1e-6) for s, _ in params.values()), name
    out_q = qat.get_layer("head").get_layer("head_dense_quant")
    step = (float(out_q.max.numpy()) - float(out_q.min.numpy())) / 255
    diff = np.abs(kp.onnx_predict(report["path"], xv) - qat.predict(xv, verbose=0))
    assert diff.max() <= 3 * step + 1e-6
    assert inner.output is not None  # the user's nested layers were not called again


def test_qat_with_a_nested_model_called_twice_is_refused(tmp_path):
    body = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(16, activation="relu")], name="body"
    )
    inp = keras.Input((16,))
    model = keras.Model(inp, keras.layers.Dense(10)(body(body(inp))))
    qat = kp.quantize_aware(model)
    qat(np.random.default_rng(0).random((64, 16), dtype=np.float32), training=True)
    with pytest.raises(ValueError, match="nested model 'body'.*called more than once"):
        kp.export_onnx(qat, tmp_path / "q.onnx", "int8")
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TFLite on JAX/torch: a TF child process")
def test_inference_report_with_tflite(trained, data):
    _, (xv, yv) = data
    r = kp.inference_report(
        trained, xv[:32], yv[:32], batch_sizes=(4,), formats=["tflite", "tflite-int8"], repeats=2
    )
    by = {row["format"]: row for row in r.rows}
    assert by["tflite"]["agreement"] == 1.0
    assert by["tflite-int8"]["agreement"] >= 0.9
    assert by["tflite-int8"]["bytes"] < by["tflite"]["bytes"]


def test_docstring_examples_run():
    import doctest

    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for fn in (kp.export_onnx, kp.onnx_predict, kp.inference_report):
        for test in doctest.DocTestFinder().find(fn, globs={}):
            runner.run(test)
    assert runner.tries >= 10 and runner.failures == 0


def test_mixed_precision_model_exports_its_float32_computation(tmp_path):
    """ONNX Runtime's CPU kernels have no bfloat16: the file computes in float32."""
    mixed, plain = models.mixed_and_float32_twins()
    xs = [np.random.default_rng(1).random((16, n), dtype="float32") for n in (8, 4)]
    kp.export_onnx(mixed, tmp_path / "m.onnx")
    got = kp.onnx_predict(tmp_path / "m.onnx", xs)
    np.testing.assert_allclose(got, plain.predict(xs, verbose=0), atol=1e-5)
    assert mixed.layers[-2].dtype_policy.name == "mixed_bfloat16"


def test_transformer_int8_export_runs_and_leaves_the_working_directory_clean(tmp_path, monkeypatch):
    """ORT's symbolic shape inference gives up on the attention reshapes and used to raise a
    bare Exception, leaving its partial model and a `<uuid>.data` file in the working
    directory; the export pre-processes without it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    arch = models.ARCHS["transformer"]
    model = models.transformer_encoder()
    x, _, _ = models.make_data(arch, 32)
    if BACKEND == "tensorflow":
        kp.export_onnx(model, tmp_path / "t.onnx", "int8", representative_data=x)
        got, ref = kp.onnx_predict(tmp_path / "t.onnx", x), model.predict(x, verbose=0)
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
        assert np.abs(got - ref).max() < 0.2
    else:
        # jax2onnx's graph trips ORT's int8 quantizer (a bare `assert`); torch.onnx cannot
        # export the attention's dynamic shapes. Each is a ValueError that says what to do.
        with pytest.raises(ValueError, match="another Keras backend"):
            kp.export_onnx(model, tmp_path / "t.onnx", "int8", representative_data=x)
        assert not (tmp_path / "t.onnx").exists()
    assert sorted(p.name for p in cwd.iterdir()) == []


def _pretend_cpu(monkeypatch, flags):
    import keras_perf._cpu as cpu

    monkeypatch.setattr(cpu, "cpu_info", lambda: ("pretended CPU", frozenset(flags)))
    monkeypatch.setattr(cpu, "is_x86", lambda: True)


def test_int8_saturation_follows_the_cpu(monkeypatch):
    _pretend_cpu(monkeypatch, {"avx2", "fma"})
    assert _onnx_session.int8_kernels_saturate()
    for vnni in ("avx512_vnni", "avx_vnni", "amx_int8"):
        _pretend_cpu(monkeypatch, {"avx2", vnni})
        assert not _onnx_session.int8_kernels_saturate()
    _pretend_cpu(monkeypatch, set())  # /proc/cpuinfo unreadable: nothing is assumed
    assert not _onnx_session.int8_kernels_saturate()


def test_int8_weights_in_7_bits_and_full_range_files_run_unfused_where_they_saturate(
    trained, data, monkeypatch, tmp_path
):
    """Without VNNI, ORT's fused u8s8 kernels add pairs of products in 16 bits: on an AVX2-only
    CPU a digits CNN's full-range int8 file agreed with the float file on 93 % of argmaxes.
    "int8" files get 7-bit weights by default; a full-range file runs unfused there."""
    import onnxruntime as ort

    (x, _), (xv, _) = data
    seven = kp.export_onnx(trained, tmp_path / "seven.onnx", "int8", representative_data=x)
    full = kp.export_onnx(
        trained, tmp_path / "full.onnx", "int8", representative_data=x, reduce_range=False
    )
    assert seven["reduce_range"] and not full["reduce_range"]
    assert not _onnx_session.saturating_int8_weights(onnx.load(seven["path"]))
    assert _onnx_session.saturating_int8_weights(onnx.load(full["path"]))
    assert not kp.export_onnx(trained, tmp_path / "dyn.onnx", "dynamic")["reduce_range"]

    def level(path):
        return _onnx_session.session(path).get_session_options().graph_optimization_level

    basic = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    _pretend_cpu(monkeypatch, {"avx2"})
    assert level(full["path"]) == basic and level(seven["path"]) != basic
    # Unfused, the full-range file computes what it says: as ORT's reference level does.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(full["path"], options, providers=["CPUExecutionProvider"])
    want = ref.run(None, {ref.get_inputs()[0].name: xv})[0]
    np.testing.assert_allclose(kp.onnx_predict(full["path"], xv), want, atol=1e-5)
    # With VNNI the full-range file runs fused.
    _pretend_cpu(monkeypatch, {"avx2", "avx512_vnni"})
    assert level(full["path"]) != basic


def test_reduce_range_argument_errors(trained, data, tmp_path):
    (x, _), _ = data
    with pytest.raises(TypeError, match="`reduce_range` must be True, False or None"):
        kp.export_onnx(trained, tmp_path / "m.onnx", "int8", representative_data=x, reduce_range=1)
    with pytest.raises(ValueError, match="`reduce_range` goes with quantization='dynamic' or"):
        kp.export_onnx(trained, tmp_path / "m.onnx", reduce_range=True)
    assert not (tmp_path / "m.onnx").exists()


# -- issue 41: the inference report's accuracy and agreement, as Keras' metrics count ----------
def _tabular(n=300, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, rng


def _report(model, x, y=None, formats=("keras", "onnx")):
    r = kp.inference_report(model, x, y, batch_sizes=(8,), formats=list(formats), repeats=1)
    return {row["format"]: row for row in r.rows}


@pytest.mark.slow
def test_inference_report_accuracy_of_a_sigmoid_binary_classifier_is_keras():
    # Regression (issue 41): a 1-unit sigmoid output gave the share of label 0 (argmax of one
    # column is always 0): 0.441 where `evaluate` said 0.848.
    x, _ = _tabular()
    y = (x[:, 0] + 0.3 * x[:, 1] > 0.4).astype("int64")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(0.05), "binary_crossentropy", metrics=["accuracy"])
    model.fit(x, y, epochs=20, verbose=0)
    expected = model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"]
    assert expected > 0.8 and abs(expected - (y == 0).mean()) > 0.05
    rows = _report(model, x, y)
    assert rows["keras"]["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert rows["onnx"]["accuracy"] == pytest.approx(expected, abs=1e-6)
    # Agreement: share of examples thresholded (0.5) to the class the Keras model gives.
    assert rows["onnx"]["agreement"] == 1.0
    # Labels as an (n, 1) column, as Keras takes them for this model: the same number.
    assert _report(model, x, y[:, None], ["keras"])["keras"]["accuracy"] == pytest.approx(
        expected, abs=1e-6
    )


def test_inference_report_agreement_of_a_one_unit_logits_output_cuts_at_zero():
    # A Dense(1) trained with BinaryCrossentropy(from_logits=True) outputs logits: its class
    # is logit > 0, so `agreement` (the share given the Keras model's class) cuts there; it
    # cut at 0.5 (an int8 file read 0.986 where its classes all agreed). `accuracy` stays
    # Keras' "accuracy", whose BinaryAccuracy cuts logits at 0.5 too (docs/differences.md).
    from keras_perf.export._inference_report import _agreement, _binary_threshold

    x, _ = _tabular()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile("adam", keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
    logits = model.predict(x, verbose=0)
    y = (logits[:, 0] > 0).astype("int64")  # the model's own classes
    assert 0.1 < np.mean((logits > 0) != (logits > 0.5))  # the two cuts differ here
    assert _binary_threshold(model) == 0.0
    moved = logits + np.where(logits > 0, 0.4, -0.4)  # across 0.5 in places, never across 0
    assert _agreement(moved, logits, "binary", 0.0) == 1.0
    assert _agreement(moved, logits, "binary", 0.5) < 0.95
    expected = model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"]
    assert _report(model, x, y, ["keras"])["keras"]["accuracy"] == pytest.approx(expected)
    sigmoid = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1, activation="sigmoid")])
    sigmoid.compile("adam", "binary_crossentropy")
    assert _binary_threshold(sigmoid) == 0.5


def test_inference_report_accuracy_of_integer_labels_in_a_column_is_keras():
    # Regression (issue 41): integer labels of shape (n, 1) were all read as class 0.
    x, rng = _tabular()
    y = rng.integers(0, 3, size=(len(x), 1))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile("adam", LOSS, metrics=["accuracy"])
    expected = model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"]
    rows = _report(model, x, y)
    assert rows["keras"]["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert rows["onnx"]["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert _report(model, x, y[:, 0], ["keras"])["keras"]["accuracy"] == pytest.approx(expected)
    one_hot = np.eye(3)[y[:, 0]]  # CategoricalAccuracy: the same count
    assert _report(model, x, one_hot, ["keras"])["keras"]["accuracy"] == pytest.approx(expected)


@pytest.mark.slow
def test_inference_report_agreement_of_a_regression_is_the_max_abs_difference(tmp_path):
    # Regression (issue 41): several continuous outputs got an argmax share (0.992 where the
    # largest difference was 0.025); the docs promise the max abs difference.
    x, _ = _tabular()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, "relu"), keras.layers.Dense(3)]
    )
    model.compile("adam", "mse")
    rows = _report(model, x, formats=["keras", "onnx-int8"])
    assert rows["keras"]["agreement"] == 0.0
    kp.export_onnx(model, tmp_path / "m.onnx", "int8", representative_data=x[:200])
    diff = np.abs(kp.onnx_predict(tmp_path / "m.onnx", x) - model.predict(x, verbose=0)).max()
    assert 0 < rows["onnx-int8"]["agreement"] == pytest.approx(diff, rel=1e-5)


def test_inference_report_argument_errors_before_any_work():
    x, rng = _tabular(32)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="`formats` is empty"):
        kp.inference_report(model, x, formats=[])
    with pytest.raises(TypeError, match="`pause` must be a number"):
        kp.inference_report(model, x, pause="x")
    with pytest.raises(ValueError, match="`pause` must be in"):
        kp.inference_report(model, x, pause=-1)
    with pytest.raises(ValueError, match=r"`y` must hold one label per example of `x` \(32\)"):
        kp.inference_report(model, x, np.zeros(5))
    with pytest.raises(TypeError, match="`y` must be one array of labels"):
        kp.inference_report(model, x, {"out": np.zeros(32)})
    with pytest.raises(ValueError, match=r"`y` has shape \(32, 4\)"):
        kp.inference_report(model, x, np.zeros((32, 4)))


def _dict_model():
    a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Concatenate()([a, b])
    return keras.Model(
        {"a": a, "b": b}, {"p": keras.layers.Dense(3)(h), "q": keras.layers.Dense(1)(h)}
    )


def test_dict_input_and_output_model_exports_and_predicts_as_keras(tmp_path):
    # Issue 41: a dict-input model was called with a list (Keras warns), a dict `x` missing an
    # input was a KeyError, and `onnx_predict` returned a list where Keras and
    # `tflite_predict` return a dict keyed by output name.
    keras.utils.set_random_seed(0)
    model = _dict_model()
    rng = np.random.default_rng(0)
    x = {
        "a": rng.normal(size=(40, 4)).astype("float32"),
        "b": rng.normal(size=(40, 2)).astype("float32"),
    }
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kp.export_onnx(model, tmp_path / "m.onnx")
        r = kp.inference_report(model, x, batch_sizes=(4,), formats=["keras", "onnx"], repeats=1)
    assert not [w for w in caught if "expected structure" in str(w.message)]  # called with its dict
    assert report["input_order"] == ["a", "b"]
    out, ref = kp.onnx_predict(tmp_path / "m.onnx", x), model.predict(x, verbose=0)
    assert isinstance(out, dict) and sorted(out) == ["p", "q"]
    for k in ref:
        np.testing.assert_allclose(out[k], ref[k], atol=1e-5)
    assert [row["agreement"] for row in r.rows][1] < 1e-5  # regression outputs: max abs diff
    with pytest.raises(ValueError, match=r"`x` is a dict without the model's input\(s\) \['b'\]"):
        kp.inference_report(model, {"a": x["a"]}, formats=["keras"])
    with pytest.raises(ValueError, match="give exactly those keys"):
        kp.onnx_predict(tmp_path / "m.onnx", {"a": x["a"]})


def test_onnx_predict_of_a_file_that_is_not_onnx_is_a_value_error(tmp_path):
    # Regression (issue 41): protobuf's DecodeError.
    path = tmp_path / "m.onnx"
    path.write_text("hello, not a model")
    with pytest.raises(ValueError, match="is not an ONNX model ONNX Runtime can load"):
        kp.onnx_predict(path, np.zeros((1, 4), "float32"))


def test_constant_calibration_data_is_refused(tmp_path):
    # Issue 41: all-zero calibration data wrote an int8 file agreeing on 0-17 %.
    x, _ = _tabular(64)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"`representative_data` is constant.*all 0"):
        kp.export_onnx(model, tmp_path / "m.onnx", "int8", representative_data=np.zeros_like(x))
    assert not (tmp_path / "m.onnx").exists()
    with pytest.raises(ValueError, match="is constant"):
        kp.inference_report(
            model, x, formats=["onnx-int8"], representative_data=np.ones_like(x), repeats=1
        )
    a, b = keras.Input((6,), name="a"), keras.Input((2,), name="mask")
    two = keras.Model([a, b], keras.layers.Dense(3)(keras.layers.Concatenate()([a, b])))
    with pytest.warns(kp.KerasPerfWarning, match=r"constant for input 1 \('mask'\) \(all 1\)"):
        kp.export_onnx(
            two, tmp_path / "two.onnx", "int8", representative_data=[x, np.ones((64, 2), "float32")]
        )
    assert (tmp_path / "two.onnx").exists()


def _normalized_model(x):
    norm = keras.layers.Normalization()
    norm.adapt(x)
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((x.shape[1],)), norm, keras.layers.Dense(3)])


def test_adapted_normalization_exports_its_statistics_as_constants(tmp_path):
    # Regression (issue 41): on TensorFlow the mean and variance were required graph inputs
    # (onnx_predict refused the file, "int8" failed with ORT's "Required inputs ... missing").
    x, _ = _tabular(200)
    x = x * 3 + 1
    model = _normalized_model(x)
    ref = model.predict(x, verbose=0)
    report = kp.export_onnx(model, tmp_path / "m.onnx")
    assert [i["name"] for i in report["inputs"]] == report["input_order"]
    assert len(report["inputs"]) == 1
    np.testing.assert_allclose(kp.onnx_predict(tmp_path / "m.onnx", x), ref, atol=1e-4)
    kp.export_onnx(model, tmp_path / "m8.onnx", "int8", representative_data=x)
    assert np.abs(kp.onnx_predict(tmp_path / "m8.onnx", x) - ref).max() < 0.05 * np.abs(ref).max()
    assert not isinstance(model.layers[0].mean, np.ndarray)  # The layer got its tensors back.


@pytest.mark.backends("tensorflow")
def test_a_graph_needing_inputs_the_model_lacks_is_refused(tmp_path, monkeypatch):
    # The safety net under the fold: a captured tensor the exporter made a graph input.
    import contextlib

    monkeypatch.setattr(
        _onnx_export, "_constant_statistics", lambda model: contextlib.nullcontext()
    )
    x, _ = _tabular(50)
    with pytest.raises(ValueError, match=r"needs 2 input\(s\) the model does not have"):
        kp.export_onnx(_normalized_model(x), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_qat_model_under_mixed_bfloat16_is_refused_with_the_fix(tmp_path):
    # Regression (issue 41): a raw converter error blaming an op (tf2onnx: a bfloat16 Conv
    # input; TFLite: 'tfl.mul' operands of two types).
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        qat = kp.quantize_aware(models.mlp([8], 6, 3))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    with pytest.raises(
        ValueError, match=r"export_onnx of a quantization-aware.*mixed_bfloat16.*set_weights"
    ):
        kp.export_onnx(qat, tmp_path / "q.onnx", "int8")
    with pytest.raises(
        ValueError, match=r"export_tflite of a quantization-aware.*set_global_policy"
    ):
        kp.export_tflite(qat, tmp_path / "q.tflite", "int8")
    assert not list(tmp_path.iterdir())


def test_agreement_follows_the_kind_of_output():
    # Issue 41: agreement is a class share for a classifier, the max abs difference otherwise.
    from keras_perf.export._inference_report import _agreement, _output_kind

    def model(units, activation=None, loss=None):
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation=activation)])
        if loss is not None:
            m.compile("sgd", loss)
        return m

    ref = np.array([[0.2, 0.9], [0.7, 0.4], [0.6, 0.1], [0.3, 0.8]], "float32")
    out = ref + np.array([[0.8, 0], [0, 0], [0, 0], [0, 0.02]], "float32")  # row 0 moves class
    assert _output_kind(model(2), ref) == "values"
    assert _agreement(out, ref, "values") == pytest.approx(0.8)
    assert _output_kind(model(2, "softmax"), ref) == "classes"
    assert _output_kind(model(2, loss=LOSS), ref) == "classes"  # logits, crossentropy loss
    assert _agreement(out, ref, "classes") == 0.75
    assert _output_kind(model(2, "sigmoid"), ref) == "binary"  # multi-label: every unit
    assert _agreement(out, ref, "binary") == 0.75
    one = ref[:, :1]
    assert _output_kind(model(1, "sigmoid"), one) == "binary"
    assert _output_kind(model(1, loss="binary_crossentropy"), one) == "binary"
    assert _output_kind(model(1, loss="mse"), one) == "values"
    assert _agreement(one + np.float32([[0.4], [0], [0], [0]]), one, "binary") == 0.75
