"""The cases behind kp.diagnose's claims, and the real `fit` that checks a predicted speed-up.

Shared by `bench_diagnose.py` (CPU, digits) and section 5 of `gpu_check` (GPU, synthetic
data of digits' shape: the GPU image has no scikit-learn). Keras and NumPy only.
"""

from __future__ import annotations

import copy
import statistics
import time

import keras
import numpy as np

import keras_perf as kp


class Sleepy(keras.utils.PyDataset):
    """`batches` batches of `batch` rows of (x, y), each after a `sleep`-second pause: an input
    pipeline slower than the step, which reads in parallel with `workers`."""

    def __init__(self, x, y, batches, sleep=0.02, batch=16, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batches, self.sleep, self.batch = x, y, batches, sleep, batch

    def __len__(self):
        return self.batches

    def __getitem__(self, i):
        time.sleep(self.sleep)
        j = (i * self.batch) % (len(self.x) - self.batch)
        return self.x[j : j + self.batch], self.y[j : j + self.batch]


class Augmented(keras.utils.PyDataset):
    """`batches` batches of uint8 images from a small fixed pool, flipped at random and scaled
    to [0, 1] in NumPy on the host, as a plain image pipeline does."""

    def __init__(self, images, labels, batches, batch, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.images, self.labels, self.batches, self.batch = images, labels, batches, batch
        self.seed = seed

    def __len__(self):
        return self.batches

    def __getitem__(self, i):
        rng = np.random.default_rng(self.seed + i)
        idx = rng.integers(0, len(self.images), self.batch)
        x = self.images[idx].astype("float32") / 255.0
        flip = rng.random(self.batch) < 0.5
        x[flip] = x[flip, :, ::-1]
        return x, self.labels[idx]


def applied(change: str, model_fn, data: dict):
    """A fresh model and the `fit` arguments with `change` applied, as its `how` line says."""
    data = dict(data)
    if change.startswith("mixed precision ("):
        policy = change[len("mixed precision (") : -1]
        kp.setup_mixed_precision(policy)  # before building the model
        try:
            return model_fn(), data
        finally:
            keras.mixed_precision.set_global_policy("float32")
    model = model_fn()
    if change.startswith("steps_per_execution="):
        k = int(change.split("=")[1])
        model.compile(model.optimizer, model.loss, steps_per_execution=k)
    elif change in ("jit_compile=True", "jit_compile=True (torch.compile)"):
        model.compile(model.optimizer, model.loss, jit_compile=True)
    elif change == "keras-perf traced step (torch)":
        from keras_perf.train_step import torch_traced

        torch_traced.install_traced_step(model)
    elif change.startswith("batch_size=") and "micro-batched (microbatches=" in change:
        data["batch_size"] = int(change.split(",")[0].split("=")[1])
        k = int(change.rsplit("=", 1)[1].rstrip(")"))
        model = kp.loss_scaled(model, microbatches=k)
    elif change.startswith("batch_size="):
        data["batch_size"] = int(change.split("=")[1])
    elif change == "PyDataset workers=4":
        data["x"] = copy.copy(data["x"])
        data["x"].workers = 4
    else:
        raise ValueError(f"no recipe for {change!r}")
    return model, data


def examples_per_s(model, data: dict, epochs: int) -> float:
    """Examples per second of one `fit` of `epochs` epochs, timed whole (set-up included)."""
    t0 = time.perf_counter()
    history = model.fit(**data, epochs=epochs, verbose=0)
    seconds = time.perf_counter() - t0
    assert len(history.history["loss"]) == epochs
    x = data["x"]
    if isinstance(x, keras.utils.PyDataset):
        examples = len(x) * len(x[0][1])
    else:
        examples = len(x)
    return examples * epochs / seconds


def real_speedup(change: str, model_fn, data: dict, repeats: int, epochs: int):
    """The speed-up of `change` in real `fit`s of `epochs` epochs, the unchanged and the changed
    model alternated A B B A, `repeats` times: (median, each repeat's ratio)."""
    changed_model, changed_data = applied(change, model_fn, data)
    base_model = model_fn()
    for m, d in ((base_model, data), (changed_model, changed_data)):
        m.fit(**d, epochs=1, verbose=0)  # compile and warm up
    ratios = []
    for _ in range(repeats):
        a1 = examples_per_s(base_model, data, epochs)
        b1 = examples_per_s(changed_model, changed_data, epochs)
        b2 = examples_per_s(changed_model, changed_data, epochs)
        a2 = examples_per_s(base_model, data, epochs)
        ratios.append((b1 + b2) / (a1 + a2))
    return statistics.median(ratios), ratios
