"""Memory over repeated use (issue 41): the tools users call again and again in one notebook
session level off in the process's memory.

Slow, not `timing`: the figure is resident memory, not wall time, so it runs beside other tests
(each tool measured in a fresh process of its own, as a notebook session is).
"""

import json
import subprocess
import sys
from pathlib import Path

import keras
import pytest

BACKEND = keras.backend.backend()
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


# The bound docs/diagnose.md states: over the second half of the calls of one tool on one small
# model, the process's resident memory grows by less than this per call on average (measured
# 2026-11-28 over calls 10 to 20: at most 0.04 MiB per call, on every backend; TensorFlow's
# find_max_batch_size and diagnose grew 5-6 MiB a call until their twins' train graphs were
# released, `keras_perf.backend.traced_graphs_released`; accelerate on TensorFlow: below).
REPEATED_CALLS_GROWTH_MIB_PER_CALL = 0.5
CALLS = 12  # the benchmark makes 20; 12 keep the slow tier shorter and still see 1 MiB a call


def _in_fresh_process(tools, calls):
    """`measure` of each of `tools` in turn, in a process of their own, as a notebook session
    is: after hundreds of tests in one xdist worker, the heap the worker had grown made
    accelerate on torch read 8 MiB of growth (CI, 2026-11-28 11:25) where a fresh process reads
    0.2 over eight calls. One process for several tools, as `bench_repeated_calls` runs them:
    one backend import instead of one per tool."""
    code = (
        "import json; from benchmarks.bench_repeated_calls import measure; "
        f"print('RESULT', json.dumps([measure(t, calls={calls}) for t in {list(tools)!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_the_measuring_tools_level_off_in_memory_over_repeated_calls():
    """Issue 41 (memory over repeated use): 12 calls of each of diagnose, find_learning_rate,
    find_max_batch_size and inference_report in one fresh process, the user's model alive
    throughout (no `clear_session`): for each, RSS grows by less than the stated bound from
    call 6 to call 12 (`benchmarks/bench_repeated_calls.py`)."""
    # find_max_batch_size on TensorFlow needs the BFC allocator, chosen when TensorFlow is
    # imported: the benchmark module sets it first.
    tools = ["find_learning_rate", "find_max_batch_size", "diagnose", "inference_report"]
    results = _in_fresh_process(tools, CALLS)
    grew = {
        m["tool"]: m["growth_mib"]
        for m in results
        if not m["growth_mib"] < REPEATED_CALLS_GROWTH_MIB_PER_CALL * (CALLS - CALLS // 2)
    }
    assert [m["tool"] for m in results] == tools and all(m["model_alive"] for m in results)
    # Each tool's RSS after every call in the message: a one-off step and a steady climb read
    # differently, and CI's output cuts a long repr short.
    assert grew == {}, {m["tool"]: m["rss_mib"] for m in results}


# kp.accelerate times a dozen twins a call (4-20 s here): 8 calls, the growth from 4 to 8 (its
# RSS can step in the first calls: JAX, below).
ACCELERATE_CALLS = 8


def test_accelerate_levels_off_in_memory_over_repeated_calls():
    """The same for `kp.accelerate` (8 calls, the growth from call 4 to 8), in a process of
    its own."""
    if BACKEND == "jax":
        pytest.xfail(
            "on JAX it levels off from about the 10th call (20 calls in a fresh process, "
            "2026-11-28: 2.6 MiB over calls 10-20, under the bound), after RSS steps of 3-14 "
            "MiB in the first calls that 8 calls do not get past; 20 calls cost 3 minutes of "
            "CI (docs/diagnose.md)"
        )
    if BACKEND == "tensorflow":
        pytest.xfail(
            "plain Keras on TensorFlow keeps about 4 MiB for every fresh model's first fit "
            "(6-7 MiB with jit_compile: XLA keeps every program it compiled for the life of "
            "the process), and each call fits about a dozen fresh twins: 11-12 MiB a call; "
            "docs/accelerate.md"
        )
    (m,) = _in_fresh_process(["accelerate"], ACCELERATE_CALLS)
    assert m["model_alive"]
    bound = REPEATED_CALLS_GROWTH_MIB_PER_CALL * (ACCELERATE_CALLS - ACCELERATE_CALLS // 2)
    assert m["growth_mib"] < bound, m
