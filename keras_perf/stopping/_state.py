"""Callback state saved beside a `keras.callbacks.BackupAndRestore` checkpoint.

A stateful callback (`kp.EarlyStopping`, `kp.TimeLimit`) that is given `backup_dir=` keeps a
`CallbackStateStore`. After every epoch it saves its state there, tagged with the epoch it
belongs to; when a fit is resumed it asks the store for the state that matches the epoch
`BackupAndRestore` resumes at. The result does not depend on the order of the callbacks nor on
where the previous process was killed:

- The store keeps the states of the last two epochs, so when the callback saved epoch `e` but
  `BackupAndRestore` did not (the callback is listed first), the state of `e - 1` is used and
  epoch `e` is trained again.
- When `BackupAndRestore` saved epoch `e` but the callback did not (it is listed second and
  the process died between the two), epoch `e`'s logs are lost and no state can be rebuilt
  from them. Epoch `e` must be trained again, from the weights of the end of epoch `e - 1`:
  so, whenever it sees that `BackupAndRestore` has already saved the current epoch, the store
  also saves a copy of the model's weights (and optimizer) with the state, and at resume it
  loads that copy and moves the fit's start back one epoch.
- A state that does not belong to the resumed run is ignored with a warning: no
  `BackupAndRestore` checkpoint to resume from, or an epoch that does not pair with it.
  Each callback's files are named by its class, monitor and a hash of its decision
  arguments, so two callbacks in one fit never share a file.
- A corrupt or missing file raises an error naming it; a failed write (disk full) warns once
  and training goes on.

Files, for a callback named `<name>`: `<name>.json` (the states), `<name>_best_<epoch>.npz`
(best weights, written when the best epoch changes) and `<name>_resume_<epoch>.weights.h5`
(the copy described above). All are removed when the fit ends normally.
"""

from __future__ import annotations

import json
import os

import numpy as np

from keras_perf import _keras_internals as keras_internals
from keras_perf._utils import warn

# Written by `keras.callbacks.BackupAndRestore` in its `backup_dir` (checked with Keras
# 3.8-3.15): `{"epoch": <epoch the fit resumes at>, "batch": ...}`.
BACKUP_METADATA = "training_metadata.json"
STATE_FORMAT = 2


def read_backup_epoch(backup_dir: str) -> int | None:
    """The epoch `BackupAndRestore` resumes the fit at, or None when it has no checkpoint."""
    path = os.path.join(backup_dir, BACKUP_METADATA)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            epoch = json.load(f)["epoch"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Cannot read the BackupAndRestore metadata file {path!r}: {e}") from e
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise ValueError(f"The BackupAndRestore metadata file {path!r} holds epoch={epoch!r}.")
    return epoch


def check_backup_dir(backup_dir: str, owner: str) -> None:
    """Raise `ValueError` unless `backup_dir` is (or can be made) a writable directory.

    The parent must exist: a typo in the path is reported instead of creating a tree.
    """
    where = f"{owner}(backup_dir={backup_dir!r})"
    if os.path.exists(backup_dir) and not os.path.isdir(backup_dir):
        raise ValueError(f"{where}: `backup_dir` is a file, not a directory.")
    if not os.path.isdir(backup_dir):
        parent = os.path.dirname(os.path.abspath(backup_dir))
        if not os.path.isdir(parent):
            raise ValueError(
                f"{where}: the parent directory {parent!r} of `backup_dir` does not exist. "
                "Create it, or pass the directory of your BackupAndRestore."
            )
        try:
            os.mkdir(backup_dir)
        except OSError as e:
            raise ValueError(f"{where}: cannot create `backup_dir`: {e}") from e
    probe = os.path.join(backup_dir, f".keras_perf_write_test_{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{where}: `backup_dir` is not writable: {e}") from e


class CallbackStateStore:
    """The files of one callback's state in `backup_dir` (see the module docstring).

    Args:
        backup_dir: The `backup_dir` of the fit's `BackupAndRestore`.
        name: File stem unique to the callback (class, monitor and decision arguments).
        owner: Name used in messages, e.g. `"EarlyStopping"`.
    """

    def __init__(self, backup_dir: str, name: str, owner: str):
        self.backup_dir = backup_dir
        self.name = name
        self.owner = owner
        self.path = os.path.join(backup_dir, name + ".json")
        self._states: list[dict] = []
        self._write_failed = False

    def _file(self, name: str) -> str:
        return os.path.join(self.backup_dir, name)

    # ------------------------------------------------------------------------ reading
    def read_states(self) -> list[dict]:
        """The saved states, oldest first ([] when there is no file); raise if corrupt."""
        if not os.path.exists(self.path):
            return []
        try:
            with open(self.path) as f:
                data = json.load(f)
            states = data["states"]
            if data.get("format") != STATE_FORMAT or not isinstance(states, list):
                raise ValueError(f"format {data.get('format')!r}, expected {STATE_FORMAT}")
            for state in states:
                if not isinstance(state, dict) or not isinstance(state.get("epoch"), int):
                    raise ValueError("a state without an integer 'epoch'")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"{self.owner}: the state file {self.path!r} is corrupt ({e}). Delete it (and "
                "the BackupAndRestore checkpoint beside it) to start training afresh."
            ) from e
        return states

    def load_weights_file(self, name: str) -> list[np.ndarray]:
        """The arrays of a `_best_` file named by a state; raise naming it if absent or corrupt."""
        path = self._file(name)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{self.owner}: the state file {self.path!r} refers to {path!r}, which is missing. "
                "Delete the state file to start afresh."
            )
        try:
            with np.load(path) as data:
                return [data[f"arr_{i}"] for i in range(len(data.files))]
        except Exception as e:  # numpy raises several types for a damaged archive
            raise ValueError(f"{self.owner}: the weights file {path!r} is corrupt ({e}).") from e

    def resume(self, model, epochs: int | None) -> dict | None:
        """The state the resumed fit continues from, or None to start afresh.

        May load the weights saved with that state into `model` and move the fit's first epoch
        back (see the module docstring); when the state says training had stopped, moves it to
        `epochs` so no epoch runs.
        """
        states = self.read_states()
        self._states = []
        # No checkpoint: the fit starts at epoch 0 (a state of epoch 0 may be there when this
        # callback saved it and BackupAndRestore, listed after it, did not).
        backup_epoch = read_backup_epoch(self.backup_dir) or 0
        latest = max((s["epoch"] for s in states), default=-1)
        by_epoch = {s["epoch"]: s for s in states}
        if backup_epoch == 0:
            if latest > 0:
                self._warn_stale(
                    f"there is no BackupAndRestore checkpoint to resume from in "
                    f"{self.backup_dir!r}, so the state (epoch {latest + 1}) is from another run"
                )
            return None
        if backup_epoch - 1 in by_epoch:
            chosen = by_epoch[backup_epoch - 1]
        elif latest == backup_epoch - 2 and by_epoch[latest].get("checkpoint"):
            # BackupAndRestore saved epoch `backup_epoch - 1`, we did not: train it again.
            chosen = by_epoch[latest]
            self._roll_back(model, chosen)
        else:
            have = sorted(e + 1 for e in by_epoch if e >= 0)
            self._warn_stale(
                f"BackupAndRestore resumes at epoch {backup_epoch + 1} but the state is from "
                f"epoch(s) {have or 'none'}; it is not from the same run"
            )
            return None
        self._states = [s for s in states if s["epoch"] <= chosen["epoch"]]
        if chosen.get("stop_training") and epochs is not None:
            self._skip_to(model, epochs)
        return dict(chosen)

    def _skip_to(self, model, epochs: int) -> None:
        """The run had stopped after the resumed epoch: train no further epoch.

        Sets the start epoch to `epochs`, on the model (when `BackupAndRestore`'s
        `on_train_begin` ran before ours) and in its metadata file (when it runs after ours
        and would set it back).
        """
        keras_internals.set_initial_epoch(model, epochs)
        path = os.path.join(self.backup_dir, BACKUP_METADATA)
        if os.path.exists(path):
            with open(path) as f:
                meta = json.load(f)
            meta["epoch"] = max(int(meta.get("epoch", 0)), epochs)
            with open(path + ".tmp", "w") as f:
                json.dump(meta, f)
            os.replace(path + ".tmp", path)

    def _roll_back(self, model, state: dict) -> None:
        path = self._file(state["checkpoint"])
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{self.owner}: the state file {self.path!r} refers to {path!r}, which is missing."
            )
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        try:
            model.load_weights(path)
        except Exception as e:
            raise ValueError(f"{self.owner}: cannot load the weights file {path!r}: {e}") from e
        # As BackupAndRestore does: fit continues after the state's epoch.
        keras_internals.set_initial_epoch(model, state["epoch"] + 1)

    def _warn_stale(self, why: str) -> None:
        warn(
            f"{self.owner} ignores the saved state {self.path!r}: {why}. It starts afresh.",
            stacklevel=5,
        )

    # ------------------------------------------------------------------------ writing
    def save(self, state: dict, best_weights, model=None) -> None:
        """Save `state` (must hold "epoch"); with `model`, also a copy of its weights.

        A failed write warns once per fit and is otherwise ignored: training goes on.
        """
        try:
            self._save(dict(state), best_weights, model)
        except OSError as e:
            if not self._write_failed:
                self._write_failed = True
                warn(
                    f"{self.owner} could not save its state in {self.backup_dir!r} ({e}). "
                    "Training goes on; resuming from this point may not match an uninterrupted "
                    "run. (Warned once.)",
                    stacklevel=4,
                )

    def _save(self, state: dict, best_weights, model) -> None:
        epoch = state["epoch"]
        previous = next((s for s in reversed(self._states) if s["epoch"] < epoch), None)
        if best_weights is not None:
            name = f"{self.name}_best_{state.get('best_epoch', 0)}.npz"
            if (
                previous is None
                or previous.get("best_weights_file") != name
                or not os.path.exists(self._file(name))
            ):
                tmp = self._file(name + ".tmp.npz")
                np.savez(tmp, *best_weights)
                os.replace(tmp, self._file(name))
            state["best_weights_file"] = name
        else:
            state["best_weights_file"] = None
        state["checkpoint"] = None
        if model is not None:
            name = f"{self.name}_resume_{epoch}.weights.h5"
            tmp = self._file(f"{self.name}_resume_tmp.weights.h5")
            model.save_weights(tmp, overwrite=True)
            os.replace(tmp, self._file(name))
            state["checkpoint"] = name
        states = ([previous] if previous is not None else []) + [state]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"format": STATE_FORMAT, "owner": self.owner, "states": states}, f)
        os.replace(tmp, self.path)
        self._states = states
        # Rollback needs the copy saved with the latest state only.
        keep = {s.get("best_weights_file") for s in states} | {state["checkpoint"]}
        for name in os.listdir(self.backup_dir):
            if name.startswith(self.name + "_") and name not in keep:
                os.remove(self._file(name))

    def reset(self) -> None:
        """Forget states read or written in an earlier fit."""
        self._states = []
        self._write_failed = False

    def delete(self) -> None:
        """Remove this callback's files (training ended normally)."""
        self._states = []
        if not os.path.isdir(self.backup_dir):
            return
        for name in os.listdir(self.backup_dir):
            if name == self.name + ".json" or name.startswith(self.name + "_"):
                try:
                    os.remove(self._file(name))
                except OSError:
                    pass
