"""Measure keras-perf's traced train step on torch against Keras' `fit` and bare torch.

One epoch of `fit` (4,096 examples, batch 64, Adam 1e-3, sparse cross-entropy from logits, no
metrics) per row, process CPU time, `torch.set_num_threads(1)`; the rows alternate A B B A
over `repeats` rounds and the median is reported:

- `keras`: Keras' own eager step;
- `traced`: after `install_traced_step(model)` (one aten graph per input signature);
- `traced_inductor`: the same graphs through `torch.compile` (inductor);
- `bare`: the same model and Adam written in torch (`torch.nn` layers, `torch.optim.Adam`,
  the same shuffled batches cut from tensors), eager.

Models: `mlp` (64-256-256-10, ReLU) and `cnn` (28x28x1: conv 16 3x3 ReLU, max-pool 2, conv 32
3x3 ReLU, max-pool 2, dense 10). Run with

    KERAS_BACKEND=torch python -m benchmarks._torch_traced_probe [mlp|cnn ...] [--repeats N]

`measure(name, repeats)` returns the rows as a dict (what bench_accelerate reuses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

N, BATCH, LR, EPS = 4096, 64, 1e-3, 1e-7


def data(name):
    rng = np.random.default_rng(0)
    shape = (N, 64) if name == "mlp" else (N, 28, 28, 1)
    return rng.normal(size=shape).astype("float32"), rng.integers(0, 10, N).astype("int32")


def keras_model(name):
    keras.utils.set_random_seed(0)
    L = keras.layers
    if name == "mlp":
        layers = [keras.Input((64,)), L.Dense(256, "relu"), L.Dense(256, "relu"), L.Dense(10)]
    else:
        layers = [
            keras.Input((28, 28, 1)),
            L.Conv2D(16, 3, activation="relu"),
            L.MaxPooling2D(),
            L.Conv2D(32, 3, activation="relu"),
            L.MaxPooling2D(),
            L.Flatten(),
            L.Dense(10),
        ]
    model = keras.Sequential(layers)
    model.compile(
        keras.optimizers.Adam(LR, epsilon=EPS),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def bare_epoch_fn(name, x, y):
    """One epoch of the same model and Adam in plain torch (eager)."""
    torch.manual_seed(0)
    nn = torch.nn
    if name == "mlp":
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                            nn.Linear(256, 10))  # fmt: skip
        xt = torch.from_numpy(x)
    else:
        net = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3),
                            nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(800, 10))  # fmt: skip
        xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
    yt = torch.from_numpy(y).long()
    opt = torch.optim.Adam(net.parameters(), lr=LR, eps=EPS)
    loss_fn = nn.CrossEntropyLoss()

    def epoch():
        perm = torch.randperm(N)
        for i in range(0, N, BATCH):
            idx = perm[i : i + BATCH]
            loss = loss_fn(net(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()

    return epoch


def measure(name: str, repeats: int = 3) -> dict:
    """Median process-CPU seconds per epoch of each row (see the module docstring)."""
    from keras_perf.train_step.torch_traced import install_traced_step, traced_step_state

    torch.set_num_threads(1)
    x, y = data(name)
    runs, setup = {}, {}
    for row in ("keras", "traced", "traced_inductor"):
        model = keras_model(name)
        if row != "keras":
            install_traced_step(model, inductor=row == "traced_inductor")
        start = time.process_time()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # trace/compile and warm up
        setup[row] = round(time.process_time() - start, 2)
        if row != "keras" and not traced_step_state(model)["active"]:
            raise RuntimeError(traced_step_state(model)["reason"])
        runs[row] = lambda m=model: m.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    runs["bare"] = bare_epoch_fn(name, x, y)
    runs["bare"]()
    times = {row: [] for row in runs}
    order = list(runs)
    for r in range(repeats):
        for row in order if r % 2 == 0 else order[::-1]:
            start = time.process_time()
            runs[row]()
            times[row].append(time.process_time() - start)
    med = {row: statistics.median(t) for row, t in times.items()}
    return {
        "model": name,
        "seconds_per_epoch": {k: round(v, 4) for k, v in med.items()},
        "over_bare": {k: round(v / med["bare"], 2) for k, v in med.items()},
        "first_epoch_seconds": setup,
        "all": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "load": os.getloadavg(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["mlp", "cnn"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for name in args.models:
        print(json.dumps(measure(name, args.repeats)))


if __name__ == "__main__":
    main()
