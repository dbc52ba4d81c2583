"""Section 3: a real out-of-memory, recovered by `kp.fit_with_oom_retry`; then the probe."""

from __future__ import annotations

import math
import time

from ._common import _compile, _error_text, _free_memory, _gib, _row
from ._config import WEIGHT_TOLERANCE


def _oom_model(ctx, threshold=None):
    import keras

    o = ctx.sizes["oom"]
    layers = [keras.Input((o["inputs"],)), keras.layers.Dense(o["width"], activation="tanh")]
    if ctx.dry:
        layers.append(oom_above(threshold))
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers, name="wide")


def oom_above(threshold):
    """Identity layer raising the backend's own OOM error on a training call with more than
    `threshold` examples (the fault injection of tests/test_oom.py; dry run only)."""
    import keras

    import keras_perf as kp

    class OOMAbove(keras.layers.Layer):
        def call(self, x, training=False):
            n = x.shape[0]
            if training and isinstance(n, int) and threshold is not None and n > threshold:
                raise kp.backend.oom_error(
                    f"Out of memory while trying to allocate {n * 1000} bytes (injected, "
                    f"batch {n})."
                )
            return x

    return OOMAbove()


def section_oom(ctx, rows: list) -> None:
    import numpy as np

    import keras_perf as kp

    o = ctx.sizes["oom"]
    if ctx.dry:
        batch = o["batch"]
        why = f"OOM injected above {o['threshold']} examples (dry-run)"
    else:
        # The wide layer's output alone (batch x width float32) is 1.25 x the device memory.
        batch = math.ceil(o["over"] * ctx.limit / (4 * o["width"]) / 64) * 64
        why = (
            f"the {o['width']}-wide activation alone is {_gib(4 * o['width'] * batch)} > "
            f"{_gib(ctx.limit)}"
        )
    rng = np.random.default_rng(0)
    n = batch * o["steps"]
    x = rng.standard_normal((n, o["inputs"]), dtype="float32")
    y = rng.integers(0, 10, n).astype("int32")
    case = f"fit_with_oom_retry, MLP {o['inputs']}-{o['width']}-10 float32, batch {batch}"
    model = None
    try:
        model = _compile(kp.loss_scaled(_oom_model(ctx, o.get("threshold"))))
        initial = model.get_weights()
        t0 = time.perf_counter()
        # The micro-batch rung alone: one wide activation is what runs out, which remat (the
        # ladder's other rung, tried in between by default) cannot make smaller.
        h = kp.fit_with_oom_retry(
            model, x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
            strategies=("microbatches",),
        )  # fmt: skip
        t_retry = time.perf_counter() - t0
        k = h.model.microbatches
        weights = h.model.get_weights()
        _free_memory()
        ref = _compile(kp.loss_scaled(_oom_model(ctx), microbatches=k))
        ref.set_weights(initial)
        t0 = time.perf_counter()
        ref.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        t_ref = time.perf_counter() - t0
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, ref.get_weights()))
        ref = None
        _free_memory()
        events = h.oom_events
        path = " -> ".join(str(e["microbatches"]) for e in events) + f" -> {k}"
        ok = diff <= WEIGHT_TOLERANCE and events
        note = (
            f"{why}; {len(events)} OOM events (microbatches {path}); weights vs "
            f"microbatches={k} from the start: max |diff| {diff:.1e} "
            f"({'<=' if diff <= WEIGHT_TOLERANCE else '>'} {WEIGHT_TOLERANCE:g}); "
            f"time lost {t_retry - t_ref:.1f} s (retry run {t_retry:.1f} s, "
            f"reference {t_ref:.1f} s)"
        )
        error = None
        if not events:
            error = f"no out-of-memory happened at batch {batch}: {why} was expected to fail"
        elif not ok:
            error = f"weights differ from the reference by {diff:.2e} > {WEIGHT_TOLERANCE:g}"
        rows.append(
            _row(
                ctx,
                "3/oom_retry",
                case,
                note=note,
                error=error,
                batch=batch,
                oom_events=events,
                final_microbatches=k,
                max_weight_diff=diff,
                retry_s=t_retry,
                reference_s=t_ref,
                time_lost_s=t_retry - t_ref,
            )
        )
    except Exception as exc:
        rows.append(_row(ctx, "3/oom_retry", case, error=_error_text(exc), batch=batch))
        _free_memory()
    case = f"find_max_microbatch, same model, batch {batch}"
    try:
        if model is None:
            raise RuntimeError("the model could not be built (see the row above)")
        t0 = time.perf_counter()
        fits = kp.find_max_microbatch(model, x, y, batch_size=batch)
        seconds = time.perf_counter() - t0
        rows.append(
            _row(
                ctx,
                "3/find_max_microbatch",
                case,
                note=f"{fits} examples per micro-batch fit = microbatches "
                f"{math.ceil(batch / fits)}; probe took {seconds:.1f} s",
                batch=batch,
                max_microbatch=fits,
                probe_s=seconds,
            )
        )
    except Exception as exc:
        rows.append(_row(ctx, "3/find_max_microbatch", case, error=_error_text(exc)))
    finally:
        model = None
        _free_memory()
