"""Channel pruning: groups from the graph, masks during fit, shrink == masked model, errors."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf.channel_pruning import ChannelGraphError, _select
from keras_perf.channel_pruning._graph import ChannelGraph

L = keras.layers
BACKEND = keras.backend.backend()


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


def dense_chain():
    inp = keras.Input((12,))
    x = L.Dense(16, activation="relu", name="d1")(inp)
    x = L.Dense(10, activation="sigmoid", name="d2")(x)
    return keras.Model(inp, L.Dense(3, name="out")(x))


def conv_bn_relu():
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(8, 3, padding="same", use_bias=False, name="c1")(inp)
    x = L.BatchNormalization(name="bn1")(x)
    x = L.ReLU()(x)
    x = L.Conv2D(6, 3, strides=2, name="c2")(x)
    x = L.BatchNormalization(name="bn2")(x)
    x = L.Activation("relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inp, L.Dense(3, name="out")(x))


def residual():
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(8, 3, padding="same", name="stem")(inp)
    x = L.BatchNormalization(name="stem_bn")(x)
    x = L.ReLU()(x)
    y = L.Conv2D(8, 3, padding="same", name="b1")(x)
    y = L.BatchNormalization(name="b1_bn")(y)
    x = L.ReLU()(L.Add(name="add")([x, y]))
    x = L.Conv2D(6, 1, name="head")(x)
    x = L.Flatten()(x)  # exact channel-last mapping into the Dense
    return keras.Model(inp, L.Dense(3, name="out")(x))


def depthwise_separable():
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(8, 3, padding="same", name="c1")(inp)
    x = L.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="dw")(x)
    x = L.BatchNormalization(name="dw_bn")(x)
    x = L.SeparableConv2D(6, 3, padding="same", name="sep")(x)
    x = L.MaxPooling2D()(x)
    x = L.GlobalMaxPooling2D()(x)
    return keras.Model(inp, L.Dense(3, name="out")(x))


def concatenate():
    inp = keras.Input((8, 8, 3))
    a = L.Conv2D(4, 3, padding="same", name="a")(inp)
    b = L.Conv2D(6, 1, name="b")(inp)
    c = L.Conv2D(10, 1, name="c")(inp)
    x = L.Add(name="add")([L.Concatenate(name="cat")([a, b]), c])
    x = L.Conv2D(5, 1, name="mix")(x)
    x = L.GlobalAveragePooling2D()(x)
    return keras.Model(inp, L.Dense(3, name="out")(x))


def nested():
    inner_in = keras.Input((8, 8, 4))
    y = L.Conv2D(6, 3, padding="same", name="inner_conv")(inner_in)
    y = L.BatchNormalization(name="inner_bn")(y)
    block = keras.Model(inner_in, L.ReLU()(y), name="block")
    seq = keras.Sequential([keras.Input((6,)), L.Dense(7, name="seq_dense")], name="seq")
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(4, 1, name="c1")(inp)
    x = block(x)
    x = L.GlobalAveragePooling2D()(x)
    x = seq(x)
    return keras.Model(inp, L.Dense(3, name="out")(x))


def sequential():
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            L.Conv2D(8, 3, name="c1"),
            L.BatchNormalization(name="bn1"),
            L.ReLU(),
            L.Flatten(),
            L.Dense(12, activation="relu", name="d1"),
            L.Dropout(0.1),
            L.Dense(3, name="out"),
        ]
    )


MODELS = {
    "dense_chain": dense_chain,
    "conv_bn_relu": conv_bn_relu,
    "residual": residual,
    "depthwise_separable": depthwise_separable,
    "concatenate": concatenate,
    "nested": nested,
    "sequential": sequential,
}


def data(model, n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *model.inputs[0].shape[1:])).astype("float32")
    y = rng.normal(size=(n, 3)).astype("float32")
    return x, y


def pruned(model, sparsity=0.5, lr=1e-2, **kwargs):
    model.compile(keras.optimizers.Adam(lr), "mse")
    x, y = data(model)
    cb = kp.ChannelPruningCallback(kp.ConstantSparsity(sparsity, 0, frequency=2), **kwargs)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[cb], verbose=0)
    return cb


def predict(model, x):
    return keras.ops.convert_to_numpy(model(x, training=False))


# --------------------------------------------------------------------------------------------
# shrink == masked model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shrink_equals_masked_model(name):
    model = MODELS[name]()
    cb = pruned(model)
    assert cb.removed, "the schedule removed no channel"
    small = kp.shrink(model)
    assert type(small) is type(model)
    assert small.count_params() < model.count_params()
    x, _ = data(model, n=16, seed=1)
    np.testing.assert_allclose(predict(small, x), predict(model, x), atol=1e-5, rtol=1e-5)
    report = kp.channel_report(model)
    assert report["total"]["params_after"] == small.count_params()
    assert report["total"]["params_before"] == model.count_params()
    # Shrunk layers keep their names.
    assert {w.path.split("/")[-2] for w in small.weights} == {
        w.path.split("/")[-2] for w in model.weights
    }


def test_residual_group_loses_the_same_channels_and_bn_output_is_zero():
    model = residual()
    cb = pruned(model)
    group = next(g for g in cb.graph.groups if "stem" in g.names)
    assert sorted(group.names) == ["b1", "stem"]
    dead = []
    for name in ("stem", "b1"):
        kernel, bias = model.get_layer(name).get_weights()
        dead.append(np.nonzero(~kernel.any(axis=(0, 1, 2)) & (bias == 0))[0].tolist())
    assert dead[0] == dead[1] and len(dead[0]) == 4
    for name in ("stem_bn", "b1_bn"):
        gamma, beta, *_ = model.get_layer(name).get_weights()
        assert not gamma[dead[0]].any() and not beta[dead[0]].any()
    # Consumers' input slices are zero too: b1 and head read the pruned channels.
    assert not model.get_layer("b1").get_weights()[0][:, :, dead[0], :].any()
    assert not model.get_layer("head").get_weights()[0][:, :, dead[0], :].any()
    # The BN output of a masked channel is exactly 0, in training and in inference.
    x, _ = data(model, n=4)
    probe = keras.Model(model.input, model.get_layer("b1_bn").output)
    for training in (False, True):
        out = keras.ops.convert_to_numpy(probe(x, training=training))
        assert not out[..., dead[0]].any()
    # Flatten -> Dense: the rows of pruned `head` channels (channel-last order) are zero.
    head_dead = np.nonzero(~model.get_layer("head").get_weights()[0].any(axis=(0, 1, 2)))[0]
    rows = model.get_layer("out").get_weights()[0].reshape(-1, 6, 3)
    assert len(head_dead) == 3 and not rows[:, head_dead, :].any()


def test_nothing_outside_the_group_changes():
    model = concatenate()
    model.compile(keras.optimizers.SGD(0.0), "mse")  # lr 0: only the masks change weights
    before = {w.path: keras.ops.convert_to_numpy(w.value) for w in model.weights}
    x, y = data(model)
    cb = kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, 0), include=["mix"])
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[cb], verbose=0)
    changed = {
        w.path.split("/")[-2]
        for w in model.weights
        if not np.array_equal(keras.ops.convert_to_numpy(w.value), before[w.path])
    }
    assert changed == {"mix", "out"}  # the producer and its consumer's input rows
    assert len(cb.removed) == 3 and cb.sparsity == pytest.approx(3 / 5)  # keeps round(2.5)


def test_concatenate_and_add_couple_three_producers():
    graph = ChannelGraph(concatenate())
    group = next(g for g in graph.groups if "a" in g.names)
    assert sorted(group.names) == ["a", "b", "c"]
    assert len(group.channels) == 10  # c's 10 channels, each tied to one of a's or b's


def test_global_scope_normalises_importance_per_group():
    model = dense_chain()
    model.build((None, 12))
    graph = ChannelGraph(model)
    _select.resolve(graph)
    groups = [g for g in graph.groups if g.selected]
    imp = _select.channel_importance(graph, groups, "l2")
    scores = sorted(
        (imp[c] / np.mean([imp[k] for k in g.channels]), c) for g in groups for c in g.channels
    )
    n = sum(len(g.channels) for g in groups)
    expected = {c for _, c in scores[: n - round(n * 0.6)]}
    assert _select.choose(graph, 0.4, "l2", "global") == expected
    # L2: per weight, the norm of the channel's slice; summed over the group's weights.
    k1 = model.get_layer("d1").kernel.numpy() if BACKEND == "tensorflow" else None
    if k1 is not None:
        k2 = model.get_layer("d2").kernel.numpy()
        c = int(graph.channel_of[graph.infos[0].out_slots[0]])
        np.testing.assert_allclose(
            imp[c], np.linalg.norm(k1[:, 0]) + np.linalg.norm(k2[0, :]), rtol=1e-6
        )


def test_floor_keeps_one_channel_per_producer():
    model = dense_chain()
    cb = pruned(model, sparsity=0.99)
    small = kp.shrink(model)
    assert small.get_layer("d1").units == 1 and small.get_layer("d2").units == 1
    x, _ = data(model, n=8)
    np.testing.assert_allclose(predict(small, x), predict(model, x), atol=1e-5)
    assert cb.sparsity == pytest.approx(24 / 26)


# --------------------------------------------------------------------------------------------
# include / exclude and the report
# --------------------------------------------------------------------------------------------


def test_excluding_one_member_keeps_the_whole_group():
    model = residual()
    cb = pruned(model, exclude=["b1"])
    group = next(g for g in cb.graph.groups if "stem" in g.names)
    assert not group.selected
    assert model.get_layer("stem").get_weights()[0].any(axis=(0, 1, 2)).all()
    assert kp.shrink(model).get_layer("stem").filters == 8
    report = kp.channel_report(model, exclude=["b1"])
    row = next(g for g in report["groups"] if "stem" in g["producers"])
    assert row["prunable"] is False
    assert "b1" in row["reason"] and "coupled with ['stem']" in row["reason"]
    out = next(g for g in report["groups"] if g["producers"] == ["out"])
    assert "model output" in out["reason"]


def test_channel_report_is_exact_on_a_hand_counted_model():
    inp = keras.Input((6, 6, 2))
    x = L.Conv2D(4, 3, name="conv")(inp)  # out 4x4x4: params 3*3*2*4 + 4 = 76
    x = L.BatchNormalization(name="bn")(x)  # 4 * 4 = 16
    x = L.Flatten()(x)  # 64
    model = keras.Model(inp, L.Dense(5, name="out")(x))  # 64*5 + 5 = 325
    kernel, bias = model.get_layer("conv").get_weights()
    kernel[..., [1, 3]] = 0
    bias[[1, 3]] = 0
    model.get_layer("conv").set_weights([kernel, bias])
    gamma, beta, mean, var = model.get_layer("bn").get_weights()
    gamma[[1, 3]], beta[[1, 3]] = 0, 0
    model.get_layer("bn").set_weights([gamma, beta, mean, var])
    k, b = model.get_layer("out").get_weights()
    k = k.reshape(16, 4, 5)
    k[:, [1, 3], :] = 0
    model.get_layer("out").set_weights([k.reshape(64, 5), b])
    report = kp.channel_report(model)
    rows = {r["name"]: r for r in report["layers"]}
    assert rows["conv"]["channels_before"] == 4 and rows["conv"]["channels_after"] == 2
    assert (rows["conv"]["params_before"], rows["conv"]["params_after"]) == (76, 38)
    assert (rows["bn"]["params_before"], rows["bn"]["params_after"]) == (16, 8)
    assert (rows["out"]["params_before"], rows["out"]["params_after"]) == (325, 165)
    # MACs: conv 16 pixels * 3*3*2*4 = 1152 -> 576; dense 64*5 = 320 -> 160.
    assert (rows["conv"]["macs_before"], rows["conv"]["macs_after"]) == (1152, 576)
    assert (rows["out"]["flops_before"], rows["out"]["flops_after"]) == (640, 320)
    assert report["total"]["params_after"] == 38 + 8 + 165
    assert report["total"]["flops_after"] == 2 * (576 + 160)
    assert kp.shrink(model).count_params() == 211


# --------------------------------------------------------------------------------------------
# save / load / export
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_shrunk_model_loads_without_keras_perf(tmp_path):
    model = residual()
    pruned(model)
    small = kp.shrink(model)
    path = tmp_path / "small.keras"
    small.save(path)
    x, _ = data(model, n=4)
    np.save(tmp_path / "x.npy", x)
    code = (
        "import sys, numpy as np, keras\n"
        f"m = keras.saving.load_model({str(path)!r})\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, keras.ops.convert_to_numpy("
        f"m(np.load({str(tmp_path / 'x.npy')!r}))))\n"
        "assert not any(k.startswith('keras_perf') for k in sys.modules)\n"
    )
    env = dict(os.environ, KERAS_BACKEND=BACKEND, PYTHONPATH="")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), predict(model, x), atol=1e-5)


@pytest.mark.backends("tensorflow")
def test_shrunk_model_exports_to_tflite(tmp_path):
    model = residual()
    pruned(model)
    small = kp.shrink(model)
    kp.export_tflite(small, tmp_path / "small.tflite")
    x, _ = data(model, n=4)
    out = kp.tflite_predict(tmp_path / "small.tflite", x)
    np.testing.assert_allclose(out, predict(model, x), atol=1e-4)


# --------------------------------------------------------------------------------------------
# what the walk cannot follow, bad arguments
# --------------------------------------------------------------------------------------------


def lambda_model():
    inp = keras.Input((10,))
    x = L.Dense(8, name="d1")(inp)
    x = L.Lambda(lambda t: t * 2.0, name="double")(x)
    return keras.Model(inp, L.Dense(3, name="out")(x))


def raw_ops_model():
    inp = keras.Input((10,))
    x = L.Dense(8, name="d1")(inp)
    x = keras.ops.flip(x, axis=-1)
    return keras.Model(inp, L.Dense(3, name="out")(x))


def shared_model():
    inp = keras.Input((10,))
    d = L.Dense(8, name="d1")
    shared = L.Dense(8, name="shared")
    x = L.Add()([shared(d(inp)), shared(L.Dense(8, name="d0")(inp))])
    return keras.Model(inp, L.Dense(3, name="out")(x))


def concat_off_axis():
    inp = keras.Input((4, 6))
    a = L.Dense(8, name="a")(inp)
    b = L.Dense(8, name="b")(inp)
    x = L.Concatenate(axis=1)([a, b])
    return keras.Model(inp, L.Dense(3, name="out")(L.Flatten()(x)))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda_model, r"Lambda 'double'.*exclude=\['d1'\]"),
        (raw_ops_model, r"raw `keras.ops`.*exclude=\['d1'\]"),
        (shared_model, r"'shared' is shared.*exclude="),
        (concat_off_axis, r"along axis 1, not the channel axis.*exclude=\['a', 'b'\]"),
    ],
)
def test_what_the_walk_cannot_follow_is_a_clear_error(build, match):
    model = build()
    model.compile("adam", "mse")
    x = np.zeros((8, *model.inputs[0].shape[1:]), "float32")
    before = [keras.ops.convert_to_numpy(w.value) for w in model.weights]
    cb = kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, 0))
    with pytest.raises(ValueError, match=match):
        model.fit(x, np.zeros((8, 3)), callbacks=[cb], verbose=0)
    after = [keras.ops.convert_to_numpy(w.value) for w in model.weights]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # no step ran


def test_excluding_the_producer_of_an_unfollowable_layer_works():
    model = lambda_model()
    pruned(model, exclude=["d1"])  # nothing left to prune, no error
    small = kp.shrink(model)
    x, _ = data(model, n=4)
    np.testing.assert_allclose(predict(small, x), predict(model, x), atol=1e-6)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.d = L.Dense(4)

    def call(self, x):
        return self.d(x)


def test_subclassed_model_is_a_clear_error():
    model = Subclassed()
    model(np.zeros((1, 3), "float32"))
    with pytest.raises(ValueError, match="subclassed model hides its graph"):
        kp.shrink(model)
    with pytest.raises(ValueError, match="Functional or Sequential"):
        kp.channel_report(model)


def test_graph_errors_are_channel_graph_errors_and_bad_arguments_are_not():
    # What the walk cannot follow, and a model whose graph is hidden, raise the documented
    # ChannelGraphError (a ValueError); a bad argument stays a plain ValueError.
    assert issubclass(ChannelGraphError, ValueError)
    assert kp.channel_pruning.ChannelGraphError is ChannelGraphError
    with pytest.raises(ChannelGraphError, match="Lambda 'double'"):
        pruned(lambda_model())
    model = Subclassed()
    model(np.zeros((1, 3), "float32"))
    for fn in (kp.shrink, kp.channel_report):
        with pytest.raises(ChannelGraphError, match="subclassed model hides its graph"):
            fn(model)
    with pytest.raises(ValueError, match="names no producer") as info:
        pruned(dense_chain(), include=["nope"])
    assert not isinstance(info.value, ChannelGraphError)


def test_public_names_are_the_functions_and_classes():
    # `keras_perf.channel_pruning.shrink` named both the function and the module `shrink.py`
    # (`import keras_perf.channel_pruning.shrink` gave the module); the parts are private now.
    import importlib

    import keras_perf.channel_pruning as cp

    for part in ("shrink", "callback", "report"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"keras_perf.channel_pruning.{part}")
    assert cp.shrink is kp.shrink and cp.shrink.__name__ == "shrink"
    assert cp.channel_report is kp.channel_report
    assert cp.ChannelPruningCallback is kp.ChannelPruningCallback
    name = keras.saving.get_registered_name(cp.ChannelPruningCallback)
    assert name == "keras_perf>ChannelPruningCallback"


def test_softmax_and_layer_norm_keep_their_group():
    inp = keras.Input((10,))
    x = L.Dense(8, name="d1")(inp)
    x = L.LayerNormalization(name="ln")(x)
    x = L.Dense(6, activation="softmax", name="d2")(x)
    model = keras.Model(inp, L.Dense(3, name="out")(x))
    reasons = {g["producers"][0]: g["reason"] for g in kp.channel_report(model)["groups"]}
    assert "LayerNormalization 'ln'" in reasons["d1"]
    assert "softmax" in reasons["d2"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"schedule": 0.5}, TypeError, "`schedule` must be"),
        ({"importance": "l3"}, ValueError, "`importance` must be one of 'l2', 'l1'"),
        ({"scope": "model"}, ValueError, "`scope` must be one of"),
        ({"exclude": [3]}, TypeError, "`exclude` items must be"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"schedule": kp.ConstantSparsity(0.5), **kwargs}
    with pytest.raises(error, match=match):
        kp.ChannelPruningCallback(**kwargs)


def test_unknown_include_name_is_an_error_before_training():
    model = dense_chain()
    with pytest.raises(ValueError, match=r"`include` item 'nope' names no producer.*'d1'"):
        pruned(model, include=["nope"])


def test_config_round_trip():
    cb = kp.ChannelPruningCallback(
        kp.PolynomialDecay(0.0, 0.5, 0, 10, frequency=2), "l1", "global", exclude=["a"]
    )
    again = kp.ChannelPruningCallback.from_config(cb.get_config())
    assert again.get_config() == cb.get_config()
    assert again.schedule(10) == cb.schedule(10)


def test_second_fit_keeps_the_removed_channels():
    model = dense_chain()
    cb = pruned(model, sparsity=0.5)
    removed = set(cb.removed)
    x, y = data(model)
    cb2 = kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, 1000))  # never due in this fit
    model.fit(x, y, epochs=1, batch_size=8, callbacks=[cb2], verbose=0)
    assert cb2.removed == removed
    kernel = model.get_layer("d1").get_weights()[0]
    assert (~kernel.any(axis=0)).sum() == 8  # still masked after more training
