"""Test set-up: backend choice, seeds, clean global state, backend markers.

The backend comes from KERAS_BACKEND (default: tensorflow) and must be fixed before Keras is
imported, so it is set here at import time.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()


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
