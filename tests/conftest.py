"""Test set-up: backend choice, seeds, clean global state, backend markers.

The backend comes from KERAS_BACKEND (default: tensorflow) and must be fixed before Keras is
imported, so it is set here at import time.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One xdist worker per core: each backend's own thread pools (sized to every core) would put
# twice as many busy threads as cores. PyTorch's OpenMP threads then spin against each other:
# its bfloat16 digits test took 128 s in each of two processes side by side with two threads
# each, 22.5 s with one (2026-11-28). One compute thread per worker, set before the backend
# starts its pools; child processes inherit it. The `timing` tests run in one process (`-n 0`)
# with the backends' own pools, as a user's would. KP_TEST_THREADS=0 keeps the defaults.
# Inter-op pools stay: a MirroredStrategy's replicas need ops running side by side.
ONE_THREAD = bool(os.environ.get("PYTEST_XDIST_WORKER")) and (
    os.environ.get("KP_TEST_THREADS", "1") == "1"
)
if ONE_THREAD:
    for name in ("TF_NUM_INTRAOP_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()

import keras  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()
if ONE_THREAD and BACKEND == "torch":
    import torch

    # torch may already be imported (and its OpenMP pool sized) before this file runs in an
    # xdist worker: OMP_NUM_THREADS above then reached only its child processes.
    # OpenMP also takes a list per nesting level ("4,2"): the first is the outer pool.
    first = os.environ["OMP_NUM_THREADS"].split(",")[0].strip()
    torch.set_num_threads(int(first) if first.isdigit() and int(first) > 0 else 1)


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {BACKEND}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("backends")
        if marker is not None and BACKEND not in marker.args:
            item.add_marker(pytest.mark.skip(reason=f"runs only on {', '.join(marker.args)}"))


# Keras' `clear_session()` ends with a full `gc.collect()`: 0.8 s per test on 2 idle cores
# once TensorFlow is imported (5-7 s under load), most of the default tier's time in
# teardowns. The session is cleared after every test; a full collection runs every
# `_GC_EVERY` tests (Python's own generational collection runs in between), which bounds a
# worker's memory.
_GC_EVERY = 25
_tests_since_gc = 0


@pytest.fixture(autouse=True)
def _clean_keras_state():
    global _tests_since_gc
    keras.utils.set_random_seed(1234)
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")
    _tests_since_gc += 1
    full = _tests_since_gc >= _GC_EVERY
    if full:
        _tests_since_gc = 0
    keras.backend.clear_session(free_memory=full)


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1], split 1437/360 (fixed order)."""
    from keras_perf.data import load_digits_split

    return load_digits_split(seed=0, sizes=(1437,))
