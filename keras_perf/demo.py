"""`keras-perf demo`: the whole keras-perf story on scikit-learn's bundled digits data.

Stages, one function each, each with a progress bar (one line per epoch, that epoch's values):

1. `train_teacher`: a 64-256-256-10 MLP under the device's mixed-precision policy, with the
   loss-scaling train step, `TrainingMonitor` and `EarlyStopping` (best weights restored);
2. `train_student_alone`: a 64-32-10 MLP trained on the labels (the baseline);
3. `train_distilled`: the same student architecture trained by `DistillationModel`;
4. `prune_student`: the distilled student fine-tuned with `PruningCallback` to 80 % sparsity,
   then `strip_pruning`;
5. `export_student`: TFLite with dynamic-range and full-int8 quantization, accuracy checked in
   the TFLite interpreter (needs TensorFlow, the `tensorflow` extra; skipped without it);
6. `write_report`: `summary.png` and `report.json`.

Writes `report.json`, one `*.jsonl` monitor log and PNG plot per training stage and
`summary.png` to `--out`, and prints a final table. Needs the `demo` extra (scikit-learn for the
data, matplotlib for the plots): `pip install 'keras-perf[demo]'`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import keras
import numpy as np

from keras_perf._imports import require
from keras_perf.data import load_digits_split  # train 1077 / val 360 / test 360

SEED = 0
CLASSES = 10


def _mlp(widths, name, seed):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((64,))]
    layers += [keras.layers.Dense(w, activation="relu") for w in widths]
    # Logits in float32 whatever the policy: softmax/CE stay accurate under float16.
    layers.append(keras.layers.Dense(CLASSES, dtype="float32", name="logits"))
    return keras.Sequential(layers, name=name)


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


def _accuracy(model, x, y) -> float:
    logits = model.predict(x, batch_size=512, verbose=0)
    return float(np.mean(np.argmax(logits, axis=-1) == y))


def _row(name, model, acc, monitor, seconds, tflite_bytes=None):
    import keras_perf as kp

    rep = kp.compression_report(model)["total"]
    summary = monitor.summary() if monitor is not None else {}
    return {
        "model": name,
        "accuracy": round(acc, 4),
        "params": int(rep["params"]),
        "nonzero": int(rep["nonzero"]),
        "gzip_bytes": int(rep["gzip_bytes"]),
        "tflite_bytes": tflite_bytes,
        "examples_per_s": _rate(summary),
        "time_s": round(seconds, 2),
    }


def _rate(summary: dict):
    for key in ("median_examples_per_s", "mean_examples_per_s"):
        if summary.get(key) is not None:
            return round(float(summary[key]), 1)
    return None


def _table(rows: list[dict]) -> str:
    cols = [
        ("model", "model", "{}"),
        ("accuracy", "acc", "{:.3f}"),
        ("params", "params", "{:,}"),
        ("nonzero", "nonzero", "{:,}"),
        ("gzip_bytes", "gzip B", "{:,}"),
        ("tflite_bytes", "TFLite B", "{:,}"),
        ("examples_per_s", "ex/s", "{:,.0f}"),
        ("time_s", "time s", "{:.1f}"),
    ]
    cells = [[title for _, title, _ in cols]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else fmt.format(r[k]) for k, _, fmt in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _summary_plot(rows: list[dict], path: Path):
    """Accuracy (axis from 0) and size (log axis) of every model, one row per model.

    Writes the PNG to `path`; returns the matplotlib `Figure`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    names = [r["model"] for r in rows]
    pos = np.arange(len(rows))
    fig = Figure(figsize=(11, 1.6 + 0.45 * len(rows)), layout="constrained")
    FigureCanvasAgg(fig)
    ax_acc, ax_size = fig.subplots(1, 2, sharey=True)

    accuracy = [r["accuracy"] for r in rows]
    bars = ax_acc.barh(pos, accuracy, color="tab:blue")
    ax_acc.bar_label(bars, fmt="%.3f", padding=3)
    ax_acc.set_xlim(0, 1.15)  # room for the labels; the ticks stop at 1
    ax_acc.set_xticks(np.linspace(0, 1, 6))
    ax_acc.set_yticks(pos, names)
    ax_acc.invert_yaxis()  # the pipeline's order, top to bottom
    ax_acc.set_xlabel("test accuracy (TFLite rows: in the TFLite interpreter)")
    ax_acc.set_title("accuracy on the held-out digits")

    # One size per model: the TFLite file where exported, else the gzip of the weights; the
    # colour says which, so the two kinds are never read as one series.
    colors = {"weights, gzip": "tab:gray", "TFLite file": "tab:orange"}
    kinds = ["TFLite file" if r["tflite_bytes"] else "weights, gzip" for r in rows]
    kib = [(r["tflite_bytes"] or r["gzip_bytes"]) / 1024 for r in rows]
    bars = ax_size.barh(pos, kib, color=[colors[k] for k in kinds])
    ax_size.bar_label(bars, labels=[f"{v:,.1f} KiB" for v in kib], padding=3)
    ax_size.set_xscale("log")
    ax_size.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_size.set_xlim(min(kib) / 2, max(kib) * 8)  # log axis: room for the labels
    ax_size.set_xlabel("size, KiB (log scale)")
    ax_size.set_title("size on disk")
    ax_size.tick_params(axis="y", left=False)
    handles = [Patch(color=c, label=k) for k, c in colors.items() if k in kinds]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    fig.savefig(path, dpi=100)
    return fig


@dataclasses.dataclass
class _Demo:
    """What the stages share: settings, data, and the report as it grows."""

    out: Path
    epochs: int
    verbose: bool
    train: tuple
    val: tuple
    test: tuple
    rows: list = dataclasses.field(default_factory=list)
    stages: dict = dataclasses.field(default_factory=dict)
    files: list = dataclasses.field(default_factory=list)
    exports: dict = dataclasses.field(default_factory=dict)
    inference: list = dataclasses.field(default_factory=list)

    def fit(self, name: str, model, fit_model=None, epochs=None, callbacks=()):
        """`fit_model.fit` on the digits with a monitor and a progress bar; the monitor.

        Writes `<name>.jsonl` and `<name>.png` and keeps the monitor's summary.
        """
        import keras_perf as kp

        epochs = epochs or self.epochs
        mon = kp.TrainingMonitor(log_path=str(self.out / f"{name}.jsonl"))
        bar = _StageBar(f"[{name}]", epochs) if self.verbose else keras.callbacks.Callback()
        (x, y), val = self.train, self.val
        (fit_model or model).fit(
            x,
            y,
            batch_size=BATCH,
            epochs=epochs,
            validation_data=val,
            verbose=0,
            callbacks=[mon, *callbacks, bar],
        )
        mon.plot(str(self.out / f"{name}.png"))
        self.files.extend([f"{name}.jsonl", f"{name}.png"])
        self.stages[name] = mon.summary()
        return mon

    def add_row(self, name, model, monitor, t0, accuracy=None, tflite_bytes=None) -> None:
        if accuracy is None:
            accuracy = _accuracy(model, *self.test)
        self.rows.append(
            _row(name, model, accuracy, monitor, time.perf_counter() - t0, tflite_bytes)
        )


BATCH = 64


def _sce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_teacher(demo: _Demo):
    """Stage 1: the wide teacher, loss-scaled step, mixed precision where the device has it,
    early stopping with the best weights restored."""
    import keras_perf as kp

    t0 = time.perf_counter()
    teacher = kp.loss_scaled(_mlp([256, 256], "teacher", SEED))
    teacher.compile(keras.optimizers.Adam(2e-3), _sce(), metrics=["accuracy"])
    stop = kp.EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)
    mon = demo.fit("teacher", teacher, callbacks=[stop])
    demo.stages["teacher"]["stop_reason"] = stop.stop_reason
    demo.add_row("teacher", teacher, mon, t0)
    return teacher


def train_student_alone(demo: _Demo):
    """Stage 2: the small student trained on the labels alone (the baseline)."""
    t0 = time.perf_counter()
    alone = _mlp([32], "student_alone", SEED + 1)
    alone.compile(keras.optimizers.Adam(2e-3), _sce(), metrics=["accuracy"])
    mon = demo.fit("student_alone", alone)
    demo.add_row("student alone", alone, mon, t0)
    return alone


def train_distilled(demo: _Demo, teacher):
    """Stage 3: the same student (architecture and initial weights) distilled from the
    teacher; returns `(student, distiller)`."""
    import keras_perf as kp

    t0 = time.perf_counter()
    student = _mlp([32], "student", SEED + 1)
    distiller = kp.DistillationModel(student, teacher, temperature=3.0, alpha=0.7)
    distiller.compile(optimizer=keras.optimizers.Adam(2e-3), metrics=["accuracy"])
    mon = demo.fit("distilled", student, fit_model=distiller)
    demo.add_row("distilled", student, mon, t0)
    return student, distiller


def prune_student(demo: _Demo, student, distiller):
    """Stage 4: prune the distilled student to 80 % while distillation goes on, then strip
    the pruning state; returns the pruned model."""
    import keras_perf as kp

    t0 = time.perf_counter()
    tune = max(2, demo.epochs // 2)
    steps = tune * int(np.ceil(len(demo.train[0]) / BATCH))
    start = int(keras.ops.convert_to_numpy(distiller.optimizer.iterations))  # steps count on
    frequency = max(1, steps // 20)  # end_step on the update grid, so 80 % is reached
    schedule = kp.PolynomialDecay(
        initial_sparsity=0.0,
        final_sparsity=0.8,
        begin_step=start,
        end_step=start + max(1, int(steps * 0.6) // frequency) * frequency,
        frequency=frequency,
    )
    mon = demo.fit(
        "pruned",
        student,
        fit_model=distiller,
        epochs=tune,
        callbacks=[kp.PruningCallback(schedule)],
    )
    pruned = kp.strip_pruning(student)
    demo.add_row("pruned 80%", pruned, mon, t0)
    return pruned


def export_student(demo: _Demo, pruned) -> None:
    """Stage 5: TFLite files with dynamic-range and full-int8 quantization, their accuracy
    measured in the TFLite interpreter. Skipped (with a note) without TensorFlow."""
    import keras_perf as kp

    try:
        require("tensorflow", "the demo's TFLite stage")
    except ImportError as e:
        demo.exports["skipped"] = str(e)
        if demo.verbose:
            print(f"\n[export] skipped: {e}", flush=True)
        return
    if demo.verbose:
        print("\n[export] TFLite dynamic and int8 ...", flush=True)
    x, test = demo.train[0], demo.test
    for mode in ("dynamic", "int8"):
        t0 = time.perf_counter()
        path = demo.out / f"student_{mode}.tflite"
        rep = kp.export_tflite(
            pruned, path, quantization=mode, representative_data=x[:200] if mode == "int8" else None
        )
        preds = kp.tflite_predict(path, test[0])
        acc = float(np.mean(np.argmax(preds, axis=-1) == test[1]))
        demo.exports[mode] = {k: v for k, v in rep.items() if _jsonable(v)}
        demo.add_row(
            f"TFLite {mode}", pruned, None, t0, accuracy=acc, tflite_bytes=int(rep["bytes"])
        )
        demo.files.append(path.name)


def measure_inference(demo: _Demo, pruned) -> None:
    """Stage 6: `kp.inference_report` on the pruned student: every deployment format available
    here (Keras, TFLite, ONNX with the `onnx` extra; float and int8), batch 1 and 64, latency
    percentiles, size and agreement with Keras on the test split."""
    import keras_perf as kp
    from keras_perf.export._inference_report import available_formats

    formats = available_formats(pruned)
    if demo.verbose:
        print(f"\n[inference] {', '.join(formats)} at batch 1 and 64 ...", flush=True)
    report = kp.inference_report(
        pruned, demo.test[0], demo.test[1], formats=formats, repeats=10,
        representative_data=demo.train[0][:200],
    )  # fmt: skip
    demo.inference = [{k: v for k, v in row.items() if _jsonable(v)} for row in report.rows]
    if demo.verbose:
        print(report, flush=True)


def write_report(demo: _Demo, policy: str, t_start: float) -> dict:
    """The summary plot and `report.json`; returns the report."""
    _summary_plot(demo.rows, demo.out / "summary.png")
    demo.files.append("summary.png")
    report = {
        "backend": keras.backend.backend(),
        "policy": policy,
        "epochs": demo.epochs,
        "teacher_epochs_run": demo.stages["teacher"].get("epochs"),
        "rows": demo.rows,
        "exports": demo.exports,
        "inference": demo.inference,
        "stages": demo.stages,
        "files": demo.files + ["report.json"],
        "total_time_s": round(time.perf_counter() - t_start, 1),
    }
    with open(demo.out / "report.json", "w") as f:
        json.dump(report, f, indent=1, default=_json_default)
    return report


def run(out: str | os.PathLike = "keras-perf-demo", epochs: int = 30, verbose: bool = True) -> dict:
    """Run the demo; returns the report written to `out/report.json`.

    Args:
        out: Output folder (created). Defaults to `"keras-perf-demo"`.
        epochs: Epochs per training stage (early stopping may end the teacher sooner; pruning
            fine-tunes for `max(2, epochs // 2)`). Defaults to `30`.
        verbose: Print stage progress and the final table. Defaults to `True`.

    Returns:
        The report dict: `backend`, `policy`, `epochs`, `rows` (one per model, the table's
        columns), `exports` (the TFLite reports), `inference` (`kp.inference_report`'s rows:
        latency, size and agreement per format and batch size), `stages` (monitor summaries),
        `files`.

    Raises:
        ValueError: `epochs` < 1.
        ImportError: scikit-learn or matplotlib is missing (the `demo` extra).
    """
    import keras_perf as kp
    from keras_perf._utils import check_int

    epochs = check_int("epochs", epochs, minimum=1)
    require("sklearn", "keras-perf demo", extra="demo")  # before any training
    require("matplotlib", "keras-perf demo", extra="demo")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    train, val, test = load_digits_split(seed=SEED)
    demo = _Demo(out, epochs, verbose, train, val, test)
    policy = kp.setup_mixed_precision("auto")
    if verbose:
        print(
            f"keras-perf demo: backend {keras.backend.backend()}, policy {policy}, "
            f"digits train {len(train[0])} / val {len(val[0])} / test {len(test[0])}, "
            f"out {out}"
        )

    teacher = train_teacher(demo)
    train_student_alone(demo)
    student, distiller = train_distilled(demo, teacher)
    pruned = prune_student(demo, student, distiller)
    export_student(demo, pruned)
    measure_inference(demo, pruned)
    report = write_report(demo, policy, t_start)

    if verbose:
        print("\n" + _table(demo.rows))
        print(f"\ntotal {report['total_time_s']} s; report, logs and plots in {out}/")
    return report


def _jsonable(v) -> bool:
    try:
        json.dumps(v, default=_json_default)
        return True
    except (TypeError, ValueError):
        return False


def _json_default(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, (np.ndarray,)):
        return v.tolist()
    if isinstance(v, (Path,)):
        return str(v)
    if isinstance(v, (tuple, set)):
        return list(v)
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")
