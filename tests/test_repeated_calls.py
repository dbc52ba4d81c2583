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


def _in_fresh_process(tool, calls):
    """`measure` in a process of its own, as a notebook session is: after hundreds of tests in
    one xdist worker, the heap the worker had grown made accelerate on torch read 8 MiB of
    growth (CI, 2026-11-28 11:25) where a fresh process reads 0.2 over eight calls."""
    code = (
        "import json; from benchmarks.bench_repeated_calls import measure; "
        f"print('RESULT', json.dumps(measure({tool!r}, calls={calls})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


# kp.accelerate times a dozen twins a call (4-20 s here): 8 calls, the growth from 4 to 8 (its
# RSS can step in the first calls: JAX, below).
CALLS_OF = {"accelerate": 8}


@pytest.mark.parametrize(
    "tool",
    ["find_learning_rate", "find_max_batch_size", "diagnose", "inference_report", "accelerate"],
)
def test_repeated_calls_level_off_in_memory(tool):
    """Issue 41 (memory over repeated use): 12 calls of each tool in one process, the user's
    model alive throughout (no `clear_session`): RSS grows by less than the stated bound from
    call 6 to call 12 (`benchmarks/bench_repeated_calls.py`)."""
    if tool == "accelerate" and BACKEND == "jax":
        pytest.xfail(
            "on JAX it levels off from about the 10th call (20 calls in a fresh process, "
            "2026-11-28: 2.6 MiB over calls 10-20, under the bound), after RSS steps of 3-14 "
            "MiB in the first calls that 8 calls do not get past; 20 calls cost 3 minutes of "
            "CI (docs/diagnose.md)"
        )
    if tool == "accelerate" and BACKEND == "tensorflow":
        pytest.xfail(
            "plain Keras on TensorFlow keeps about 4 MiB for every fresh model's first fit "
            "(6-7 MiB with jit_compile: XLA keeps every program it compiled for the life of "
            "the process), and each call fits about a dozen fresh twins: 11-12 MiB a call; "
            "docs/accelerate.md"
        )
    calls = CALLS_OF.get(tool, CALLS)
    # Every tool in a process of its own: a worker's heap after hundreds of tests reads
    # megabytes of growth a fresh process does not (diagnose on TensorFlow, CI 2026-11-28: 6.3
    # MiB over calls 6-12 in a worker), and find_max_batch_size on TensorFlow needs the BFC
    # allocator, chosen when TensorFlow is imported (the benchmark module sets it first).
    m = _in_fresh_process(tool, calls)
    assert m["model_alive"]
    assert m["growth_mib"] < REPEATED_CALLS_GROWTH_MIB_PER_CALL * (calls - calls // 2), m
