"""Writes tests/data/stopping_v1/: what keras-perf's stopping callbacks put on disk.

Run once with the code of 2026-11-26 (before `keras_perf/stopping/` became a package), from
the repository root: `KERAS_BACKEND=tensorflow python tests/data/make_stopping_fixture.py`.
tests/test_stopping.py checks that today's code still reads these files:

- `configs.json`: `keras.saving.serialize_keras_object` of an `EarlyStopping` and a
  `TimeLimit` (registered names, module, config), as Keras writes them into any saved config;
- `backup/`: a `BackupAndRestore` directory after a fit killed at the end of epoch 3 (index 2),
  with both callbacks' state files (`backup_dir=`) and EarlyStopping's best weights;
- `expected.json`: the callbacks' `state_dict()` (without weights) at that moment.
"""

import json
import os
import shutil

import keras
import numpy as np

import keras_perf as kp

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stopping_v1")
SCRIPT = [1.0, 0.5, 0.7, 0.4, 0.3]
X = np.linspace(-1, 1, 64, dtype="float32").reshape(16, 4)
Y = X @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32")


class Script(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        logs["val_loss"] = SCRIPT[epoch]


class Kill(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("killed")


def callbacks(backup):
    es = kp.EarlyStopping(
        patience=3,
        min_delta=0.01,
        relative_delta=True,
        restore_best_weights=True,
        divergence_threshold=9.0,
        backup_dir=backup,
    )
    tl = kp.TimeLimit(3600, backup_dir=backup)
    return es, tl


def model():
    keras.utils.set_random_seed(5)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    m.compile(keras.optimizers.Adam(0.05), "mse")
    return m


if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    backup = os.path.join(OUT, "backup")
    os.makedirs(backup)
    es, tl = callbacks(backup)
    cbs = [Script(), es, tl, keras.callbacks.BackupAndRestore(backup), Kill()]
    try:
        model().fit(X, Y, batch_size=16, epochs=5, shuffle=False, callbacks=cbs, verbose=0)
    except RuntimeError:
        pass
    configs = {type(c).__name__: keras.saving.serialize_keras_object(c) for c in (es, tl)}
    for c in configs.values():  # the path differs per checkout: the test sets its own
        c["config"]["backup_dir"] = None
    with open(os.path.join(OUT, "configs.json"), "w") as f:
        json.dump(configs, f, indent=1, sort_keys=True)
    expected = {}
    for c in (es, tl):
        state = c.state_dict()
        state.pop("best_weights")
        for key in ("elapsed", "epoch_times", "tail_times", "max_batch_time"):
            state.pop(key, None)  # wall times: differ on every run
        expected[type(c).__name__] = state
    expected["best_weights"] = es.best_weights[0].tolist()  # the Dense kernel
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    print(sorted(os.listdir(backup)))
