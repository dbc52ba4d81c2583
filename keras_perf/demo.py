"""`keras-perf demo`: the whole keras-perf story on scikit-learn's bundled digits data.

Stages, each with a progress bar:

1. teacher: a 64-256-256-10 MLP under the device's mixed-precision policy, with the
   loss-scaling train step, `TrainingMonitor` and `EarlyStopping` (best weights restored);
2. student alone: a 64-32-10 MLP trained on the labels (the baseline);
3. distilled student: the same student architecture trained by `DistillationModel`;
4. pruned student: the distilled student fine-tuned with `PruningCallback` to 80 % sparsity,
   then `strip_pruning`;
5. export: TFLite with dynamic-range and full-int8 quantization, accuracy checked in the
   TFLite interpreter.

Writes `report.json`, one `*.jsonl` monitor log and PNG plot per training stage and
`summary.png` to `--out`, and prints a final table.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import keras
import numpy as np

SEED = 0
CLASSES = 10


def load_digits_split(seed: int = SEED):
    """Digits scaled to [0, 1]: train 1077, validation 360, test 360 (stratification-free)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images.reshape(len(data.images), -1) / 16.0).astype("float32")
    y = data.target.astype("int32")
    idx = np.random.default_rng(seed).permutation(len(x))
    x, y = x[idx], y[idx]
    return (x[:1077], y[:1077]), (x[1077:1437], y[1077:1437]), (x[1437:], y[1437:])


def _mlp(widths, name, seed):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((64,))]
    layers += [keras.layers.Dense(w, activation="relu") for w in widths]
    # Logits in float32 whatever the policy: softmax/CE stay accurate under float16.
    layers.append(keras.layers.Dense(CLASSES, dtype="float32", name="logits"))
    return keras.Sequential(layers, name=name)


class _StageBar(keras.callbacks.Callback):
    """One progress bar per stage, advanced per epoch, with the loss and validation accuracy."""

    def __init__(self, title: str, epochs: int):
        super().__init__()
        self.title, self.epochs = title, epochs

    def on_train_begin(self, logs=None):
        print(f"\n{self.title}", flush=True)
        self.bar = keras.utils.Progbar(self.epochs, unit_name="epoch")

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        shown = [(k, float(logs[k])) for k in ("loss", "val_accuracy") if k in logs]
        self.bar.update(epoch + 1, values=shown, finalize=epoch + 1 >= self.epochs)

    def on_train_end(self, logs=None):
        if self.bar._seen_so_far < self.epochs:  # stopped early: close the line
            print(f" (stopped after {self.bar._seen_so_far} epochs)", flush=True)


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
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _summary_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(names, [r["accuracy"] for r in rows], color="tab:blue")
    axes[0].set_ylim(0.8, 1.0)
    axes[0].set_title("test accuracy (digits)")
    size = [r["tflite_bytes"] or r["gzip_bytes"] for r in rows]
    axes[1].bar(names, [s / 1024 for s in size], color="tab:green")
    axes[1].set_title("size, KiB (TFLite file where exported, else gzip of weights)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(out: str | os.PathLike = "keras-perf-demo", epochs: int = 30, verbose: bool = True) -> dict:
    """Run the demo; returns the report written to `out/report.json`.

    Args:
        out: Output folder (created). Defaults to `"keras-perf-demo"`.
        epochs: Epochs per training stage (early stopping may end the teacher sooner; pruning
            fine-tunes for `max(2, epochs // 2)`). Defaults to `30`.
        verbose: Print stage progress and the final table. Defaults to `True`.

    Returns:
        The report dict: `backend`, `policy`, `epochs`, `rows` (one per model, the table's
        columns), `exports` (the TFLite reports), `stages` (monitor summaries), `files`.

    Raises:
        ValueError: `epochs` < 1.
    """
    import keras_perf as kp
    from keras_perf._utils import check_int

    epochs = check_int("epochs", epochs, minimum=1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    (x, y), (xv, yv), (xt, yt) = load_digits_split()
    policy = kp.setup_mixed_precision("auto")
    if verbose:
        print(f"keras-perf demo: backend {keras.backend.backend()}, policy {policy}, "
              f"digits train {len(x)} / val {len(xv)} / test {len(xt)}, out {out}")
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows, stages, files = [], {}, []

    def stage_callbacks(name, n_epochs, extra=()):
        mon = kp.TrainingMonitor(log_path=str(out / f"{name}.jsonl"))
        bar = _StageBar(f"[{name}]", n_epochs) if verbose else keras.callbacks.Callback()
        return mon, [mon, *extra, bar]

    def finish_stage(name, mon):
        png = out / f"{name}.png"
        mon.plot(str(png))
        files.extend([f"{name}.jsonl", f"{name}.png"])
        stages[name] = mon.summary()

    # 1. Teacher, mixed precision where the device has it, loss-scaled step, early stopping.
    t0 = time.perf_counter()
    teacher = kp.loss_scaled(_mlp([256, 256], "teacher", SEED))
    teacher.compile(keras.optimizers.Adam(2e-3), sce, metrics=["accuracy"])
    stop = kp.EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)
    mon, cbs = stage_callbacks("teacher", epochs, [stop])
    teacher.fit(x, y, batch_size=64, epochs=epochs, validation_data=(xv, yv), verbose=0, callbacks=cbs)
    finish_stage("teacher", mon)
    rows.append(_row("teacher", teacher, _accuracy(teacher, xt, yt), mon, time.perf_counter() - t0))
    stages["teacher"]["stop_reason"] = stop.stop_reason

    # 2. The student on labels alone (baseline).
    t0 = time.perf_counter()
    alone = _mlp([32], "student_alone", SEED + 1)
    alone.compile(keras.optimizers.Adam(2e-3), sce, metrics=["accuracy"])
    mon, cbs = stage_callbacks("student_alone", epochs)
    alone.fit(x, y, batch_size=64, epochs=epochs, validation_data=(xv, yv), verbose=0, callbacks=cbs)
    finish_stage("student_alone", mon)
    rows.append(_row("student alone", alone, _accuracy(alone, xt, yt), mon, time.perf_counter() - t0))

    # 3. Distilled student (same architecture and initial weights as the baseline).
    t0 = time.perf_counter()
    student = _mlp([32], "student", SEED + 1)
    distiller = kp.DistillationModel(student, teacher, temperature=3.0, alpha=0.7)
    distiller.compile(optimizer=keras.optimizers.Adam(2e-3), metrics=["accuracy"])
    mon, cbs = stage_callbacks("distilled", epochs)
    distiller.fit(x, y, batch_size=64, epochs=epochs, validation_data=(xv, yv), verbose=0, callbacks=cbs)
    finish_stage("distilled", mon)
    rows.append(_row("distilled", student, _accuracy(student, xt, yt), mon, time.perf_counter() - t0))

    # 4. Prune the distilled student to 80 % while distillation continues, then strip.
    t0 = time.perf_counter()
    tune = max(2, epochs // 2)
    steps = tune * int(np.ceil(len(x) / 64))
    start = int(keras.ops.convert_to_numpy(distiller.optimizer.iterations))  # steps count on
    frequency = max(1, steps // 20)  # end_step on the update grid, so 80 % is reached
    schedule = kp.PolynomialDecay(
        initial_sparsity=0.0, final_sparsity=0.8, begin_step=start,
        end_step=start + max(1, int(steps * 0.6) // frequency) * frequency, frequency=frequency,
    )
    pruning = kp.PruningCallback(schedule)
    mon, cbs = stage_callbacks("pruned", tune, [pruning])
    distiller.fit(x, y, batch_size=64, epochs=tune, validation_data=(xv, yv), verbose=0, callbacks=cbs)
    finish_stage("pruned", mon)
    pruned = kp.strip_pruning(student)
    rows.append(_row("pruned 80%", pruned, _accuracy(pruned, xt, yt), mon, time.perf_counter() - t0))

    # 5. Export the pruned student: dynamic-range and full-int8 TFLite, accuracy in TFLite.
    exports = {}
    if verbose:
        print("\n[export] TFLite dynamic and int8 ...", flush=True)
    for mode in ("dynamic", "int8"):
        t0 = time.perf_counter()
        path = out / f"student_{mode}.tflite"
        rep = kp.export_tflite(
            pruned, path, quantization=mode, representative_data=x[:200] if mode == "int8" else None
        )
        preds = kp.tflite_predict(path, xt)
        acc = float(np.mean(np.argmax(preds, axis=-1) == yt))
        exports[mode] = {k: v for k, v in rep.items() if _jsonable(v)}
        row = _row(f"TFLite {mode}", pruned, acc, None, time.perf_counter() - t0, int(rep["bytes"]))
        rows.append(row)
        files.append(path.name)

    _summary_plot(rows, out / "summary.png")
    files.append("summary.png")
    report = {
        "backend": keras.backend.backend(),
        "policy": policy,
        "epochs": epochs,
        "teacher_epochs_run": stages["teacher"].get("epochs"),
        "rows": rows,
        "exports": exports,
        "stages": stages,
        "files": files + ["report.json"],
        "total_time_s": round(time.perf_counter() - t_start, 1),
    }
    with open(out / "report.json", "w") as f:
        json.dump(report, f, indent=1, default=_json_default)
    if verbose:
        print("\n" + _table(rows))
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
