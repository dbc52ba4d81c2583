"""The state an epoch starts from: model and optimizer variables, and the host RNGs.

Lives here: `_snapshot`/`_restore` (host copies of every variable a train step changes) and
`_host_random_state`/`_set_host_random_state` (Python's, NumPy's and torch's RNGs, and a
DataLoader's own). Not here: when they are taken and restored (`_callbacks._RunCallbacks`),
a generator's batches (`_replay`).
"""

from __future__ import annotations

import random
import sys

import keras
import numpy as np


def _state_variables(model) -> list:
    """Every variable a train step changes, except metrics (reset at each epoch anyway)."""
    variables, seen = [], set()
    optimizer = getattr(model, "optimizer", None)
    extra = list(optimizer.variables) if optimizer is not None else []
    for v in list(model.variables) + extra:
        if id(v) not in seen:
            seen.add(id(v))
            variables.append(v)
    return variables


def _snapshot(model) -> list:
    # np.array(copy=True): on CPU, torch and JAX may hand out views of the live buffers.
    return [
        (v, np.array(keras.ops.convert_to_numpy(v.value), copy=True))
        for v in _state_variables(model)
    ]


def _restore(snapshot) -> None:
    for variable, value in snapshot:
        variable.assign(value)


def _torch_generators(x) -> list:
    """The torch RNGs that shuffle a DataLoader `x` (the global one, and its own if it has one)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found = [torch.default_generator]
    for owner in (x, getattr(x, "sampler", None), getattr(x, "batch_sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _host_random_state(x) -> tuple:
    """Python's, NumPy's and torch's global RNG states, and the RNG of a DataLoader `x`.

    They draw the shuffling of arrays (NumPy on JAX, torch on torch), of a PyDataset (Python)
    and of a DataLoader (torch): restored with the weights, the retried epoch sees the batches
    the failed attempt saw, in the same order.
    """
    torch_states = [(g, g.get_state()) for g in _torch_generators(x)]
    return random.getstate(), np.random.get_state(), torch_states


def _set_host_random_state(state) -> None:
    python_state, numpy_state, torch_states = state
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    for generator, value in torch_states:
        generator.set_state(value)
