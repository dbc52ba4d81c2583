"""Timing candidates against each other: real `fit` calls on each candidate's own twin.

What is timed is what the user's `fit` will show, not the steps alone: a short epoch of a small
model spends as much in `fit`'s own work (the data adapter, the epoch's iterator made and torn
down, the epoch's end, the callbacks) as in its steps, and no execution setting changes that
work. Timing windows of steps from the first batch's start to the last step's end overstated
the gain a real `fit` shows (TensorFlow MLP, 32-step epochs: 1.31x measured against 1.01x
in 3-epoch fits; JAX: 2.57x against 1.30x).

So each timed fit is split by a callback into its parts (`_Parts`): the fit's set-up (from the
call to the epoch's start), the epoch (from its start to the call's return: the iterator, the
steps, the epoch's end, the teardown) and, inside it, the steps (the first batch's start to the
end of training). Where one epoch of the user's data has at most `MAX_STEPS` steps, every timed
fit is one whole epoch, exactly as the user's `fit` runs it (a short last batch included; the
warm-up is a whole epoch too, so that its second trace is not timed). A longer epoch is timed in
windows of `MAX_STEPS` steps whose steps are scaled to the epoch's (the rest of the epoch's work
counted once). The figure per fit: the seconds of one epoch of a fit of `EPOCHS_SHOWN` epochs,
`set-up / EPOCHS_SHOWN + epoch`; a candidate's figure is the median over its fits.

Each twin is warmed up first (untimed: traces and compiles its train function, not counted
against `max_seconds`). Then the fits run in turn, in A B B A order (each round reverses the
order of the one before, so that a slow spell of the machine does not fall on one candidate),
until the time budget is spent (at least 3 rounds, so that the median leaves out one
slow spell; at most 9).
"""

from __future__ import annotations

import math
import time
import warnings

import keras
import numpy as np

MIN_ROUNDS, MAX_ROUNDS = 3, 9
MAX_STEPS = 64  # an epoch of at most this many steps is timed whole; longer ones in windows
EPOCHS_SHOWN = 3  # the fit's one-off set-up is counted once per this many epochs


class _Parts(keras.callbacks.Callback):
    """The marks of one timed fit: the epoch's start, the first batch's start, training's end.

    Async-safe (keeps Keras' async dispatch on JAX and torch, as fit runs without it).
    `on_train_end` comes after the epoch's end, which reads the logs (waits for the last step).
    """

    def __init__(self):
        super().__init__()
        self.async_safe = True
        self.epoch_begin = self.first_begin = self.train_end = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.epoch_begin is None:
            self.epoch_begin = time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_begin is None:
            self.first_begin = time.perf_counter()

    def on_train_end(self, logs=None):
        self.train_end = time.perf_counter()


def epoch_figure(t0, parts, end, steps, epoch_steps) -> float:
    """Seconds of one epoch of a fit of `EPOCHS_SHOWN` epochs, from one timed fit.

    `t0`, `end`: the call's start and return; `parts`: its `_Parts`; `steps`: the steps the
    fit ran (None: a whole epoch); `epoch_steps`: the steps of one epoch of the user's fit.
    """
    setup = parts.epoch_begin - t0
    epoch = end - parts.epoch_begin
    if steps is not None and epoch_steps is not None and epoch_steps != steps:
        window = parts.train_end - parts.first_begin  # the steps (and the epoch's end)
        epoch += window * (epoch_steps / steps - 1.0)
    return setup / EPOCHS_SHOWN + epoch


class Entry:
    """A candidate with its twin, fit arguments, steps per timed fit (None: a whole epoch) and
    its measured figures (seconds of one epoch, as `epoch_figure` counts it)."""

    def __init__(self, candidate, model, fit_kwargs, steps, epoch_steps, epoch_examples):
        self.candidate = candidate
        self.model = model
        self.fit_kwargs = fit_kwargs
        self.steps = steps
        self.epoch_steps = epoch_steps
        self.epoch_examples = epoch_examples
        self.seconds: list[float] = []

    @property
    def examples_per_s(self) -> float | None:
        if not self.seconds:
            return None
        return self.epoch_examples / float(np.median(self.seconds))


def plan(epoch_steps, steps_multiple=1):
    """Steps per timed fit: None (a whole epoch) where the epoch has at most `MAX_STEPS`
    steps; else `MAX_STEPS` rounded down to a multiple of `steps_multiple` (at least one)."""
    if epoch_steps is not None and epoch_steps <= MAX_STEPS:
        return None
    return max(MAX_STEPS // steps_multiple, 1) * steps_multiple


def epoch_steps_of(examples, batch_size) -> int:
    """Steps of one epoch of `examples` in batches of `batch_size` (a short last batch too)."""
    return math.ceil(examples / batch_size)


def timed_fit(entry, steps=None) -> float:
    """One fit of `steps` steps (None: one whole epoch); returns its `epoch_figure`."""
    parts = _Parts()
    kw = dict(entry.fit_kwargs)
    if steps is not None:
        kw["steps_per_epoch"] = steps
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ran out of data.*")
        warnings.filterwarnings("ignore", message=".*`shuffle=True` was passed.*")
        t0 = time.perf_counter()
        entry.model.fit(**kw, epochs=1, verbose=0, callbacks=[parts])
        end = time.perf_counter()
    return epoch_figure(t0, parts, end, steps, entry.epoch_steps)


def warm_up(entry) -> float:
    """An untimed fit (traces and compiles the train function): a whole epoch where the
    timed fits are whole epochs (its short last batch and last `steps_per_execution` window are
    traces of their own), else a few steps. Returns its seconds."""
    t0 = time.perf_counter()
    if entry.steps is None:
        timed_fit(entry)
    else:
        steps = max(2 * entry.candidate.steps_multiple, 2)
        timed_fit(entry, min(steps, entry.steps))
    return time.perf_counter() - t0


def alternate(entries, seconds) -> None:
    """Time the entries in A B B A rounds for about `seconds` (at least `MIN_ROUNDS` rounds)."""
    end = time.perf_counter() + seconds
    order = list(entries)
    for r in range(MAX_ROUNDS):
        for e in order:
            e.seconds.append(timed_fit(e, e.steps))
        order.reverse()
        if r + 1 >= MIN_ROUNDS and time.perf_counter() > end:
            break
