"""One neutral interface over the backend Keras runs on.

This `__init__` is the dispatch only: the implementation module (`tensorflow`, `jax` or
`torch` beside this file) is chosen once, at import, from `keras.backend.backend()`, and its
interface is exposed here. Those modules, `keras_perf/export/_tflite_lib.py` (TensorFlow Lite, on any backend) and the
train step's backend modules (`keras_perf/train_step/<backend>.py`) are the only places in
keras-perf that import a backend framework at module level; private Keras attributes are read
in `keras_perf/_keras_internals.py` alone.

Interface (every implementation module provides these names):

- ``is_oom_error(exc) -> bool``: whether `exc` is the backend's out-of-memory error.
- ``memory_stats() -> dict | None``: ``{"current_bytes", "peak_bytes", "device", "measure"}``
  of the first accelerator, or None when there is no accelerator (or it reports nothing);
  ``measure`` names the counter (``"tf_allocator_peak"``, ``"torch_cuda_peak"``,
  ``"xla_peak_bytes_in_use"``). Every measure keras-perf reports is a key of
  ``MEASURES`` (``_measures.py``), which says what it counts.
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
- ``array_fit_input(model, x, y, sample_weight, batch_size, shuffle)`` (optional; TensorFlow
  only): a `tf.data.Dataset` of in-memory arrays for `fit` under a tf.distribute strategy, else
  None; callers use ``array_fit_kwargs`` here, which falls back to the arrays.
- ``model_scope(model)``, ``is_multi_worker(model)`` and ``any_worker(flag, model)`` (optional;
  TensorFlow only): the scope of the tf.distribute strategy `model` was created under, in which
  a model sharing its layers must be created; whether that strategy spans several workers;
  `flag` OR-ed over them.
- ``traced_graphs_released()`` (optional; TensorFlow only): a context manager (usable as a
  decorator) that lets the graphs of train functions traced inside it be freed once unused
  (TensorFlow keeps every graph with a `tf.custom_gradient` alive otherwise; Keras' optimizer
  has one); elsewhere a null context. The tools that trace twins' train functions use it.
- ``global_rng_state() -> object | None`` and ``set_global_rng_state(state)`` (optional;
  torch and TensorFlow): the framework's global RNG state, which `fit` and `clone_model` draw
  from (TensorFlow: the eager op-seed generator a global seed starts, from which the shuffle
  of Keras' array pipeline takes its seed); elsewhere None and a no-op.
- ``set_random_seed(seed)`` (optional; TensorFlow): `keras.utils.set_random_seed`, without
  clearing TensorFlow's kernel caches (which makes every tf.function instantiate again and
  leaves memory behind each time); elsewhere Keras' own.
- ``tf_data_has_stage(dataset, name) -> bool`` and ``tf_data_tuned(dataset, cache=False,
  parallel_map=False)``: tf.data pipelines, on every backend (tf.data runs beside any Keras
  backend with TensorFlow installed), so they always come from the ``tensorflow`` module,
  imported at their first call.
- ``step_memory_unavailable() -> str | None`` and ``step_memory(model, data, run_step,
  sizes) -> dict``: the peak memory of one training step, read in process for
  `kp.find_max_batch_size`. The first says why it cannot be read here (TensorFlow's CPU
  allocator without statistics), in words that say the fix, or None. The second returns
  ``{"bytes", "measure", "ran"}``: the bytes the step needs (the model's and optimizer's
  variables included), the name of the measure, and whether `run_step()` (one training step)
  ran to measure it. TensorFlow: its allocator's peak during the step (``"tf_allocator_peak"``,
  GPU:0 or CPU:0); torch: the CUDA allocator's peak (``"torch_cuda_peak"``), on a CPU the
  peak of the tensors autograd saves for backward plus the weights, gradients, optimizer
  state and batch (``"torch_saved_tensors"``); JAX: XLA's memory analysis of the compiled
  step, without running it (``"xla_memory_analysis"``). `sizes` gives the byte counts the
  dispatch computes: ``state`` (model and optimizer variables), ``trainable``, ``batch``.
- ``epoch_memory(model, sizes) -> meter | None``: the per-epoch peak of `fit` on a CPU in the
  backend's own measure (see the dispatch's `epoch_memory`); `sizes(model, data)` gives the
  byte counts of `step_memory`'s `sizes` for a batch. JAX and torch read the step through
  `keras_perf/backend/_step_spy.py`, which stands in for ``model.train_function`` during `fit`.
- ``kernel_op(op, dtype, size) -> callable``: one matmul (``op="matmul"``) or 3x3 convolution
  (``"conv"``) in `dtype` on the backend's default device, run by calling it (it returns once
  the result exists); raises where the dtype has no kernel. `keras_perf.precision` times it.

Every optional name is defined here on every backend, with a neutral default where the
implementation has none (`any_worker` returns `flag`, `is_multi_worker` False, `model_scope`
a null context, `carry_in_step_state` True, the fake-quant names None). The dispatch adds
only what is built on the interface alone: ``is_oom(exc)`` (``is_oom_error`` over the
exception's causes), ``clear_memory()`` (garbage collection first), ``has_accelerator()``,
``step_memory(model, data, run_step)`` (the byte counts of the model's variables and the batch,
then the implementation's ``step_memory``), ``epoch_memory(model)`` (None on an accelerator,
else the implementation's, given those byte counts), and the constants ``BACKEND``,
``STEP_READS_EXTERNAL_VARIABLES``, ``STEP_MEMORY_RUNS_STEP`` and ``FIT_BUILDS_IN_FIRST_STEP``.

Re-exported from backend-neutral modules below this package, so that callers reach them here
too: ``host_memory()`` and ``reset_host_peak_memory()`` (`keras_perf._host_memory`),
``examples_seen(model)`` and ``is_functional(model)`` (`keras_perf._keras_internals`, the one
module that reads private Keras attributes).

Layering: this package sits above the neutral ground floor (`keras_perf._utils`,
`keras_perf._keras_internals`, `keras_perf._host_memory`, `keras_perf._imports`) and below
the train step (`keras_perf/train_step/`, whose backend modules may import the
implementation module of their backend); it never imports `keras_perf.train_step` or a
feature package (tests/test_imports.py checks that).
"""

from __future__ import annotations

import contextlib
import gc
import math

import keras
import numpy as np

from keras_perf._host_memory import host_memory, reset_host_peak_memory
from keras_perf._keras_internals import examples_seen, is_functional
from keras_perf.backend._measures import MEASURES

BACKEND: str = keras.backend.backend()

# The implementation module, chosen once (as keras/src/backend/__init__.py picks its backend).
if BACKEND == "tensorflow":
    from keras_perf.backend import tensorflow as _impl
elif BACKEND == "jax":
    from keras_perf.backend import jax as _impl
elif BACKEND == "torch":
    from keras_perf.backend import torch as _impl
else:
    raise ImportError(
        "keras-perf supports the Keras backends ['jax', 'tensorflow', 'torch']; KERAS_BACKEND "
        f"is {BACKEND!r}."
    )

__all__ = [
    "BACKEND",
    "FIT_BUILDS_IN_FIRST_STEP",
    "MEASURES",
    "STEP_MEMORY_RUNS_STEP",
    "STEP_READS_EXTERNAL_VARIABLES",
    "any_worker",
    "carry_in_step_state",
    "clear_memory",
    "configure_devices",
    "epoch_memory",
    "examples_seen",
    "fake_quant",
    "fake_quant_kernel",
    "global_rng_state",
    "has_accelerator",
    "host_memory",
    "is_functional",
    "is_multi_worker",
    "is_oom",
    "is_oom_error",
    "kernel_op",
    "list_devices",
    "memory_stats",
    "model_scope",
    "moving_average_fake_quant",
    "oom_error",
    "release_step_state",
    "reset_host_peak_memory",
    "reset_peak_memory",
    "set_global_rng_state",
    "set_random_seed",
    "step_memory",
    "step_memory_unavailable",
    "tf_data_has_stage",
    "tf_data_tuned",
    "traced_graphs_released",
]

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
step_memory_unavailable = _impl.step_memory_unavailable


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


def array_fit_kwargs(model, x, y=None, sample_weight=None, batch_size=32, shuffle=True):
    """What to pass `model.fit` to train on in-memory arrays: the arrays themselves, except
    under a TensorFlow tf.distribute strategy, where a `tf.data.Dataset` of them stands in
    (Keras' array pipeline there crashes the process after tens of fits; backend/tensorflow.py
    says how). For the tools that run many `fit` calls on twins (`accelerate`, `diagnose`)."""
    fn = getattr(_impl, "array_fit_input", None)
    ds = fn(model, x, y, sample_weight, batch_size, shuffle) if fn is not None else None
    if ds is not None:
        return {"x": ds, "shuffle": False}  # the dataset shuffles; fit's flag would only warn
    kw = {"x": x, "y": y, "batch_size": batch_size}
    if sample_weight is not None:
        kw["sample_weight"] = sample_weight
    if not shuffle:
        kw["shuffle"] = False
    return kw


def model_scope(model):
    """Context in which to create a model that shares `model`'s layers (TF: its strategy scope).

    Keras binds a TensorFlow model to the tf.distribute strategy in scope when the model is
    created; a twin made outside that scope would train on one device. A no-op elsewhere.
    """
    fn = getattr(_impl, "model_scope", None)
    return contextlib.nullcontext() if fn is None else fn(model)


@contextlib.contextmanager
def traced_graphs_released():
    """Let the graphs of train functions traced inside be freed once unused (TensorFlow).

    A context manager and, called, a decorator (`@traced_graphs_released()`): the tools that
    trace their twins' train functions use it, so repeated calls level off in memory. A null
    context on JAX and torch, whose traces are freed with the functions that hold them.
    """
    fn = getattr(_impl, "traced_graphs_released", None)
    with contextlib.nullcontext() if fn is None else fn():
        yield


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


def has_accelerator() -> bool:
    """Whether the backend sees a GPU or TPU."""
    return any(d["kind"] in ("GPU", "TPU") for d in list_devices())


#: Whether a compiled train step reads a variable that is not part of the model's or the
#: optimizer's state when it runs (TensorFlow graphs, eager torch), or bakes its value in when
#: traced (a jitted JAX step receives only that state; see `carry_in_step_state`).
STEP_READS_EXTERNAL_VARIABLES: bool = BACKEND != "jax"

#: Whether `fit` makes an unbuilt model's weights and the optimizer's slots inside the first
#: traced train step, after the first epoch began (TensorFlow: Keras defers its symbolic build
#: there unless a distribution strategy is set), rather than before the first epoch (JAX,
#: torch).
FIT_BUILDS_IN_FIRST_STEP: bool = BACKEND == "tensorflow"

#: Whether `step_memory` runs the training step to measure it (TensorFlow, torch: the peak is
#: read during the step) or compiles it only (JAX: XLA's memory analysis).
STEP_MEMORY_RUNS_STEP: bool = BACKEND != "jax"


def _nbytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is not None:
            dtype = keras.backend.standardize_dtype(t.dtype)
            total += math.prod(int(d) for d in t.shape) * np.dtype(dtype).itemsize
    return total


def step_memory(model, data, run_step) -> dict:
    """The peak memory of one training step of `model` on `data`, measured in process.

    Args:
        model: A compiled, built model (its optimizer and metrics built too).
        data: The batch, `(x, y, sample_weight)`.
        run_step: Runs one training step on `data` (TensorFlow and torch run it inside
            their measure; JAX compiles the step and does not call it).

    Returns:
        ``{"bytes", "measure", "ran"}`` (see the interface above).
    """
    return _impl.step_memory(model, data, run_step, _step_sizes(model, data))


def _step_sizes(model, data) -> dict:
    optimizer = getattr(model, "optimizer", None)
    state = {id(v): v for v in list(model.variables) + list(getattr(optimizer, "variables", []))}
    return {
        "state": _nbytes(state.values()),
        "trainable": _nbytes(model.trainable_variables),
        "batch": _nbytes(keras.tree.flatten(data)),
    }


def epoch_memory(model):
    """A meter of the peak memory of each epoch of `model`'s `fit` on a CPU, in the backend's
    own measure, or None where it has none for this model (callers then read the process's
    peak resident memory).

    Call it at `on_train_begin` (the train function exists then); the meter's `start_epoch()`
    goes at each epoch's begin, `finish_epoch()` at its end (a dict ``{"bytes", "measure",
    "device"}``, or None when nothing was measured), `close()` at the end of training.
    TensorFlow: its CPU allocator's peak over the epoch (``"tf_allocator_peak"``, only with
    the BFC allocator, see `step_memory_unavailable`); JAX: XLA's memory analysis of the step
    `fit` compiled, for the shapes of the epoch's first batch (``"xla_memory_analysis"``, read
    from JAX's compilation cache where `fit` compiled that step); torch: the count of
    `step_memory` (``"torch_saved_tensors"``) taken during the epoch's first step.
    """
    if has_accelerator():
        return None
    return _impl.epoch_memory(model, _step_sizes)


# The framework's own global RNG (torch's), which `fit` and `clone_model` draw from beside
# Python's and NumPy's; TensorFlow and JAX: None (Keras draws their randomness from its own
# seed generators).
global_rng_state = getattr(_impl, "global_rng_state", lambda: None)
set_global_rng_state = getattr(_impl, "set_global_rng_state", lambda state: None)
# `keras.utils.set_random_seed`; TensorFlow's keeps its kernel caches (backend/tensorflow.py).
set_random_seed = getattr(_impl, "set_random_seed", keras.utils.set_random_seed)


def _tf_data(name):
    """A tf.data function of the TensorFlow module, imported at the first call.

    tf.data is TensorFlow the library, not the Keras backend: a `tf.data.Dataset` feeds `fit`
    on every backend (TensorFlow installed), so these do not dispatch on `BACKEND`.
    """

    def call(*args, **kwargs):
        from keras_perf.backend import tensorflow

        return getattr(tensorflow, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"`keras_perf.backend.tensorflow.{name}`, on any backend."
    return call


tf_data_has_stage = _tf_data("has_stage")
tf_data_tuned = _tf_data("tf_data_tuned")
