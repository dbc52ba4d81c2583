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
- ``carry_in_step_state(model, variables) -> bool`` and ``release_step_state(model,
  variables)`` (optional; JAX only): make assignments to variables outside the model reach the
  compiled train step without retracing it. TensorFlow graphs and eager torch read every
  variable when the step runs, so elsewhere the first returns True and does nothing.
- ``fake_quant(x, min_vals, max_vals, num_bits, narrow_range, axis=None)`` (optional; torch
  only): `keras.quantizers.fake_quant_with_min_max_vars` in fused ops, where Keras' own path
  is slow; elsewhere the name is None and callers use Keras'. With it, ``fake_quant_kernel``
  and ``moving_average_fake_quant``: the QAT kernel and activation quantizers in torch ops.
- ``model_scope(model)`` (optional; TensorFlow only): the scope of the tf.distribute strategy
  `model` was created under, in which a model sharing its layers must be created.
- ``kernel_op(op, dtype, size) -> callable``: one matmul (``op="matmul"``) or 3x3 convolution
  (``"conv"``) in `dtype` on the backend's default device, run by calling it (it returns once
  the result exists); raises where the dtype has no kernel. `keras_perf.precision` times it.

Beside each, ``train_step_<backend>.py`` holds that backend's ``TrainStep`` (a subclass of
``keras_perf._train_step_base.TrainStepBase``), which ``keras_perf/train_step.py`` picks once
at import; ``keras_internals.py`` is the one module that touches private Keras attributes.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import resource
import sys

import keras

from keras_perf.backend import keras_internals

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
fake_quant = getattr(_impl, "fake_quant", None)
fake_quant_kernel = getattr(_impl, "fake_quant_kernel", None)
moving_average_fake_quant = getattr(_impl, "moving_average_fake_quant", None)
carry_in_step_state = getattr(_impl, "carry_in_step_state", lambda model, variables: True)
release_step_state = getattr(_impl, "release_step_state", lambda model, variables: None)
kernel_op = _impl.kernel_op


def any_worker(flag: bool, model=None) -> bool:
    """`flag` OR-ed over the workers of a multi-worker run (TF MultiWorkerMirroredStrategy).

    Callbacks that decide from local facts (a wall clock) call this so every worker takes
    the same decision; elsewhere (one process) it returns `flag` unchanged. Every worker
    must call it the same number of times: it is a collective operation.
    """
    fn = getattr(_impl, "any_worker", None)
    return bool(flag) if fn is None else fn(bool(flag), model)


def is_multi_worker(model=None) -> bool:
    """Whether training runs in several processes that must agree (TF multi-worker)."""
    fn = getattr(_impl, "is_multi_worker", None)
    return False if fn is None else fn(model)


def model_scope(model):
    """Context in which to create a model that shares `model`'s layers (TF: its strategy scope).

    Keras binds a TensorFlow model to the tf.distribute strategy in scope when the model is
    created; a twin made outside that scope would train on one device. A no-op elsewhere.
    """
    fn = getattr(_impl, "model_scope", None)
    return contextlib.nullcontext() if fn is None else fn(model)


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
    """Resident memory of this process: ``{"current_bytes", "peak_bytes"}``.

    The peak is since the process started, or since the last `reset_host_peak_memory()`.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB.
    current = None
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    return {"current_bytes": current, "peak_bytes": int(peak)}


def reset_host_peak_memory() -> bool:
    """Reset this process's peak resident memory (Linux); False where unsupported.

    Writes ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), which resets the kernel's
    high-water mark that ``getrusage`` and ``VmHWM`` report. It is process-wide: any later
    `host_memory()` peak counts from this moment.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def examples_seen(model) -> int | None:
    """Examples Keras' built-in loss tracker has counted since the model's metrics were reset.

    Keras' own `train_step`/`test_step` (every backend) update `model._loss_tracker`, a
    `keras.metrics.Mean`, with `sample_weight` = the leading dimension of the batch's first
    input, so its `count` is the number of examples seen this epoch, a short last batch and
    `steps_per_execution > 1` included. `fit` resets it at each epoch start and `evaluate`
    resets it at its start (after `on_test_begin`). Private attribute, present since Keras 3.0,
    checked with Keras 3.15. Reading it syncs the device: call it per epoch, never per batch.

    Returns:
        The count as an int, or None when the model has no such tracker or it counted nothing
        (a custom `train_step` that does not update it).
    """
    tracker = keras_internals.loss_tracker(model)
    count = getattr(tracker, "count", None)
    if count is None:
        return None
    # float() of the 0-d backend tensor: on TF, convert_to_numpy of a variable warns under NumPy 2.
    raw = getattr(count, "value", count)
    if hasattr(raw, "read_value"):
        # tf.distribute: a sync-on-read variable; reading it outside the replicas sums them.
        raw = raw.read_value()
    value = float(raw)
    return int(round(value)) if value > 0 else None


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


#: Whether a compiled train step reads a variable that is not part of the model's or the
#: optimizer's state when it runs (TensorFlow graphs, eager torch), or bakes its value in when
#: traced (a jitted JAX step receives only that state; see `carry_in_step_state`).
STEP_READS_EXTERNAL_VARIABLES: bool = BACKEND != "jax"
