"""kp.EarlyStopping and kp.TimeLimit: Keras parity, extra criteria, time budget, resume."""

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf.stopping import _time_limit as time_limit
from tests import models

BACKEND = keras.backend.backend()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- scripted logs
class FakeModel:
    """Stands in for a model when hooks are driven directly: its 'weights' are the epoch."""

    def __init__(self):
        self.stop_training = False
        self.metrics = []
        self.w = np.zeros(1)

    def get_weights(self):
        return [self.w.copy()]

    def set_weights(self, weights):
        self.w = np.array(weights[0])


def drive(cb, values, key="val_loss", losses=None, model=None, start=0):
    """Feed `values` (one per epoch) through `cb`'s hooks; return (last epoch, final weight)."""
    model = model or FakeModel()
    cb.set_model(model)
    cb.on_train_begin()
    epoch = start - 1
    for epoch in range(start, len(values)):
        model.w = np.array([float(epoch)])
        cb.on_epoch_begin(epoch)
        logs = {"loss": 1.0 if losses is None else losses[epoch]}
        if values[epoch] is not None:
            logs[key] = values[epoch]
        cb.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    cb.on_train_end()
    return epoch, float(model.w[0])


def _sequences():
    rng = np.random.default_rng(7)
    seqs = {
        "down_then_flat": [40, 30, 25, 24, 24, 25, 23, 23, 26, 27, 28, 22, 30, 31, 32],
        "monotone": list(range(60, 45, -1)),
        "zigzag": [20, 30, 10, 40, 9, 50, 8, 60, 60, 61, 62, 7, 70, 71, 72],
    }
    for i in range(3):
        seqs[f"walk{i}"] = list(np.cumsum(rng.integers(-4, 5, size=18)) + 64)
    # Multiples of 1/64: exact in float32 and float64, so Keras' float32 comparisons and ours agree.
    return {k: [float(v) / 64.0 for v in s] for k, s in seqs.items()}


SEQUENCES = _sequences()
CONFIGS = [
    dict(patience=p, min_delta=d, mode=m, baseline=b, start_from_epoch=s)
    for p in (0, 1, 3)
    for d in (0.0, 1 / 32)
    for m in ("auto", "min", "max")
    for b in (None, "mid")
    for s in (0, 2)
]


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_parity_with_keras_early_stopping(name):
    values = SEQUENCES[name]
    for config in CONFIGS:
        config = dict(config, restore_best_weights=True)
        key = "val_accuracy" if config["mode"] == "max" else "val_loss"
        if config["baseline"] == "mid":
            config["baseline"] = float(np.median(values))
        ours = kp.EarlyStopping(monitor=key, **config)
        theirs = keras.callbacks.EarlyStopping(monitor=key, **config)
        got, want = drive(ours, values, key), drive(theirs, values, key)
        assert got == want, (name, config)
        assert ours.stopped_epoch == theirs.stopped_epoch, (name, config)
        assert ours.best_epoch == theirs.best_epoch, (name, config)
        assert ours.best == pytest.approx(float(theirs.best)), (name, config)
        assert ours.stop_reason == ("patience" if theirs.stopped_epoch else None)


def test_stopping_threshold_min_and_max():
    es = kp.EarlyStopping(patience=10, stopping_threshold=0.2, restore_best_weights=True)
    assert drive(es, [1.0, 0.5, 0.2, 0.1]) == (2, 2.0)
    assert (es.stop_reason, es.stopped_epoch, es.best, es.best_epoch) == ("threshold", 2, 0.2, 2)
    es = kp.EarlyStopping("val_accuracy", patience=10, mode="max", stopping_threshold=0.9)
    assert drive(es, [0.5, 0.89, 0.91, 0.95], key="val_accuracy")[0] == 2
    assert es.stop_reason == "threshold"


def test_divergence_restores_the_best_epoch():
    es = kp.EarlyStopping(patience=10, divergence_threshold=3.0, restore_best_weights=True)
    assert drive(es, [2.0, 1.0, 1.5, 3.0, 0.1]) == (3, 1.0)  # stopped at 3, weights of epoch 1
    assert (es.stop_reason, es.best_epoch, es.best) == ("divergence", 1, 1.0)


@pytest.mark.parametrize(
    "values, losses, stop",
    [
        ([1.0, 0.5, math.nan, 0.1], None, 2),
        ([1.0, 0.5, math.inf, 0.1], None, 2),
        ([1.0, 0.5, 0.4, 0.1], [1.0, math.nan, 1.0, 1.0], 1),
    ],
)
def test_non_finite_stops_and_never_becomes_best(values, losses, stop):
    es = kp.EarlyStopping(patience=10, restore_best_weights=True, check_finite=True)
    last, weight = drive(es, values, losses=losses)
    assert (last, es.stop_reason, es.stopped_epoch) == (stop, "non_finite", stop)
    assert math.isfinite(es.best) and weight == es.best_epoch == stop - 1


def test_defaults_behave_like_keras_on_nan_and_inf():
    # Regression: check_finite used to default to True, stopping at the NaN where Keras trains
    # on (and watching `loss` too while monitoring `val_loss`).
    values = [1.0, 0.5, math.nan, 0.6, 0.7]
    ours = kp.EarlyStopping(patience=2)
    theirs = keras.callbacks.EarlyStopping(patience=2)
    assert drive(ours, values) == drive(theirs, values) == (3, 3.0)
    assert ours.stop_reason == "patience" and ours.check_finite is False
    losses = [1.0, math.nan, math.inf, 1.0, 1.0, 1.0]
    values = [3.0, 2.0, 1.0, 0.5, 0.4, 0.3]
    ours, theirs = kp.EarlyStopping(), keras.callbacks.EarlyStopping()
    assert drive(ours, values, losses=losses) == drive(theirs, values, losses=losses) == (5, 5.0)
    assert ours.stop_reason is None and ours.best == 0.3


def test_relative_delta():
    values = [10.0, 9.5, 9.2, 8.9, 8.0]
    absolute = kp.EarlyStopping(patience=0, min_delta=0.1)
    relative = kp.EarlyStopping(patience=0, min_delta=0.1, relative_delta=True)
    assert drive(absolute, values)[0] == 4  # every step beats best - 0.1
    assert drive(relative, values)[0] == 1  # 9.5 does not beat 10 - 10% = 9.0
    assert relative.best == 10.0 and relative.stop_reason == "patience"


def test_thresholds_wait_for_start_from_epoch_but_non_finite_does_not():
    es = kp.EarlyStopping(stopping_threshold=0.5, start_from_epoch=3, patience=5)
    assert drive(es, [0.1, 0.2, 0.3, 0.4, 0.9])[0] == 3
    es = kp.EarlyStopping(start_from_epoch=3, check_finite=True)
    assert drive(es, [0.1, math.nan, 0.3, 0.4])[0] == 1 and es.stop_reason == "non_finite"


def test_missing_key_warns_once_naming_the_keys():
    # (In mode="auto" a misspelt monitor raises at the first epoch, as in Keras.)
    es = kp.EarlyStopping(monitor="val_los", patience=0, mode="min")
    with pytest.warns(
        kp.KerasPerfWarning, match=r"`val_los`.*Keys available: loss, val_loss"
    ) as rec:
        assert drive(es, [3.0, 2.0, 1.0], key="val_loss") == (2, 2.0)
    assert len([w for w in rec if issubclass(w.category, kp.KerasPerfWarning)]) == 1
    assert es.stop_reason is None
    with pytest.raises(KeyError, match=r"`val_los`.*Keys available: loss, val_loss"):
        drive(kp.EarlyStopping(monitor="val_los", mode="min", strict=True), [3.0], key="val_loss")


def test_state_dict_resume_equals_uninterrupted_and_instance_is_reusable():
    values = [10.0, 9.0, 8.0, 8.5, 7.5, 7.6, 7.7, 7.8, 7.9, 8.0, 8.1, 8.2]
    whole = kp.EarlyStopping(patience=3, min_delta=0.05, restore_best_weights=True)
    assert drive(whole, values) == (7, 4.0)

    first = kp.EarlyStopping(patience=3, min_delta=0.05, restore_best_weights=True)
    first.set_model(FakeModel())
    first.on_train_begin()
    for epoch in range(6):  # interrupted after epoch 5: best at 4, one epoch waited
        first.model.w = np.array([float(epoch)])
        first.on_epoch_end(epoch, {"val_loss": values[epoch], "loss": 1.0})
    state = first.state_dict()
    weights = state.pop("best_weights")
    state = json.loads(json.dumps(state))  # the scalars are JSON-serialisable
    assert (state["wait"], state["best_epoch"], state["epoch"]) == (1, 4, 5)
    state["best_weights"] = weights

    resumed = kp.EarlyStopping(patience=3, min_delta=0.05, restore_best_weights=True)
    resumed.load_state_dict(state)
    assert drive(resumed, values, start=6) == (7, 4.0)
    assert (resumed.best_epoch, resumed.best, resumed.stopped_epoch) == (4, 7.5, 7)
    # Without the state the resumed run would pick epoch 6 as its best and stop later.
    assert drive(kp.EarlyStopping(patience=3, min_delta=0.05), values, start=6)[0] == 9
    # The same instance in a second fit starts afresh (reset on train begin).
    assert drive(resumed, values) == (7, 4.0) and resumed.best_epoch == 4


def test_serialization_round_trip():
    es = kp.EarlyStopping(
        "val_accuracy",
        0.01,
        2,
        1,
        "max",
        0.5,
        True,
        1,
        relative_delta=True,
        stopping_threshold=0.99,
        divergence_threshold=0.1,
        check_finite=False,
        strict=True,
        backup_dir="ckpt",
    )
    tl = kp.TimeLimit(
        3600,
        restore_best_weights=True,
        monitor="loss",
        mode="min",
        granularity="batch",
        backup_dir="ckpt",
    )
    for cb in (es, tl):
        clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(cb))
        assert type(clone) is type(cb) and clone.get_config() == cb.get_config()
    assert es.get_config()["stopping_threshold"] == 0.99 and tl.get_config()["seconds"] == 3600.0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(patience=-1), ValueError, r"`patience` must be an integer >= 0, got -1"),
        (dict(patience=1.5), TypeError, r"`patience` must be an integer"),
        (dict(mode="best"), ValueError, r"`mode` must be one of 'auto', 'min', 'max'; got 'best'"),
        (dict(min_delta=-0.1), ValueError, r"`min_delta` must be in \[0.0, inf\)"),
        (dict(start_from_epoch=-2), ValueError, r"`start_from_epoch` must be an integer >= 0"),
        (dict(stopping_threshold=math.nan), ValueError, r"`stopping_threshold` must be in"),
        (dict(monitor=""), TypeError, r"`monitor` must be a non-empty string"),
        (
            dict(mode="min", stopping_threshold=1.0, baseline=0.5),
            ValueError,
            r"`stopping_threshold` \(1.0\) must not be higher than `baseline` \(0.5\)",
        ),
        (
            dict(mode="min", divergence_threshold=0.4, baseline=0.5),
            ValueError,
            r"`divergence_threshold` \(0.4\) must be higher than `baseline`",
        ),
        (
            dict(mode="min", stopping_threshold=2.0, divergence_threshold=1.0),
            ValueError,
            r"`stopping_threshold` \(2.0\) must be lower than `divergence_threshold` \(1.0\)",
        ),
        (
            dict(mode="max", monitor="acc", stopping_threshold=0.4, baseline=0.5),
            ValueError,
            r"must not be lower than `baseline`",
        ),
        (
            dict(mode="max", monitor="acc", divergence_threshold=0.6, baseline=0.5),
            ValueError,
            r"`divergence_threshold` \(0.6\) must be lower than `baseline`",
        ),
        # mode="auto" on a loss: the direction is known at construction.
        (dict(monitor="loss", stopping_threshold=0.6, baseline=0.5), ValueError, r"in mode 'min'"),
        (dict(backup_dir=""), ValueError, r"`backup_dir` must be a directory path or None"),
        (dict(strict=1), TypeError, r"`strict` must be True or False"),
    ],
)
def test_early_stopping_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kp.EarlyStopping(**kwargs)


def test_unknown_direction_is_checked_at_first_epoch():
    # As Keras: in mode="auto" only `loss` and compiled metrics that declare a direction are
    # known; anything else raises at the first epoch (even when the key is missing).
    for monitor in ("val_score", "val_accuracy"):
        es = kp.EarlyStopping(monitor=monitor, stopping_threshold=0.4, baseline=0.5)
        with pytest.raises(
            ValueError, match=rf"monitor={monitor}, but Keras isn't able.*mode='max'"
        ):
            drive(es, [0.1], key=monitor)
        with pytest.raises(ValueError, match=r"isn't able to automatically determine"):
            drive(keras.callbacks.EarlyStopping(monitor=monitor), [0.1], key=monitor)
    # With the direction known at the first epoch (the compiled metric says "up"), the
    # arguments are checked against it before any decision.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    es = kp.EarlyStopping(monitor="accuracy", stopping_threshold=0.4, baseline=0.5)
    with pytest.raises(
        ValueError, match=r"must not be lower than `baseline` \(0.5\) in mode 'max'"
    ):
        model.fit(np.ones((4, 2)), np.zeros(4), epochs=1, callbacks=[es], verbose=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(seconds=0), ValueError, r"`seconds` must be in \(0.0, inf\), got 0.0"),
        (dict(seconds=-5), ValueError, r"`seconds` must be in \(0.0, inf\)"),
        (dict(seconds="1h"), TypeError, r"`seconds` must be a number"),
        (
            dict(seconds=10, granularity="step"),
            ValueError,
            r"`granularity` must be one of 'epoch', 'batch'",
        ),
        (dict(seconds=10, mode="up"), ValueError, r"`mode` must be one of"),
    ],
)
def test_time_limit_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kp.TimeLimit(**kwargs)


# ------------------------------------------------------------------- TimeLimit, fake clock
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_time_limit_stops_when_the_next_epoch_would_overrun(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(time_limit, "_now", clock)
    tl = kp.TimeLimit(44.0, restore_best_weights=True)
    model = FakeModel()
    tl.set_model(model)
    tl.on_train_begin()
    durations = [15.0, 10.0, 10.0, 10.0, 10.0]  # the first epoch compiles
    values = [3.0, 1.0, 2.0, 2.5, 0.5]
    for epoch, (d, v) in enumerate(zip(durations, values)):
        model.w = np.array([float(epoch)])
        tl.on_epoch_begin(epoch)
        clock.t += d
        tl.on_epoch_end(epoch, {"val_loss": v, "loss": v})
        if model.stop_training:
            break
    tl.on_train_end()
    # After epoch 2: 35 s spent, next epoch ~10 s -> 45 s > 44 s: stop there, not after.
    assert (epoch, tl.stopped_epoch, tl.stop_reason) == (2, 2, "time_limit")
    assert tl.elapsed == pytest.approx(35.0) and tl.next_epoch_estimate() == 10.0
    assert (tl.best_epoch, model.w[0]) == (1, 1.0)  # best weights restored


def test_time_limit_batch_granularity(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(time_limit, "_now", clock)
    tl = kp.TimeLimit(25.0, granularity="batch")
    model = FakeModel()
    tl.set_model(model)
    tl.on_train_begin()
    stopped_at = None
    for epoch in range(5):
        tl.on_epoch_begin(epoch)
        for batch in range(10):
            clock.t += 5.0 if (epoch, batch) == (0, 0) else 1.0
            tl.on_train_batch_end(batch)
            if model.stop_training:
                stopped_at = (epoch, batch)
                break
        clock.t += 3.0  # validation
        tl.on_epoch_end(epoch, {"loss": 1.0})
        if model.stop_training:
            break
    # Epoch 0 ends at 17 s (a whole epoch more would overrun, a batch does not); in epoch 1
    # batch k ends at 18+k s: stop once t + 1 s (a batch) + 3 s (validation) > 25 s.
    assert stopped_at == (1, 4) and tl.stopped_epoch == 1 and tl.stop_reason == "time_limit"
    assert clock.t - 1000.0 == 25.0


def test_time_limit_state_carries_the_elapsed_time(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(time_limit, "_now", clock)
    tl = kp.TimeLimit(100.0)
    tl.set_model(FakeModel())
    tl.on_train_begin()
    for epoch in range(3):
        clock.t += 20.0
        tl.on_epoch_end(epoch, {"loss": 1.0})
    state = tl.state_dict()
    assert state["elapsed"] == pytest.approx(60.0) and state["epoch"] == 2
    resumed = kp.TimeLimit(100.0)
    resumed.load_state_dict(state)
    clock.t += 500.0  # downtime does not count
    model = FakeModel()
    resumed.set_model(model)
    resumed.on_train_begin()
    clock.t += 20.0
    resumed.on_epoch_end(3, {"loss": 1.0})  # 80 s + 20 s estimate = 100 s: not over
    assert not model.stop_training
    clock.t += 20.0
    resumed.on_epoch_end(4, {"loss": 1.0})
    assert model.stop_training and resumed.elapsed == pytest.approx(100.0)


# ------------------------------------------------------------------- real fits
@pytest.fixture
def data(digits):
    (x, y), (xv, yv) = digits
    return x[:512], y[:512], xv, yv


def _model(lr=0.05, optimizer="sgd"):
    model = models.mlp([16], seed=3)
    opt = keras.optimizers.SGD(lr) if optimizer == "sgd" else keras.optimizers.Adam(lr)
    model.compile(
        opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    return model


class Record(keras.callbacks.Callback):
    """Keeps the weights after every epoch."""

    def on_train_begin(self, logs=None):
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(self.model.get_weights())


def _same(a, b):
    return all(np.allclose(u, v, atol=1e-6) for u, v in zip(a, b))


def test_fit_parity_with_keras_restored_weights(data):
    x, y, xv, yv = data
    runs = []
    for cls in (kp.EarlyStopping, keras.callbacks.EarlyStopping):
        model = _model(lr=1.0)
        es = cls(monitor="val_loss", patience=1, min_delta=0.002, restore_best_weights=True)
        hist = model.fit(
            x,
            y,
            validation_data=(xv, yv),
            batch_size=128,
            epochs=25,
            shuffle=False,
            callbacks=[es],
            verbose=0,
        )
        runs.append((len(hist.history["loss"]), es.best_epoch, model.get_weights()))
    assert runs[0][:2] == runs[1][:2]
    assert runs[0][0] < 25  # it did stop early
    assert _same(runs[0][2], runs[1][2])


def test_fit_threshold_on_val_accuracy_infers_max(data):
    x, y, xv, yv = data
    model = _model(lr=0.5)
    es = kp.EarlyStopping("val_accuracy", stopping_threshold=0.8, patience=50)
    hist = model.fit(
        x, y, validation_data=(xv, yv), batch_size=128, epochs=40, callbacks=[es], verbose=0
    )
    acc = hist.history["val_accuracy"]
    assert es.stop_reason == "threshold" and es.stopped_epoch == len(acc) - 1
    assert acc[-1] >= 0.8 and all(a < 0.8 for a in acc[:-1])


def _regression():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


# Stable for three epochs, then a learning rate that blows the weights up to Inf/NaN.
BLOW_UP = keras.callbacks.LearningRateScheduler(lambda epoch: 0.05 if epoch < 3 else 50.0)


def test_fit_non_finite_restores_finite_weights(data):
    x, y, xv, yv = data
    model = _regression()
    rec = Record()
    es = kp.EarlyStopping(
        monitor="val_loss", patience=50, restore_best_weights=True, check_finite=True
    )
    hist = model.fit(
        x,
        y.astype("float32"),
        validation_data=(xv, yv.astype("float32")),
        batch_size=32,
        epochs=20,
        shuffle=False,
        callbacks=[BLOW_UP, rec, es],
        verbose=0,
    )
    losses = hist.history["loss"]
    assert es.stop_reason == "non_finite" and len(losses) == 4 and not math.isfinite(losses[-1])
    assert es.best_epoch == 2 and es.best == hist.history["val_loss"][2]
    weights = model.get_weights()
    assert all(np.isfinite(w).all() for w in weights)
    assert _same(weights, rec.weights[2])


def test_fit_divergence_with_check_finite_off(data):
    x, y, _, _ = data
    model = _regression()
    es = kp.EarlyStopping("loss", divergence_threshold=100.0, check_finite=False, patience=50)
    hist = model.fit(
        x,
        y.astype("float32"),
        batch_size=32,
        epochs=20,
        shuffle=False,
        callbacks=[BLOW_UP, es],
        verbose=0,
    )
    losses = hist.history["loss"]
    assert es.stop_reason == "divergence" and es.stopped_epoch == 3 and len(losses) == 4
    assert max(losses[:3]) < 100.0 and not losses[3] < 100.0  # >= 100 or NaN


class Script(keras.callbacks.Callback):
    """Replaces `val_loss` by a scripted value (callbacks after it see the scripted logs)."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def on_epoch_end(self, epoch, logs=None):
        logs["val_loss"] = self.values[epoch]


class Interrupt(keras.callbacks.Callback):
    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("preempted")


def test_interrupt_and_resume_with_backup_and_restore(data, tmp_path):
    x, y, _, _ = data
    script = [
        5.0,
        4.0,
        3.0,
        3.5,
        2.9,
        3.1,
        3.2,
        3.3,
        3.4,
        3.5,
    ]  # best at 4; patience 2 -> stop at 6
    backup = str(tmp_path / "backup")

    def fit(model, es, extra=()):
        cbs = [Script(script), keras.callbacks.BackupAndRestore(backup), es, *extra]
        return model.fit(x, y, batch_size=128, epochs=10, shuffle=False, callbacks=cbs, verbose=0)

    def new_es():
        return kp.EarlyStopping(patience=2, restore_best_weights=True, backup_dir=backup)

    whole_model, whole = _model(optimizer="adam", lr=0.01), new_es()
    fit(whole_model, whole)
    assert (whole.stopped_epoch, whole.best_epoch, whole.stop_reason) == (6, 4, "patience")
    assert not os.path.exists(backup)

    model = _model(optimizer="adam", lr=0.01)
    with pytest.raises(RuntimeError, match="preempted"):
        fit(model, new_es(), extra=[Interrupt(5)])
    assert any(n.startswith("keras_perf_EarlyStopping") for n in os.listdir(backup))
    # A new process: fresh model and callbacks; BackupAndRestore and the state files resume it.
    model, es = _model(optimizer="adam", lr=0.01), new_es()
    hist = fit(model, es)
    assert len(hist.history["loss"]) == 2  # epochs 5 and 6
    assert (es.stopped_epoch, es.best_epoch, es.best, es.stop_reason) == (6, 4, 2.9, "patience")
    assert _same(model.get_weights(), whole_model.get_weights())
    assert not os.path.exists(backup)


class Sleep(keras.callbacks.Callback):
    def __init__(self, epoch_s=0.0, batch_s=0.0):
        super().__init__()
        self.epoch_s, self.batch_s = epoch_s, batch_s

    def on_epoch_begin(self, epoch, logs=None):
        time.sleep(self.epoch_s)

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.batch_s)


def test_fit_time_limit_ends_before_the_budget(data):
    x, y, xv, yv = data
    model = _model()
    # Compile first (train and validation), and time an epoch on this (possibly busy) machine.
    fit_kw = dict(validation_data=(xv, yv), batch_size=256, verbose=0)
    model.fit(x, y, epochs=1, **fit_kw)
    t0 = time.perf_counter()
    model.fit(x, y, epochs=2, callbacks=[Sleep(epoch_s=0.25)], **fit_kw)
    # About 4.6 epochs: a rule that waited for less than a whole epoch of room would run a 5th.
    budget = 4.6 * (time.perf_counter() - t0) / 2
    tl = kp.TimeLimit(budget, restore_best_weights=True)
    rec = Record()
    t0 = time.perf_counter()
    hist = model.fit(x, y, epochs=100, callbacks=[Sleep(epoch_s=0.25), rec, tl], **fit_kw)
    wall = time.perf_counter() - t0
    epochs = len(hist.history["loss"])
    assert tl.stop_reason == "time_limit" and 2 <= epochs < 100
    # The clock starts at on_train_begin, and the epochs' times add up to it.
    times = tl.epoch_times
    assert len(times) == epochs and sum(times) == pytest.approx(tl.elapsed, abs=1e-3)

    def estimate(done):  # the documented estimate: longest epoch, the first left out
        return max(done[1:]) if len(done) > 1 else done[0]

    # Each decision is the documented rule: go on while the next epoch is expected to fit...
    for n in range(1, epochs):
        assert sum(times[:n]) + estimate(times[:n]) <= budget
    # ...and stop at the first epoch after which it is not.
    assert tl.elapsed + tl.next_epoch_estimate() > budget
    # So the budget is overrun at most by how much the last epoch outran its estimate (on a
    # steady machine, not at all); fit's set-up before on_train_begin is not counted.
    assert tl.elapsed <= budget + max(0.0, times[-1] - estimate(times[:-1])) + 1e-6
    assert wall < 1.15 * tl.elapsed + 0.5
    assert _same(model.get_weights(), rec.weights[tl.best_epoch])
    assert tl.best == min(hist.history["val_loss"])


def test_fit_time_limit_batch_granularity_ends_mid_epoch(data):
    x, y, _, _ = data
    model = _model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    tl = kp.TimeLimit(1.0, granularity="batch")
    steps = []

    class Steps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            steps.append(0)

        def on_train_batch_end(self, batch, logs=None):
            steps[-1] += 1

    t0 = time.perf_counter()
    model.fit(
        x, y, batch_size=16, epochs=5, callbacks=[Sleep(batch_s=0.05), Steps(), tl], verbose=0
    )
    wall = time.perf_counter() - t0
    # 32 batches of >= 50 ms: the first epoch alone would overrun 1 s; it ends early instead.
    assert tl.stop_reason == "time_limit" and tl.stopped_epoch == 0
    assert 3 <= steps[0] < 32 and wall < 1.0 + 0.5


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_tf_distribute_replicas_share_the_decision():
    script = textwrap.dedent(
        """
        import json, os
        os.environ["KERAS_BACKEND"] = "tensorflow"
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
        import keras, numpy as np
        import keras_perf as kp
        from keras_perf.data import load_digits_split
        [(x, y)] = load_digits_split(seed=None, sizes=())  # scikit-learn's order
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(10)])
            model.compile(keras.optimizers.SGD(1.0),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        es = kp.EarlyStopping(patience=1, min_delta=0.002, restore_best_weights=True)
        h = model.fit(x[:512], y[:512], validation_data=(x[1437:], y[1437:]), batch_size=128,
                      epochs=25, shuffle=False, callbacks=[es], verbose=0)
        replicas_equal = all(
            all(np.array_equal(c.numpy(), v.value.values[0].numpy()) for c in v.value.values)
            for v in model.weights)
        print(json.dumps({"replicas": strategy.num_replicas_in_sync, "val_loss": h.history["val_loss"],
                          "stopped": es.stopped_epoch, "best_epoch": es.best_epoch,
                          "replicas_equal": replicas_equal,
                          "eval": float(model.evaluate(x[1437:], y[1437:], verbose=0))}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["replicas"] == 2 and result["replicas_equal"]
    # The decision replays exactly from the (already reduced) logs through Keras' own rule.
    keras_es = keras.callbacks.EarlyStopping(patience=1, min_delta=0.002, restore_best_weights=True)
    last, best = drive(keras_es, result["val_loss"])
    assert result["stopped"] == keras_es.stopped_epoch == last > 0
    assert result["best_epoch"] == keras_es.best_epoch
    assert result["eval"] == pytest.approx(min(result["val_loss"]), rel=1e-4)


# -- files written before keras_perf/stopping/ became a package --------------------------------
FIXTURE = os.path.join(os.path.dirname(__file__), "data", "stopping_v1")  # make_stopping_fixture.py


def test_configs_saved_by_the_old_modules_still_deserialize():
    # Keras looks the registered name up ("keras_perf>EarlyStopping"); the recorded module
    # ("keras_perf.early_stopping") no longer exists.
    with open(os.path.join(FIXTURE, "configs.json")) as f:
        saved = json.load(f)
    assert saved["EarlyStopping"]["module"] == "keras_perf.early_stopping"
    for cls in (kp.EarlyStopping, kp.TimeLimit):
        entry = saved[cls.__name__]
        assert entry["registered_name"] == f"keras_perf>{cls.__name__}"
        obj = keras.saving.deserialize_keras_object(entry)
        assert type(obj) is cls
        assert obj.get_config() == entry["config"]
        assert (
            keras.saving.serialize_keras_object(obj)["registered_name"] == entry["registered_name"]
        )


def test_backup_state_files_written_by_the_old_modules_resume(tmp_path):
    import shutil

    sys.path.insert(0, os.path.dirname(FIXTURE))
    try:
        import make_stopping_fixture as fixture
    finally:
        sys.path.pop(0)
    backup = str(tmp_path / "backup")
    shutil.copytree(os.path.join(FIXTURE, "backup"), backup)
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        expected = json.load(f)
    model = fixture.model()
    for cb in fixture.callbacks(backup):
        cb.set_model(model)
        cb.set_params({"epochs": 5, "steps": 1, "verbose": 0})
        cb.on_train_begin()  # finds its state file (named by class, monitor, arguments)
        state = cb.state_dict()
        weights = state.pop("best_weights")
        assert {k: state[k] for k in expected[type(cb).__name__]} == expected[type(cb).__name__]
        if isinstance(cb, kp.EarlyStopping):
            assert state["wait"] == 1 and state["best_epoch"] == 1  # not a fresh start
            np.testing.assert_array_equal(weights[0], np.array(expected["best_weights"], "float32"))
