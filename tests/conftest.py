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


@pytest.fixture(autouse=True)
def _clean_keras_state():
    keras.utils.set_random_seed(1234)
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")
    keras.backend.clear_session()


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1], split 1437/360 (fixed order)."""
    from keras_perf.data import load_digits_split

    return load_digits_split(seed=0, sizes=(1437,))
