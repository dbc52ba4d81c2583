"""Whole executions of `steps_per_execution` N > 1 on torch, for keras-perf's installed traced
step (`torch_traced.install_traced_step`): Keras' own torch `make_*_function` refuse N > 1,
while its epoch iterator hands over N batches at a time, as on TensorFlow and JAX. Each
function runs the batches one after the other: training and evaluation return the last
step's logs (the metrics accumulate), prediction joins the batches' outputs.
"""

from __future__ import annotations

import contextlib

import keras
import torch


def steps_per_execution(model) -> int:
    return int(getattr(model, "steps_per_execution", 1) or 1)


def function(model, kind: str, force: bool):
    """`model`'s cached `{kind}_function` ("train", "test", "predict") where it runs whole
    executions; else a new one, cached. A function Keras made for one step per call (before
    `steps_per_execution` was raised) would run each execution's first batch only."""
    name = f"{kind}_function"
    cached = getattr(model, name, None)
    if force or not getattr(cached, "_kp_executions", False):
        cached = _MAKERS[kind](model)
        cached._kp_executions = True
        setattr(model, name, cached)
    return cached


def _steps(step: str, grad: bool):
    """Training (`train_step`, with gradients) or evaluation (`test_step`, without)."""

    def make(model):
        def multi(data):
            with contextlib.nullcontext() if grad else torch.no_grad():
                for batch in data:
                    logs = getattr(model, step)(batch)
            return logs

        return multi

    return make


def _predict(model):
    def multi_predict(data):
        with torch.no_grad():
            outputs = [model.predict_step(batch) for batch in data]
        if len(outputs) == 1:
            return outputs[0]
        return keras.tree.map_structure(lambda *t: torch.cat(t), *outputs)

    return multi_predict


_MAKERS = {
    "train": _steps("train_step", True),
    "test": _steps("test_step", False),
    "predict": _predict,
}
