"""Writes tests/data/configs_v1.json: serialized configs of classes whose module moved.

Run once with the code of 2026-11-26 (when `keras_perf/monitor/__init__.py` and
`keras_perf/distillation/__init__.py` still rewrote their classes' `__module__`), from the
repository root: `KERAS_BACKEND=tensorflow python tests/data/make_configs_fixture.py`.
tests/test_saved_configs.py checks that today's code still deserializes them.
"""

import json
import os

import keras

import keras_perf as kp


def mlp(width, name):
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(3)],
        name=name,
    )


if __name__ == "__main__":
    objects = {
        "TrainingMonitor": kp.TrainingMonitor(step_timing=False, verbose=1),
        "DistillationModel": kp.DistillationModel(
            mlp(2, "student"), mlp(4, "teacher"), temperature=2.5, alpha=0.4
        ),
    }
    configs = {k: keras.saving.serialize_keras_object(v) for k, v in objects.items()}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs_v1.json")
    with open(path, "w") as f:
        json.dump(configs, f, indent=1, sort_keys=True)
    print({k: (v["module"], v["registered_name"]) for k, v in configs.items()})
