"""Benchmark of kp.diagnose: its verdicts, and its predicted speed-ups against real training.

Three cases with a bottleneck beyond doubt:
1. input: a PyDataset that sleeps 20 ms per batch (digits MLP, batch 16);
2. host: a 64-32-10 MLP on digits at batch 8;
3. compute: a 512-2048-2048-10 MLP with SGD at batch 512.

For each: the verdict; the top what-if's predicted speed-up next to the real one, a 3-epoch
`fit` with the change applied against one without (alternated, 5 repeats, median; target:
within 25 %); and the cost of diagnose itself (target: below `max_seconds` plus the set-up).
torch runs with one intra-op thread (`torch.set_num_threads(1)`).

Run: python -m benchmarks.bench_diagnose [--quick] [--json PATH]
"""

from __future__ import annotations

import time

import keras
import numpy as np

import keras_perf as kp

from . import _harness
from ._diagnose_cases import Sleepy, real_speedup
from ._harness import digits, finish, parse_args, row

if keras.backend.backend() == "torch":
    import torch

    torch.set_num_threads(1)


def mlp(sizes, optimizer="adam"):
    return _harness.mlp(sizes[1:-1], sizes[0], sizes[-1], seed=0, optimizer=optimizer)


def cases(quick):
    (x, y), _ = digits()
    rng = np.random.default_rng(0)
    n_big = 2048 if quick else 8192
    xb = rng.normal(size=(n_big, 512)).astype("float32")
    yb = rng.integers(0, 10, n_big)
    return [
        ("input", lambda: mlp([64, 32, 10]), {"x": Sleepy(x, y, 20 if quick else 60)}),
        ("host", lambda: mlp([64, 32, 10]), {"x": x, "y": y, "batch_size": 8}),
        (
            "compute",
            lambda: mlp([512, 2048, 2048, 10], "sgd"),
            {"x": xb, "y": yb, "batch_size": 512},
        ),
    ]


def main():
    args = parse_args(__doc__.splitlines()[0])
    # --quick: fewer repeats, a shorter budget; --smoke (CI): a 3 s budget, 6 steps.
    repeats, max_seconds = (1, 3) if args.smoke else (1, 8) if args.quick else (5, 60)
    steps = 6 if args.smoke else 10 if args.quick else 50
    epochs = 1 if args.quick else 3
    rows = []
    for expected, model_fn, data in cases(args.quick):
        model = model_fn()
        t0 = time.perf_counter()
        d = kp.diagnose(model, steps=steps, max_seconds=max_seconds, **data)
        cost = time.perf_counter() - t0
        print(d, "\n")
        rows.append(
            row(
                f"diagnose verdict, {expected} case",
                {"wall_ratio": float(d.bottleneck == expected), "cpu_ratio": None, "repeats": 1},
                "1 (right)",
                note=f"said {d.bottleneck}; shares "
                + ", ".join(f"{k} {v:.2f}" for k, v in d.shares.items()),
            )
        )
        rows.append(
            row(
                f"diagnose cost / (max_seconds + set-up), {expected} case",
                {
                    "wall_ratio": cost / (max_seconds + d.trace_seconds),
                    "cpu_ratio": None,
                    "repeats": 1,
                },
                "< 1",
                note=f"{cost:.1f} s (set-up {d.trace_seconds:.1f} s)",
            )
        )
        if not d.what_if:
            continue
        top = d.what_if[0]
        try:
            real, ratios = real_speedup(top["change"], model_fn, data, repeats, epochs)
        except ValueError as exc:
            print(exc)
            continue
        rows.append(
            row(
                f"predicted / real speed-up of '{top['change']}', {expected} case",
                {
                    "wall_ratio": top["speedup"] / real,
                    "cpu_ratio": None,
                    "wall_spread": (min(ratios), max(ratios)),
                    "repeats": repeats,
                },
                "0.75-1.25",
                note=f"predicted {top['speedup']:.2f}x, real {real:.2f}x ({epochs}-epoch fits)",
            )
        )
    finish(rows, args)


if __name__ == "__main__":
    main()
