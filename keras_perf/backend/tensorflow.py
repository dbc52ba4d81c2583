"""TensorFlow implementation of the backend interface (see `keras_perf.backend`)."""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import ops

from keras_perf import _keras_internals as keras_internals


def is_oom_error(exc: BaseException) -> bool:
    if isinstance(exc, tf.errors.ResourceExhaustedError):
        return True
    # On some GPU paths TF's allocator failure surfaces as an InternalError
    # ("Dst tensor is not initialized") instead of ResourceExhaustedError.
    if isinstance(exc, tf.errors.InternalError) and "Dst tensor is not initialized" in str(exc):
        return True
    return False


def oom_error(message: str) -> BaseException:
    return tf.errors.ResourceExhaustedError(None, None, message)


def _gpus():
    return tf.config.list_physical_devices("GPU")


def memory_stats():
    if not _gpus():
        return None
    try:
        info = tf.config.experimental.get_memory_info("GPU:0")
    except (ValueError, RuntimeError):
        return None
    return {
        "current_bytes": int(info["current"]),
        "peak_bytes": int(info["peak"]),
        "device": "GPU:0",
        "measure": "tf_allocator_peak",
    }


def reset_peak_memory() -> bool:
    if not _gpus():
        return False
    try:
        tf.config.experimental.reset_memory_stats("GPU:0")
    except (ValueError, RuntimeError):
        return False
    return True


def _allocator_device() -> str:
    return "GPU:0" if _gpus() else "CPU:0"


def step_memory_unavailable():
    """Why TensorFlow's allocator cannot measure a step here (None: it can).

    Its statistics must count a new 256 KiB tensor. On a CPU the BFC allocator is needed
    too, which TensorFlow uses only when `TF_CPU_ALLOCATOR_USE_BFC=true` was set before it
    was imported: without it (TensorFlow 2.21, oneDNN on) the statistics exist but miss most
    of what a compiled step allocates (a 256-wide MLP step read 0 bytes above the weights at
    batch 192 and 2 MB at 256), and with `TF_ENABLE_ONEDNN_OPTS=0` they are not kept at all.
    """
    device = _allocator_device()
    try:
        before = tf.config.experimental.get_memory_info(device)["current"]
        probe = tf.zeros((2**16,), tf.float32)
        grew = tf.config.experimental.get_memory_info(device)["current"] - before
        del probe
    except (ValueError, RuntimeError):
        grew = 0
    bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("true", "1")
    if grew >= 2**18 and (device != "CPU:0" or bfc):
        return None
    if device == "CPU:0":
        return (
            "TensorFlow's CPU allocator does not count what a training step allocates unless "
            "it is the BFC allocator. Set the environment variable TF_CPU_ALLOCATOR_USE_BFC=true "
            "before TensorFlow is imported (for example `TF_CPU_ALLOCATOR_USE_BFC=true python "
            "train.py`, or `os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'` before "
            "`import keras`)."
        )
    return f"TensorFlow's allocator of {device} keeps no memory statistics in this process."


def step_memory(model, data, run_step, sizes) -> dict:
    """The allocator's peak during `run_step()` above its bytes in use before, plus the
    model's and optimizer's variables (which those bytes in use already held)."""
    device = _allocator_device()
    before = tf.config.experimental.get_memory_info(device)["current"]
    tf.config.experimental.reset_memory_stats(device)
    run_step()
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    return {
        "bytes": int(sizes["state"] + peak - before),
        "measure": "tf_allocator_peak",
        "ran": True,
    }


class _AllocatorEpochMemory:
    """The peak of TensorFlow's CPU allocator (BFC) over the epoch above its bytes in use at
    the epoch's start, plus the model's and optimizer's variables: `step_memory`'s count, over
    an epoch. Not the raw peak, which holds every tensor of the process: other models', and
    those a traced Keras train step leaves behind after its model is gone (TensorFlow 2.21,
    Keras 3.15: a model's weights and optimizer slots stay allocated after `del model`)."""

    def __init__(self, model, sizes) -> None:
        self._model, self._sizes = model, sizes
        self._before = self._state = None

    def start_epoch(self) -> None:
        # The variables that exist now are in the bytes in use; slots made during the epoch
        # (TensorFlow builds an optimizer in its first step) count in the peak above them.
        self._state = self._sizes(self._model, ())["state"]
        self._before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")

    def finish_epoch(self):
        if self._before is None:
            return None
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        figure = self._state + max(peak - self._before, 0)
        return {"bytes": int(figure), "measure": "tf_allocator_peak", "device": "CPU:0"}

    def close(self) -> None:
        pass


def epoch_memory(model, sizes):
    """The CPU allocator's peak, where it keeps statistics (`step_memory_unavailable`)."""
    if _gpus() or step_memory_unavailable() is not None:
        return None
    return _AllocatorEpochMemory(model, sizes)


def list_devices():
    devices = []
    for dev in tf.config.list_physical_devices():
        kind = dev.device_type
        entry = {"name": dev.name, "kind": kind, "memory_bytes": None, "compute_capability": None}
        if kind == "GPU":
            try:
                details = tf.config.experimental.get_device_details(dev)
            except (ValueError, RuntimeError):
                details = {}
            entry["name"] = details.get("device_name", dev.name)
            entry["compute_capability"] = details.get("compute_capability")
        devices.append(entry)
    return devices


def configure_devices(memory_growth: bool, memory_limit_mb):
    gpus = _gpus()
    notes = []
    if not gpus:
        return ["no GPU visible to TensorFlow: nothing to configure"]
    try:
        for gpu in gpus:
            if memory_limit_mb is not None:
                # TF refuses memory growth on a device that has a virtual-device limit.
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=int(memory_limit_mb))]
                )
                notes.append(f"{gpu.name}: memory limited to {memory_limit_mb} MB")
            else:
                tf.config.experimental.set_memory_growth(gpu, memory_growth)
                notes.append(f"{gpu.name}: memory growth {'on' if memory_growth else 'off'}")
    except RuntimeError as e:
        raise RuntimeError(
            "configure_devices() must run before TensorFlow initialises its GPUs: call it right "
            f"after `import keras_perf`, before building any model. TensorFlow said: {e}"
        ) from e
    return notes


def clear_memory() -> None:
    # TensorFlow's BFC allocator keeps its pool and has no public call to return it; the
    # tensors of a failed step are freed by the garbage collection the caller runs.
    return None


@contextlib.contextmanager
def traced_graphs_released():
    """Release the graphs of train functions traced inside, once they are no longer used.

    Why: `tf.custom_gradient` in graph mode registers each traced gradient function in
    TensorFlow's global gradient registry under a fresh name ("CustomGradient-<n>") and never
    removes it, and that function holds the graph it was traced in. Keras' TensorFlow
    optimizer sums gradients through `ReplicaContext.all_reduce`, which is such a custom
    gradient, so every train function Keras traces stays in memory for the life of the
    process (5-6 MiB for a small MLP's twin; FACTS.md). The measuring tools trace the train
    functions of twins they discard, so they drop the entries registered while they ran.
    A registered entry is read only while gradients are taken through the graph that
    registered it, which for a train function happens inside its own trace. So an entry
    registered by another thread tracing at the same moment would be dropped too: the tools
    are not meant to run beside a trace in another thread (nor is Keras' `fit`).
    """
    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    if not isinstance(registry, dict):  # a TensorFlow whose registry is laid out otherwise
        yield
        return
    before = set(registry)
    try:
        yield
    finally:
        for name in [k for k in registry if k not in before]:
            if name.startswith("CustomGradient-"):
                registry.pop(name, None)


def global_rng_state():
    """TensorFlow's global seed and the eager op-seed generator it starts.

    With a global seed (`keras.utils.set_random_seed`), every random op without a seed of its
    own takes the next op seed from that generator, the shuffle of Keras' array pipeline
    among them. The measuring tools seed their twins' fits (so a candidate and the baseline
    see the same batches), which resets both: without a restore the user's next `fit`
    shuffled in another order (its weights 7.5e-3 apart after one epoch).
    """
    ctx = context.context()
    rng = getattr(ctx, "_rng", None)  # private; Context._seed and _rng since TF 2.0
    return getattr(ctx, "_seed", None), None if rng is None else rng.getstate()


def set_global_rng_state(state) -> None:
    seed, rng_state = state
    _set_global_seed(seed)  # None: no global seed, as before
    rng = getattr(context.context(), "_rng", None)
    if rng is not None and rng_state is not None:
        rng.setstate(rng_state)


def _set_global_seed(seed) -> None:
    """`tf.random.set_seed(seed)` without clearing TensorFlow's kernel caches.

    Why: `tf.random.set_seed` also clears the eager context's caches, so every tf.function
    is instantiated again at its next call, and an instantiation is not all freed:
    `kp.accelerate` seeds around each exactness check, and on a model whose twins it kept
    (nothing new traced) the process still grew by 2.3 MiB a call (TF 2.21; 0.0 with the
    cache kept). The clear exists to reset the state of cached stateful random kernels, which
    Keras 3 does not use (its random ops are stateless, seeded by its `SeedGenerator`s), and
    keeping the user's cached kernels is what restoring the user's state means. Falls back to
    `tf.random.set_seed` on a TensorFlow whose context is laid out otherwise.
    """
    ctx = context.context()
    if not (hasattr(ctx, "_seed") and hasattr(ctx, "_rng")):  # private; since TF 2.0
        tf.random.set_seed(seed)
        return
    ctx._seed = seed
    ctx._rng = random.Random(seed if seed is None else int(seed))


def set_random_seed(seed: int) -> None:
    """`keras.utils.set_random_seed(seed)`, with TensorFlow's global seed set by
    `_set_global_seed` (its kernel caches kept)."""
    keras_internals.set_keras_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    _set_global_seed(seed)


def _strategy(model):
    if model is not None and getattr(model, "_distribute_strategy", None) is not None:
        return model._distribute_strategy
    return tf.distribute.get_strategy()


def model_scope(model):
    """The scope of the strategy `model` was created under (Keras records it), else a no-op."""
    strategy = getattr(model, "_distribute_strategy", None)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def array_fit_input(model, x, y, sample_weight, batch_size, shuffle):
    """Under a tf.distribute strategy, a `tf.data.Dataset` of the arrays to pass `fit` in
    their place (batches of `batch_size`, reshuffled each epoch where `shuffle`); else None.

    Keras' own array pipeline under a strategy crashes the process: Keras builds the model
    from a batch peeked off a fresh distributed iterator at the start of every `fit`, and
    dropping that iterator segfaults after some 70-90 fits in one process (TF 2.21, Keras 3.15,
    a `MirroredStrategy` on one CPU; a plain `from_tensor_slices` pipeline ran 200 fits). The
    tools that time many fits of twins feed them this pipeline instead.
    """
    if getattr(model, "_distribute_strategy", None) is None:
        return None
    # Lists become tuples (tf.data would stack a list of inputs into one tensor); `x` alone is
    # a 1-tuple, so that Keras never reads a tuple of inputs as (x, y).
    x, y = (tuple(p) if isinstance(p, list) else p for p in (x, y))
    parts = tuple(p for p in (x, y, sample_weight) if p is not None)
    n = int(tf.nest.flatten(x)[0].shape[0])
    ds = tf.data.Dataset.from_tensor_slices(parts)
    if shuffle:
        ds = ds.shuffle(n, seed=0, reshuffle_each_iteration=True)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def is_multi_worker(model=None) -> bool:
    strategy = _strategy(model)
    extended = getattr(strategy, "extended", None)
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        getattr(extended, "_in_multi_worker_mode", lambda: False)()
    )


def any_worker(flag: bool, model=None) -> bool:
    if not is_multi_worker(model):
        return flag
    strategy = _strategy(model)
    local = strategy.run(lambda: tf.constant(1.0 if flag else 0.0))
    return float(strategy.reduce("SUM", local, axis=None)) > 0


def dataset_stages(dataset) -> list:
    """Every stage of a tf.data pipeline, the last first.

    tf.data has no public way to walk a pipeline; `Dataset._inputs()` (each stage's inputs)
    is what its own graph rewrites use.
    """
    found, stack, seen = [], [dataset], set()
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        found.append(ds)
        try:
            stack.extend(ds._inputs())
        except (AttributeError, NotImplementedError):  # a stage that does not say
            pass
    return found


def has_stage(dataset, name: str) -> bool:
    """Whether a tf.data pipeline has a stage of this class (`"CacheDataset"`, ...)."""
    return any(type(ds).__name__.lstrip("_") == name for ds in dataset_stages(dataset))


def tf_data_tuned(dataset, cache: bool = False, parallel_map: bool = False):
    """`dataset` cached and/or with its maps made parallel, then prefetched (AUTOTUNE).

    The variants of a tf.data pipeline that `kp.diagnose` times: `prefetch` last; with
    `parallel_map`, tf.data's map-parallelization rewrite (as `num_parallel_calls=AUTOTUNE`
    on each map); with `cache`, `cache()` before the prefetch.
    """
    if cache:
        dataset = dataset.cache()
    if parallel_map:
        options = tf.data.Options()
        options.experimental_optimization.map_parallelization = True
        dataset = dataset.with_options(options)
    return dataset.prefetch(tf.data.AUTOTUNE)


def kernel_op(op: str, dtype: str, size: int):
    """A callable running one `op` ("matmul": two size x size matrices; "conv": a 3x3
    convolution, batch 16, size x size x 64, NHWC) in `dtype` on TensorFlow's default device,
    returning once the result exists. Raises where the dtype has no kernel for the op."""
    shape = (
        ((size, size), (size, size)) if op == "matmul" else ((16, size, size, 64), (3, 3, 64, 64))
    )
    # Stateless draws: the global seed's op-seed sequence, which the next `fit` draws its
    # shuffles from, is left as it was.
    a = tf.cast(tf.random.stateless_uniform(shape[0], (0, 0), -1.0, 1.0), dtype)
    b = tf.cast(tf.random.stateless_uniform(shape[1], (0, 1), -1.0, 1.0), dtype)
    fn = tf.linalg.matmul if op == "matmul" else (lambda x, k: tf.nn.conv2d(x, k, 1, "SAME"))
    step = tf.function(fn, jit_compile=False)

    def run():
        y = step(a, b)
        return float(tf.reshape(y, [-1])[0])  # copying one element waits for the result

    return run
