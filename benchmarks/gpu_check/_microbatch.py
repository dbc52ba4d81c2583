"""Section 2: micro-batching memory (peak device memory and step time per setting)."""

from __future__ import annotations

import time

from ._common import _compile, _error_text, _gib, _row, convnet
from ._config import MICROBATCHES


def _reset_peak(ctx) -> None:
    import keras_perf as kp

    if not kp.backend.reset_peak_memory():
        kp.backend.reset_host_peak_memory()


def _peak(ctx) -> tuple[int, str]:
    """Peak bytes and where they were read: the device allocator, else host RSS (dry run)."""
    import keras_perf as kp

    stats = kp.backend.memory_stats()
    if stats is not None:
        return int(stats["peak_bytes"]), "device"
    return int(kp.backend.host_memory()["peak_bytes"]), "host RSS"


def _pick_batch(ctx, model, x, y) -> tuple[int, str]:
    """A batch that fills `fill` of the device, from the peaks at two small batches."""
    m = ctx.sizes["memory"]
    b0 = m["probe_batch"]
    peaks = []
    for b in (b0, 2 * b0):
        _reset_peak(ctx)
        for _ in range(2):
            model.train_on_batch(x[:b], y[:b])
        peaks.append(_peak(ctx)[0])
    per_example = max((peaks[1] - peaks[0]) / b0, 1.0)
    fixed = peaks[0] - b0 * per_example
    how = (
        f"probe: {_gib(per_example)} per example, {_gib(fixed)} fixed "
        f"(peaks at batch {b0} and {2 * b0})"
    )
    if ctx.dry:
        return m["batch"], how + f"; dry-run: batch fixed at {m['batch']}"
    batch = int((m["fill"] * ctx.limit - fixed) // per_example) // 8 * 8
    batch = max(8, min(batch, m["max_batch"]))
    return batch, how + f"; batch {batch} for {m['fill']:.0%} of {_gib(ctx.limit)}"


def section_memory(ctx, rows: list, microbatches=MICROBATCHES, batch=None) -> None:
    import numpy as np

    import keras_perf as kp

    m = ctx.sizes["memory"]
    s = ctx.sizes["convnet"]
    base, label, _ = convnet(ctx)
    model = _compile(kp.loss_scaled(base))
    rng = np.random.default_rng(0)
    probe_note = f"batch {batch} from the first process"
    if batch is None:
        n = max(2 * m["probe_batch"], 8)
        x = rng.standard_normal((n, s["image"], s["image"], 3), dtype="float32")
        y = rng.integers(0, s["classes"], n).astype("int32")
        batch, probe_note = _pick_batch(ctx, model, x, y)
    x = rng.standard_normal((batch, s["image"], s["image"], 3), dtype="float32")
    y = rng.integers(0, s["classes"], batch).astype("int32")
    shared = len(microbatches) > 1
    for k in microbatches:
        row_id = f"2/microbatches={k}"
        case = f"{label} float32, batch {batch}, microbatches={k}"
        try:
            model.microbatches = k
            _reset_peak(ctx)
            model.train_on_batch(x, y)  # compiles
            times = []
            for _ in range(m["steps"]):
                t0 = time.perf_counter()
                model.train_on_batch(x, y)  # returns host numbers: waits for the device
                times.append(time.perf_counter() - t0)
            step_s = sorted(times)[len(times) // 2]
            peak, where = _peak(ctx)
            note = f"peak from {where}"
            if ctx.limit:
                note += f" = {peak / ctx.limit:.0%} of {_gib(ctx.limit)}"
            if ctx.backend == "jax":
                note += "; JAX peak since process start (cannot be reset): " + (
                    "settings share this process (dry-run)"
                    if shared and ctx.dry
                    else "own process"
                    if not shared
                    else "settings share a process"
                )
            if k == microbatches[0]:
                note += "; " + probe_note
            rows.append(
                _row(
                    ctx,
                    row_id,
                    case,
                    examples_per_s=batch / step_s,
                    step_ms=1000 * step_s,
                    peak_memory_bytes=peak,
                    note=note,
                    batch=batch,
                    memory_source=where,
                )
            )
        except Exception as exc:
            error = _error_text(exc)
            if kp.backend.is_oom(exc):
                error = f"out of memory at microbatches={k}, batch {batch}: {error}"
            rows.append(_row(ctx, row_id, case, error=error, batch=batch))
            kp.backend.clear_memory()
