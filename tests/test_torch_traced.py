"""keras-perf's traced train step on torch (keras_perf/train_step/torch_traced.py) and the
`traced_step` setting of the train step on every backend."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import keras_perf as kp

torch_only = pytest.mark.backends("torch")
N, BATCH = 100, 32  # a short last batch of 4: a second input signature


def _traced():
    from keras_perf.train_step import torch_traced

    return torch_traced


def torch_ops():
    import torch

    return torch.ops


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, *shape)).astype("float32"), rng.integers(0, 3, N)


def _mlp():
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )


def _cnn():
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            L.Conv2D(4, 3, use_bias=False),
            L.BatchNormalization(),
            L.ReLU(),
            L.MaxPooling2D(),
            L.Flatten(),
            L.Dense(3),
        ]
    )


class _Sub(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.hidden(x) * 2.0)


class _Branchy(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(3)

    def call(self, x):
        h = self.a(x)
        if keras.ops.convert_to_numpy(keras.ops.sum(x)) > 0:  # control flow on a value
            return h * 2.0
        return h


def _compiled(make, metrics=("accuracy",), optimizer=None, seed=1):
    keras.utils.set_random_seed(seed)
    model = make()
    model.compile(
        optimizer or keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


def _pair(make, x, y, epochs=2, install=True, **compile_kw):
    """(plain history, traced history, plain model, traced model) after the same fits."""
    plain, traced = _compiled(make, **compile_kw), _compiled(make, **compile_kw)
    if install:
        _traced().install_traced_step(traced)
    h1 = plain.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    h2 = traced.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return h1.history, h2.history, plain, traced


def _close(a, b, atol=1e-5):
    for u, v in zip(keras.tree.flatten(a), keras.tree.flatten(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=atol, rtol=1e-5)


def _same(h1, h2, m1, m2, atol=1e-5):
    assert h1.keys() == h2.keys()
    for k in h1:
        np.testing.assert_allclose(h1[k], h2[k], atol=atol, rtol=1e-5, err_msg=k)
    _close(m1.get_weights(), m2.get_weights(), atol)
    _close([v.numpy() for v in m1.optimizer.variables], [v.numpy() for v in m2.optimizer.variables])


@torch_only
def test_sequential_mlp_matches_keras_fit_with_a_short_last_batch():
    x, y = _data((6,))
    h1, h2, m1, m2 = _pair(_mlp, x, y)
    _same(h1, h2, m1, m2)
    state = _traced().traced_step_state(m2)
    assert state["active"] and state["reason"] is None
    assert state["signatures"] == 2  # the full batches and the short last one


@torch_only
@pytest.mark.slow
def test_cnn_with_batchnorm_matches_keras_fit_moving_statistics_included():
    x, y = _data((8, 8, 1))
    h1, h2, m1, m2 = _pair(_cnn, x, y)
    _same(h1, h2, m1, m2)
    bn1, bn2 = m1.layers[1], m2.layers[1]
    assert not np.allclose(bn2.moving_mean.numpy(), 0.0)  # the step wrote them back
    _close(bn1.non_trainable_weights, bn2.non_trainable_weights)
    _close(m1.predict(x, verbose=0), m2.predict(x, verbose=0))


def _images(rank):
    """Convolutions and poolings of every kind on `rank`-D images (channels-last, as Keras)."""
    L = keras.layers
    if rank == 1:
        return [keras.Input((16, 3)), L.Conv1D(4, 3, activation="relu"), L.MaxPooling1D(),
                L.AveragePooling1D(2), L.Flatten(), L.Dense(3)]  # fmt: skip
    if rank == 2:
        return [keras.Input((16, 16, 3)), L.Conv2D(4, 3, padding="same", activation="relu"),
                L.MaxPooling2D(), L.AveragePooling2D(2, padding="same"), L.DepthwiseConv2D(3),
                L.SeparableConv2D(4, 2), L.Conv2DTranspose(3, 2, strides=2),
                L.GlobalAveragePooling2D(), L.Dense(3)]  # fmt: skip
    return [keras.Input((6, 6, 6, 2)), L.Conv3D(4, 3, activation="relu"), L.MaxPooling3D(),
            L.Flatten(), L.Dense(3)]  # fmt: skip


@torch_only
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_images_are_not_copied_to_channels_first_and_train_as_keras_fit(rank):
    # Keras' torch backend copies every image to channels-first memory before a convolution
    # or a pooling (and its convolution copies it back); the traced step hands them a view:
    # 2.5x faster on a small CNN (docs/accelerate.md). The weights stay Keras' (the same
    # convolutions run; the poolings and ReLU gradients read the other layout).
    def make():
        return keras.Sequential(_images(rank))

    shape = make().input_shape[1:]
    x, y = _data(shape)
    h1, h2, m1, m2 = _pair(make, x, y)
    _same(h1, h2, m1, m2)
    assert _traced().traced_step_state(m2)["active"]
    graphs = [graph for graph, _ in m2.__dict__["_kp_traced_step"].cache.values()]
    reads = {}  # op -> whether its image is in channels-last memory (channels the fastest)
    for graph in graphs:
        for node in graph.graph.nodes:
            name = str(node.target)
            if ("pool" in name or "convolution" in name) and "backward" not in name:
                if rank > 1 or "convolution" in name:  # torch pools 1-D images as 2-D copies
                    image = node.args[0].meta["val"]
                    reads.setdefault(name, set()).add(image.stride()[1] == 1)
    assert len(reads) == {1: 1, 2: 3, 3: 2}[rank], reads  # convolutions and the poolings
    assert all(v == {True} for v in reads.values()), reads


@torch_only
def test_functional_dict_input_model_matches_keras_fit():
    def make():
        a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
        h = keras.layers.Concatenate()([keras.layers.Dense(8, activation="relu")(a), b])
        return keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(h))

    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(N, 4)).astype("float32"), "b": rng.normal(size=(N, 2))}
    x["b"] = x["b"].astype("float32")
    y = rng.integers(0, 3, N)
    _same(*_pair(make, x, y))


@torch_only
def test_dict_output_model_matches_keras_fit():
    # Regression: the metrics got `y_pred.detach()` and a dict of outputs has no `detach`, so
    # a multi-output model fell back ("'dict' object has no attribute 'detach'").
    def make():
        a = keras.Input((6,), name="a")
        h = keras.layers.Dense(8, activation="relu")(a)
        return keras.Model(a, {"c": keras.layers.Dense(3)(h), "r": keras.layers.Dense(1)(h)})

    x, y = _data((6,))
    y = {"c": y, "r": x[:, :1].copy()}
    loss = {"c": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "r": "mse"}
    plain, traced = (_compiled(make) for _ in range(2))
    for m in (plain, traced):
        m.compile(keras.optimizers.Adam(1e-2), loss, metrics={"c": ["accuracy"], "r": ["mae"]})
    _traced().install_traced_step(traced)
    h1 = plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    h2 = traced.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert _traced().traced_step_state(traced)["active"]
    _same(h1.history, h2.history, plain, traced)


@torch_only
def test_loss_scaled_keeps_an_installed_traced_step():
    # `kp.fit_with_oom_retry`'s micro-batching rung wraps an accelerated model this way.
    model = _compiled(_mlp)
    _traced().install_traced_step(model, inductor=True)
    assert kp.loss_scaled(model).traced_step == "inductor"
    _traced().install_traced_step(model)
    assert kp.loss_scaled(model, microbatches=2).traced_step is True
    assert kp.loss_scaled(model, traced_step=False).traced_step is False
    model.compile("adam", "mse")  # compiled again: Keras' own step, nothing to keep
    assert kp.loss_scaled(model).traced_step is False
    assert kp.loss_scaled(_compiled(_mlp)).traced_step is False


@torch_only
def test_subclassed_model_matches_keras_fit():
    x, y = _data((6,))
    _same(*_pair(_Sub, x, y))


@torch_only
def test_recurrent_layers_train_as_keras_fit_with_their_inputs_gradients_stacked():
    # Keras' recurrent layers on torch's CPU read their inputs one time step at a time, and the
    # gradient of each read is a zero tensor as large as the whole input: the traced step
    # stacks the per-step gradients instead of summing T such tensors (LSTM epoch 0.091 ->
    # 0.065 s here, docs/accelerate.md), with the same weights.
    L = keras.layers

    def make():
        inp = keras.Input((7, 4))
        h = L.LSTM(6, return_sequences=True)(inp)
        h = L.GRU(5, return_sequences=True)(h)
        return keras.Model(inp, L.Dense(3)(L.SimpleRNN(4)(h)))

    x = np.random.default_rng(0).normal(size=(N, 7, 4)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, N)
    h1, h2, m1, m2 = _pair(make, x, y)
    _same(h1, h2, m1, m2)
    assert _traced().traced_step_state(m2)["active"]
    graphs = [graph for graph, _ in m2.__dict__["_kp_traced_step"].cache.values()]
    nodes = [node for graph in graphs for node in graph.graph.nodes]
    per_step = [  # gradients of one time step of a (time, batch, features) sequence
        list(n.args[1])
        for n in nodes
        if n.target is torch_ops().aten.select_backward.default
        and len(n.args[1]) == 3
        and n.args[1][0] == 7
    ]
    assert per_step == []
    assert any(n.target is torch_ops().aten.stack.default for n in nodes)


@torch_only
@pytest.mark.slow
def test_a_sequence_longer_than_pythons_recursion_limit_keeps_the_traced_step():
    # Regression: the pass that stacks the per-step gradients walked their sum recursively,
    # and a 1,100-step LSTM fell back to Keras' step with a RecursionError.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1100, 2)), keras.layers.LSTM(3), keras.layers.Dense(2)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    _traced().install_traced_step(model)
    x = np.random.default_rng(0).normal(size=(8, 1100, 2)).astype("float32")
    model.fit(x, np.zeros(8, "int32"), batch_size=8, verbose=0)
    state = _traced().traced_step_state(model)
    assert state["active"] and state["reason"] is None, state
    ((graph, _),) = model.__dict__["_kp_traced_step"].cache.values()
    targets = [node.target for node in graph.graph.nodes]
    assert torch_ops().aten.select_backward.default not in targets


@torch_only
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lstm", "attention", "embedding"])
def test_sequence_models_match_keras_fit(kind):
    L = keras.layers
    rng = np.random.default_rng(0)
    if kind == "embedding":
        x = rng.integers(0, 20, (N, 5))

        def make():
            return keras.Sequential(
                [keras.Input((5,), dtype="int32"), L.Embedding(20, 4), L.Flatten(), L.Dense(3)]
            )
    else:
        x = rng.normal(size=(N, 5, 4)).astype("float32")

        def make():
            inp = keras.Input((5, 4))
            if kind == "lstm":
                h = L.LSTM(6)(inp)
            else:
                h = L.GlobalAveragePooling1D()(L.MultiHeadAttention(2, 4)(inp, inp))
            return keras.Model(inp, L.Dense(3)(h))

    y = rng.integers(0, 3, N)
    _same(*_pair(make, x, y))


@torch_only
@pytest.mark.slow
def test_sgd_with_momentum_and_a_schedule_and_regularisers_match():
    def make():
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, kernel_regularizer="l2", activity_regularizer="l1"),
                keras.layers.Dense(3),
            ]
        )

    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 3, 0.5)
    opt = keras.optimizers.SGD(schedule, momentum=0.9, clipnorm=1.0)
    x, y = _data((6,))
    plain, traced = (
        _compiled(make, optimizer=opt),
        _compiled(make, optimizer=keras.optimizers.SGD(schedule, momentum=0.9, clipnorm=1.0)),
    )
    _traced().install_traced_step(traced)
    h1 = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    h2 = traced.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    _same(h1, h2, plain, traced)


@torch_only
def test_a_model_with_control_flow_on_values_falls_back_with_the_reason():
    x, y = _data((6,))
    plain, traced = _compiled(_Branchy), _compiled(_Branchy)
    _traced().install_traced_step(traced)
    h1 = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    with pytest.warns(kp.KerasPerfWarning, match="cannot use keras-perf's traced train step"):
        h2 = traced.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    state = _traced().traced_step_state(traced)
    assert not state["active"] and "tracing the step failed" in state["reason"]
    _same(h1, h2, plain, traced)  # Keras' own step trained it


@torch_only
def test_a_step_that_fell_back_keeps_running_steps_per_execution():
    # Keras' own torch functions refuse steps_per_execution > 1: a step installed with it
    # that fell back runs each batch of an execution plain, in this fit and the next ones.
    x, y = _data((6,))
    plain, traced = _compiled(_Branchy), _compiled(_Branchy)
    _traced().install_traced_step(traced)
    traced.steps_per_execution = 2
    h1 = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    with pytest.warns(kp.KerasPerfWarning, match="cannot use keras-perf's traced train step"):
        traced.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    h2 = traced.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    assert not _traced().traced_step_state(traced)["active"]
    np.testing.assert_allclose(h1["loss"][1], h2["loss"][0], rtol=1e-5)
    _close(plain.get_weights(), traced.get_weights())
    _close(plain.evaluate(x, y, verbose=0), traced.evaluate(x, y, verbose=0))
    _close(plain.predict(x, verbose=0), traced.predict(x, verbose=0))


class _OwnStep(keras.Sequential):
    """A model whose class overrides `train_step` (an extra log, a count of its calls)."""

    calls = 0

    def train_step(self, data):
        type(self).calls += 1
        logs = super().train_step(data)
        logs["extra"] = keras.ops.ones(())
        return logs


@torch_only
def test_a_model_overriding_train_step_keeps_its_own_step_and_says_why():
    # The traced step traces Keras' own step: an override would silently not run (its logs,
    # its side effects). It is refused before any tracing, and the override trains the model.
    def make():
        return _OwnStep([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])

    x, y = _data((6,))
    model = _compiled(make)
    reason = _traced().traced_step_unsupported(model)
    assert reason is not None and "_OwnStep overrides train_step" in reason
    _traced().install_traced_step(model)
    _OwnStep.calls = 0
    with pytest.warns(kp.KerasPerfWarning, match="_OwnStep overrides train_step"):
        h = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history
    assert "extra" in h and _OwnStep.calls == -(-len(x) // BATCH)
    assert not _traced().traced_step_state(model)["active"]


@torch_only
def test_an_optimizer_branching_on_the_step_count_falls_back_with_a_reason_that_says_so():
    # torch's data-dependent guard carries no message: the reason says what it means.
    x, y = _data((6,))
    opt = keras.optimizers.Adam(gradient_accumulation_steps=2)
    model = _compiled(_mlp, optimizer=opt)
    _traced().install_traced_step(model)
    with pytest.warns(kp.KerasPerfWarning, match="tracing the step failed"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    reason = _traced().traced_step_state(model)["reason"]
    assert "gradient_accumulation_steps" in reason and not reason.endswith(": )")


@torch_only
def test_unseeded_dropout_draws_from_torch_and_matches_keras_fit_under_the_same_seed():
    # Keras' unseeded Dropout calls torch's own dropout (torch's global generator); the
    # traced graph draws from it at run time, the same masks in the same order.
    def make():
        return keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(16), keras.layers.Dropout(0.5),
             keras.layers.Dense(3)]
        )  # fmt: skip

    x, y = _data((6,))
    plain, traced = _compiled(make), _compiled(make)
    _traced().install_traced_step(traced)
    keras.utils.set_random_seed(7)
    h1 = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    keras.utils.set_random_seed(7)
    h2 = traced.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    assert _traced().traced_step_state(traced)["active"]
    _same(h1, h2, plain, traced)


@torch_only
def test_seeded_dropout_falls_back_with_the_reason():
    # A seeded Dropout seeds a torch.Generator from its seed tensor's value (Keras' torch
    # random), which a traced graph cannot do.
    def make():
        return keras.Sequential(
            [keras.Input((6,)), keras.layers.Dropout(0.5, seed=3), keras.layers.Dense(3)]
        )

    x, y = _data((6,))
    model = _compiled(make)
    _traced().install_traced_step(model)
    with pytest.warns(kp.KerasPerfWarning, match="tracing the step failed"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert not _traced().traced_step_state(model)["active"]


@torch_only
def test_compiling_again_returns_the_model_to_keras_own_step():
    x, y = _data((6,))
    model = _compiled(_mlp)
    _traced().install_traced_step(model)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert _traced().traced_step_state(model)["active"]
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = _traced().traced_step_state(model)
    assert not state["active"] and "compiled again" in state["reason"]
    assert "train_step" not in model.__dict__
    model.fit(x, y, batch_size=BATCH, verbose=0)  # plain Keras, no warning
    _traced().remove_traced_step(model)
    assert _traced().traced_step_state(model) == {
        "active": False, "reason": None, "inductor": False, "signatures": 0
    }  # fmt: skip


@torch_only
def test_save_and_load_after_install(tmp_path):
    x, y = _data((6,))
    model = _compiled(_mlp)
    _traced().install_traced_step(model)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert "train_step" not in loaded.__dict__
    _close(model.predict(x, verbose=0), loaded.predict(x, verbose=0))
    _close([v.numpy() for v in model.optimizer.variables], [v.numpy() for v in loaded.optimizer.variables])  # fmt: skip
    loaded.fit(x, y, batch_size=BATCH, verbose=0)


@torch_only
def test_steps_per_execution_runs_on_the_installed_step_as_one_step_at_a_time(tmp_path):
    """Keras' torch backend refuses steps_per_execution > 1; the installed traced step runs
    it: fit, validation, evaluate and predict as with 1, the batch callbacks once per N."""

    class Batches(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(batch)

    x, y = _data((6,))  # 100 examples: 4 batches of 32, the last short
    runs = []
    for spe in (1, 2):
        model = _compiled(_mlp)
        _traced().install_traced_step(model)
        model.steps_per_execution = spe
        record = Batches()
        h = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                      validation_data=(x[:40], y[:40]), callbacks=[record])  # fmt: skip
        ev = model.evaluate(x, y, batch_size=25, verbose=0, return_dict=True)
        with warnings.catch_warnings():
            # 7 batches: the last execution holds one, and Keras' torch iterator warns.
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            runs.append(
                (h.history, model, record.ends, ev, model.predict(x, batch_size=16, verbose=0))
            )
    (h1, m1, ends1, ev1, p1), (h2, m2, ends2, ev2, p2) = runs
    _same(h1, h2, m1, m2)
    assert ends1 == [0, 1, 2, 3] * 2 and ends2 == [1, 3] * 2  # Keras' numbering, as on TF/JAX
    assert ev1.keys() == ev2.keys()
    np.testing.assert_allclose(list(ev1.values()), list(ev2.values()), rtol=1e-6)
    assert p2.shape == p1.shape == (N, 3)
    _close(p1, p2)
    assert int(m2.optimizer.iterations) == 8
    # Saved and loaded: plain Keras with one step per execution, which it runs.
    m2.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.steps_per_execution == 1
    loaded.fit(x, y, batch_size=BATCH, verbose=0)
    # Raised after a fit with 1 (Keras' one-step functions cached): whole executions run.
    m1.steps_per_execution = 4
    iterations = int(m1.optimizer.iterations)
    m1.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(m1.optimizer.iterations) == iterations + 4
    assert m1.evaluate(x, y, batch_size=25, verbose=0, return_dict=True).keys() == ev1.keys()
    assert m1.predict(x, batch_size=25, verbose=0).shape == (N, 3)
    # Removed: back to 1, which Keras' own step runs.
    _traced().remove_traced_step(m2)
    assert m2.steps_per_execution == 1
    m2.fit(x, y, batch_size=BATCH, verbose=0)


@torch_only
def test_data_the_step_cannot_trace_runs_the_eager_step_without_recursion():
    # train_on_batch hands the step a None sample weight: not traced, the model's own eager
    # step runs. With the `traced_step` setting that step once entered the traced one again,
    # without end (RecursionError, also in kp.find_max_batch_size's probe).
    x, y = _data((6,))
    losses = []
    for traced in (False, True):
        keras.utils.set_random_seed(1)
        model = kp.loss_scaled(_mlp(), clipnorm=1.0, traced_step=traced)
        model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
        losses.append(model.train_on_batch(x[:32], y[:32]))
        losses.append(model.train_on_batch(x[32:64], y[32:64]))
    np.testing.assert_allclose(losses[:2], losses[2:], rtol=1e-6)
    installed = _compiled(_mlp)
    _traced().install_traced_step(installed)
    found = kp.find_max_batch_size(installed, x, y, memory_limit_bytes=2**28)
    assert found.max_batch_size >= 1


@torch_only
def test_callbacks_see_the_same_logs():
    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batch_logs, self.epoch_logs = [], []

        def on_train_batch_end(self, batch, logs=None):
            self.batch_logs.append({k: float(v) for k, v in logs.items()})

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_logs.append(dict(logs))

    x, y = _data((6,))
    runs = []
    for install in (False, True):
        model = _compiled(_mlp)
        if install:
            _traced().install_traced_step(model)
        record = Record()
        stop = keras.callbacks.EarlyStopping("loss", patience=0, min_delta=10.0)
        model.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0,
                  callbacks=[record, stop])  # fmt: skip
        runs.append((record, stop.stopped_epoch))
    (a, stop_a), (b, stop_b) = runs
    assert stop_a == stop_b == 1
    assert len(a.batch_logs) == len(b.batch_logs) == 8
    for u, v in zip(a.batch_logs + a.epoch_logs, b.batch_logs + b.epoch_logs):
        assert u.keys() == v.keys()
        np.testing.assert_allclose(list(u.values()), list(v.values()), rtol=1e-5, atol=1e-6)


@torch_only
def test_bad_arguments():
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        _traced().install_traced_step("model")
    with pytest.raises(ValueError, match="not compiled"):
        _traced().install_traced_step(_mlp())


# -- the `traced_step` setting of keras-perf's train step ----------------------------------


@torch_only
@pytest.mark.parametrize("clipnorm", [None, 0.5])
def test_loss_scaled_traced_step_matches_the_eager_step(clipnorm):
    x, y = _data((6,))
    runs = []
    for traced in (False, True):
        keras.utils.set_random_seed(1)
        model = kp.loss_scaled(_mlp(), clipnorm=clipnorm, traced_step=traced)
        model.compile(
            keras.optimizers.Adam(1e-2),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        h = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
        runs.append((h, model))
    (h1, m1), (h2, m2) = runs
    _same(h1, h2, m1, m2)
    assert {"grad_norm", "skipped_steps", "loss_scale"} <= h2.keys()
    assert _traced().traced_step_state(m2)["active"]
    assert m2.get_config()["traced_step"] is True


@torch_only
@pytest.mark.parametrize("one_graph", [False, True], ids=["cpu-two-graphs", "one-graph"])
@pytest.mark.parametrize(
    "batchnorm,bad,skipped", [(False, np.inf, 1), (True, np.inf, 1), (False, 1e21, 0)]
)
def test_loss_scaled_traced_step_skips_a_non_finite_step_as_the_eager_step(
    monkeypatch, one_graph, batchnorm, bad, skipped
):
    """Both forms of the skip: on a CPU the host checks the gradients between two graphs; the
    one-graph form (GPUs: no host synchronisation) selects with `torch.where`. A skipped step
    keeps the weights, the Adam slots, iterations, BatchNormalization's moving statistics and
    the compiled metrics (the batch is left out of the epoch's accuracy), as keras-perf's eager
    step does. An input of 1e21 gives finite gradients whose sum of
    squares overflows: not skipped (each gradient is checked), as in the eager step."""
    if one_graph:
        monkeypatch.setattr(_traced(), "SPLIT_DEVICES", frozenset())
    x, y = _data((6,))
    x[40] = bad  # in the second batch
    runs = []
    for traced in (False, True):
        keras.utils.set_random_seed(1)
        model = kp.loss_scaled(_cnn_free_mlp(batchnorm), clipnorm=1.0, traced_step=traced)
        model.compile(
            "adam",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        h = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
        runs.append((h, model))
    (h1, m1), (h2, m2) = runs
    assert h1["skipped_steps"] == h2["skipped_steps"] == [skipped]
    # The compiled metrics leave a skipped batch out, as the loss does.
    assert h2["accuracy"] == pytest.approx(h1["accuracy"], abs=1e-7)
    assert skipped or h1["grad_norm"] == h2["grad_norm"] == [np.inf]
    _same(h1, h2, m1, m2)
    assert _traced().traced_step_state(m2)["active"]


@torch_only
def test_loss_scaled_traced_step_on_a_cpu_updates_in_place_as_keras_own_step():
    """On a CPU the update graph of a finite step writes the weights and Adam slots in place:
    no copy of each and no `torch.where` between old and new values (they made the traced
    step 1.30x Keras' own traced step on an MLP in float32, 1.50x in bfloat16)."""
    import torch

    x, y = _data((6,))
    keras.utils.set_random_seed(1)
    model = kp.loss_scaled(_mlp(), traced_step=True)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    entries = list(model._kp_traced_step.cache.values())  # the full and the short batch

    def count(graph, op):
        return sum(n.target is op for n in graph.graph.nodes)

    aten = torch.ops.aten
    n_state = len(model.trainable_variables) + len(model.optimizer.variables)
    assert len(entries) == 2 and n_state >= 8
    for entry in entries:
        assert isinstance(entry, _traced()._SplitStep) and entry.skip is None
        for graph in (entry.gradients, entry.update):
            assert count(graph, aten.where.self) < n_state // 2, graph.code
            assert count(graph, aten.clone.default) == 0, graph.code


def _cnn_free_mlp(batchnorm=False):
    norm = [keras.layers.BatchNormalization()] if batchnorm else []
    return keras.Sequential([keras.Input((6,)), *norm, keras.layers.Dense(3)])


@torch_only
def test_loss_scaled_microbatches_fall_back_with_the_reason():
    x, y = _data((6,))
    model = kp.loss_scaled(_mlp(), microbatches=2, traced_step=True)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.warns(kp.KerasPerfWarning, match="microbatches=2"):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    assert "microbatches=2" in _traced().traced_step_state(model)["reason"]


def test_traced_step_setting_is_saved_and_validated():
    with pytest.raises(ValueError, match="`traced_step` must be False, True or 'inductor'"):
        kp.loss_scaled(_mlp(), traced_step="yes")
    model = kp.loss_scaled(_mlp())
    assert model.traced_step is False and model.get_config()["traced_step"] is False


@pytest.mark.backends("tensorflow", "jax")
def test_traced_step_on_tensorflow_and_jax_warns_that_it_changes_nothing():
    x, y = _data((6,))
    with pytest.warns(kp.KerasPerfWarning, match="applies to the PyTorch backend only"):
        model = kp.loss_scaled(_mlp(), traced_step=True)
    assert model.get_config()["traced_step"] is True
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, verbose=0)
