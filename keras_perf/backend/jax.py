"""JAX implementation of the backend interface (see `keras_perf.backend`)."""

from __future__ import annotations

import os

import jax


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
