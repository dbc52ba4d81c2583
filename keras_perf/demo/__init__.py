"""`keras-perf demo`: every keras-perf lever against its own baseline, on scikit-learn's
bundled digits data, the same data and seeds on both sides.

Levers (one function each in `keras_perf.demo._levers`):

- training speed: plain `fit` vs `fit` after `kp.accelerate` (examples/s);
- memory: one step's peak with `remat="full"` and with 4 micro-batches vs neither, as
  `kp.backend.step_memory` measures it, at the same loss;
- distillation: a student on a 10 % labelled share alone vs the same student distilled,
  label-free, on every input from a teacher trained on that share (points, mean over seeds);
- pruning: the over-parameterised teacher at 85 % sparsity vs unpruned (points, gzip size);
  channel pruning + `kp.shrink` (parameters, latency);
- deployment: Keras `predict` vs TFLite/ONNX float and int8 at batch 1 and 64, as
  `kp.inference_report` measures them;
- learning rate: `kp.find_learning_rate`'s suggestion vs Adam's default, same epochs.

Writes `report.json` (`levers`: one `{"lever", "baseline", "with", "gain", "unit", "note"}`
row each, plus `gain_unit` and `pays`; `rows`: the models; `inference`, `stages`, `files`),
`summary.png` (one panel per unit), the teacher's monitor log and plot and the range test's
plot to `--out`, and prints both tables. Needs the `demo` extra (scikit-learn, matplotlib).

On TensorFlow the demo turns on the CPU BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`,
unless set) when TensorFlow is not imported yet, so that the memory lever can be measured.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if "tensorflow" not in sys.modules:  # before Keras imports it: the memory lever's measure
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from keras_perf._imports import require  # noqa: E402
from keras_perf.demo._common import LEVER_KEYS, Demo, Settings  # noqa: E402
from keras_perf.demo._report import (  # noqa: E402
    _StageBar,
    _summary_plot,
    lever_table,
    model_table,
    write_report,
)

__all__ = ["run", "LEVER_KEYS", "Settings", "_StageBar", "_summary_plot"]


def run(
    out: str | os.PathLike = "keras-perf-demo",
    epochs: int = 30,
    verbose: bool = True,
    quick: bool = False,
) -> dict:
    """Run the demo; returns the report written to `out/report.json`.

    Args:
        out: Output folder (created). Defaults to `"keras-perf-demo"`.
        epochs: The teacher's epochs at most (early stopping may end it sooner; 3 at most
            with `quick`). The other stages' sizes are fixed (see `Settings`). Defaults to `30`.
        verbose: Print stage progress and the final tables. Defaults to `True`.
        quick: A smoke run (CI): every lever, one seed, a few epochs each; the figures are not
            the demo's. Defaults to `False`.

    Returns:
        The report dict: `levers` (one row per lever: `lever`, `baseline`, `with`, `gain`,
        `unit`, `note`, `gain_unit`, `pays`), `rows` (one per model), `inference`
        (`kp.inference_report`'s rows), `stages`, `files`, `backend`, `policy`, `settings`,
        `total_time_s`, `process_cpu_s`.

    Raises:
        ValueError: `epochs` < 1.
        ImportError: scikit-learn or matplotlib is missing (the `demo` extra).
    """
    import keras

    import keras_perf as kp
    from keras_perf._utils import check_int
    from keras_perf.data import load_digits_split
    from keras_perf.demo import _levers

    epochs = check_int("epochs", epochs, minimum=1)
    require("sklearn", "keras-perf demo", extra="demo")  # before any training
    require("matplotlib", "keras-perf demo", extra="demo")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    settings = Settings.quick(min(epochs, 3)) if quick else Settings(teacher_epochs=epochs)
    train, val, test = load_digits_split(seed=0)
    demo = Demo(out, settings, verbose, train, val, test)
    policy = kp.setup_mixed_precision("auto")
    if verbose:
        print(
            f"keras-perf demo{' --quick' if quick else ''}: backend {keras.backend.backend()}, "
            f"policy {policy}, digits train {len(train[0])} / val {len(val[0])} / "
            f"test {len(test[0])}, out {out}"
        )

    def bar(title, n):
        return _StageBar(title, n) if verbose else keras.callbacks.Callback()

    stages = [
        ("teacher", lambda: _levers.train_teacher(demo, bar)),
        ("training speed", lambda: _levers.training_speed(demo)),
        ("memory", lambda: _levers.memory(demo)),
        ("distillation", lambda: _levers.distillation(demo)),
        ("pruning", lambda: _levers.pruning(demo, teacher)),
        ("deployment", lambda: _levers.deployment(demo, teacher)),
        ("learning rate", lambda: _levers.learning_rate(demo)),
    ]
    teacher = None
    for name, stage in stages:
        c0 = time.process_time()
        result = stage()
        teacher = result if name == "teacher" else teacher
        demo.cpu_s[name] = round(time.process_time() - c0, 1)
    demo.stages["process_cpu_s"] = demo.cpu_s
    report = write_report(demo, policy, t_start, cpu_start)
    if verbose:
        print("\n" + model_table(demo.rows))
        print("\n" + lever_table(demo.levers))
        print(
            f"\ntotal {report['total_time_s']} s wall, {report['process_cpu_s']} s process CPU; "
            f"report, logs and plots in {out}/"
        )
    return report
