"""The demo's progress bar, terminal tables, `summary.png` and `report.json`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import keras
import numpy as np

from keras_perf.demo._common import json_default


class _StageBar(keras.callbacks.Callback):
    """One progress bar per stage, advanced per epoch, showing that epoch's logs.

    The values are the epoch's own (as Keras' `verbose=1` line shows them), not averages over
    the epochs so far.
    """

    KEYS = ("loss", "accuracy", "val_loss", "val_accuracy", "sparsity")

    def __init__(self, title: str, epochs: int):
        super().__init__()
        self.title, self.epochs = title, epochs

    def on_train_begin(self, logs=None):
        print(f"\n{self.title}", flush=True)
        # stateless_metrics=set(): every value is shown as given (Keras' ProgbarLogger does
        # the same); interval=0: one update per epoch is never too often.
        self.bar = keras.utils.Progbar(
            self.epochs, unit_name="epoch", stateless_metrics=set(), interval=0
        )
        self.seen = 0

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        self.seen = epoch + 1
        shown = [(k, float(logs[k])) for k in self.KEYS if k in logs]
        self.bar.update(self.seen, values=shown, finalize=self.seen >= self.epochs)

    def on_train_end(self, logs=None):
        if self.seen < self.epochs:  # stopped early: close the line
            print(f"\n(stopped after {self.seen} of {self.epochs} epochs)", flush=True)


def _number(v) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def gain_text(row) -> str:
    if row["gain"] is None:
        return "-"
    if row["gain_unit"] == "points":
        return f"{row['gain']:+.1f} pts"
    return f"x{row['gain']:.2f}"


def _grid(header, body, right=range(1, 99)) -> str:
    cells = [header, *body]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w)
                  for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in cells
    ]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def lever_table(levers: list[dict]) -> str:
    """One line per lever: its baseline, the value with it, the gain, the unit and a note."""
    body = [
        [r["lever"], _number(r["baseline"]), _number(r["with"]), gain_text(r), r["unit"], r["note"]]
        for r in levers
    ]
    return _grid(["lever", "baseline", "with", "gain", "unit", "note"], body, right=(1, 2, 3))


def model_table(rows: list[dict]) -> str:
    body = [
        [r["model"], f"{r['accuracy']:.3f}", f"{r['params']:,}", f"{r['nonzero']:,}",
         f"{r['gzip_bytes']:,}"]
        for r in rows
    ]  # fmt: skip
    return _grid(["model", "acc", "params", "nonzero", "gzip B"], body)


def _summary_plot(levers: list[dict], path: Path):
    """One panel per unit: baseline and with-lever bars for each lever in that unit, on a
    linear axis from 0, each bar labelled with its value; the gain in the lever's label.

    Rows without a measured pair are left out (their note says why). Writes the PNG to
    `path`; returns the matplotlib `Figure`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    units: dict[str, list] = {}
    for r in levers:
        if r["baseline"] is not None and r["with"] is not None:
            units.setdefault(r["unit"], []).append(r)
    n = max(1, len(units))
    cols = 2 if n > 1 else 1
    nrows = int(np.ceil(n / cols))
    heights = [max(len(v) for v in list(units.values())[i * cols:(i + 1) * cols] or [[0]])
               for i in range(nrows)]  # fmt: skip
    fig = Figure(figsize=(13, 1.0 + sum(1.1 + 0.7 * h for h in heights)), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(nrows, cols, height_ratios=[1 + 0.7 * h for h in heights] or [1])
    colours = {"baseline": "tab:gray", "with the lever": "tab:blue"}
    for i, (unit, rows) in enumerate(units.items()):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        pos = np.arange(len(rows))
        base = [r["baseline"] for r in rows]
        with_ = [r["with"] for r in rows]
        b1 = ax.barh(pos - 0.2, base, height=0.38, color=colours["baseline"])
        b2 = ax.barh(pos + 0.2, with_, height=0.38,
                     color=[colours["with the lever"] if r["pays"] else "tab:red" for r in rows])  # fmt: skip
        ax.bar_label(b1, labels=[_number(v) for v in base], padding=3, fontsize=8)
        ax.bar_label(b2, labels=[_number(v) for v in with_], padding=3, fontsize=8)
        top = max(base + with_)
        ax.set_xlim(0, 100 if unit.endswith("%") else top * 1.25)  # honest: from 0
        ax.set_yticks(pos, [f"{r['lever']}\n({gain_text(r)})" for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(unit, fontsize=10)
    handles = [Patch(color=c, label=k) for k, c in colours.items()]
    handles.append(Patch(color="tab:red", label="with the lever, where it does not pay"))
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False)
    fig.suptitle("keras-perf demo: each lever against its baseline (axes from 0)")
    fig.savefig(path, dpi=90)
    return fig


def write_report(demo, policy: str, t_start: float, cpu_start: float) -> dict:
    """The summary plot and `report.json`; returns the report."""
    _summary_plot(demo.levers, demo.out / "summary.png")
    demo.files.append("summary.png")
    report = {
        "backend": keras.backend.backend(),
        "policy": policy,
        "settings": demo.settings.__dict__,
        "epochs": demo.settings.teacher_epochs,
        "teacher_epochs_run": demo.stages["teacher"].get("epochs"),
        "levers": demo.levers,
        "rows": demo.rows,
        "inference": demo.inference,
        "stages": demo.stages,
        "files": demo.files + ["report.json"],
        "total_time_s": round(time.perf_counter() - t_start, 1),
        "process_cpu_s": round(time.process_time() - cpu_start, 1),
    }
    with open(demo.out / "report.json", "w") as f:
        json.dump(report, f, indent=1, default=json_default)
    return report
