"""Claim: calling the measuring tools again and again in one process levels off in memory.

Users call `kp.diagnose`, `kp.find_max_batch_size`, `kp.find_learning_rate`,
`kp.inference_report` and `kp.accelerate` many times in one notebook. Each call builds twins and compiles
functions. This script calls each tool `--calls` times (20 by default) on one small model
(an MLP 16-64-64-4, Adam) with small data, in one process, and reads the process's resident
memory (RSS, `/proc/self/statm`) after every call. The figure is the growth from call 10 to
call 20 (the first calls fill Keras', XLA's and the allocators' caches), in MiB, with the
ratio RSS(20) / RSS(10). The user's model survives: no `keras.utils.clear_session()`.

Each call is kept short (`diagnose`: 5 steps, `max_seconds=1`, a 1 GB memory limit so that
it measures the same things on every call, no what-ifs unless `--what-if`;
`find_learning_rate`: 10 steps; `find_max_batch_size`: one setting, a 64-example cap;
`inference_report`: Keras' own format alone, batch 1, 3 repeats; `accelerate`: `max_seconds=1`,
`apply=False`).

Run: `python -m benchmarks.bench_repeated_calls [--quick] [--tools a,b] [--calls N]
[--json out.json]`. `--quick` runs 12 calls (the growth then from call 6 to 12), `--smoke`
2 calls of one tool (from call 1 to 2: the row's code path, no figure).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    # find_max_batch_size's memory cap on TensorFlow's CPU needs the BFC allocator.
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import keras  # noqa: E402
import numpy as np  # noqa: E402

TOOLS = (
    "find_learning_rate",
    "find_max_batch_size",
    "diagnose",
    "inference_report",
    "accelerate",
)
MIB = 2**20


def rss() -> int:
    from keras_perf._host_memory import host_memory

    gc.collect()
    return host_memory()["current_bytes"]


def small_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data(n=256):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 16)).astype("float32"), rng.integers(0, 4, n)


def one_call(tool: str, model, x, y, what_if: bool = False):
    import keras_perf as kp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if tool == "find_learning_rate":
            kp.find_learning_rate(model, x, y, steps=10, batch_size=32, max_lr=1e-2)
        elif tool == "find_max_batch_size":
            kp.find_max_batch_size(
                model, x, y, settings=("plain",), memory_limit_bytes=10**9, max_batch_size=64
            )
        elif tool == "diagnose":
            # A memory limit makes diagnose measure the step's peak on every call; without one
            # it measures it only when that costs under a quarter of the budget, which on a
            # slow machine can first happen mid-run: a one-off 3-5 MiB step read as growth
            # (TensorFlow without the BFC allocator never measures it: no limit there).
            from keras_perf.backend import step_memory_unavailable

            limit = None if step_memory_unavailable() else 10**9
            kp.diagnose(model, x, y, batch_size=32, steps=5, max_seconds=1, what_if=what_if,
                        memory_limit_bytes=limit)  # fmt: skip
        elif tool == "inference_report":
            kp.inference_report(model, x[:64], y[:64], batch_sizes=(1,), formats=["keras"],
                                repeats=3, pause=0.0)  # fmt: skip
        elif tool == "accelerate":
            kp.accelerate(model, x, y, batch_size=32, max_seconds=1, apply=False)
        else:
            raise ValueError(f"unknown tool {tool!r}; choose from {TOOLS}")


def _twins_kept() -> int | None:
    """How many twins `kp.accelerate` keeps for the next call (acceleration/_pool.py)."""
    from keras_perf.acceleration import _pool

    pool = _pool._LAST[0]
    return None if pool is None else sum(len(v) for v in pool.twins.values())


def measure(tool: str, calls: int = 20, what_if: bool = False) -> dict:
    """RSS after each of `calls` calls of `tool` on one model; the growth over the second half.

    For `accelerate`, also the twins it keeps after each call and the growth over the second
    half's calls that made no new twin (the sum of their rises): a call meets a pair of settings it has not timed
    before where what paid differs from the calls before (the pairs follow the measurement),
    and makes and keeps one twin for it (one per candidate at most: a bounded step)."""
    model, (x, y) = small_model(), data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    before = rss()
    after, kept = [], []
    for _ in range(calls):
        one_call(tool, model, x, y, what_if)
        after.append(rss())
        if tool == "accelerate":
            kept.append(_twins_kept())
    half = calls // 2
    growth = after[-1] - after[half - 1]
    extra = {}
    if kept:
        steady = sum(after[i] - after[i - 1] for i in range(half, calls) if kept[i] == kept[i - 1])
        extra = {"twins_kept": kept, "growth_without_new_twins_mib": round(steady / MIB, 2)}
    return {
        **extra,
        "tool": tool,
        "calls": calls,
        "rss_before_mib": round(before / MIB, 1),
        "rss_mib": [round(a / MIB, 1) for a in after],
        "growth_mib": round(growth / MIB, 2),
        "growth_from_call": half,
        "ratio": after[-1] / after[half - 1],
        "model_alive": model.built and model.optimizer is not None,
    }


def main() -> None:
    from . import _harness

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _harness.add_mode_flags(p)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--tools", default=None, help="default: all; with --smoke, one (the "
                   "rows' code path is the same for every tool; tests/test_repeated_calls.py "
                   "runs each)")  # fmt: skip
    p.add_argument("--calls", type=int, default=None)
    p.add_argument("--what-if", action="store_true")
    args = _harness.resolve_modes(p.parse_args())
    calls = args.calls or (2 if args.smoke else 12 if args.quick else 20)
    rows = []
    tools = args.tools or ("inference_report" if args.smoke else ",".join(TOOLS))
    for tool in tools.split(","):
        try:
            m = measure(tool, calls, args.what_if)
        except ValueError as e:
            if "TF_CPU_ALLOCATOR_USE_BFC" not in str(e):
                raise
            # TensorFlow imported without the BFC allocator (`keras-perf bench`'s one process):
            # this tool's memory cap cannot be counted here; run the script alone for it.
            print(f"{tool}: skipped ({e})", file=sys.stderr)
            continue
        print(m, file=sys.stderr)
        rows.append(
            {
                "claim": f"{tool}: RSS(call {calls}) / RSS(call {m['growth_from_call']})",
                "backend": keras.backend.backend(),
                "wall_ratio": round(m["ratio"], 4),
                "cpu_ratio": None,
                "wall_spread": [],
                "cpu_spread": [],
                "repeats": calls,
                "target": "growth < 1 MiB/call",
                "note": f"growth {m['growth_mib']} MiB over calls "
                f"{m['growth_from_call']}-{calls}; RSS {m['rss_mib'][0]}-{m['rss_mib'][-1]} MiB",
            }
        )
    _harness.finish(rows, args)


if __name__ == "__main__":
    main()
