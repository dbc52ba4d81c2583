"""`EpochMeter`: per-epoch timing figures from clock readings, in plain Python (no Keras).

Holds the class and its statistics helpers (`_quantile`, `_spread`, `_gaps`). How the callback
feeds it without slowing training is in the `keras_perf.monitor` package docstring; the
callback itself (examples, memory, MFU, logs, files) is in `_callback.py`.
"""

from __future__ import annotations

import time

from keras_perf._utils import check_bool


class EpochMeter:
    """Plain measuring class: per-epoch timing figures from clock readings (no Keras inside).

    Call `start()` at the epoch's start, `step_begin(index)` before and `step_end(index)` after
    each step (or execution: `index` is the 0-based index of its first/last step),
    `train_done()` after a device sync that follows the last step, `val_start()`/`val_end()`
    around validation, then `finish()`. `step_end` only appends to a list, so it is safe to
    call from Keras' worker threads.

    Step times come from one of two readings, each of which splits the epoch into steps that
    sum to the epoch time: gaps between step *ends* (right when the host waits for the
    device, or when ends are read in the main thread as on TensorFlow), or gaps between step
    *begins* (right when the host is the bottleneck and Keras' worker threads, starved of the
    GIL, read the ends late and bunched together). The wrong reading squeezes several steps
    into one long gap and near-zero ones; for the same sum that always widens the spread, so
    the reading whose gaps vary less (smaller coefficient of variation) is used.

    Args:
        step_timing: Record each step's end time (for the percentiles and the step count).
            Defaults to `True`.
        clock: Function returning seconds. Defaults to `time.perf_counter`.

    Example:
        >>> meter = EpochMeter()
        >>> meter.start()
        >>> for i in range(3):
        ...     meter.step_end(i)
        >>> meter.finish()["steps"]
        3
    """

    def __init__(self, step_timing: bool = True, clock=time.perf_counter) -> None:
        self.step_timing = check_bool("step_timing", step_timing)
        self.clock = clock
        self.start()

    def start(self) -> None:
        """Begin an epoch: forget the previous one and read the clock."""
        self._ends: list[tuple[int, float]] = []
        self._begins: list[tuple[int, float]] = []
        self._train_done: float | None = None
        self._val_start: float | None = None
        self._val_end: float | None = None
        self._t0 = self.clock()

    def step_begin(self, index: int) -> None:
        """Record that the step (or execution starting at step) `index` is being dispatched."""
        if self.step_timing:
            self._begins.append((index, self.clock()))

    def step_end(self, index: int) -> None:
        """Record that the step (or execution ending at step) `index` has finished."""
        if self.step_timing:
            self._ends.append((index, self.clock()))

    def train_done(self) -> None:
        """Record the end of the training part (call right after a device sync)."""
        if self._train_done is None:
            self._train_done = self.clock()

    def val_start(self) -> None:
        self.train_done()
        self._val_start = self.clock()

    def val_end(self) -> None:
        self._val_end = self.clock()

    def finish(self, steps: int | None = None, max_steps: int | None = None) -> dict:
        """Figures of the epoch: `epoch_time_s`, `val_time_s`, `steps`, `steps_per_s` and, with
        step timing, `step_time_ms_p50` and `step_time_ms_p90`.

        Args:
            steps: Steps run this epoch, used when steps were not timed. Defaults to `None`.
            max_steps: Steps in a full epoch, if known. Keras reports the last execution of
                an epoch as ending at `begin + steps_per_execution - 1` even when fewer
                batches were left; this caps the count. Defaults to `None`.

        Returns:
            A dict; values that are unknown are `None`.
        """
        self.train_done()
        # Steps finish in order, but Keras' worker threads may take their readings out of
        # order (wake-up jitter): the k-th earliest reading is the k-th step's completion.
        indices = sorted(i for i, _ in self._ends)
        if max_steps:
            indices = [min(i, max_steps - 1) for i in indices]
        ends = list(zip(indices, sorted(t for _, t in self._ends)))
        train_end = ends[-1][1] if ends else self._train_done
        if ends:
            # The last step's completion, not a later sync, ends the training part; but a
            # reading taken in a worker thread can lag, so never beyond the sync either.
            train_end = min(max(t for _, t in ends), self._train_done)
            steps = ends[-1][0] + 1
        epoch_time = max(train_end - self._t0, 1e-9)
        out = {
            "epoch_time_s": epoch_time,
            "val_time_s": None,
            "steps": steps,
            "steps_per_s": steps / epoch_time if steps else None,
            "step_time_ms_p50": None,
            "step_time_ms_p90": None,
        }
        if self._val_start is not None and self._val_end is not None:
            out["val_time_s"] = max(self._val_end - max(self._val_start, train_end), 0.0)
        if ends:
            per_step = _gaps([(-1, self._t0)] + ends)
            begins = sorted(self._begins)
            if begins and begins[-1][0] < steps:
                # Dispatch readings: each step spans from its start to the next one's, the
                # last to the end of training. Like the completion gaps, these sum to the
                # epoch; see the class docstring for why the steadier reading wins.
                dispatch = _gaps([(i - 1, t) for i, t in begins] + [(steps - 1, train_end)])
                if dispatch and _spread(dispatch) < _spread(per_step):
                    per_step = dispatch
            out["step_time_ms_p50"] = _quantile(per_step, 0.5)
            out["step_time_ms_p90"] = _quantile(per_step, 0.9)
        return out


def _quantile(values: list[float], q: float) -> float:
    """The `q` quantile with linear interpolation (NumPy's default), in plain Python: cheaper
    than NumPy's call overhead for the few hundred values of an epoch."""
    a = sorted(values)
    pos = q * (len(a) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(a) - 1)
    return a[lo] + (a[hi] - a[lo]) * (pos - lo)


def _spread(values: list[float]) -> float:
    """Coefficient of variation (population standard deviation over mean); inf if mean is 0."""
    mean = sum(values) / len(values)
    if mean <= 0:
        return float("inf")
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 / mean


def _gaps(points: list[tuple[int, float]]) -> list[float]:
    """Per-step milliseconds between consecutive (last step index, time) readings."""
    out = []
    for (i0, t0), (i1, t1) in zip(points, points[1:]):
        if i1 > i0:
            out.append(max(t1 - t0, 0.0) / (i1 - i0) * 1000.0)
    return out
