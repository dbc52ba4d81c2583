"""Exactness: does a candidate train the model as its own settings do?

Two twins start from the user's weights (fresh optimizers of the same config), one with the
model's own settings and one with the candidate's; both train `STEPS` steps on the same
batches, in the same order (`shuffle=False`). These are the very twins `accelerate` times, trained
for the check before their first timed fit, so that each candidate's train function is traced
and compiled once (a model with dropout: twins of their own, below). Then:

- every weight is compared: exact when `|a - b| <= ATOL + RTOL * max|b|` for each variable
  (`b` the reference's values: float32 rounding, relative to the variable's own scale);
- a bias that feeds a BatchNormalization directly carries no signal (the normalisation
  subtracts it again), so its few-ulp differences can grow through Adam's division by a tiny
  second moment: it is left out, and the model's outputs on the first batch (inference mode)
  are compared instead, with `OUT_ATOL + OUT_RTOL * max|output|`;
- dropout is set to rate 0 on both twins (Dropout layers, the `dropout` and
  `recurrent_dropout` of recurrent cells, attention dropout): a candidate can draw other masks
  from the same seed (XLA's random numbers differ from TensorFlow's), which is no reason to
  call it inexact. A traced train function keeps the rate it was traced with, so a model with
  dropout is checked on twins of its own, not on the timed ones.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf._fit_measure import RandomState
from keras_perf._utils import iter_layers

STEPS = 4
RTOL, ATOL = 1e-5, 1e-6
OUT_RTOL, OUT_ATOL = 1e-4, 1e-5


def _dropouts(model):
    """(layer, attribute) of every dropout rate above 0 in `model`."""
    found = []
    for layer in iter_layers(model):
        if isinstance(layer, keras.layers.Dropout) or type(layer).__name__ in (
            "GaussianDropout",
            "AlphaDropout",
        ):
            if layer.rate > 0:
                found.append((layer, "rate"))
        for attr in ("dropout", "recurrent_dropout", "_dropout"):
            value = vars(layer).get(attr)  # instance attributes (an RNN's are cell properties)
            if isinstance(value, float) and value > 0:
                found.append((layer, attr))
    return found


def has_dropout(model) -> bool:
    """Whether any layer of `model` drops out at a rate above 0."""
    return bool(_dropouts(model))


def no_dropout(model) -> None:
    """Dropout rates at 0 in every layer of `model` (a twin)."""
    for layer, attr in _dropouts(model):
        setattr(layer, attr, 0.0)


def _successors(layer) -> list:
    return keras_internals.consumers(layer)


def biases_before_batchnorm(model) -> set:
    """Paths of the bias variables of layers whose output goes straight into a BatchNorm."""
    paths = set()
    layers = list(iter_layers(model))
    for i, layer in enumerate(layers):
        bias = getattr(layer, "bias", None)
        if bias is None or not hasattr(bias, "path"):
            continue
        after = _successors(layer)
        if not after and isinstance(model, keras.Sequential) and i + 1 < len(layers):
            after = [layers[i + 1]]
        if after and all(isinstance(a, keras.layers.BatchNormalization) for a in after):
            paths.add(bias.path)
    return paths


def train_twin(twin, data, batch_size) -> None:
    xs, ys, sws = data
    rng = RandomState()
    try:
        _backend.set_random_seed(1234)  # keeps TensorFlow's kernel caches (backend/)
        kw = _backend.array_fit_kwargs(twin, xs, ys, sws, batch_size, shuffle=False)
        twin.fit(**kw, epochs=1, verbose=0)
    finally:
        rng.restore()


def _first_batch(xs, batch_size):
    return keras.tree.map_structure(lambda a: a[:batch_size], xs)


class Snapshot:
    """A trained twin's weights (paths and float64 values) and, where biases are left out, its
    outputs on the first batch: what `compare` holds a candidate against, kept while the twin
    itself goes on to be timed."""

    def __init__(self, model, data, batch_size, skip):
        self.weights = [
            (w.path, np.asarray(keras.ops.convert_to_numpy(w.value), dtype="float64"))
            for w in model.weights
        ]
        self.outputs = None
        if skip:
            out = model.predict_on_batch(_first_batch(data[0], batch_size))
            self.outputs = [
                np.asarray(keras.ops.convert_to_numpy(o), "float64")
                for o in keras.tree.flatten(out)
            ]


def compare(reference, candidate, data, batch_size, skip) -> tuple[bool, float]:
    """(exact, max abs weight difference) of two twins trained on `data`; `reference` is a
    model or its `Snapshot`."""
    if not isinstance(reference, Snapshot):
        reference = Snapshot(reference, data, batch_size, skip)
    exact, worst = True, 0.0
    for a, (_, vb) in zip(candidate.weights, reference.weights):
        if a.path in skip:
            continue
        va = np.asarray(keras.ops.convert_to_numpy(a.value), dtype="float64")
        if va.shape != vb.shape:
            return False, float("inf")
        if not va.size:
            continue
        d = float(np.max(np.abs(va - vb)))
        worst = max(worst, d)
        if not d <= ATOL + RTOL * float(np.max(np.abs(vb))):
            exact = False
    if skip:
        first = _first_batch(data[0], batch_size)
        out_a = keras.tree.flatten(candidate.predict_on_batch(first))
        for oa, ob in zip(out_a, reference.outputs):
            oa = np.asarray(keras.ops.convert_to_numpy(oa), "float64")
            d = float(np.max(np.abs(oa - ob))) if oa.size else 0.0
            if not d <= OUT_ATOL + OUT_RTOL * float(np.max(np.abs(ob), initial=0.0)):
                exact = False
    return exact, worst
