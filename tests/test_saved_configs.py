"""Configs saved before a class moved to another module still deserialize.

Keras writes a registered class's `registered_name` ("keras_perf>DistillationModel") and its
module into every saved config and looks the registered name up first; the fixtures were
written by the code of the day (tests/data/make_*_fixture.py), when the recorded modules were
`keras_perf.monitor` and `keras_perf.distillation` (stopping: tests/test_stopping.py).
"""

import json
import os

import keras
import pytest

import keras_perf as kp

DATA = os.path.join(os.path.dirname(__file__), "data")
with open(os.path.join(DATA, "configs_v1.json")) as f:
    SAVED = json.load(f)


@pytest.mark.parametrize(
    "cls", [kp.TrainingMonitor, kp.DistillationModel], ids=lambda c: c.__name__
)
def test_config_saved_before_the_move_deserializes(cls):
    entry = SAVED[cls.__name__]
    assert entry["registered_name"] == f"keras_perf>{cls.__name__}"
    assert entry["module"] != cls.__module__  # written when the module was another
    obj = keras.saving.deserialize_keras_object(entry)
    assert type(obj) is cls
    again = keras.saving.serialize_keras_object(obj)
    assert again["registered_name"] == entry["registered_name"]
    config = json.loads(json.dumps(again["config"]))
    # Every saved setting comes back; settings added since (e.g. `remat`) take their defaults.
    assert {k: config[k] for k in entry["config"]} == entry["config"]
    assert {k: v for k, v in config.items() if k not in entry["config"]} in (
        {},
        {"remat": None, "remat_threshold": None, "traced_step": False},
    )


with open(os.path.join(DATA, "configs_v2.json")) as f:
    SAVED_V2 = json.load(f)


@pytest.mark.parametrize("name", sorted(SAVED_V2))
def test_config_saved_with_the_package_as_module_deserializes(name):
    """Saved when pruning, channel_pruning and oom rewrote `__module__` to the package."""
    entry = SAVED_V2[name]
    assert entry["registered_name"] == f"keras_perf>{name}"
    obj = keras.saving.deserialize_keras_object(entry)
    assert type(obj).__name__ == name
    assert entry["module"] != type(obj).__module__  # the module now is the defining one
    again = json.loads(json.dumps(keras.saving.serialize_keras_object(obj)))
    assert again["registered_name"] == entry["registered_name"]
    assert _without_modules(again["config"]) == _without_modules(entry["config"])


def _without_modules(config):
    """The config with every nested `"module"` entry dropped (nested schedules moved too)."""
    if isinstance(config, dict):
        return {k: _without_modules(v) for k, v in config.items() if k != "module"}
    if isinstance(config, list):
        return [_without_modules(v) for v in config]
    return config
