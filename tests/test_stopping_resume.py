"""Resuming kp.EarlyStopping / kp.TimeLimit with keras.callbacks.BackupAndRestore.

A resumed fit must equal the uninterrupted one whatever the order of the callbacks and
wherever the process died; state files belong to one callback and one run; bad directories
and files are clear errors, and a failed write does not stop training.
"""

import glob
import os

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf.stopping import _state
from keras_perf.stopping import _time_limit as time_limit

SCRIPT = [5.0, 4.0, 3.0, 3.5, 2.9, 3.1, 3.2, 3.3, 3.4, 3.5]  # best at 4; patience 2 -> stop at 6
X = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
Y = X @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32")


class Script(keras.callbacks.Callback):
    """Writes a scripted `val_loss` into the logs (listed first, so every callback sees it)."""

    def on_epoch_end(self, epoch, logs=None):
        logs["val_loss"] = SCRIPT[epoch]


class Kill(keras.callbacks.Callback):
    """Dies in `on_epoch_end` of epoch `at`, where it sits in the callback list."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError("killed")


class Batches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


def _model():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.05), "mse")
    return model


def _fit(model, callbacks, epochs=10):
    return model.fit(
        X, Y, batch_size=16, epochs=epochs, shuffle=False, callbacks=callbacks, verbose=0
    )


def _same(a, b):
    return all(np.allclose(u, v, atol=1e-6) for u, v in zip(a, b))


def _new_es(backup, **kw):
    kw = {"patience": 2, "restore_best_weights": True, **kw}
    return kp.EarlyStopping(backup_dir=backup, **kw)


def _order(order, backup, cb, kill=None, where=None):
    """[Script, B&R, cb] ("BE") or [Script, cb, B&R] ("EB"), `kill` inserted at `where`."""
    bar = keras.callbacks.BackupAndRestore(backup)
    cbs = [bar, cb] if order == "BE" else [cb, bar]
    if kill is not None:
        cbs.insert(where, kill)
    return [Script(), *cbs]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    backup = str(tmp_path_factory.mktemp("whole") / "b")
    model, es = _model(), _new_es(backup)
    hist = _fit(model, _order("BE", backup, es))
    assert (es.stopped_epoch, es.best_epoch, es.stop_reason) == (6, 4, "patience")
    return len(hist.history["loss"]), es.best, model.get_weights()


# Where the kill sits in the callback list is Python ordering, the same on every backend: the
# whole matrix runs on TensorFlow; JAX and PyTorch run the kill between the two callbacks (the
# regression's place) at every epoch and in both orders, which covers what a backend changes
# (the weights a killed fit leaves, the backup Keras writes). CI time: 2/3 of the matrix is
# left out on two backends.
WHERE = [
    pytest.param(0, id="before-both", marks=pytest.mark.backends("tensorflow")),
    pytest.param(1, id="between"),
    pytest.param(2, id="after-both", marks=pytest.mark.backends("tensorflow")),
]


@pytest.mark.slow  # a kill at every point, both orders: the slow tier
@pytest.mark.parametrize("order", ["BE", "EB"])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("at", [0, 1, 3, 4, 5, 6])
def test_kill_anywhere_and_resume_equals_uninterrupted(uninterrupted, tmp_path, order, where, at):
    # Regression: with BackupAndRestore listed first, a kill between its save and
    # EarlyStopping's resumed one epoch off and restored the wrong "best" weights.
    backup = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="killed"):
        _fit(_model(), _order(order, backup, _new_es(backup), Kill(at), where))
    # A new process: fresh model and callbacks, same order.
    model, es = _model(), _new_es(backup)
    hist = _fit(model, _order(order, backup, es))
    epochs, best, weights = uninterrupted
    assert (es.stopped_epoch, es.best_epoch, es.stop_reason) == (6, 4, "patience")
    assert es.best == best == 2.9
    assert _same(model.get_weights(), weights)
    assert len(hist.history.get("loss", [])) <= epochs
    assert not os.path.exists(backup)


class Tick(keras.callbacks.Callback):
    """Advances the fake clock by 10 s per epoch."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def on_epoch_begin(self, epoch, logs=None):
        self.clock[0] += 10.0


@pytest.mark.slow  # a kill at every point, both orders: the slow tier
@pytest.mark.parametrize("order", ["BE", "EB"])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("at", [0, 2, 4])
def test_time_limit_kill_and_resume(monkeypatch, tmp_path, order, where, at):
    clock = [1000.0]
    monkeypatch.setattr(time_limit, "_now", lambda: clock[0])
    backup = str(tmp_path / "b")

    def run(kill=None):
        model = _model()
        tl = kp.TimeLimit(55.0, backup_dir=backup)
        return model, tl, [Tick(clock), *_order(order, backup, tl, kill, where)]

    model, tl, cbs = run()
    _fit(model, cbs)
    whole = (tl.stopped_epoch, tl.elapsed, model.get_weights())
    assert whole[:2] == (4, 50.0)  # 50 s spent + 10 s estimate > 55 s
    with pytest.raises(RuntimeError, match="killed"):
        model, tl, cbs = run(Kill(at))
        _fit(model, cbs)
    clock[0] += 500.0  # downtime does not count
    model, tl, cbs = run()
    _fit(model, cbs)
    assert (tl.stopped_epoch, tl.elapsed, tl.stop_reason) == (4, 50.0, "time_limit")
    assert _same(model.get_weights(), whole[2])


def test_two_callbacks_with_the_same_monitor_keep_their_own_state(tmp_path):
    # Regression: both wrote keras_perf_EarlyStopping_val_loss.json, so each resumed from the
    # other's state.
    backup = str(tmp_path / "b")

    def run(kill=None):
        a = _new_es(backup, patience=2)
        b = _new_es(backup, patience=4, restore_best_weights=False)
        cbs = _order("EB", backup, a, kill, 2)
        cbs.insert(2, b)
        return a, b, cbs

    a, b, cbs = run()
    _fit(_model(), cbs)
    whole = [(cb.stopped_epoch, cb.wait, cb.best_epoch) for cb in (a, b)]
    assert whole == [(6, 2, 4), (0, 2, 4)]  # b has waited 2 of its 4 epochs at the stop
    a, b, cbs = run(Kill(5))
    with pytest.raises(RuntimeError, match="killed"):
        _fit(_model(), cbs)
    assert len(glob.glob(os.path.join(backup, "keras_perf_EarlyStopping_val_loss_*.json"))) == 2
    a, b, cbs = run()
    _fit(_model(), cbs)
    assert [(cb.stopped_epoch, cb.wait, cb.best_epoch) for cb in (a, b)] == whole


def test_state_of_an_unrelated_run_is_ignored_with_a_warning(tmp_path):
    # Regression: state left by a killed run (no BackupAndRestore checkpoint to pair with) was
    # loaded into a new model: it stopped after 2 epochs and restored the old run's weights.
    backup = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="killed"):
        _fit(_model(), [Script(), _new_es(backup), Kill(5)])
    assert glob.glob(os.path.join(backup, "keras_perf_EarlyStopping_*.json"))
    model, es = _model(), _new_es(backup)
    with pytest.warns(
        kp.KerasPerfWarning,
        match=r"ignores the saved state .*keras_perf_Early"
        r"Stopping.*no BackupAndRestore checkpoint",
    ):
        hist = _fit(model, [Script(), es])
    assert len(hist.history["loss"]) == 7 and (es.stopped_epoch, es.best_epoch) == (6, 4)
    ref = _model()
    _fit(ref, [Script(), _new_es(None)])
    assert _same(model.get_weights(), ref.get_weights())


def _killed_run(backup, at=4):
    with pytest.raises(RuntimeError, match="killed"):
        _fit(_model(), _order("EB", backup, _new_es(backup), Kill(at), 2))
    (path,) = glob.glob(os.path.join(backup, "keras_perf_EarlyStopping_*.json"))
    return path


def test_corrupt_state_file_is_an_error_naming_it_before_training(tmp_path):
    backup = str(tmp_path / "b")
    path = _killed_run(backup)
    with open(path, "w") as f:
        f.write('{"format": 2, "states": [')
    batches = Batches()
    with pytest.raises(ValueError, match=rf"state file '{path}' is corrupt"):
        _fit(_model(), [batches, *_order("EB", backup, _new_es(backup))])
    assert batches.count == 0


def test_missing_best_weights_file_is_an_error_naming_it(tmp_path):
    backup = str(tmp_path / "b")
    _killed_run(backup)
    for npz in glob.glob(os.path.join(backup, "keras_perf_EarlyStopping_*_best_*.npz")):
        os.remove(npz)
    batches = Batches()
    name = os.path.join(backup, "keras_perf_EarlyStopping_val_loss_[0-9a-f]+_best_4.npz")
    with pytest.raises(FileNotFoundError, match=rf"refers to '{name}', which is missing"):
        _fit(_model(), [batches, *_order("EB", backup, _new_es(backup))])
    assert batches.count == 0


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda tmp: _touch(tmp / "file"), r"`backup_dir` is a file, not a directory"),
        (lambda tmp: str(tmp / "no" / "such" / "dir"), r"parent directory .* does not exist"),
        (lambda tmp: "/proc/keras_perf_test", r"cannot create `backup_dir`"),
        (lambda tmp: "/proc/self", r"`backup_dir` is not writable"),
    ],
    ids=["file", "missing-parent", "cannot-create", "unwritable"],
)
@pytest.mark.parametrize("cls", ["EarlyStopping", "TimeLimit"])
def test_bad_backup_dir_fails_before_any_training_step(tmp_path, make, match, cls):
    backup = make(tmp_path)
    cb = _new_es(backup) if cls == "EarlyStopping" else kp.TimeLimit(60, backup_dir=backup)
    batches = Batches()
    with pytest.raises(ValueError, match=rf"{cls}\(backup_dir=.*{match}"):
        _fit(_model(), [batches, Script(), cb])
    assert batches.count == 0


def _touch(path):
    path.write_text("x")
    return str(path)


def test_failed_state_write_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_state.CallbackStateStore, "_save", disk_full)
    backup = str(tmp_path / "b")
    es = _new_es(backup)
    with pytest.warns(kp.KerasPerfWarning, match=r"could not save its state.*No space left") as rec:
        hist = _fit(_model(), _order("BE", backup, es))
    assert len([w for w in rec if issubclass(w.category, kp.KerasPerfWarning)]) == 1
    assert len(hist.history["loss"]) == 7 and es.stopped_epoch == 6


def test_write_to_dev_full_warns_and_training_goes_on(tmp_path, monkeypatch):
    real_open = open

    def full_open(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".json.tmp"):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(_state, "open", full_open, raising=False)
    backup = str(tmp_path / "b")
    es = _new_es(backup)
    with pytest.warns(kp.KerasPerfWarning, match=r"could not save its state") as rec:
        _fit(_model(), _order("EB", backup, es))
    assert len([w for w in rec if issubclass(w.category, kp.KerasPerfWarning)]) == 1
    assert es.stopped_epoch == 6
