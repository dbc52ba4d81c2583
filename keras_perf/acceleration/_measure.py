"""Timing candidates against each other: real `fit` calls on each candidate's own twin.

What is timed is what the user's `fit` will show, not the steps alone: a short epoch of a small
model spends as much in `fit`'s own work (the data adapter, the epoch's iterator made and torn
down, the epoch's end, the callbacks) as in its steps, and no execution setting changes that
work. Timing windows of steps from the first batch's start to the last step's end overstated
the gain a real `fit` shows (TensorFlow MLP, 32-step epochs: 1.31x measured against 1.01x
in 3-epoch fits; JAX: 2.57x against 1.30x).

So each timed fit is split by a callback into its parts (`_Parts`): the fit's set-up (from the
call to the epoch's start), the epoch (from its start to training's end: the iterator, the
steps, the epoch's end) and, inside it, the steps (the first batch's start to the end of
training). The fit's teardown after training's end is left out of every figure: on TensorFlow
it is the tf.data iterator's, which at random waits about 0.2 s of wall (and no CPU) for its
background threads, once per fit whatever the settings (a TF Transformer's 1-epoch fits took
0.45 or 0.65 s, the same model and settings); counted, it made a 1.02x setting read as 1.46x.
Where one epoch of the user's data has at most `MAX_STEPS` steps, every timed fit is whole
epochs, exactly as the user's `fit` runs them (a short last batch included; the warm-up is a
whole epoch too, so that its second trace is not timed). A longer epoch is timed in
windows of `MAX_STEPS` steps whose steps are scaled to the epoch's (the rest of the epoch's work
counted once). The figure per fit: the seconds of one epoch of a fit of `EPOCHS_SHOWN` epochs,
`set-up / EPOCHS_SHOWN + epoch`; a candidate's figure is the median over its fits. Where every
whole epoch takes under `SHORT_EPOCH_S`, the fits are of `EPOCHS_SHOWN` epochs, the figure a
third of one (`fit_epochs` says why).

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
SHORT_EPOCH_S = 0.1  # whole epochs shorter than this are timed in fits of EPOCHS_SHOWN epochs


class _Parts(keras.callbacks.Callback):
    """The marks of one timed fit: the epoch's start, the first batch's start, training's end.

    Async-safe (keeps Keras' async dispatch on JAX and torch, as fit runs without it).
    `on_train_end` comes after the epoch's end, which reads the logs (waits for the last step).
    Its batch hook costs nothing measurable: 3-epoch fits of a torch dict-input model with it
    and with an epoch hook alone, 41 alternated pairs: 6.61 and 6.60 ms of wall per epoch.
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

    `t0`: the call's start; `end`: training's end (`timed_fit` passes `on_train_end`'s mark,
    not the call's return: the module's docstring says why); `parts`: its `_Parts`; `steps`:
    the steps the fit ran (None: a whole epoch); `epoch_steps`: the steps of one epoch of the
    user's fit.
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
        self.epochs = None  # epochs per timed fit: decided by `alternate` (`fit_epochs`)

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
    """One fit of `steps` steps (None: whole epochs, `entry.epochs` of them, default 1);
    returns its `epoch_figure` (a fit of `EPOCHS_SHOWN` epochs: its seconds per epoch)."""
    parts = _Parts()
    kw = dict(entry.fit_kwargs)
    epochs = 1
    if steps is not None:
        kw["steps_per_epoch"] = steps
    elif entry.epochs:
        epochs = entry.epochs
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ran out of data.*")
        warnings.filterwarnings("ignore", message=".*`shuffle=True` was passed.*")
        t0 = time.perf_counter()
        entry.model.fit(**kw, epochs=epochs, verbose=0, callbacks=[parts])
    end = parts.train_end  # not the call's return: the teardown is left out (module docstring)
    if epochs == EPOCHS_SHOWN:
        return (end - t0) / EPOCHS_SHOWN  # what the user's fit of EPOCHS_SHOWN epochs shows
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
    """Time the entries in A B B A rounds for about `seconds` (at least `MIN_ROUNDS` rounds).

    The first round of an accelerate call also decides the epochs per timed fit
    (`fit_epochs`), for these entries and any timed with them later; where it chooses
    `EPOCHS_SHOWN`, that round was a probe and its figures are dropped.
    """
    end = time.perf_counter() + seconds
    known = {e.epochs for e in entries if e.epochs is not None}
    epochs = max(known) if known else None
    if epochs is not None:
        for e in entries:
            e.epochs = epochs
    order = list(entries)
    rounds = 0
    while rounds < MAX_ROUNDS:
        for e in order:
            e.seconds.append(timed_fit(e, e.steps))
        order.reverse()
        if epochs is None:
            epochs = fit_epochs(entries)
            for e in entries:
                e.epochs = epochs
            if epochs != 1:
                for e in entries:
                    e.seconds.clear()
                continue
        rounds += 1
        if rounds >= MIN_ROUNDS and time.perf_counter() > end:
            break


def fit_epochs(entries) -> int:
    """Epochs per timed fit: `EPOCHS_SHOWN` where every entry's fit is a whole epoch of at most
    `SHORT_EPOCH_S` (by its figure so far), else 1.

    A fit's first epoch costs more than the next ones, beyond the set-up a figure already
    spreads over `EPOCHS_SHOWN` epochs (the epoch's iterator, the step and the machine's caches
    warming up after the other candidate's fit). A 3-epoch `fit` pays it once, a figure from
    1-epoch fits every epoch. Torch dict-input model, 8-step epochs, 31 alternated pairs: a
    1-epoch fit 14.6 ms plain and 8.1 ms traced, an epoch of a 3-epoch fit 13.4 and 6.35 ms, so
    1-epoch fits read its 2.10x gain as 1.80x; beside a 0.1 s epoch such a cost is 1-2 %. Short
    epochs are therefore timed as the user's fit runs them, `EPOCHS_SHOWN` at a time, for a
    few tenths of a second more.
    """
    short = all(e.steps is None and e.seconds and max(e.seconds) < SHORT_EPOCH_S for e in entries)
    return EPOCHS_SHOWN if short else 1
