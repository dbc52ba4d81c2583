"""One neutral interface over the backend Keras runs on.

The implementation module (`tensorflow`, `jax` or `torch` beside this file) is chosen once, at
import, from `keras.backend.backend()`. These modules are the only place in keras-perf allowed
to import a backend framework at module level or to touch private Keras internals.

Interface (every implementation module provides these names):

- ``is_oom_error(exc) -> bool``: whether `exc` is the backend's out-of-memory error.
- ``memory_stats() -> dict | None``: ``{"current_bytes", "peak_bytes", "device"}`` of the first
  accelerator, or None when there is no accelerator (or it reports nothing).
- ``reset_peak_memory() -> bool``: reset the accelerator's peak counter; False if unsupported.
- ``list_devices() -> list[dict]``: ``name``, ``kind`` (CPU/GPU/TPU), ``memory_bytes``,
  ``compute_capability`` (a ``(major, minor)`` tuple or None).
- ``configure_devices(memory_growth, memory_limit_mb) -> list[str]``: apply what the backend
  supports; returns human-readable notes on what was done.
- ``clear_memory() -> None``: release cached accelerator memory (after an OOM).
- ``oom_error(message) -> BaseException``: an instance of the backend's own out-of-memory
  error (TF ``ResourceExhaustedError``, XLA ``JaxRuntimeError`` with status
  ``RESOURCE_EXHAUSTED``, ``torch.OutOfMemoryError``), for injecting OOM in tests on CPU.

Beside each, ``train_step_<backend>.py`` holds that backend's ``TrainStep`` mixin, exported
here as ``TrainStepBase``.
"""

from __future__ import annotations

import gc
import importlib
import os
import resource
import sys

import keras

BACKEND: str = keras.backend.backend()

_MODULES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
if BACKEND not in _MODULES:
    raise ImportError(
        f"keras-perf supports the Keras backends {sorted(_MODULES)}; KERAS_BACKEND is {BACKEND!r}."
    )
_impl = importlib.import_module(f"{__name__}.{_MODULES[BACKEND]}")

is_oom_error = _impl.is_oom_error
oom_error = _impl.oom_error
memory_stats = _impl.memory_stats
reset_peak_memory = _impl.reset_peak_memory
list_devices = _impl.list_devices
configure_devices = _impl.configure_devices
_step = importlib.import_module(f"{__name__}.train_step_{_MODULES[BACKEND]}")
#: Base class of `kp.LossScaleTrainStep`: the train step for this backend.
TrainStepBase = _step.TrainStep


def clear_memory() -> None:
    """Collect garbage, then release the backend's cached accelerator memory."""
    gc.collect()
    _impl.clear_memory()


def is_oom(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is an out-of-memory error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _impl.is_oom_error(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def host_memory() -> dict:
    """Resident memory of this process: ``{"current_bytes", "peak_bytes"}`` (peak since start)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB.
    current = None
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    return {"current_bytes": current, "peak_bytes": int(peak)}


def has_accelerator() -> bool:
    """Whether the backend sees a GPU or TPU."""
    return any(d["kind"] in ("GPU", "TPU") for d in list_devices())


def is_functional(model) -> bool:
    """Whether `model` is a Functional model (Sequential models with an input count too)."""
    # Private import: Keras exports no public Functional class (checked on Keras 3.8-3.15).
    from keras.src.models.functional import Functional

    return isinstance(model, Functional) or (
        isinstance(model, keras.Sequential) and bool(getattr(model, "inputs", None))
    )
