"""`_RunCallbacks`: the user's callbacks, shared by every `fit` call of one run.

Lives here: the `CallbackList` that forwards each hook of the whole run once and takes the
epoch-start snapshot. Not here: the snapshot itself (`_snapshot`), the generator replay it
drives (`_replay`), the retry loop (`_retry`).
"""

from __future__ import annotations

import keras

from keras_perf.oom._snapshot import _host_random_state, _restore, _set_host_random_state, _snapshot


class _RunCallbacks(keras.callbacks.CallbackList):
    """The user's callbacks, shared by every `fit` call of one `fit_with_oom_retry` run.

    `on_train_begin` is forwarded once (so callbacks that reset their state there, like
    `EarlyStopping`, are not reset by a retry); `on_epoch_end` runs only for epochs that
    completed, so each completed epoch reaches the callbacks once. `on_train_end` comes from
    the final, successful `fit` call. At each epoch start the state is snapshotted (weights,
    optimizer, host RNGs) and the number of training steps run by completed epochs, which
    is where a replayed generator resumes, is handed to `replay`.
    """

    def __init__(self, callbacks, x=None, replay=None, **kwargs):
        super().__init__(callbacks, **kwargs)
        self._kp_started = False
        self._x, self.replay = x, replay
        self.begun_epoch = None  # epoch whose on_epoch_begin ran last
        self.completed_epoch = None  # epoch whose on_epoch_end ran last
        self.snapshot = self.random_state = self.resume_random_state = None
        self.steps_done = 0  # training steps of the completed epochs
        self._epoch_steps = 0

    def on_train_begin(self, logs=None):
        if not self._kp_started:
            self._kp_started = True
            super().on_train_begin(logs)

    def on_epoch_begin(self, epoch, logs=None):
        if self.resume_random_state is not None and self.resume_random_state[0] == epoch:
            # The retried epoch: the host RNGs as the failed attempt found them. Set here, not
            # before `fit`, which draws seeds (new metrics, a new twin) before the first epoch.
            _set_host_random_state(self.resume_random_state[1])
        self.resume_random_state = None
        self.snapshot = _snapshot(self.model)
        self.random_state = _host_random_state(self._x)
        if self.replay is not None:
            self.replay.keep_from(self.steps_done)
        self.begun_epoch, self._epoch_steps = epoch, 0
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._epoch_steps = batch + 1  # `batch` is the last step of the execution
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self.completed_epoch = epoch
        self.steps_done += self._epoch_steps

    def epoch_in_progress(self) -> bool:
        return self.begun_epoch is not None and self.begun_epoch != self.completed_epoch

    def rewind(self, random_state: bool = True) -> None:
        """Back to the state at the start of the epoch in progress (host RNGs too, or not)."""
        _restore(self.snapshot)
        if random_state:
            _set_host_random_state(self.random_state)
