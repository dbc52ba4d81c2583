"""The range test's curve: smoothing, the divergence rule, the suggestion, the result and plot.

Plain Python and NumPy, no Keras: the training side (`_finder`) feeds one raw loss per step to
`SmoothedLoss`, asks `diverged`, and wraps what it recorded in `LRFinderResult`.

- Smoothing: an exponential moving average with bias correction, as fastai's and Lightning's
  range tests: `avg = (1 - s) * avg + s * loss`, `smoothed = avg / (1 - (1 - s) ** n)` after
  `n` losses (`s` = `smoothing`; fastai and Lightning use 0.02, torch-lr-finder 0.05).
- Divergence (fastai's and Lightning's rule): the run stops after the first step, from the
  second on, whose smoothed loss exceeds `DIVERGENCE_FACTOR` (4) times the lowest smoothed
  loss so far, or whose loss is not finite. That step stays in the curve.
- Suggestion (`steepest_descent`): the learning rate where the smoothed loss falls fastest
  against log(learning rate), the first `skip_begin` and last `skip_end` points left out.
"""

from __future__ import annotations

import math

import numpy as np

from keras_perf._imports import require

DIVERGENCE_FACTOR = 4.0


class SmoothedLoss:
    """Exponential moving average of the loss with bias correction (fastai's `smooth_loss`)."""

    def __init__(self, smoothing: float):
        self.smoothing = smoothing
        self._avg = 0.0
        self._count = 0

    def update(self, loss: float) -> float:
        """Add one step's loss; return the smoothed loss (NaN once a loss was not finite)."""
        self._count += 1
        self._avg = (1.0 - self.smoothing) * self._avg + self.smoothing * loss
        return self._avg / (1.0 - (1.0 - self.smoothing) ** self._count)


def diverged(smoothed_losses: list[float]) -> bool:
    """Whether the last smoothed loss ends the run: not finite, or > 4x the best so far."""
    last = smoothed_losses[-1]
    if not math.isfinite(last):
        return True
    return len(smoothed_losses) > 1 and last > DIVERGENCE_FACTOR * min(smoothed_losses)


def steepest_descent(lrs, losses, skip_begin: int = 10, skip_end: int = 1) -> int | None:
    """Index of the steepest descent of `losses` against log(`lrs`), or None if undecidable.

    The points `skip_begin:len - skip_end` are kept, the non-finite among them dropped, and
    `np.gradient(losses, log(lrs))` (central differences, one-sided at the ends) is minimised
    over the kept points up to the one with the lowest loss (all of them where that is the
    first). On a geometric grid the log spacing is constant, so the index is the same as that
    of `np.gradient(losses).argmin()`, the rule of pytorch_lightning's `suggestion()` before
    it took the spacing into account, wherever that descent comes before the lowest loss. A descent after it is the loss
    falling back from a divergence the run did not stop at (it stops at 4x the lowest): on
    digits (torch, seed 1) the loss rose from 1.5 to 5.2 and dipped to 5.0 at 3.3, which
    Lightning's rule suggested and which trains to 10 % accuracy. None when fewer than 2
    points remain, or when the loss rises at every one up to its lowest (it never went down:
    there is no descent to point at).

    Args:
        lrs: Learning rates, positive, in the order they were tried.
        losses: The (smoothed) loss after each of them.
        skip_begin: Points left out at the start. Defaults to `10`.
        skip_end: Points left out at the end. Defaults to `1`.

    Returns:
        An index into `lrs`, or None.
    """
    lrs = np.asarray(lrs, dtype=np.float64)
    losses = np.asarray(losses, dtype=np.float64)
    kept = np.arange(len(losses))[skip_begin : len(losses) - skip_end]
    kept = kept[np.isfinite(losses[kept])]
    if len(kept) < 2:
        return None
    slopes = np.gradient(losses[kept], np.log(lrs[kept]))
    lowest = int(np.argmin(losses[kept]))  # the first lowest point
    # A curve whose lowest loss is its first point never fell below where it started: noise
    # decides the pick wherever it is looked for, and the whole curve is, as Lightning does.
    best = int(np.argmin(slopes[: lowest + 1] if lowest > 0 else slopes))
    if not slopes[best] < 0:
        return None
    return int(kept[best])


class LRFinderResult:
    """What `kp.find_learning_rate` found: the curve, the suggestion and a plot.

    Attributes:
        lrs: The learning rate of each step run, rising geometrically.
        losses: The smoothed loss after each step (float32 losses as Python floats).
        raw_losses: Each step's loss before smoothing.
        suggestion: The learning rate at the steepest descent of `losses`, or None when there
            is none (too few points, or a loss that never went down); see `suggest`.
        suggestion_index: Its index in `lrs`, or None.
        stop_reason: Why the run ended before `steps` steps, or None when it ran them all.
        min_lr, max_lr, steps, smoothing: The arguments the test ran with.
    """

    def __init__(self, lrs, raw_losses, losses, *, min_lr, max_lr, steps, smoothing, stop_reason):
        self.lrs = [float(v) for v in lrs]
        self.raw_losses = [float(v) for v in raw_losses]
        self.losses = [float(v) for v in losses]
        self.min_lr, self.max_lr, self.steps, self.smoothing = min_lr, max_lr, steps, smoothing
        self.stop_reason = stop_reason
        self.suggestion_index = steepest_descent(self.lrs, self.losses, *self.default_skips())
        self.suggestion = None if self.suggestion_index is None else self.lrs[self.suggestion_index]

    def default_skips(self) -> tuple[int, int]:
        """`(skip_begin, skip_end)` of the suggestion: `(steps // 10, 1)`, Lightning's `(10, 1)`
        at the default 100 steps."""
        return self.steps // 10, 1

    def suggest(self, skip_begin: int | None = None, skip_end: int = 1) -> float | None:
        """The suggestion with other skips (Lightning's `suggestion(skip_begin, skip_end)`).

        Args:
            skip_begin: Points left out at the start. Defaults to `None`: `steps // 10`.
            skip_end: Points left out at the end. Defaults to `1`.

        Returns:
            The learning rate at the steepest descent of the smoothed loss, or None.
        """
        if skip_begin is None:
            skip_begin = self.default_skips()[0]
        index = steepest_descent(self.lrs, self.losses, skip_begin, skip_end)
        return None if index is None else self.lrs[index]

    def plot(self, path=None, ax=None):
        """Draw the smoothed loss against the learning rate (log x axis), the suggestion marked.

        Needs matplotlib (`pip install 'keras-perf[plot]'`).

        Args:
            path: File to save the figure to (any format matplotlib writes), or None.
                Defaults to `None`.
            ax: A matplotlib `Axes` to draw into, or None for a new figure. Defaults to `None`.

        Returns:
            The matplotlib `Figure`.

        Raises:
            ImportError: matplotlib is not installed; the message names the `plot` extra.
        """
        require("matplotlib", "LRFinderResult.plot")
        if ax is None:
            from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

            fig = Figure(figsize=(6, 4), layout="constrained")
            ax = fig.add_subplot()
        else:
            fig = ax.figure
        ax.plot(self.lrs, self.losses, label="smoothed loss")
        ax.plot(self.lrs, self.raw_losses, alpha=0.3, linewidth=0.8, label="loss")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        finite = [v for v in self.losses if math.isfinite(v)]
        if finite:  # the diverging tail would otherwise squash the curve
            low = min(v for v in finite + self.raw_losses if math.isfinite(v))
            high = max(finite[0], min(finite) * DIVERGENCE_FACTOR)
            ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
        if self.suggestion is not None:
            ax.plot(
                [self.suggestion],
                [self.losses[self.suggestion_index]],
                "o",
                color="red",
                markersize=8,
                label=f"suggestion {self.suggestion:.2g}",
            )
        ax.legend()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig

    def __repr__(self) -> str:
        ran = f"{len(self.lrs)} of {self.steps} steps"
        span = f"lr {self.min_lr:.2g} to {self.lrs[-1]:.2g}" if self.lrs else "no step"
        suggestion = "none" if self.suggestion is None else f"{self.suggestion:.3g}"
        stop = f"; stopped: {self.stop_reason}" if self.stop_reason else ""
        return f"LRFinderResult(suggestion={suggestion}; {ran}, {span}{stop})"
