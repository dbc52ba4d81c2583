"""Pairs of pieces through kill-and-resume and save/load (issue 35's property test, part two).

tests/test_channel_pruning_edges.py drives the callback pieces against each other (channel and
magnitude pruning, early stopping). Here each model-level piece (keras-perf's train step
skipping a non-finite step, a `kp.quantize_aware` model, a `kp.DistillationModel`) meets each
callback piece (magnitude pruning, `kp.EarlyStopping` with its `backup_dir`), with
`BackupAndRestore` listed first or last: a run interrupted at an epoch boundary and resumed
with new callbacks ends with the uninterrupted run's weights, and the finished model saved
and loaded keeps them. (Channel pruning refuses a QAT model and a subclassed one: tested
with its messages in test_channel_pruning_edges.py.)
"""

import keras
import numpy as np
import pytest

import keras_perf as kp
from tests import models

# The slow tier, TensorFlow only (`.ci/run` leaves `pairs_of_pieces` out on JAX and torch):
# 12 cases of three 4-epoch fits, on code whose backend parts the fast tests cover.
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
