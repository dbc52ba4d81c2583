"""Reports on a `TrainingMonitor` history: the summary, the CSV file and the plot.

Plain functions of the history (a list of per-epoch dicts), apart from the callback that
records it; `TrainingMonitor.summary()`, `.to_csv()` and `.plot()` forward here. Also
`MONITOR_KEYS`, the keys the monitor adds to the logs. Not here: the callback (`_callback.py`)
and the timing (`_meter.py`).
"""

from __future__ import annotations

import csv
import math
import os
import statistics

from keras_perf._imports import require
from keras_perf._utils import check_choice

__all__ = ["MONITOR_KEYS", "history_figure", "plot_history", "summarize", "write_csv"]

#: Keys the monitor adds to each epoch's logs (when their value is known).
MONITOR_KEYS = (
    "epoch_time_s",
    "val_time_s",
    "steps",
    "examples",
    "steps_per_s",
    "examples_per_s",
    "step_time_ms_p50",
    "step_time_ms_p90",
    "peak_memory_bytes",
    "loss_scale",
    "mfu",
)

#: Training-health logs of keras-perf's train steps, each plotted in a panel of its own.
HEALTH_KEYS = ("grad_norm", "skipped_steps", "loss_scale")

_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "f1", "iou", "top_k")


def is_number(v) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def summarize(history: list[dict], monitor: str | None = None, mode: str = "auto") -> dict:
    """Totals over every recorded epoch; see `TrainingMonitor.summary` for the keys.

    Raises:
        ValueError: `mode` is not `"auto"`, `"min"` or `"max"`, or `monitor` was never logged
            (the message lists the keys that were).
    """
    check_choice("mode", mode, ("auto", "min", "max"))
    h = history
    if not h:
        return {"epochs": 0}
    if monitor is None:
        monitor = "val_loss" if any(is_number(r.get("val_loss")) for r in h) else "loss"
    values = [(r["epoch"], r.get(monitor)) for r in h if is_number(r.get(monitor))]
    if not values:
        keys = sorted({k for r in h for k, v in r.items() if is_number(v)})
        raise ValueError(
            f"`monitor={monitor!r}` was not recorded; the numeric keys recorded are {keys}."
        )
    if mode == "auto":
        name = monitor[4:] if monitor.startswith("val_") else monitor
        mode = "max" if any(s in name for s in _HIGHER_IS_BETTER) else "min"
    pick = max if mode == "max" else min
    best_epoch, best = pick(values, key=lambda ev: ev[1])

    def col(key):
        return [r[key] for r in h if is_number(r.get(key))]

    def total(key):
        vals = col(key)
        return sum(vals) if vals else None

    def mean(key):
        vals = col(key)
        return statistics.fmean(vals) if vals else None

    def median(key):
        vals = col(key)
        return statistics.median(vals) if vals else None

    train, val = total("epoch_time_s") or 0.0, total("val_time_s") or 0.0
    peaks = col("peak_memory_bytes")
    return {
        "epochs": len(h),
        "fits": len({r.get("fit") for r in h}),
        "total_time_s": train + val,
        "train_time_s": train,
        "val_time_s": val,
        "steps": total("steps"),
        "examples": total("examples"),
        "mean_examples_per_s": mean("examples_per_s"),
        "median_examples_per_s": median("examples_per_s"),
        "mean_steps_per_s": mean("steps_per_s"),
        "median_steps_per_s": median("steps_per_s"),
        "step_time_ms_p50": median("step_time_ms_p50"),
        "peak_memory_bytes": max(peaks) if peaks else None,
        "mean_mfu": mean("mfu"),
        "log_complete": not any(r.get("log_error") for r in h),
        "best": {"metric": monitor, "value": best, "epoch": best_epoch, "mode": mode},
    }


def write_csv(history: list[dict], path: str | os.PathLike) -> str:
    """Write `history` as CSV (one row per epoch, the union of keys as columns).

    Returns:
        The path written, as a string.
    """
    path = os.fspath(path)
    fields: list[str] = []
    for r in history:
        fields.extend(k for k in r if k not in fields)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        for r in history:
            writer.writerow({k: "" if v is None else v for k, v in r.items()})
    return path


def plot_history(
    history: list[dict], path: str | os.PathLike, metrics: list[str] | None = None
) -> str:
    """Save a PNG of `history`, one panel per kind of figure; see `TrainingMonitor.plot`.

    Returns:
        The path written, as a string.

    Raises:
        RuntimeError: `history` is empty.
        ImportError: matplotlib is not installed (the `plot` extra).
    """
    path = os.fspath(path)
    history_figure(history, metrics).savefig(path, dpi=100)
    return path


def history_figure(history: list[dict], metrics: list[str] | None = None):
    """The matplotlib `Figure` that `plot_history` saves (on an Agg canvas, no pyplot)."""
    if not history:
        raise RuntimeError(
            "TrainingMonitor.plot(): no epoch recorded yet; pass the monitor to "
            "`model.fit(..., callbacks=[mon])` first."
        )
    require("matplotlib", "TrainingMonitor.plot")
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    h = history
    epochs = [r["epoch"] for r in h]

    def recorded(key):
        return any(is_number(r.get(key)) for r in h)

    def series(key, scale=1.0):
        return [r[key] / scale if is_number(r.get(key)) else math.nan for r in h]

    skip = (
        set(MONITOR_KEYS)
        | set(HEALTH_KEYS)
        | {"epoch", "fit", "time", "memory_device", "memory_measure"}
    )
    if metrics is None:
        metrics = []
        for r in h:
            metrics.extend(
                k for k, v in r.items() if k not in skip and k not in metrics and is_number(v)
            )
    losses = [m for m in metrics if "loss" in m]
    others = [m for m in metrics if "loss" not in m]
    rate = "examples_per_s" if recorded("examples_per_s") else "steps_per_s"
    where = h[-1].get("memory_device") or "memory"

    # (title, y label, [(key, label, scale)], options): only panels with something recorded.
    panels = [
        ("Loss", "loss", [(m, m, 1.0) for m in losses], {}),
        ("Metrics", "value", [(m, m, 1.0) for m in others], {}),
        ("Throughput", rate.replace("_per_s", " / s"), [(rate, rate, 1.0)], {"zero": True}),
        (
            "Step time",
            "ms per step",
            [("step_time_ms_p50", "p50", 1.0), ("step_time_ms_p90", "p90", 1.0)],
            {"zero": True},
        ),
        (
            f"Peak memory ({where})",
            "MiB",
            [("peak_memory_bytes", "peak memory", 2**20)],
            {"zero": True},
        ),
        ("Gradient norm", "global norm", [("grad_norm", "grad_norm", 1.0)], {"zero": True}),
        (
            "Skipped steps (non-finite gradients)",
            "steps",
            [("skipped_steps", "skipped_steps", 1.0)],
            {"zero": True, "integer": True},
        ),
        ("Loss scale", "scale (log2 axis)", [("loss_scale", "loss_scale", 1.0)], {"log2": True}),
    ]
    panels = [
        (title, ylabel, [s for s in lines if recorded(s[0])], opts)
        for title, ylabel, lines, opts in panels
    ]
    panels = [p for p in panels if p[2]]
    names = [key for _, _, lines, _ in panels for key, _, _ in lines]
    palette = list(colormaps["tab10"].colors) + list(colormaps["Dark2"].colors)  # 18 apart
    colour = {key: palette[i % len(palette)] for i, key in enumerate(names)}

    fig = Figure(figsize=(8, 1.1 + 1.9 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, ylabel, lines, opts) in zip(axes, panels):
        for key, label, scale in lines:
            ax.plot(epochs, series(key, scale), marker="o", color=colour[key], label=label)
        ax.set_title(title, loc="left", fontsize="medium")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if opts.get("log2"):
            ax.set_yscale("log", base=2)
        elif opts.get("zero"):  # rates, times, sizes: from zero, not a zoomed band
            values = [v for key, _, scale in lines for v in series(key, scale) if v == v]
            top = max(values, default=0.0)
            ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
        if opts.get("integer"):
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        # Outside the axes, to the right: a legend never covers a line.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    axes[-1].set_xlabel("epoch")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig
