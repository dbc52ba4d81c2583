"""Pairs of pieces through kill-and-resume and save/load (issue 35's property test, part two).

tests/test_channel_pruning_edges.py drives the callback pieces against each other (channel and
magnitude pruning, early stopping). Here each model-level piece (keras-perf's train step
skipping a non-finite step, a `kp.quantize_aware` model, a `kp.DistillationModel`) meets each
callback piece (magnitude pruning, `kp.EarlyStopping` with its `backup_dir`), with
`BackupAndRestore` listed first or last: a run interrupted at an epoch boundary and resumed
with new callbacks ends with the uninterrupted run's weights, and the finished model saved
and loaded keeps them. (Channel pruning refuses a QAT model and a subclassed one: tested
with its messages in test_channel_pruning_edges.py.)

`kp.fit_with_oom_retry` meets the same pieces: an out-of-memory error injected mid-epoch and
recovered by the ladder ends where a run with the winning setting from the start ends (weights,
QAT ranges, pruning masks, early-stopping state), and a retrying run killed and resumed ends
where the uninterrupted retrying run does. `kp.shrink` after channel pruning meets an adapted
`Normalization`, BatchNormalization, `kp.loss_scaled` settings and `kp.quantize_aware`: the
shrunk model computes what the masked one computes and keeps its state through save/load.
"""

import keras
import numpy as np
import pytest

import keras_perf as kp
from tests import models

# The slow tier, TensorFlow only (`.ci/run` leaves `pairs_of_pieces` out on JAX and torch):
# 12 cases of three 4-epoch fits, 5 of four with OOM retry and one shrink case, on code whose
# backend parts the fast tests cover (all pass on JAX and torch too, run by hand).
pytestmark = pytest.mark.slow

XS = np.random.default_rng(2).random((64, 12)).astype("float32")
YS = np.random.default_rng(3).integers(0, 3, 64)
# One example of the second batch of 16 has a NaN weight: its loss is not finite, so keras-
# perf's train step skips that step in every epoch.
SW = np.ones(64, "float32")
SW[20] = np.nan
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(model_piece):
    keras.utils.set_random_seed(5)
    model = models.mlp([16, 16], 12, 3, activation="relu", hidden_names=["a", "b"])
    if model_piece == "skipped_steps":
        model = kp.loss_scaled(model)
    elif model_piece == "qat":
        model = kp.quantize_aware(model)
    else:
        teacher = models.mlp([32], 12, 3)
        model = kp.DistillationModel(model, teacher, temperature=2.0, alpha=0.5)
        model.compile(keras.optimizers.Adam(0.01))
        return model
    model.compile(keras.optimizers.Adam(0.01), LOSS)
    return model


def callback(name, directory):
    if name == "magnitude":
        return kp.PruningCallback(kp.PolynomialDecay(0.0, 0.6, 0, 8, frequency=2))
    return kp.EarlyStopping("loss", patience=5, restore_best_weights=True, backup_dir=directory)


class InterruptAtEpoch2(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def weights(model):
    return [np.array(w) for w in model.get_weights()]


@pytest.mark.parametrize("backup_first", [True, False])
@pytest.mark.parametrize("callback_piece", ["magnitude", "early_stopping"])
@pytest.mark.parametrize("model_piece", ["skipped_steps", "qat", "distillation"])
def test_pairs_of_pieces_with_a_model_piece_resume_and_reload(
    model_piece, callback_piece, backup_first, tmp_path
):
    def run(directory, extra=()):
        model = build(model_piece)
        backup = keras.callbacks.BackupAndRestore(str(directory))
        piece = callback(callback_piece, str(directory))
        callbacks = [backup, piece] if backup_first else [piece, backup]
        kwargs = {"sample_weight": SW} if model_piece == "skipped_steps" else {}
        history = model.fit(XS, YS, batch_size=16, epochs=4, shuffle=False, verbose=0,
                            callbacks=[*callbacks, *extra], **kwargs)  # fmt: skip
        return model, history

    reference, history = run(tmp_path / "reference")
    if model_piece == "skipped_steps":
        assert history.history["skipped_steps"] == [1.0] * 4  # the poisoned step, each epoch
    with pytest.raises(RuntimeError, match="interrupted"):
        run(tmp_path / "resumed", [InterruptAtEpoch2()])
    resumed, _ = run(tmp_path / "resumed")
    expected = weights(reference)
    assert all(np.isfinite(w).all() for w in expected)
    for a, b in zip(weights(resumed), expected, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    if callback_piece == "magnitude":
        # Pruning took hold: the (student's) three kernels are 60 % zeros, a teacher's none.
        zeros = [float(np.mean(w == 0)) for w in expected if w.ndim == 2]
        assert sum(z > 0.55 for z in zeros) == 3, zeros
    path = tmp_path / "model.keras"
    reference.save(path)
    loaded = keras.saving.load_model(path)
    for a, b in zip(weights(loaded), expected, strict=True):
        np.testing.assert_array_equal(a, b)


# -- OOM retry ---------------------------------------------------------------------------------
class OOMUntil(keras.callbacks.Callback):
    """Raises the backend's own OOM error at every step from `(epoch, batch)` on until the
    model being fitted has `setting` (its `(remat, microbatches)`), as an allocator would.

    Listed last, so every other callback's batch hook has run, as before a real step fails.
    `fit_with_oom_retry` points the callbacks at the model it retries with (`set_model`).
    """

    def __init__(self, epoch, batch, setting):
        super().__init__()
        self.at, self.setting, self.epoch = (epoch, batch), setting, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        model = self.model
        setting = (getattr(model, "remat", None), getattr(model, "microbatches", 1))
        if (self.epoch, batch) >= self.at and setting != self.setting:
            raise kp.backend.oom_error("Out of memory while trying to allocate 1GiB (injected).")


# The ladder's first rung for each model piece: micro-batches where every layer treats the
# examples independently (exact), remat for a QAT model (its ranges are the batch's min/max:
# micro-batches would update them per slice).
WINNING = {
    "skipped_steps": ("microbatches", (None, 2)),
    "qat": ("remat", ("full", 1)),
    "distillation": ("microbatches", (None, 2)),
}


def es_piece(directory):
    # mode="max" on the loss: the best epoch is the first, so restoring it (under the pruning
    # masks of the last epoch) is visible.
    return kp.EarlyStopping(
        "loss", mode="max", patience=5, restore_best_weights=True, backup_dir=directory
    )


def es_state(es):
    return (es.best_epoch, es.wait, es.stopped_epoch, es.stop_reason)


# Both orders for a model with the train step (it retries itself) and for a stock one (a
# `kp.loss_scaled` twin retries): BackupAndRestore first or last, pruning before or after
# early stopping. Distillation (a model with the train step) in one order, for time.
@pytest.mark.parametrize(
    "model_piece, order",
    [("skipped_steps", "backup_pruning_es"), ("skipped_steps", "es_pruning_backup"),
     ("qat", "backup_pruning_es"), ("qat", "es_pruning_backup"),
     ("distillation", "es_pruning_backup")],
)  # fmt: skip
def test_oom_retry_with_pieces_equals_the_winning_setting_and_resumes(model_piece, order, tmp_path):
    strategy, setting = WINNING[model_piece]

    def run(directory, fit, oom_at=None, extra=(), model_setting=None):
        model = build(model_piece)
        if model_setting is not None:  # the winning setting from the start
            model = kp.loss_scaled(model, remat=model_setting[0], microbatches=model_setting[1])
        backup = keras.callbacks.BackupAndRestore(str(directory))
        # Mask updates at steps 1, 3, 5, 7: epoch 0 (steps 0-3) starts without one and has
        # two, so its retry must start from the masks its first attempt started from.
        pruning = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.6, 1, 7, frequency=2))
        es = es_piece(str(directory))
        callbacks = [backup, pruning, es] if order == "backup_pruning_es" else [es, pruning, backup]
        oom = [] if oom_at is None else [OOMUntil(*oom_at, setting)]
        kwargs = {"sample_weight": SW} if model_piece == "skipped_steps" else {}
        history = fit(model, XS, YS, batch_size=16, epochs=4, shuffle=False, verbose=0,
                      callbacks=[*callbacks, *extra, *oom], **kwargs)  # fmt: skip
        return model, history, pruning, es

    reference, ref_history, ref_pruning, ref_es = run(
        tmp_path / "reference", keras.Model.fit, model_setting=setting
    )
    # The OOM comes at the last step of epoch 0, after two mask updates in that epoch: the
    # epoch is rolled back and retried with the winning setting, so the run is the
    # reference's to float rounding.
    model, history, pruning, es = run(tmp_path / "retry", kp.fit_with_oom_retry, oom_at=(0, 3))
    assert [(e["epoch"], e["strategy"]) for e in history.oom_events] == [(0, strategy)]
    assert (getattr(history.model, "remat", None), history.model.microbatches) == setting
    assert history.epoch == [0, 1, 2, 3]
    expected = weights(reference)
    assert all(np.isfinite(w).all() for w in expected)
    for a, b in zip(weights(model), expected, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for key in ("loss", "sparsity") + (
        ("skipped_steps",) if model_piece == "skipped_steps" else ()
    ):
        np.testing.assert_allclose(history.history[key], ref_history.history[key], rtol=1e-5)
    # The callbacks' masks (keyed by auto-generated layer names, which differ between builds).
    masks = list(pruning.state_dict()["masks"].values())
    ref_masks = list(ref_pruning.state_dict()["masks"].values())
    assert len(masks) == len(ref_masks) == 3
    for mask, ref_mask in zip(masks, ref_masks):
        np.testing.assert_array_equal(mask, ref_mask)
    # The best epoch (the first) restored under the last masks: 60 % zeros, as logged.
    assert es_state(es) == es_state(ref_es) and es.best_epoch == 0
    assert es.best == pytest.approx(ref_es.best, rel=1e-6)
    zeros = [float(np.mean(w == 0)) for w in weights(model) if w.ndim == 2]
    assert sum(z > 0.55 for z in zeros) == 3, zeros

    # Killed at epoch 2 after an OOM in epoch 0, resumed with new callbacks; the resumed run
    # runs out of memory in epoch 3, a later epoch than the one it resumed at (its epoch 2
    # runs unsliced: the same updates to float rounding, after the last mask update).
    with pytest.raises(RuntimeError, match="interrupted"):
        run(tmp_path / "resumed", kp.fit_with_oom_retry, (0, 3), [InterruptAtEpoch2()])
    resumed, resumed_history, _, resumed_es = run(
        tmp_path / "resumed", kp.fit_with_oom_retry, oom_at=(3, 1)
    )
    assert [(e["epoch"], e["strategy"]) for e in resumed_history.oom_events] == [(3, strategy)]
    assert resumed_history.epoch == [2, 3]
    steps = int(reference.optimizer.iterations)  # 16 (12: skipped steps do not count)
    assert int(resumed.optimizer.iterations) == int(model.optimizer.iterations) == steps
    assert es_state(resumed_es) == es_state(es)
    for a, b in zip(weights(resumed), weights(model), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)

    # The model that finished the run saves and loads with its setting and weights.
    path = tmp_path / "retried.keras"
    history.model.save(path)
    loaded = keras.saving.load_model(path)
    assert (getattr(loaded, "remat", None), loaded.microbatches) == setting
    for a, b in zip(weights(loaded), weights(model), strict=True):
        np.testing.assert_array_equal(a, b)


# -- shrink ------------------------------------------------------------------------------------
SHRINK_X = 3.0 + 2.0 * XS  # inputs around 4: an adapted Normalization matters


def shrink_subject():
    """Adapted Normalization, Dense, BatchNormalization, ReLU, Dense, Dense behind keras-perf's
    train step with micro-batches, clipping and remat, channel-pruned for 3 epochs."""
    keras.utils.set_random_seed(5)
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(SHRINK_X)
    inp = keras.Input((12,))
    h = keras.layers.Dense(16, name="a")(norm(inp))
    # momentum=0.5: the moving statistics move far from their start in a few steps.
    h = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.5, name="bn")(h))
    h = keras.layers.Dense(16, activation="relu", name="b")(h)
    model = keras.Model(inp, keras.layers.Dense(3, name="out")(h))
    model = kp.loss_scaled(model, microbatches=2, clipnorm=1.0, remat="full")
    model.compile(keras.optimizers.Adam(0.01), LOSS)
    pruning = kp.ChannelPruningCallback(kp.PolynomialDecay(0.0, 0.5, 0, 8, frequency=2))
    model.fit(SHRINK_X, YS, batch_size=16, epochs=3, shuffle=False, verbose=0,
              callbacks=[pruning])  # fmt: skip
    return model


def settings(model):
    names = ("microbatches", "clipnorm", "remat", "remat_threshold", "initial_scale",
             "dynamic_growth_steps")  # fmt: skip
    return {name: getattr(model, name) for name in names}


def predict(model, x=SHRINK_X):
    return keras.ops.convert_to_numpy(model(x, training=False))


def test_shrink_with_normalization_batchnorm_loss_scaled_settings_qat_and_reload(tmp_path):
    model = shrink_subject()
    small = kp.shrink(model)
    assert small.get_layer("a").units < 16 and small.get_layer("b").units < 16
    assert isinstance(small, kp.LossScaledModel) and settings(small) == settings(model)
    np.testing.assert_allclose(predict(small), predict(model), atol=1e-5)
    # Every non-trainable state: the Normalization's statistics, BN's on the kept channels.
    kept = np.flatnonzero(np.any(np.array(model.get_layer("a").kernel) != 0, axis=0))
    assert len(kept) == small.get_layer("a").units
    for name in ("mean", "variance"):
        np.testing.assert_array_equal(getattr(small.get_layer("norm"), name),
                                      getattr(model.get_layer("norm"), name))  # fmt: skip
    for name in ("moving_mean", "moving_variance"):
        big = np.array(getattr(model.get_layer("bn"), name))
        np.testing.assert_array_equal(np.array(getattr(small.get_layer("bn"), name)), big[kept])
    moved = np.array(model.get_layer("bn").moving_variance)[kept]
    assert float(np.abs(moved - 1.0).max()) > 0.1, moved  # not the initial statistics

    # Trained on, the shrunk model takes the masked model's steps (a removed channel has zero
    # gradients: its gamma and its consumers' rows are zero), with the same settings: two
    # micro-batches per step, each normalised with its own statistics, clipped.
    for m in (model, small):
        m.compile(keras.optimizers.SGD(0.1), LOSS)  # Adam would magnify float rounding
        m.fit(SHRINK_X, YS, batch_size=16, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(predict(small), predict(model), atol=1e-5)
    loaded = keras.saving.load_model(_saved(small, tmp_path / "small.keras"))
    assert settings(loaded) == settings(small)
    np.testing.assert_array_equal(predict(loaded), predict(small))

    # Prune, shrink, then quantize: the QAT model of the shrunk model computes what the QAT
    # model of the masked one computes, ranges from the same batch.
    qat, qat_masked = kp.quantize_aware(small), kp.quantize_aware(model)
    assert settings(qat) == settings(small)
    for m in (qat, qat_masked):
        m(SHRINK_X, training=True)
    np.testing.assert_allclose(predict(qat), predict(qat_masked), atol=1e-5)
    qat.compile(keras.optimizers.Adam(0.01), LOSS)
    qat.fit(SHRINK_X, YS, batch_size=16, epochs=1, shuffle=False, verbose=0)
    loaded = keras.saving.load_model(_saved(qat, tmp_path / "qat.keras"))
    assert settings(loaded) == settings(qat)
    np.testing.assert_array_equal(predict(loaded), predict(qat))
    for a, b in zip(weights(loaded), weights(qat), strict=True):
        np.testing.assert_array_equal(a, b)


def _saved(model, path):
    model.save(path)
    return path
