"""What this machine's CPU is: its model name and feature flags, from /proc/cpuinfo (Linux).

Read once per process. Used where code adapts to the CPU at hand: the bfloat16 units
`kp.precision_report()` names, and the int8 dot-product instructions (VNNI) whose absence
makes ONNX Runtime's fused uint8 x int8 kernels saturate (`keras_perf.export._onnx_session`).
"""

from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=1)
def cpu_info() -> tuple[str | None, frozenset]:
    """(model name or None, feature flags) of the first CPU /proc/cpuinfo lists; flags are
    empty where the file cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None, frozenset()
    name, flags = None, frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name is None:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return name, flags


# Instructions that multiply uint8 by int8 and add in 32 bits (no 16-bit intermediate).
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
