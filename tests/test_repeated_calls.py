"""Memory over repeated use (issue 41): the tools users call again and again in one notebook
session level off in the process's memory.

Slow, not `timing`: the figure is resident memory, not wall time, so it runs beside other tests
(each xdist worker is a process of its own, one test at a time).
"""

import keras
import pytest

BACKEND = keras.backend.backend()

pytestmark = pytest.mark.slow


# The bound docs/diagnose.md states: over the second half of the calls of one tool on one small
# model, the process's resident memory grows by less than this per call on average (measured
# 2026-11-28 over calls 10 to 20: at most 0.04 MiB per call, on every backend, except the
# TensorFlow cases below, 5-6 MiB per call).
REPEATED_CALLS_GROWTH_MIB_PER_CALL = 0.5
CALLS = 12  # the benchmark makes 20; 12 keep the slow tier shorter and still see 1 MiB a call


@pytest.mark.parametrize(
    "tool", ["find_learning_rate", "find_max_batch_size", "diagnose", "inference_report"]
)
def test_repeated_calls_level_off_in_memory(tool):
    """Issue 41 (memory over repeated use): 12 calls of each tool in one process, the user's
    model alive throughout (no `clear_session`): RSS grows by less than the stated bound from
    call 6 to call 12 (`benchmarks/bench_repeated_calls.py`)."""
    if tool in ("find_max_batch_size", "diagnose") and BACKEND == "tensorflow":
        pytest.xfail(
            "known, not fixed yet: on TensorFlow each call grows RSS by 5-6 MiB (measured "
            "6.2 find_max_batch_size, 5.5 diagnose); the twins are released (weakrefs dead), "
            "the growth is in TensorFlow's runtime, one traced train function per twin"
        )
    from benchmarks.bench_repeated_calls import measure

    m = measure(tool, calls=CALLS)
    assert m["model_alive"]
    assert m["growth_mib"] < REPEATED_CALLS_GROWTH_MIB_PER_CALL * (CALLS - CALLS // 2), m
