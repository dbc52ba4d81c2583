"""Study: does distillation help a small student on digits? (student alone vs distilled).

sklearn's bundled digits (1437 train / 360 test, same split as the tests), a 256-256 MLP
teacher trained on the labels, a 16-unit MLP student. For every seed, temperature T and alpha
the student trains for 150 epochs; test accuracy is read at epochs 20, 50 and 150 (Adam at a
constant learning rate, so the reading at epoch 20 is what a 20-epoch run gives). The same
student trained on labels alone is the baseline; alpha=1.0 (soft targets only, labels unused)
is the label-free case.

    KERAS_BACKEND=jax python -m benchmarks.study_distillation --json study.json [--quick]
    python -m benchmarks.study_distillation --table-from [PATH]   # no training

Prints a markdown table (mean ± std over seeds of test accuracy, %) for docs/BENCHMARKS.md
(distillation section). The run cited there is recorded in
benchmarks/study_distillation_results.json (`--json` wrote it; every seed's accuracies):
`--table-from` alone prints its table again, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_perf as kp  # noqa: E402

from . import _harness  # noqa: E402

EPOCHS = (20, 50, 150)
TEMPERATURES = (1.0, 3.0, 5.0)
ALPHAS = (0.5, 0.9)
SEEDS = (0, 1, 2)
BATCH = 128
LR = 2e-3
# The run whose figures docs/BENCHMARKS.md cites (JAX, Keras 3.15.1, 3 seeds, 150 epochs).
RESULTS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "study_distillation_results.json"
)


digits = _harness.digits


def mlp(widths, name):
    return _harness.mlp(widths, name=name)


def accuracy(model, x, y):
    logits = model.predict(x, batch_size=512, verbose=0)
    return float(np.mean(np.argmax(logits, -1) == y))


class ReadAt(keras.callbacks.Callback):
    """Test accuracy of the student at the given (1-based) epochs."""

    def __init__(self, student, x, y, epochs):
        super().__init__()
        self.student, self.x, self.y, self.epochs = student, x, y, set(epochs)
        self.acc = {}

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 in self.epochs:
            self.acc[epoch + 1] = accuracy(self.student, self.x, self.y)


def run_student(seed, train, test, teacher, temperature, alpha, epochs):
    keras.utils.set_random_seed(seed + 100)
    student = mlp([16], "student")
    read = ReadAt(student, *test, EPOCHS if epochs == max(EPOCHS) else [epochs])
    if teacher is None:  # student alone, on labels
        student.compile(
            keras.optimizers.Adam(LR), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        student.fit(*train, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[read])
    else:
        model = kp.DistillationModel(student, teacher, temperature=temperature, alpha=alpha)
        model.compile(keras.optimizers.Adam(LR))
        model.fit(*train, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[read])
    return read.acc


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", metavar="PATH", help="write every seed's accuracies as JSON")
    p.add_argument("--quick", action="store_true", help="1 seed, 20 epochs, T=3, alpha=0.9")
    p.add_argument(
        "--table-from",
        metavar="PATH",
        nargs="?",
        const=RESULTS,
        help="print the table of a JSON written by --json (default: the recorded run, "
        "benchmarks/study_distillation_results.json) and train nothing",
    )
    args = p.parse_args()
    if args.table_from:
        with open(args.table_from) as f:
            print(summarise(json.load(f)["rows"]))
        return
    epochs_max = 20 if args.quick else max(EPOCHS)
    seeds = SEEDS[:1] if args.quick else SEEDS
    temps = (3.0,) if args.quick else TEMPERATURES
    alphas = (0.9,) if args.quick else ALPHAS
    train, test = digits()
    rows = []
    t0 = time.time()
    for seed in seeds:
        keras.utils.set_random_seed(seed)
        teacher = mlp([256, 256], "teacher")
        teacher.compile(
            keras.optimizers.Adam(1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        teacher.fit(*train, batch_size=64, epochs=60, verbose=0)
        rows.append(
            {"seed": seed, "variant": "teacher 256-256", "acc": {"-": accuracy(teacher, *test)}}
        )
        acc = run_student(seed, train, test, None, None, None, epochs_max)
        rows.append({"seed": seed, "variant": "student alone", "acc": acc})
        for t in temps:
            for a in alphas + (1.0,):
                if a == 1.0 and t != 3.0:
                    continue
                acc = run_student(seed, train, test, teacher, t, a, epochs_max)
                rows.append({"seed": seed, "variant": f"KD T={t:g} alpha={a:g}", "acc": acc})
                print(
                    f"[{time.time() - t0:6.0f}s] seed {seed} T={t:g} alpha={a:g}: {acc}", flush=True
                )
        keras.backend.clear_session()
    table = summarise(rows)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "backend": keras.backend.backend(),
                    "keras": keras.__version__,
                    "rows": rows,
                    "seconds": time.time() - t0,
                },
                f,
                indent=1,
            )


def summarise(rows):
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cols = sorted({k for r in rows for k in r["acc"] if k != "-"}, key=int)
    lines = [
        "| variant | " + " | ".join(f"epoch {c}" for c in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for v in variants:
        cells = []
        for c in cols if v != "teacher 256-256" else ["-"]:
            vals = [100 * r["acc"][c] for r in rows if r["variant"] == v and c in r["acc"]]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.1f} ± {sd:.1f}")
        if v == "teacher 256-256":
            cells = cells * len(cols)
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
