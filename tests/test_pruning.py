"""Pruning: schedules and masks against tfmot, fit on digits, patterns, resume, bad input."""

import re

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf._layer_selection import check_selectors
from keras_perf._masks import MaskConstraint
from keras_perf.pruning._masks import _magnitude_masks
from keras_perf.pruning._selection import _select
from tests import models

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def mlp(hidden=32, name=None):
    return models.mlp([hidden], name=name, hidden_names=["hidden"], out_name="logits")


def compile_(model, optimizer=None):
    model.compile(
        optimizer or keras.optimizers.Adam(5e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def key(t):
    """A weight's name that survives save/load (paths get a new model-name prefix)."""
    return f"{t.layer.name}/{t.variable.name}"


def weights_of(model):
    return {key(t): keras.ops.convert_to_numpy(t.variable.value) for t in _select(model)}


def tfmot():
    pytest.importorskip("tf_keras")
    return pytest.importorskip("tensorflow_model_optimization")


class WeightsAtBatchEnd(keras.callbacks.Callback):
    """Records the target weights after the first `n` optimizer steps."""

    def __init__(self, n):
        super().__init__()
        self.n, self.seen = n, []

    def on_train_batch_end(self, batch, logs=None):
        if len(self.seen) < self.n:
            self.seen.append(weights_of(self.model))


# --------------------------------------------------------------------------------------------
# schedules
# --------------------------------------------------------------------------------------------

POLY_CASES = [
    (0.0, 0.8, 0, 100, 3, 10),
    (0.1, 0.9, 50, 1000, 2, 100),
    (0.5, 0.5, 10, 20, 1, 1),
    (0.3, 0.95, 0, 7, 3, 3),
    (0.0, 0.6, 100, 101, 0.5, 1),
]
CONST_CASES = [(0.5, 0, -1, 100), (0.9, 10, 200, 7), (0.0, 5, 5, 1), (0.33, 0, 1000, 250)]
STEPS = [0, 1, 2, 5, 7, 9, 10, 11, 20, 49, 50, 51, 99, 100, 101, 150, 200, 525, 1000, 1001, 5000]


def test_polynomial_decay_values():
    schedule = kp.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=1000, frequency=100)
    assert schedule(0) == (True, 0.0)
    assert schedule(50) == (False, pytest.approx(0.8 * (1 - 0.95**3), rel=1e-6))
    assert schedule(500)[1] == pytest.approx(0.7, rel=1e-6)
    assert schedule(1000) == (True, pytest.approx(0.8, rel=1e-7))
    assert schedule(1100) == (False, pytest.approx(0.8, rel=1e-7))  # past end_step


def test_constant_sparsity_values():
    schedule = kp.ConstantSparsity(0.5, begin_step=10, end_step=30, frequency=10)
    assert [s for s in range(50) if schedule(s)[0]] == [10, 20, 30]
    assert schedule(0)[1] == 0.5
    forever = kp.ConstantSparsity(0.5, begin_step=0, frequency=25)
    assert forever(10**6)[0] is True


@pytest.mark.backends("tensorflow")
def test_schedules_match_tfmot():
    import tensorflow as tf

    mot = tfmot().sparsity.keras
    compared = 0
    for args in POLY_CASES:
        ours, theirs = kp.PolynomialDecay(*args), mot.PolynomialDecay(*args)
        in_fit = tf.function(theirs)  # how tfmot evaluates it during fit
        for step in STEPS:
            should, sparsity = in_fit(tf.constant(step, tf.int64))
            assert ours(step) == (bool(should.numpy()), float(sparsity.numpy())), (args, step)
            compared += 1
    for args in CONST_CASES:
        ours, theirs = kp.ConstantSparsity(*args), mot.ConstantSparsity(*args)
        for step in STEPS:
            should, sparsity = theirs(step)
            assert ours(step) == (bool(should.numpy()), float(sparsity.numpy())), (args, step)
            compared += 1
    assert compared == len(STEPS) * (len(POLY_CASES) + len(CONST_CASES))


@pytest.mark.backends("tensorflow")
def test_tfmot_schedule_accepted_and_converted():
    mot = tfmot().sparsity.keras
    cb = kp.PruningCallback(mot.PolynomialDecay(0.1, 0.7, 5, 55, frequency=10))
    assert isinstance(cb.schedule, kp.PolynomialDecay)
    assert cb.schedule.get_config()["end_step"] == 55
    cb = kp.PruningCallback(mot.ConstantSparsity(0.4, 3, frequency=2))
    assert cb.schedule(5) == (True, pytest.approx(0.4))


def test_custom_callable_schedule():
    cb = kp.PruningCallback(lambda step: (np.bool_(step % 2 == 0), np.float32(0.25)))
    assert cb.schedule(4) == (True, 0.25) and cb.schedule(3) == (False, 0.25)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: kp.ConstantSparsity(1.0), r"target_sparsity.*\[0\.0, 1\.0\)"),
        (lambda: kp.ConstantSparsity(-0.1), r"target_sparsity"),
        (lambda: kp.PolynomialDecay(0.0, 1.0, 0, 10), r"final_sparsity"),
        (lambda: kp.PolynomialDecay(-0.1, 0.5, 0, 10), r"initial_sparsity"),
        (lambda: kp.PolynomialDecay(0.0, 0.5, 10, 5), r"end_step.*>= `begin_step` \(10\)"),
        (lambda: kp.PolynomialDecay(0.0, 0.5, 0, -1), r"end_step.*cannot be -1"),
        (lambda: kp.ConstantSparsity(0.5, 10, 5), r"end_step.*or -1"),
        (lambda: kp.ConstantSparsity(0.5, frequency=0), r"frequency.*>= 1"),
        (lambda: kp.ConstantSparsity(0.5, begin_step=-1), r"begin_step.*>= 0"),
    ],
)
def test_schedule_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_schedule_type_errors():
    with pytest.raises(TypeError, match="begin_step"):
        kp.ConstantSparsity(0.5, begin_step=1.5)
    with pytest.raises(TypeError, match="schedule"):
        kp.PruningCallback(0.5)


# --------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------


@pytest.mark.backends("tensorflow")
def test_layer_mask_matches_tfmot_pruning_impl():
    import tensorflow as tf
    from tensorflow_model_optimization.python.core.sparsity.keras import pruning_impl

    tfmot()
    rng = np.random.default_rng(0)
    for shape in [(64, 32), (3, 3, 8, 16), (100,), (7, 5)]:
        for sparsity in [0.0, 0.1, 0.5, 0.8, 0.95, 0.999]:
            w = rng.standard_normal(shape).astype("float32")
            schedule = tfmot().sparsity.keras.ConstantSparsity(sparsity, 0)
            impl = pruning_impl.Pruning(lambda: 0, [], schedule, (1, 1), "AVG")
            threshold, mask = impl._update_mask(tf.constant(w))
            (ours,), (our_threshold,) = _magnitude_masks(
                [keras.ops.convert_to_tensor(w)], sparsity, "layer"
            )
            ours = keras.ops.convert_to_numpy(ours)
            assert float(keras.ops.convert_to_numpy(our_threshold)) == float(threshold.numpy())
            np.testing.assert_array_equal(ours, mask.numpy())


@pytest.mark.backends("tensorflow")
def test_m_by_n_matches_tfmot():
    import tensorflow as tf
    from tensorflow_model_optimization.python.core.sparsity.keras import pruning_impl

    mot = tfmot()
    rng = np.random.default_rng(1)
    impl = pruning_impl.Pruning(
        lambda: 0, [], mot.sparsity.keras.ConstantSparsity(0.5, 0), (1, 1), "AVG", (2, 4)
    )
    for layer, shape in [(keras.layers.Dense(6), (16,)), (keras.layers.Conv2D(4, 3), (5, 5, 8))]:
        model = keras.Sequential([keras.Input(shape), layer])
        w = rng.standard_normal(tuple(layer.kernel.shape)).astype("float32")
        layer.kernel.assign(w)
        kp.prune_low_magnitude(model, m_by_n=(2, 4))
        theirs = impl._update_mask_sparsity_m_by_n(tf.constant(w), (2, 4)).numpy()
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer.kernel) != 0, theirs != 0)


class Holder(keras.Model):
    """A subclassed model holding already-built layers (no symbolic tracing: cheap on JAX)."""

    def __init__(self, layers, **kwargs):
        super().__init__(**kwargs)
        self.held = list(layers)
        self.built = True

    def call(self, x):
        return x


def test_m_by_n_pattern_block_by_block():
    rng = np.random.default_rng(2)
    dense, conv, tconv = (
        keras.layers.Dense(5),
        keras.layers.Conv2D(3, 2),
        keras.layers.Conv2DTranspose(4, 2),
    )
    dense.build((None, 10))  # 10 inputs: blocks of 4, 4 and a partial block of 2
    conv.build((None, 6, 6, 10))
    tconv.build((None, 6, 6, 9))
    model = Holder([dense, conv, tconv])
    original = {}
    for layer in (dense, conv, tconv):
        w = rng.standard_normal(tuple(layer.kernel.shape)).astype("float32")
        layer.kernel.assign(w)
        original[layer.name] = w
    kp.prune_low_magnitude(model, m_by_n=(2, 4))
    # Input axis per kind: Dense 0, Conv -2, ConvTranspose -1.
    for layer, axis in [(dense, 0), (conv, -2), (tconv, -1)]:
        w = np.moveaxis(original[layer.name], axis, -1)
        kept = np.moveaxis(keras.ops.convert_to_numpy(layer.kernel), axis, -1) != 0
        rows, length = w.reshape(-1, w.shape[-1]), w.shape[-1]
        kept = kept.reshape(-1, length)
        blocks = 0
        for r in range(rows.shape[0]):
            for start in range(0, length, 4):
                block, keep = np.abs(rows[r, start : start + 4]), kept[r, start : start + 4]
                expected = np.zeros(len(block), bool)
                expected[np.argsort(-block)[: min(2, len(block))]] = True
                np.testing.assert_array_equal(keep, expected)
                blocks += 1
        assert blocks >= rows.shape[0] * (length // 4)


def test_global_scope_uses_one_threshold():
    rng = np.random.default_rng(3)
    model = mlp(hidden=16)
    model.layers[0].kernel.assign(rng.standard_normal((64, 16)).astype("float32"))
    model.layers[1].kernel.assign(0.1 * rng.standard_normal((16, 10)).astype("float32"))
    before = weights_of(model)
    kp.prune_low_magnitude(model, sparsity=0.6, scope="global")
    after = weights_of(model)
    kept = np.concatenate([np.abs(before[p][after[p] != 0]) for p in before])
    pruned = np.concatenate([np.abs(before[p][after[p] == 0]) for p in before])
    assert pruned.max() < kept.min()  # one threshold for all layers
    assert len(kept) == round((64 * 16 + 16 * 10) * 0.4)
    report = kp.sparsity_report(model)
    per_layer = [w["sparsity"] for w in report["weights"]]
    assert per_layer[1] > 0.9 > per_layer[0]  # the small-magnitude layer is pruned far more


def test_global_scope_callback_reports_one_threshold(digits):
    (x, y), _ = digits
    model = compile_(mlp())
    cb = kp.PruningCallback(kp.ConstantSparsity(0.7, 0, frequency=1000), scope="global")
    model.fit(x[:256], y[:256], batch_size=64, epochs=1, callbacks=[cb], verbose=0)
    assert len(set(cb.thresholds.values())) == 1 and len(cb.thresholds) == 2
    assert kp.sparsity_report(model)["total"]["sparsity"] == pytest.approx(0.7, abs=1e-3)


# --------------------------------------------------------------------------------------------
# fit on digits
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fit_digits_polynomial_to_80_percent(digits):
    (x, y), (xt, yt) = digits
    epochs, batch = 12, 128  # 12 steps per epoch, 144 steps
    keras.utils.set_random_seed(7)
    dense = compile_(mlp(hidden=128), keras.optimizers.Adam(1e-2))
    dense.fit(x, y, batch_size=batch, epochs=epochs, verbose=0)
    dense_acc = dense.evaluate(xt, yt, verbose=0)[1]

    keras.utils.set_random_seed(7)
    model = compile_(mlp(hidden=128), keras.optimizers.Adam(1e-2))
    schedule = kp.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=72, frequency=24)
    cb = kp.PruningCallback(schedule)
    history = model.fit(x, y, batch_size=batch, epochs=epochs, callbacks=[cb], verbose=0)
    acc = model.evaluate(xt, yt, verbose=0)[1]
    report = kp.sparsity_report(model)
    for row in report["weights"]:
        assert row["sparsity"] == pytest.approx(0.8, abs=0.01), row
    for t in cb.targets:  # pruned entries exactly zero, and exactly where the mask says
        w = keras.ops.convert_to_numpy(t.variable.value)
        mask = keras.ops.convert_to_numpy(t.mask.value)
        assert np.all(w[mask == 0] == 0.0)
    assert [h["step"] for h in cb.history] == [0, 24, 48, 72]
    assert history.history["sparsity"][-1] == pytest.approx(0.8, abs=0.01)
    print(f"digits test accuracy: dense {dense_acc:.4f}, 80% sparse {acc:.4f}")
    assert acc >= dense_acc - 0.02, (acc, dense_acc)


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.01),
    ],
)
def test_pruned_entries_stay_zero_after_every_step(digits, optimizer):
    (x, y), _ = digits
    model = compile_(mlp(), optimizer())
    cb = kp.PruningCallback(kp.ConstantSparsity(0.5, 0, frequency=10_000))  # one update, step 0
    spy = WeightsAtBatchEnd(4)
    model.fit(x[:320], y[:320], batch_size=32, epochs=1, callbacks=[cb, spy], verbose=0)
    masks = {key(t): keras.ops.convert_to_numpy(t.mask.value) == 0 for t in cb.targets}
    assert [h["step"] for h in cb.history] == [0]
    first = spy.seen[0]
    for seen in [*spy.seen, weights_of(model)]:
        for path, pruned in masks.items():
            assert pruned.mean() == pytest.approx(0.5, abs=0.01)
            assert np.all(seen[path][pruned] == 0.0)
            assert np.all(seen[path][~pruned] != 0.0)
    assert any(not np.array_equal(first[p], weights_of(model)[p]) for p in masks)  # it trained


def test_mask_updates_do_not_retrace_the_train_step(digits):
    # On JAX the masks travel with the optimizer state, so 8 mask updates cost no compile
    # (they used to cost one each: ~9x the plain epoch time). Weights stay zero after each step.
    (x, y), _ = digits
    model = compile_(mlp())
    rebuilds = []
    make = model.make_train_function
    model.make_train_function = lambda force=False: (rebuilds.append(force), make(force))[1]
    cb = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=35, frequency=5))
    spy = WeightsAtBatchEnd(20)
    model.fit(x[:640], y[:640], batch_size=32, epochs=2, callbacks=[cb, spy], verbose=0)
    # One rebuild when the masking constraints are installed; none for the mask updates.
    assert rebuilds.count(True) == 1, rebuilds
    assert [h["step"] for h in cb.history] == [0, 5, 10, 15, 20, 25, 30, 35]
    assert cb.sparsity == pytest.approx(0.8, abs=0.01)
    # Steps 16-20 ran with the masks set at step 15, so their pruned entries are zero.
    expected = kp.PolynomialDecay(0.0, 0.8, 0, 35, frequency=5)(15)[1]
    for seen in spy.seen[15:20]:
        zeros = np.mean(np.concatenate([(w == 0).ravel() for w in seen.values()]))
        assert zeros == pytest.approx(expected, abs=0.01)
    # After training the optimizer is as it was: its variables are its own again.
    assert not any(v is t.mask for v in model.optimizer.variables for t in cb.targets)


class SaveAtEpochEnd(keras.callbacks.Callback):
    """Saves the model; keeps the optimizer's variables at that moment, masks left out."""

    def __init__(self, path, pruning):
        super().__init__()
        self.path, self.pruning, self.optimizer_state = path, pruning, None

    def on_epoch_end(self, epoch, logs=None):
        self.model.save(self.path)
        masks = [t.mask for t in self.pruning.targets]
        self.optimizer_state = [
            keras.ops.convert_to_numpy(v)
            for v in self.model.optimizer.variables
            if not any(v is m for m in masks)
        ]


def test_saving_during_pruning_keeps_optimizer_state_loadable(digits, tmp_path):
    # A checkpoint written while the callback runs holds the optimizer state as Keras saves
    # it (on JAX the masks ride along with that state) and loads into a fresh model, whole.
    (x, y), _ = digits
    model = compile_(mlp())
    cb = kp.PruningCallback(kp.ConstantSparsity(0.5, 0, frequency=5))
    path = str(tmp_path / "mid.keras")
    saver = SaveAtEpochEnd(path, cb)
    model.fit(x[:320], y[:320], batch_size=32, epochs=1, callbacks=[cb, saver], verbose=0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Keras warns (and skips) on an optimizer mismatch
        loaded = keras.saving.load_model(path)
    state = [keras.ops.convert_to_numpy(v) for v in loaded.optimizer.variables]
    assert len(state) == len(saver.optimizer_state) == 2 + 2 * 4  # iterations, lr, Adam m and v
    for a, b in zip(state, saver.optimizer_state):
        np.testing.assert_array_equal(a, b)
    assert int(state[0]) == 10  # iterations


def test_step_is_optimizer_iterations_and_continues_across_fits(digits):
    (x, y), _ = digits
    model = compile_(mlp())
    schedule = kp.ConstantSparsity(0.5, begin_step=3, end_step=40, frequency=7)
    cb = kp.PruningCallback(schedule)
    model.fit(x[:320], y[:320], batch_size=32, epochs=2, callbacks=[cb], verbose=0)  # steps 0-19
    assert [h["step"] for h in cb.history] == [3, 10, 17]
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 20
    model.fit(x[:320], y[:320], batch_size=32, epochs=1, callbacks=[cb], verbose=0)  # 20-29
    assert [h["step"] for h in cb.history] == [24] == [s for s in range(20, 30) if schedule(s)[0]]
    assert cb.history[-1]["sparsity"] == pytest.approx(0.5, abs=0.01)


@pytest.mark.backends("tensorflow", "jax")  # torch supports only steps_per_execution=1
def test_steps_per_execution_prunes_at_execution_start(digits):
    (x, y), _ = digits
    model = mlp()
    model.compile("adam", "sparse_categorical_crossentropy", steps_per_execution=4)
    cb = kp.PruningCallback(kp.ConstantSparsity(0.5, begin_step=2, frequency=5, end_step=12))
    model.fit(x[:512], y[:512], batch_size=32, epochs=1, callbacks=[cb], verbose=0)
    # Executions start at 0, 4, 8, 12: the prune steps 2, 7, 12 are served at 0, 4 and 12.
    assert [h["step"] for h in cb.history] == [2, 7, 12]


def test_sparsity_in_epoch_logs_and_verbose(digits, capsys):
    (x, y), _ = digits
    model = compile_(mlp())
    cb = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.6, 0, 10, frequency=5), verbose=1)
    history = model.fit(x[:160], y[:160], batch_size=32, epochs=3, callbacks=[cb], verbose=0)
    # 5 steps per epoch: updates at steps 0 (s = 0), 5 and 10 run at the start of epochs 0-2.
    assert history.history["sparsity"] == pytest.approx([h["sparsity"] for h in cb.history])
    assert history.history["sparsity"][-1] == pytest.approx(0.6, abs=0.01)
    assert "PruningCallback: step 10: target sparsity 0.6000" in capsys.readouterr().out


def test_tensorboard_scalars(digits, tmp_path):
    # Written through keras_perf._tensorboard (tf.summary, else tensorboardX) on any backend;
    # read back with TensorFlow's reader.
    tf = pytest.importorskip("tensorflow")
    (x, y), _ = digits
    model = compile_(mlp())
    cb = kp.PruningCallback(kp.ConstantSparsity(0.5, 0, frequency=5), log_dir=str(tmp_path))
    model.fit(x[:320], y[:320], batch_size=32, epochs=1, callbacks=[cb], verbose=0)
    tags, sparsity = {}, []
    for f in tmp_path.iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(f)):
            for v in event.summary.value:
                tags.setdefault(v.tag, []).append(event.step)
                if v.tag == "pruning/sparsity":
                    sparsity.append(float(tf.make_ndarray(v.tensor)))
    assert tags["pruning/sparsity"] == [0, 5]
    assert sparsity == pytest.approx([h["sparsity"] for h in cb.history], abs=1e-6)
    assert "pruning/sequential/hidden/kernel" in tags or any("hidden/kernel" in t for t in tags)


# --------------------------------------------------------------------------------------------
# which weights
# --------------------------------------------------------------------------------------------


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, activation="relu", name="inner")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(self.inner(x))


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block(name="block")
        self.head = keras.layers.Dense(10, name="head")

    def call(self, x):
        return self.head(self.block(x))


def test_subclassed_model_with_nested_layer(digits):
    (x, y), _ = digits
    model = compile_(Net())
    model(x[:2])
    cb = kp.PruningCallback(kp.ConstantSparsity(0.5, 0, frequency=1000))
    model.fit(x[:128], y[:128], batch_size=32, epochs=1, callbacks=[cb], verbose=0)
    paths = sorted(t.path for t in cb.targets)
    assert paths == sorted([model.block.inner.kernel.path, model.head.kernel.path])
    assert all(keras.ops.convert_to_numpy(model.block.inner.bias).any() for _ in [0])
    assert kp.sparsity_report(model)["total"]["sparsity"] == pytest.approx(0.5, abs=0.01)


def test_what_is_prunable():
    def built(layer, *shapes):
        layer.build(*shapes)
        return layer

    frozen = built(keras.layers.Dense(3, name="frozen"), (None, 4))
    frozen.trainable = False
    model = Holder(
        [
            built(keras.layers.Conv2D(4, 3, name="conv"), (None, 6, 6, 3)),
            built(keras.layers.SeparableConv2D(4, 3, name="sep"), (None, 6, 6, 3)),
            built(keras.layers.DepthwiseConv2D(1, name="depthwise"), (None, 6, 6, 3)),
            built(keras.layers.BatchNormalization(name="bn"), (None, 6, 6, 3)),
            built(keras.layers.Conv2DTranspose(4, 2, name="tconv"), (None, 6, 6, 3)),
            built(keras.layers.MultiHeadAttention(2, 4, name="mha"), (None, 5, 6), (None, 5, 6)),
            built(keras.layers.LSTM(5, name="lstm"), (None, 5, 3)),
            built(keras.layers.Embedding(20, 4, name="emb"), (None, 3)),
            built(keras.layers.LayerNormalization(name="ln"), (None, 4)),
            frozen,
            built(keras.layers.Dense(2, name="out"), (None, 4)),
        ]
    )
    found = {f"{t.layer.name}/{t.variable.name}" for t in _select(model)}
    expected = {
        "conv/kernel", "sep/pointwise_kernel", "tconv/kernel", "query/kernel", "key/kernel",
        "value/kernel", "attention_output/kernel", "lstm_cell/kernel",
        "lstm_cell/recurrent_kernel", "emb/embeddings", "out/kernel",
    }  # fmt: skip
    assert found == expected


@pytest.mark.parametrize(
    "include, exclude, expected",
    [
        ("hidden", None, {"hidden"}),
        (r"hid.*", None, {"hidden"}),
        (re.compile("logit"), None, {"logits"}),
        (keras.layers.Dense, None, {"hidden", "logits"}),
        (None, ["logits"], {"hidden"}),
        (None, r".*/logits/kernel", {"hidden"}),
        (["hidden", "logits"], "hidden", {"logits"}),
    ],
)
def test_include_exclude(include, exclude, expected):
    model = mlp()
    targets = _select(model, check_selectors("i", include), check_selectors("e", exclude))
    assert {t.layer.name for t in targets} == expected


def test_include_enclosing_layer_selects_nested():
    model = Net()
    model(np.zeros((1, 64), "float32"))
    assert [t.layer.name for t in _select(model, ("block",))] == ["inner"]
    assert [t.layer.name for t in _select(model, (), (Block,))] == ["head"]


def test_include_matching_nothing_lists_prunable_layers(digits):
    (x, y), _ = digits
    model = compile_(mlp())
    cb = kp.PruningCallback(kp.ConstantSparsity(0.5), include=["hiden"])
    with pytest.raises(ValueError, match=r"'hiden' matches no prunable weight.*hidden \(Dense"):
        model.fit(x[:32], y[:32], epochs=1, callbacks=[cb], verbose=0)


def test_exclude_matching_nothing_is_an_error_in_select():
    with pytest.raises(ValueError, match="`exclude` item 'nothing_here' matches no"):
        _select(mlp(), (), ("nothing_here",))


def test_model_without_prunable_weights():
    model = keras.Sequential([keras.Input((4,)), keras.layers.LayerNormalization()])
    with pytest.raises(ValueError, match="no prunable weights.*never biases"):
        kp.prune_low_magnitude(model)
    with pytest.raises(ValueError, match="not built"):
        kp.sparsity_report(keras.Sequential([keras.layers.Dense(3)]))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"scope": "model"}, ValueError, r"`scope` must be one of 'layer', 'global'"),
        ({"m_by_n": (4, 4)}, ValueError, r"1 <= m < n"),
        ({"m_by_n": 2}, ValueError, r"pair \(m, n\)"),
        ({"m_by_n": (2, 4), "scope": "global"}, ValueError, r"cannot be combined"),
        ({"include": [3]}, TypeError, r"`include` items must be"),
        ({"exclude": object}, TypeError, r"`exclude` items must be"),
        ({"verbose": -1}, ValueError, r"verbose"),
        ({"log_dir": 5}, TypeError, r"log_dir"),
    ],
)
def test_callback_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kp.PruningCallback(kp.ConstantSparsity(0.5), **kwargs)


def test_prune_low_magnitude_bad_sparsity():
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"`sparsity` must be in \[0\.0, 1\.0\)"):
            kp.prune_low_magnitude(mlp(), sparsity=bad)


def test_uncompiled_model_in_fit_is_an_error():
    cb = kp.PruningCallback(kp.ConstantSparsity(0.5))
    cb.set_model(mlp())
    with pytest.raises(ValueError, match="compiled model"):
        cb.on_train_begin()


# --------------------------------------------------------------------------------------------
# one-shot, strip, save/load, resume, serialization
# --------------------------------------------------------------------------------------------


def test_prune_low_magnitude_then_fit_keeps_zeros_until_strip(digits):
    (x, y), _ = digits
    model = compile_(mlp())
    model.fit(x[:64], y[:64], epochs=1, verbose=0)  # a train step traced without masks
    kp.prune_low_magnitude(model, sparsity=0.75)
    assert kp.sparsity_report(model)["total"]["sparsity"] == pytest.approx(0.75, abs=0.01)
    model.fit(x[:128], y[:128], epochs=1, verbose=0)
    assert kp.sparsity_report(model)["total"]["sparsity"] == pytest.approx(0.75, abs=0.01)
    kp.strip_pruning(model)
    assert not any(isinstance(v.constraint, MaskConstraint) for v in model.weights)
    model.fit(x[:128], y[:128], epochs=1, verbose=0)
    # A plain model again: zeros regrow (except rows of the always-blank digit pixels).
    assert kp.sparsity_report(model)["total"]["sparsity"] < 0.3


def test_strip_pruning_same_outputs_and_saves_plain(digits, tmp_path):
    (x, y), (xt, _) = digits
    model = compile_(mlp())
    cb = kp.PruningCallback(kp.ConstantSparsity(0.6, 0, frequency=3))
    model.fit(x[:128], y[:128], batch_size=32, epochs=1, callbacks=[cb], verbose=0)
    before = keras.ops.convert_to_numpy(model.predict(xt, verbose=0))
    stripped = kp.strip_pruning(model)
    assert stripped is model
    assert all(v.constraint is None for v in model.weights)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.predict(xt, verbose=0)), before)
    path = str(tmp_path / "plain.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)  # no custom objects needed
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded.predict(xt, verbose=0)), before, atol=1e-6
    )
    assert kp.sparsity_report(loaded)["total"]["sparsity"] == pytest.approx(0.6, abs=0.01)
    assert kp.strip_pruning(loaded) is loaded  # a no-op on an unpruned model


def test_save_load_resume_keeps_pattern(digits, tmp_path):
    (x, y), _ = digits
    model = compile_(mlp())
    schedule = kp.PolynomialDecay(0.2, 0.7, begin_step=0, end_step=30, frequency=15)
    cb = kp.PruningCallback(schedule)
    with pytest.warns(kp.KerasPerfWarning, match="end_step=30 lies beyond"):  # on purpose
        model.fit(x[:320], y[:320], batch_size=32, epochs=1, callbacks=[cb], verbose=0)  # 0-9
    assert [h["step"] for h in cb.history] == [0]
    saved = weights_of(model)
    path = str(tmp_path / "pruning.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert kp.sparsity_report(loaded)["total"] == kp.sparsity_report(model)["total"]
    cb2 = kp.PruningCallback(schedule)
    spy = WeightsAtBatchEnd(5)  # steps 10-14: before the next prune step (15)
    with pytest.warns(kp.KerasPerfWarning, match="end_step=30 lies beyond"):  # steps 10-29
        loaded.fit(x[:320], y[:320], batch_size=32, epochs=2, callbacks=[cb2, spy], verbose=0)
    for seen in spy.seen:
        for p, w in saved.items():
            assert np.all(seen[p][w == 0] == 0.0)  # masks rebuilt from the saved zeros
    assert [h["step"] for h in cb2.history] == [15]  # the step count continued from the file
    assert kp.sparsity_report(loaded)["total"]["sparsity"] == pytest.approx(
        schedule(15)[1], abs=0.01
    )


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resume(digits, tmp_path):
    (x, y), _ = digits
    schedule = kp.ConstantSparsity(0.5, begin_step=0, end_step=100, frequency=25)  # 10 steps/epoch

    def run(callbacks):
        keras.utils.set_random_seed(3)
        model = compile_(mlp())
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        pruning = kp.PruningCallback(schedule)
        model.fit(x[:320], y[:320], batch_size=32, epochs=4, verbose=0, shuffle=False,
                  callbacks=[pruning, backup, *callbacks])  # fmt: skip
        return model, pruning

    with pytest.raises(RuntimeError, match="interrupted"):
        run([Interrupt()])
    resumed, pruning = run([])
    assert int(keras.ops.convert_to_numpy(resumed.optimizer.iterations)) == 40
    # Resumed at step 20: the prune at step 25 is the only one run, at the same step as an
    # uninterrupted run would; the pattern is not rebuilt from scratch at step 20.
    assert [h["step"] for h in pruning.history] == [25]
    assert kp.sparsity_report(resumed)["total"]["sparsity"] == pytest.approx(0.5, abs=0.01)


def test_state_dict_round_trip(digits):
    (x, y), _ = digits
    model = compile_(mlp())
    cb = kp.PruningCallback(kp.ConstantSparsity(0.5, 0, frequency=1000))
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, callbacks=[cb], verbose=0)
    state = cb.state_dict()
    assert state["step"] == 2 and set(state["masks"]) == {"hidden/kernel", "logits/kernel"}
    fresh = compile_(mlp())
    fresh.set_weights(kp.strip_pruning(model).get_weights())
    fresh.layers[0].kernel.assign(
        np.ones((64, 32), "float32")
    )  # zeros gone: masks must come from state
    cb2 = kp.PruningCallback(kp.ConstantSparsity(0.5, begin_step=100))  # no update in this fit
    cb2.load_state_dict(state)
    with pytest.warns(kp.KerasPerfWarning, match="no mask update in this fit"):
        fresh.fit(x[:64], y[:64], batch_size=32, epochs=1, callbacks=[cb2], verbose=0)
    assert cb2.history == []
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(fresh.layers[0].kernel) == 0,
        state["masks"]["hidden/kernel"] == 0,
    )


def test_get_config_round_trips():
    for schedule in (
        kp.PolynomialDecay(0.1, 0.9, 5, 50, power=2, frequency=5),
        kp.ConstantSparsity(0.3, 1, 9, 2),
    ):
        restored = keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(schedule)
        )
        assert type(restored) is type(schedule) and restored.get_config() == schedule.get_config()
    cb = kp.PruningCallback(
        kp.PolynomialDecay(0.0, 0.5, 0, 10), scope="layer", m_by_n=(2, 4),
        include=["a", re.compile("b.*"), keras.layers.Dense], exclude=keras.layers.Embedding, verbose=1,
    )  # fmt: skip
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(cb))
    assert isinstance(restored, kp.PruningCallback)
    assert restored.get_config() == cb.get_config()
    assert restored.include[2] is keras.layers.Dense and restored.include[1].pattern == "b.*"
    assert restored.m_by_n == (2, 4)


# --------------------------------------------------------------------------------------------
# regressions: restored weights, two callbacks, unreachable schedules, unbuilt models,
# bit-exact schedules, schedule serialisation, resumes
# --------------------------------------------------------------------------------------------


class FakeMetric(keras.callbacks.Callback):
    """Writes `logs["fake"]` from a fixed list, so the best epoch is known in advance."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def on_epoch_end(self, epoch, logs=None):
        logs["fake"] = self.values[epoch]


def _early_stopping(kind):
    cls = keras.callbacks.EarlyStopping if kind == "keras" else kp.EarlyStopping
    return cls(monitor="fake", mode="min", patience=2, restore_best_weights=True)


@pytest.mark.parametrize("kind", ["keras", "kp"])
@pytest.mark.parametrize("pruning_first", [True, False])
def test_restore_best_weights_keeps_the_latest_masks(digits, kind, pruning_first):
    # Regression: EarlyStopping(restore_best_weights=True) put back the best epoch's weights,
    # pruned less than the masks by then (logged 0.898, real 0.892). The latest masks apply.
    (x, y), _ = digits
    model = compile_(mlp())
    cb = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.8, 0, 30, frequency=5))
    stop = _early_stopping(kind)
    order = [cb, stop] if pruning_first else [stop, cb]
    history = model.fit(x[:320], y[:320], batch_size=32, epochs=6, verbose=0,
                        callbacks=[FakeMetric([3.0, 1.0, 2.0, 2.5, 4.0, 5.0]), *order])  # fmt: skip
    assert stop.best_epoch == 1 and len(history.history["loss"]) == 4  # restored from epoch 1
    logged = history.history["sparsity"][-1]
    assert logged == cb.sparsity and logged > history.history["sparsity"][1] + 0.05
    total = 0
    best = dict(zip([v.path for v in model.weights], stop.best_weights))
    for t in cb.targets:
        w = keras.ops.convert_to_numpy(t.variable.value)
        mask = keras.ops.convert_to_numpy(t.mask.value)
        np.testing.assert_array_equal(w, best[t.path] * mask)  # best weights, latest masks
        assert np.count_nonzero(w) == np.count_nonzero(mask)
        total += mask.size
    report = kp.sparsity_report(model)["total"]
    assert report["sparsity"] == pytest.approx(logged, abs=0.5 / total)


def test_two_pruning_callbacks_on_one_model_are_an_error(digits):
    (x, y), _ = digits
    model = compile_(mlp())
    first = kp.PruningCallback(kp.ConstantSparsity(0.5, 0, frequency=2))
    second = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.8, 0, 1, frequency=1), scope="global")
    with pytest.raises(ValueError, match=r"(?s)Two PruningCallbacks.*ConstantSparsity.*"
                       r"PolynomialDecay.*scope='global'"):  # fmt: skip
        model.fit(x[:64], y[:64], epochs=1, callbacks=[first, second], verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0  # before any step
    # One at a time is fine: a second fit may bring another callback (or the same again).
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, callbacks=[second], verbose=0)
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, callbacks=[first], verbose=0)
    assert first.history[0]["step"] == 2


def _hooks(model, cb, epochs, steps, initial_epoch=0):
    cb.set_model(model)
    cb.set_params({"epochs": epochs, "steps": steps, "verbose": 0})
    cb.on_train_begin()
    cb.on_epoch_begin(initial_epoch)  # the plan is checked here, before any step


def test_schedule_that_cannot_reach_its_target_warns(digits):
    # The README's snippet: 1,077 examples, batch 32 (34 steps), 10 epochs = 340 steps, but the
    # schedule ends at step 2000: its last mask update (step 300) prunes to 0.309, not 0.8.
    (x, y), _ = digits
    schedule = kp.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=2000, frequency=100)
    reached = schedule(300)[1]
    assert reached == pytest.approx(0.8 * (1 - 0.85**3), abs=1e-6)
    model = compile_(mlp())
    with pytest.warns(kp.KerasPerfWarning, match=(
        rf"340 steps \(10 epochs x 34\).*steps 0-339.*end_step=2000.*step 300.*{reached:.4f}"
        r".*final_sparsity=0\.8"
    )):  # fmt: skip
        model.fit(x[:1077], y[:1077], batch_size=32, epochs=10, callbacks=[
            kp.PruningCallback(schedule)], verbose=0)  # fmt: skip
    assert kp.sparsity_report(model)["total"]["sparsity"] == pytest.approx(reached, abs=1e-3)


@pytest.mark.parametrize(
    "schedule, epochs, steps, match",
    [
        (kp.PolynomialDecay(0.0, 0.8, 0, 90, frequency=20), 10, 10, r"step 80.*0\.79"),
        (kp.ConstantSparsity(0.5, begin_step=100), 5, 10, r"no mask update.*begin_step=100"),
        (kp.PolynomialDecay(0.0, 0.8, 60, 200, frequency=10), 5, 10, r"no mask update"),
    ],
)
def test_unreachable_schedule_cases_warn(schedule, epochs, steps, match):
    model = compile_(mlp())
    with pytest.warns(kp.KerasPerfWarning, match=match):
        _hooks(model, kp.PruningCallback(schedule), epochs, steps)


@pytest.mark.parametrize(
    "schedule, epochs, steps",
    [
        (kp.PolynomialDecay(0.0, 0.8, 0, 99, frequency=33), 10, 10),  # end at step 99: reached
        (kp.ConstantSparsity(0.5, begin_step=99), 10, 10),
        (kp.PolynomialDecay(0.0, 0.8, 0, 2000, frequency=100), 10, None),  # unknown length
    ],
)
def test_reachable_schedule_does_not_warn(schedule, epochs, steps):
    _hooks(compile_(mlp()), kp.PruningCallback(schedule), epochs, steps)  # warnings are errors


def test_subclassed_model_fitted_without_building(digits):
    # Regression: a subclassed model compiled and fitted the normal way (never called or built
    # before `fit`) raised "not built" on TensorFlow, where Keras builds it in the first step.
    (x, y), _ = digits
    model = compile_(Net())
    assert not model.built
    cb = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.6, 0, 6, frequency=3))
    history = model.fit(x[:320], y[:320], batch_size=32, epochs=2, callbacks=[cb], verbose=0)
    assert sorted(t.path for t in cb.targets) == sorted(
        [model.block.inner.kernel.path, model.head.kernel.path]
    )
    assert [h["step"] for h in cb.history][-2:] == [3, 6]
    assert history.history["sparsity"][-1] == cb.sparsity == pytest.approx(0.6, abs=0.01)
    for t in cb.targets:
        w = keras.ops.convert_to_numpy(t.variable.value)
        assert np.all(w[keras.ops.convert_to_numpy(t.mask.value) == 0] == 0.0)
    assert kp.sparsity_report(model)["total"]["sparsity"] == pytest.approx(0.6, abs=0.01)


BIT_EXACT_CASES = [
    (0.0, 0.8, 0, 2000, 3, 100),
    (0.1, 0.9, 50, 1000, 3, 100),
    (0.3, 0.95, 7, 2513, 3, 1),
    (0.2, 0.85, 300, 1700, 1, 100),
    (0.0, 0.6, 100, 2600, 0.5, 10),
    (0.05, 0.7, 0, 2600, 2, 100),
    (0.0, 0.9, 250, 2250, 4, 50),
    (0.15, 0.75, 0, 1999, 1.5, 100),
]


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("args", BIT_EXACT_CASES)
def test_polynomial_decay_bit_exact_with_tfmot_every_step(args):
    # Regression: 1-ulp differences on hundreds of the 2,601 steps. tfmot's schedule gives two
    # answers: eager TF divides; inside a tf.function (how tfmot evaluates it in training)
    # Grappler multiplies by the reciprocal and rewrites pow(x, 2 | 3 | 0.5). Ours is the
    # latter, and `_polynomial_sparsity(..., in_graph=False)` reproduces the former.
    import tensorflow as tf

    from keras_perf.pruning._polynomial import _polynomial_sparsity

    theirs = tfmot().sparsity.keras.PolynomialDecay(*args)
    ours = kp.PolynomialDecay(*args)
    steps = np.arange(0, 2601)
    graph_fn = tf.function(lambda s: theirs(s))
    eager, graph, should = [], [], []
    for s in steps:
        eager.append(theirs(tf.constant(s, tf.int64))[1].numpy())
        g_should, g_sparsity = graph_fn(tf.constant(s, tf.int64))
        graph.append(g_sparsity.numpy())
        should.append(bool(g_should.numpy()))
    eager, graph = np.array(eager, np.float32), np.array(graph, np.float32)
    got = [ours(int(s)) for s in steps]
    np.testing.assert_array_equal(np.array([g[1] for g in got], np.float32), graph)
    assert [g[0] for g in got] == should
    in_eager = np.array([_polynomial_sparsity(ours, int(s), in_graph=False) for s in steps])
    np.testing.assert_array_equal(in_eager.astype(np.float32), eager)
    assert 0 < np.max(np.abs(eager - graph)) < 1e-6  # tfmot differs from itself, slightly


@pytest.mark.backends("tensorflow")
def test_schedule_configs_load_in_tfmot_and_keras():
    import tensorflow as tf

    mot = tfmot().sparsity.keras
    cases = [
        (kp.PolynomialDecay(0.1, 0.8, 10, 500, power=2, frequency=25), mot.PolynomialDecay),
        (kp.ConstantSparsity(0.6, 5, 300, 7), mot.ConstantSparsity),
    ]
    for ours, theirs_cls in cases:
        theirs = theirs_cls.from_config(ours.get_config())
        assert theirs.get_config()["config"] == {**ours.get_config()}
        in_fit = tf.function(theirs)
        for s in (0, 5, 10, 12, 35, 100, 300, 500, 600):
            should, sparsity = in_fit(tf.constant(s, tf.int64))
            assert ours(s) == (bool(should.numpy()), float(sparsity.numpy())), s
        # tfmot's own nested form loads into ours, and ours through Keras' (de)serialiser.
        again = type(ours).from_config(theirs.get_config())
        assert again.get_config() == ours.get_config()
        restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(ours))
        assert type(restored) is type(ours) and restored.get_config() == ours.get_config()


def test_schedule_config_is_plain_json():
    import json

    ours = kp.PolynomialDecay(np.float32(0.25), np.float64(0.75), np.int64(3), 40, np.int32(2))
    config = ours.get_config()
    assert json.loads(json.dumps(config)) == config
    assert type(config["begin_step"]) is int and type(config["initial_sparsity"]) is float


def test_exclude_matching_nothing_is_an_error(digits):
    (x, y), _ = digits
    model = compile_(mlp())
    cb = kp.PruningCallback(kp.ConstantSparsity(0.5), exclude=["logitz"])
    with pytest.raises(ValueError, match=r"`exclude` item 'logitz' matches no prunable.*logits"):
        model.fit(x[:32], y[:32], epochs=1, callbacks=[cb], verbose=0)


def test_masks_survive_backup_and_restore_before_the_next_update(digits, tmp_path):
    # Interrupted after step 20, resumed: steps 20-24 (before the next update at 25) run with
    # the pattern that existed at the interruption, not with all-ones masks.
    (x, y), _ = digits
    schedule = kp.PolynomialDecay(0.0, 0.7, begin_step=5, end_step=35, frequency=10)

    def run(extra):
        keras.utils.set_random_seed(3)
        model = compile_(mlp())
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        pruning, spy = kp.PruningCallback(schedule), WeightsAtBatchEnd(5)
        model.fit(x[:320], y[:320], batch_size=32, epochs=4, verbose=0, shuffle=False,
                  callbacks=[pruning, backup, spy, *extra])  # fmt: skip
        return model, pruning, spy

    with pytest.raises(RuntimeError, match="interrupted"):
        _, first, first_spy = run([Interrupt()])
    _, pruning, spy = run([])
    assert [h["step"] for h in pruning.history] == [25, 35]
    pattern = {p: w == 0 for p, w in spy.seen[0].items()}  # after step 20
    zeros = np.mean(np.concatenate([z.ravel() for z in pattern.values()]))
    assert zeros == pytest.approx(schedule(15)[1], abs=0.01) and zeros > 0.3
    for seen in spy.seen:
        for p, z in pattern.items():
            assert np.all(seen[p][z] == 0.0)


def test_initial_epoch_resume_after_load(digits, tmp_path):
    (x, y), _ = digits
    schedule = kp.PolynomialDecay(0.0, 0.6, begin_step=0, end_step=30, frequency=10)
    model = compile_(mlp())
    with pytest.warns(kp.KerasPerfWarning, match="end_step=30 lies beyond"):  # steps 0-19
        model.fit(x[:320], y[:320], batch_size=32, epochs=2, verbose=0,
                  callbacks=[kp.PruningCallback(schedule)])  # fmt: skip
    path = str(tmp_path / "mid.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    cb = kp.PruningCallback(schedule)
    history = loaded.fit(
        x[:320], y[:320], batch_size=32, epochs=4, initial_epoch=2, verbose=0, callbacks=[cb]
    )  # fmt: skip  steps 20-39
    assert [h["step"] for h in cb.history] == [20, 30]
    assert history.history["sparsity"][-1] == pytest.approx(0.6, abs=0.01)
    assert kp.sparsity_report(loaded)["total"]["sparsity"] == pytest.approx(0.6, abs=0.01)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: kp.ConstantSparsity(float("nan")), ValueError, "target_sparsity"),
        (lambda: kp.PolynomialDecay(0.0, 0.5, 0, 10, power=float("nan")), ValueError, "power"),
        (lambda: kp.PolynomialDecay(0.0, 0.5, 0, 10, power=0), ValueError, r"power.*\(0\.0, inf\)"),
        (lambda: kp.PolynomialDecay(0.0, 0.5, 0, 10, frequency=0), ValueError, "frequency"),
        (lambda: kp.PolynomialDecay(0.0, 0.5, 0, 10, frequency=2.0), TypeError, "frequency"),
        (lambda: kp.ConstantSparsity(0.5, 0, end_step=-2), ValueError, "end_step"),
    ],
)
def test_more_schedule_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()
