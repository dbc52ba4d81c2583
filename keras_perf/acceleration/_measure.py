"""Timing candidates against each other: real `fit` calls on each candidate's own twin.

Each twin is warmed up first (an untimed fit that traces, and compiles, its train function:
not counted against `max_seconds`). Then fits of the same number of steps run in turn, in
A B B A order (each round reverses the order of the one before, so that a slow spell of the
machine does not fall on one candidate), until the time budget is spent (at least 2 rounds,
at most 9). Each candidate's figure is the median of its seconds per step, timed as
`kp.diagnose` times a fit (`keras_perf._fit_measure.fit_steps`: from the first batch's start to the
last step's end).
"""

from __future__ import annotations

import time

import numpy as np

from keras_perf._fit_measure import fit_steps

MIN_ROUNDS, MAX_ROUNDS = 2, 9


class Entry:
    """A candidate with its twin, fit arguments, steps per fit and measured seconds per step."""

    def __init__(self, candidate, model, fit_kwargs, steps):
        self.candidate = candidate
        self.model = model
        self.fit_kwargs = fit_kwargs
        self.steps = steps
        self.seconds: list[float] = []

    @property
    def examples_per_s(self) -> float | None:
        if not self.seconds:
            return None
        return self.candidate.batch_size / float(np.median(self.seconds))


def warm_up(entry) -> float:
    """An untimed fit (traces and compiles the train function); returns its seconds."""
    t0 = time.perf_counter()
    steps = max(2 * entry.candidate.steps_multiple, 2)
    fit_steps(entry.model, min(steps, entry.steps), None, **entry.fit_kwargs)
    return time.perf_counter() - t0


def alternate(entries, seconds) -> None:
    """Time the entries in A B B A rounds for about `seconds` (at least `MIN_ROUNDS` rounds)."""
    end = time.perf_counter() + seconds
    order = list(entries)
    for r in range(MAX_ROUNDS):
        for e in order:
            s, done, _ = fit_steps(e.model, e.steps, None, **e.fit_kwargs)
            e.seconds.append(s / done)
        order.reverse()
        if r + 1 >= MIN_ROUNDS and time.perf_counter() > end:
            break
