"""Resident memory of this Python process, on any backend (the standard library only).

Backend-neutral, on the ground floor of the package; `keras_perf.backend` re-exports both
functions, so callers keep reaching them as `kp.backend.host_memory()` and
`kp.backend.reset_host_peak_memory()`.
"""

from __future__ import annotations

import os
import resource
import sys


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
