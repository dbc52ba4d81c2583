"""Writes tests/data/configs_v2.json: serialized configs of classes whose `__module__` was rewritten.

Run once with the code of 2026-11-26 (when `keras_perf/pruning`, `channel_pruning` and `oom`
rewrote their classes' `__module__` to the package), from the repository root:
`KERAS_BACKEND=tensorflow python tests/data/make_configs_v2_fixture.py`.
tests/test_saved_configs.py checks that today's code still deserializes them.
"""

import json
import os

import keras

import keras_perf as kp
from keras_perf.oom import _rungs

if __name__ == "__main__":
    decay = kp.PolynomialDecay(0.1, 0.6, begin_step=2, end_step=20, frequency=2)
    objects = {
        "PolynomialDecay": decay,
        "ConstantSparsity": kp.ConstantSparsity(0.5, begin_step=3, frequency=5),
        "PruningCallback": kp.PruningCallback(decay, scope="global", exclude=["out"]),
        "ChannelPruningCallback": kp.ChannelPruningCallback(decay, importance="l1"),
        "PerUpdateSchedule": _rungs.PerUpdateSchedule(
            keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5), 4
        ),
    }
    configs = {k: keras.saving.serialize_keras_object(v) for k, v in objects.items()}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs_v2.json")
    with open(path, "w") as f:
        json.dump(configs, f, indent=1, sort_keys=True)
    print({k: (v["module"], v["registered_name"]) for k, v in configs.items()})
