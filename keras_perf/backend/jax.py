"""JAX implementation of the backend interface (see `keras_perf.backend`)."""

from __future__ import annotations

import itertools
import os

import jax
import keras

from keras_perf.backend._step_spy import StepSpy


def is_oom_error(exc: BaseException) -> bool:
    # XLA reports allocation failures as XlaRuntimeError / JaxRuntimeError whose message
    # starts with the status code RESOURCE_EXHAUSTED.
    name = type(exc).__name__
    if name in ("XlaRuntimeError", "JaxRuntimeError") and "RESOURCE_EXHAUSTED" in str(exc):
        return True
    return False


def oom_error(message: str) -> BaseException:
    # What XLA raises: the runtime error class with the status code leading the message.
    error_type = getattr(jax.errors, "JaxRuntimeError", None)
    if error_type is None:  # jax < 0.4.36 exposes it only under jaxlib's name
        from jax.lib import xla_client

        error_type = xla_client.XlaRuntimeError
    return error_type(f"RESOURCE_EXHAUSTED: {message}")


def _accelerators():
    return [d for d in jax.devices() if d.platform != "cpu"]


def memory_stats():
    devs = _accelerators()
    if not devs:
        return None
    stats = devs[0].memory_stats() or {}
    if "bytes_in_use" not in stats:
        return None
    return {
        "current_bytes": int(stats["bytes_in_use"]),
        "peak_bytes": int(stats.get("peak_bytes_in_use", stats["bytes_in_use"])),
        "device": str(devs[0]),
        "measure": "xla_peak_bytes_in_use",
    }


def reset_peak_memory() -> bool:
    # JAX exposes no reset of `peak_bytes_in_use`: callers report the peak since start.
    return False


def _compute_capability(dev):
    cc = getattr(dev, "compute_capability", None)
    if not cc:
        return None
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def list_devices():
    devices = []
    for dev in jax.devices():
        kind = {"gpu": "GPU", "tpu": "TPU", "cpu": "CPU"}.get(dev.platform, dev.platform.upper())
        memory = None
        if kind != "CPU":
            memory = (dev.memory_stats() or {}).get("bytes_limit")
        devices.append(
            {
                "name": f"{dev.device_kind} ({dev})",
                "kind": kind,
                "memory_bytes": memory,
                "compute_capability": _compute_capability(dev),
            }
        )
    return devices


def _backends_initialized() -> bool:
    # Private JAX API (checked on jax 0.4.30-0.10): whether a client, and so its preallocated
    # memory pool, already exists. If it does, allocator settings no longer apply.
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def configure_devices(memory_growth: bool, memory_limit_mb):
    notes = []
    initialized = _backends_initialized()
    if initialized:
        notes.append(
            "JAX already created its devices: allocator settings cannot change now. Call "
            "configure_devices() before any JAX computation, or set XLA_PYTHON_CLIENT_PREALLOCATE / "
            "XLA_PYTHON_CLIENT_MEM_FRACTION in the environment."
        )
        return notes
    # JAX's equivalent of memory growth: do not preallocate 75 % of the GPU up front.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false" if memory_growth else "true"
    notes.append(f"XLA_PYTHON_CLIENT_PREALLOCATE={os.environ['XLA_PYTHON_CLIENT_PREALLOCATE']}")
    if memory_limit_mb is not None:
        notes.append(
            "memory_limit_mb is not applied on JAX: XLA limits memory only as a fraction of the "
            "device (set XLA_PYTHON_CLIENT_MEM_FRACTION before importing JAX)."
        )
    return notes


def clear_memory() -> None:
    jax.clear_caches()


def step_memory_unavailable():
    # XLA's memory analysis of a compiled step exists on every platform JAX runs on; a
    # platform without one is found (and reported) at the first compilation.
    return None


def _spec(tensor):
    if tensor is None:
        return None
    # As the step would receive it (float64 data is float32 unless x64 is enabled).
    dtype = jax.dtypes.canonicalize_dtype(tensor.dtype)
    return jax.ShapeDtypeStruct(tuple(tensor.shape), dtype)


def _state_specs(model):
    return tuple(
        [_spec(v.value) for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )


def _compiled_step_bytes(model, data_specs, fast: bool) -> int:
    """Arguments (state and batch) + outputs - the donated state they share + scratch
    ("temp") buffers of the train step compiled as Keras compiles it (the state donated)."""
    lowered = jax.jit(model.train_step, donate_argnums=0).lower(_state_specs(model), data_specs)
    if fast:
        # Compiled to be measured, not run: without LLVM's optimisations, 2-3x faster on
        # XLA:CPU. Buffers are assigned before code generation, so the analysis is the same
        # (checked equal on MLP steps, micro-batched or not, jax 0.10).
        compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    else:
        # With the options of Keras' own jit, JAX finds the step `fit` compiled in its cache
        # (0.02 s for a 16-layer MLP whose compilation took 1.6 s).
        compiled = lowered.compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise ValueError(
            f"XLA gives no memory analysis of a compiled step on {jax.devices()[0].platform}, so "
            "the peak of a training step cannot be read there; run without "
            "`memory_limit_bytes` (on an accelerator, by trying until out-of-memory)."
        )
    return int(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def step_memory(model, data, run_step, sizes) -> dict:
    """XLA's memory analysis of the compiled train step, as Keras compiles it (the state
    donated): arguments (state and batch) + outputs - the donated state they share + scratch
    ("temp") buffers. Compiled from shapes only, so nothing is allocated or run."""
    specs = jax.tree_util.tree_map(_spec, data)
    total = _compiled_step_bytes(model, specs, fast=not _accelerators())
    return {"bytes": total, "measure": "xla_memory_analysis", "ran": False}


class _CompiledStepEpochMemory(StepSpy):
    """XLA's memory analysis of the step `fit` compiled, for the shapes of each epoch's first
    batch (read by peeking at the batch iterator Keras hands the train function)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self._specs = None
        self._bytes: dict = {}
        self._failed = False

    def call(self, original, state, iterator):
        if self._specs is None:
            first = next(iterator)
            self._specs = jax.tree_util.tree_map(_spec, first)
            iterator = itertools.chain([first], iterator)
        return original(state, iterator)

    def start_epoch(self) -> None:
        self._specs = None
        if not self._failed and self.install():
            # A rebuilt train function (new `remat` or `microbatches` on the same model): the
            # counts per batch shape were of the old step.
            function = self._wrapper._kp_original
            if function is not getattr(self, "_function", None):
                self._function, self._bytes = function, {}

    def finish_epoch(self):
        if self._specs is None or self._failed:
            return None
        leaves, tree = jax.tree_util.tree_flatten(self._specs)
        key = (tree, tuple((leaf.shape, str(leaf.dtype)) for leaf in leaves))
        if key not in self._bytes:
            try:
                self._bytes[key] = _compiled_step_bytes(self.model, self._specs, fast=False)
            except Exception:  # a step this analysis cannot lower: the caller falls back
                self._failed = True
                self.remove()
                return None
        return {"bytes": self._bytes[key], "measure": "xla_memory_analysis", "device": "cpu"}

    def close(self) -> None:
        self.remove()


def epoch_memory(model, sizes):
    """XLA's analysis of the compiled step, where `fit` compiles one (jit, no distribution)."""
    del sizes  # the analysis holds the state and the batch
    if _accelerators() or getattr(model, "train_function", None) is None:
        return None
    if model.run_eagerly or not model.jit_compile or keras.distribution.distribution():
        return None
    return _CompiledStepEpochMemory(model)


# ------------------------------------------------------------------------------------------
# Variables carried into the jitted train step
# ------------------------------------------------------------------------------------------
# Keras' JAX trainer passes the jitted step only the model's, the optimizer's and the metrics'
# variables; any other variable is baked into the compiled function as a constant. A variable
# listed among the optimizer's own variables travels with the optimizer state instead: the
# step receives its current value at each call, and `optimizer.apply` (which runs variable
# constraints) sees it inside the same stateless scope. Private Keras attributes used here,
# checked on Keras 3.8-3.15: `BaseOptimizer._variables` and `LossScaleOptimizer.inner_optimizer`.


def _optimizer_chain(optimizer):
    """The optimizer and the ones it wraps (a LossScaleOptimizer's inner optimizer)."""
    chain = [optimizer]
    while getattr(chain[-1], "inner_optimizer", None) is not None:
        chain.append(chain[-1].inner_optimizer)
    return chain


def _is_in(variable, variables) -> bool:
    return any(variable is v for v in variables)


def _excluding(owner, carried, method):
    """`method(store)` run while `carried` are out of `owner._variables`: saved optimizer state
    stays exactly what it is without them, and loads into a plain optimizer (and back)."""

    def call(store):
        everything = owner._variables[:]
        owner._variables[:] = [v for v in everything if not _is_in(v, carried)]
        try:
            return method(store)
        finally:
            owner._variables[:] = everything

    return call


def carry_in_step_state(model, variables) -> bool:
    """Make later assignments to `variables` reach the model's jitted train step without a
    retrace; False when the optimizer is missing or not built yet (the caller then retraces).
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(optimizer, "built", False):
        return False
    chain = _optimizer_chain(optimizer)
    owner = chain[-1]  # the optimizer whose apply() runs the constraints
    carried = owner.__dict__.setdefault("_kp_carried", [])
    for v in variables:
        if not _is_in(v, owner._variables):
            owner._variables.append(v)
        if not _is_in(v, carried):
            carried.append(v)
    for opt in chain:
        for name in ("save_own_variables", "load_own_variables"):
            if name not in opt.__dict__:
                original = getattr(type(opt), name).__get__(opt)
                opt.__dict__[name] = _excluding(owner, carried, original)
    return True


def release_step_state(model, variables) -> None:
    """Undo `carry_in_step_state` for `variables` (the optimizer is as before once none is left)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    chain = _optimizer_chain(optimizer)
    owner = chain[-1]
    carried = owner.__dict__.get("_kp_carried")
    if not carried:
        return
    owner._variables[:] = [v for v in owner._variables if not _is_in(v, variables)]
    carried[:] = [v for v in carried if not _is_in(v, variables)]
    if not carried:
        del owner.__dict__["_kp_carried"]
        for opt in chain:
            opt.__dict__.pop("save_own_variables", None)
            opt.__dict__.pop("load_own_variables", None)


def kernel_op(op: str, dtype: str, size: int):
    """A callable running one jitted `op` ("matmul": two size x size matrices; "conv": a 3x3
    convolution, batch 16, size x size x 64, NHWC) in `dtype` on JAX's default device,
    returning once the result exists. Raises where the dtype has no kernel for the op."""
    import jax.numpy as jnp

    if op == "matmul":
        shapes = ((size, size), (size, size))
        fn = jnp.matmul
    else:
        shapes = ((16, size, size, 64), (3, 3, 64, 64))

        def fn(x, k):
            return jax.lax.conv_general_dilated(
                x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )

    keys = jax.random.split(jax.random.PRNGKey(0))
    a, b = (jax.random.uniform(k, s, minval=-1.0).astype(dtype) for k, s in zip(keys, shapes))
    step = jax.jit(fn)

    def run():
        return float(step(a, b).block_until_ready().reshape(-1)[0])

    return run
