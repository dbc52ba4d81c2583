"""What the demo's stages share: settings, models, data, timing and the lever row."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import keras
import numpy as np

SEED = 0
CLASSES = 10
BATCH = 64
#: The keys of every lever row in `report.json` (`gain_unit` says how `gain` reads).
LEVER_KEYS = ("lever", "baseline", "with", "gain", "unit", "note")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sizes of each stage; `quick()` is the smoke run CI uses."""

    teacher_epochs: int = 30
    label_share: float = 0.1
    seeds: tuple = (0, 1, 2)
    share_epochs: int = 40  # the student alone (and the share's teacher) on the labelled share
    distill_epochs: int = 20  # label-free distillation on every training input
    prune_epochs: int = 8
    lr_epochs: int = 5
    lr_steps: int = 100
    speed_epochs: int = 3
    accelerate_seconds: float = 20.0
    memory_batch: int = 1024
    repeats: int = 10

    @classmethod
    def quick(cls, teacher_epochs: int = 2) -> Settings:
        return cls(
            teacher_epochs=teacher_epochs,
            seeds=(0,),
            share_epochs=4,
            distill_epochs=2,
            prune_epochs=2,
            lr_epochs=1,
            lr_steps=20,
            speed_epochs=1,
            accelerate_seconds=5.0,
            memory_batch=256,
            repeats=3,
        )


def mlp(widths, name, seed):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((64,))]
    layers += [keras.layers.Dense(w, activation="relu") for w in widths]
    # Logits in float32 whatever the policy: softmax/CE stay accurate under float16.
    layers.append(keras.layers.Dense(CLASSES, dtype="float32", name="logits"))
    return keras.Sequential(layers, name=name)


def sce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def accuracy(model, x, y) -> float:
    logits = model.predict(x, batch_size=512, verbose=0)
    return float(np.mean(np.argmax(logits, axis=-1) == y))


def copy_of(model, name):
    """A new model with `model`'s architecture and weights, uncompiled."""
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    twin.name = name
    return twin


def latency_ms(model, x, repeats: int) -> float:
    """Median wall time of `model.predict_on_batch(x)` in milliseconds (one warm-up call)."""
    model.predict_on_batch(x)
    times = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        model.predict_on_batch(x)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def lever(name, baseline, with_, unit, *, higher_is_better=True, points=False, note="",
          why_not="", tolerance=0.0):  # fmt: skip
    """One lever row. `gain`: `with - baseline` in points (`points=True`, accuracies in %),
    else the ratio in the lever's favour (`with / baseline`, or `baseline / with` where lower
    is better), so a gain above 1 (or 0 points) always means the lever pays. `why_not` is
    prefixed to the note when it does not. `tolerance`: points a lever may lose and still pay
    (pruning trades a little accuracy for size)."""
    gain = None
    if baseline is not None and with_ is not None:
        if points:
            gain = round(with_ - baseline, 2)
        elif baseline > 0 and with_ > 0:
            gain = round(with_ / baseline if higher_is_better else baseline / with_, 2)
    pays = gain is not None and (gain > -tolerance if points else gain > 1.0)
    if gain is not None and not pays and why_not:
        note = f"does not pay here: {why_not}" + (f"; {note}" if note else "")
    return {
        "lever": name,
        "baseline": None if baseline is None else round(float(baseline), 4),
        "with": None if with_ is None else round(float(with_), 4),
        "gain": gain,
        "unit": unit,
        "note": note,
        "gain_unit": "points" if points else "x",
        "pays": pays,
    }


def say(demo, text: str) -> None:
    if demo.verbose:
        print(text, flush=True)


@dataclasses.dataclass
class Demo:
    """What the stages share: settings, data, and the report as it grows."""

    out: Path
    settings: Settings
    verbose: bool
    train: tuple
    val: tuple
    test: tuple
    rows: list = dataclasses.field(default_factory=list)
    levers: list = dataclasses.field(default_factory=list)
    stages: dict = dataclasses.field(default_factory=dict)
    files: list = dataclasses.field(default_factory=list)
    inference: list = dataclasses.field(default_factory=list)
    cpu_s: dict = dataclasses.field(default_factory=dict)

    def add_model(self, name, model, acc, seconds=None, examples_per_s=None) -> None:
        import keras_perf as kp

        rep = kp.compression_report(model)["total"]
        self.rows.append(
            {
                "model": name,
                "accuracy": round(acc, 4),
                "params": int(rep["params"]),
                "nonzero": int(rep["nonzero"]),
                "gzip_bytes": int(rep["gzip_bytes"]),
                "examples_per_s": examples_per_s,
                "time_s": None if seconds is None else round(seconds, 2),
            }
        )


def jsonable(v) -> bool:
    try:
        json.dumps(v, default=json_default)
        return True
    except (TypeError, ValueError):
        return False


def json_default(v):
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (tuple, set)):
        return list(v)
    raise TypeError(f"not JSON serialisable: {type(v).__name__}")
