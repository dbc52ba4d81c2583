"""Shared measuring code for the benchmark scripts (not a benchmark itself).

Every claim is a ratio of keras-perf against plain Keras, measured in one process with the two
variants alternated A B B A (so drift and warm-up hit both alike), repeated, and summarised by
the median. Wall time and process CPU time (`time.process_time()`) are both recorded: on a shared
machine wall time is noisy, CPU time of the same work much less so.

A script calls `abba(...)` per claim, builds rows with `row(...)`, and ends with
`finish(rows, args)`, which prints a table and, with `--json PATH`, writes the rows for
`keras-perf bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps (CI smoke run)")
    p.add_argument("--json", metavar="PATH", help="write the result rows as JSON to PATH")
    return p.parse_args()


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Run `fn` once; return (wall seconds, process CPU seconds)."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def abba(baseline: Callable[[], object], candidate: Callable[[], object], repeats: int = 5) -> dict:
    """Time `candidate` against `baseline` in A B B A order, `repeats` times.

    Each callable does one unit of work (say, one epoch of `fit`) and must already be warmed up
    (compiled). Returns the median candidate/baseline ratios of wall and CPU time, each pair's
    ratios and their spread (min, max).
    """
    wall, cpu = [], []
    for _ in range(repeats):
        a1 = timed(baseline)
        b1 = timed(candidate)
        b2 = timed(candidate)
        a2 = timed(baseline)
        wall.append((b1[0] + b2[0]) / (a1[0] + a2[0]))
        cpu.append((b1[1] + b2[1]) / max(a1[1] + a2[1], 1e-9))
    return summarize(wall, cpu)


def summarize(wall: list[float], cpu: list[float]) -> dict:
    """Median ratios and their spread (min, max) from per-repeat wall and CPU ratios."""
    return {
        "wall_ratio": statistics.median(wall),
        "cpu_ratio": statistics.median(cpu),
        "wall_spread": (min(wall), max(wall)),
        "cpu_spread": (min(cpu), max(cpu)),
        "repeats": len(wall),
    }


def row(claim: str, result: dict, target: str, backend: str | None = None, note: str = "") -> dict:
    """One table row: the claim, the measured ratios, the target beside them."""
    import keras

    return {
        "claim": claim,
        "backend": backend or keras.backend.backend(),
        "wall_ratio": round(result["wall_ratio"], 3),
        "cpu_ratio": round(result["cpu_ratio"], 3) if result.get("cpu_ratio") is not None else None,
        "wall_spread": [round(v, 3) for v in result.get("wall_spread", ())],
        "cpu_spread": [round(v, 3) for v in result.get("cpu_spread", ())],
        "repeats": result.get("repeats"),
        "target": target,
        "note": note,
    }


def digits():
    """scikit-learn's bundled digits scaled to [0, 1], split 1437/360 in a fixed order."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images.reshape(len(data.images), -1) / 16.0).astype("float32")
    y = data.target.astype("int32")
    idx = np.random.default_rng(0).permutation(len(x))
    x, y = x[idx], y[idx]
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform(terse=True)}"


def finish(rows: list[dict], args: argparse.Namespace) -> None:
    """Print the rows as a table; write them to `--json` if given."""
    for r in rows:
        spread = f"wall {r['wall_spread']} cpu {r['cpu_spread']}"
        print(
            f"{r['claim']:<55} {r['backend']:<10} wall {r['wall_ratio']:<6} cpu {r['cpu_ratio']!s:<6} "
            f"target {r['target']:<10} ({spread}, n={r['repeats']}) {r['note']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=1)
