"""Device configuration and inventory, the same call on every Keras backend."""

from __future__ import annotations

from keras_perf import backend as _backend
from keras_perf._utils import check_bool, check_int

__all__ = ["configure_devices", "device_report"]


def configure_devices(memory_growth: bool = True, memory_limit_mb: int | None = None) -> list[str]:
    """Configure how the backend allocates accelerator memory.

    Call it once, right after importing keras-perf and before building a model: every
    backend fixes its allocator when it first touches a device.

    - TensorFlow: per-GPU memory growth, or a logical device capped at `memory_limit_mb`
      (TensorFlow refuses both at once, so a limit takes precedence over growth).
    - JAX: `memory_growth=True` turns off XLA's up-front preallocation
      (`XLA_PYTHON_CLIENT_PREALLOCATE=false`); an absolute limit has no JAX equivalent and is
      reported as not applied.
    - PyTorch: the caching allocator already grows on demand; a limit becomes
      `torch.cuda.set_per_process_memory_fraction`.

    Without an accelerator nothing needs configuring and the notes say so.

    Args:
        memory_growth: Allocate accelerator memory as needed instead of all at once.
            Defaults to `True`.
        memory_limit_mb: Cap on each accelerator's memory in MiB, or `None` for no cap.
            Defaults to `None`.

    Returns:
        A list of short notes describing what was applied (or why nothing was).

    Raises:
        TypeError: `memory_growth` is not a bool or `memory_limit_mb` not an int.
        ValueError: `memory_limit_mb` is not positive.
        RuntimeError: TensorFlow has already initialised its GPUs.

    Example:
        >>> import keras_perf as kp
        >>> notes = kp.configure_devices(memory_growth=True)
        >>> len(notes) > 0 and all(isinstance(note, str) for note in notes)
        True
    """
    check_bool("memory_growth", memory_growth)
    check_int("memory_limit_mb", memory_limit_mb, minimum=1, allow_none=True)
    return list(_backend.configure_devices(memory_growth, memory_limit_mb))


def device_report() -> list[dict]:
    """List the devices the current Keras backend can use.

    Returns:
        One dict per device with keys `name`, `kind` (`"CPU"`, `"GPU"` or `"TPU"`),
        `memory_bytes` (total memory where the backend reports it, else `None`) and
        `compute_capability` (`(major, minor)` for CUDA GPUs, else `None`).

    Example:
        >>> import keras_perf as kp
        >>> any(d["kind"] == "CPU" for d in kp.device_report())
        True
    """
    return [dict(d) for d in _backend.list_devices()]
