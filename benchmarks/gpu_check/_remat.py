"""Section 6: gradient checkpointing (`kp.loss_scaled(model, remat=...)`) on the device.

Per model (a deep MLP, a Transformer encoder, ResNet50 at 64 x 64) and remat setting (none,
`"full"`): the peak memory of one training step as `kp.backend.step_memory` measures it on the
device (torch: the CUDA allocator's peak during the step plus the state; JAX: XLA's memory
analysis of the step compiled for the GPU) and the median time of `steps` `train_on_batch`
calls after one that compiles. Then a real out-of-memory that remat fixes without changing the
batch: a 64-layer MLP whose plain step needs about 1.25 x the device's memory (two saved
tensors per layer), trained with `kp.fit_with_oom_retry(strategies=("remat",))`; its weights
against a run with `remat="full"` from the start.
"""

from __future__ import annotations

import math
import time

from ._common import _compile, _error_text, _free_memory, _gib, _row
from ._config import REMAT_MODELS, REMAT_MODES, WEIGHT_TOLERANCE


def _remat_model(ctx, kind):
    import keras

    s = ctx.sizes["remat"][kind]
    keras.utils.set_random_seed(0)
    if kind == "mlp":
        inp = keras.Input((s["inputs"],))
        h = inp
        for _ in range(s["depth"]):
            h = keras.layers.Dense(s["width"], activation="gelu")(h)
        label = f"deep MLP {s['inputs']}-{s['depth']}x{s['width']} gelu"
        return keras.Model(inp, keras.layers.Dense(10)(h)), (s["inputs"],), label
    if kind == "transformer":
        inp = keras.Input((s["seq"], s["d"]))
        h = inp
        for _ in range(s["blocks"]):
            a = keras.layers.MultiHeadAttention(s["heads"], s["d"] // s["heads"])(h, h)
            h = keras.layers.LayerNormalization()(h + a)
            f = keras.layers.Dense(s["ff"], activation="gelu")(h)
            h = keras.layers.LayerNormalization()(h + keras.layers.Dense(s["d"])(f))
        h = keras.layers.GlobalAveragePooling1D()(h)
        label = f"Transformer seq {s['seq']}, d {s['d']}, {s['heads']} heads, {s['blocks']} blocks"
        return keras.Model(inp, keras.layers.Dense(10)(h)), (s["seq"], s["d"]), label
    n = s["image"]
    if ctx.dry:
        model = keras.Sequential(
            [
                keras.Input((n, n, 3)),
                keras.layers.Conv2D(8, 3, padding="same"),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10),
            ]
        )
        return model, (n, n, 3), f"tiny CNN+BN {n}x{n}"
    model = keras.applications.ResNet50(
        weights=None, input_shape=(n, n, 3), classes=10, classifier_activation=None
    )
    return model, (n, n, 3), f"ResNet50 {n}x{n}"


def _measure(ctx, model, x, y, steps):
    """(peak bytes, how measured, median step seconds) of one training step."""
    import keras_perf as kp

    model.train_on_batch(x, y)  # builds and compiles
    data = (x, y, None)
    mem = kp.backend.step_memory(model, data, lambda: model.train_on_batch(x, y))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.train_on_batch(x, y)  # returns host numbers: waits for the device
        times.append(time.perf_counter() - t0)
    return mem["bytes"], mem["measure"], sorted(times)[len(times) // 2]


def section_remat(ctx, rows: list) -> None:
    import keras
    import numpy as np

    import keras_perf as kp

    steps = ctx.sizes["remat"]["steps"]
    for kind in REMAT_MODELS:
        for mode in REMAT_MODES:
            row_id = f"6/{kind}/remat={mode}"
            batch = ctx.sizes["remat"][kind]["batch"]
            case = f"{kind}, remat={mode}, batch {batch}"
            try:
                base, shape, label = _remat_model(ctx, kind)
                case = f"{label}, float32, remat={mode}, batch {batch}"
                model = kp.loss_scaled(base, remat=None if mode == "none" else mode)
                model.compile(
                    keras.optimizers.Adam(1e-3),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                )
                rng = np.random.default_rng(0)
                x = rng.standard_normal((batch, *shape), dtype="float32")
                y = rng.integers(0, 10, batch).astype("int32")
                peak, measure, step_s = _measure(ctx, model, x, y, steps)
                note = f"peak: {measure}"
                if ctx.limit:
                    note += f" = {peak / ctx.limit:.0%} of {_gib(ctx.limit)}"
                rows.append(
                    _row(
                        ctx,
                        row_id,
                        case,
                        examples_per_s=batch / step_s,
                        step_ms=1000 * step_s,
                        peak_memory_bytes=peak,
                        memory_measure=measure,
                        note=note,
                        batch=batch,
                    )
                )
            except Exception as exc:
                rows.append(_row(ctx, row_id, case, error=_error_text(exc), batch=batch))
            finally:
                base = model = x = y = None
                _free_memory()
    _oom_fixed_by_remat(ctx, rows)


def _oom_model(ctx):
    import keras

    o = ctx.sizes["remat"]["oom"]
    keras.utils.set_random_seed(0)
    layers = [keras.Input((o["inputs"],))]
    layers += [keras.layers.Dense(o["width"], activation="gelu") for _ in range(o["depth"])]
    return keras.Sequential(layers + [keras.layers.Dense(10)], name="deep")


def _oom_unless_remat():
    """Dry run: the backend's own OOM error at every step of a model without remat."""
    import keras

    import keras_perf as kp

    class OOMUnlessRemat(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if getattr(self.model, "remat", None) != "full":
                raise kp.backend.oom_error(
                    "Out of memory while trying to allocate 1GiB (injected: no remat)."
                )

    return OOMUnlessRemat()


def _oom_fixed_by_remat(ctx, rows: list) -> None:
    import numpy as np

    import keras_perf as kp

    o = ctx.sizes["remat"]["oom"]
    build, shape = (lambda: _oom_model(ctx)), (o["inputs"],)
    label = f"MLP {o['inputs']}-{o['depth']}x{o['width']} gelu"
    if ctx.dry:
        batch, why, callbacks = (
            o["batch"],
            "OOM injected unless remat (dry-run)",
            [_oom_unless_remat()],
        )
    elif ctx.backend == "jax":
        # XLA keeps fewer tensors of a gelu MLP than two per layer (the 2026-11-27 H100 run fit
        # the MLP below in the pool), so on JAX the row trains the Transformer of the rows
        # above, at a batch where XLA's own analysis of the plain step is `over` x the pool.
        def build():
            return _remat_model(ctx, "transformer")[0]

        _, shape, label = _remat_model(ctx, "transformer")
        per_example = o["jax_transformer_bytes_per_example"]
        batch = math.ceil(o["over"] * ctx.limit / per_example / 8) * 8
        why = (
            f"plain step needs about {_gib(per_example * batch)} by XLA's analysis "
            f"({_gib(per_example)} per example) > {_gib(ctx.limit)}"
        )
        callbacks = []
    else:
        # Two float32 tensors of batch x width saved per gelu Dense (its input, its pre-
        # activation): together about `over` x the device; remat keeps each layer's input only.
        per_example = 2 * 4 * o["width"] * o["depth"]
        batch = math.ceil(o["over"] * ctx.limit / per_example / 64) * 64
        why = f"plain step saves about {_gib(per_example * batch)} for backward > {_gib(ctx.limit)}"
        callbacks = []
    rng = np.random.default_rng(0)
    n = batch * o["steps"]
    x = rng.standard_normal((n, *shape), dtype="float32")
    y = rng.integers(0, 10, n).astype("int32")
    case = f"fit_with_oom_retry(strategies=('remat',)), {label} float32, batch {batch}"
    try:
        model = _compile(kp.loss_scaled(build()))
        initial = model.get_weights()
        t0 = time.perf_counter()
        h = kp.fit_with_oom_retry(
            model, x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
            strategies=("remat",), callbacks=callbacks,
        )  # fmt: skip
        t_retry = time.perf_counter() - t0
        events = h.oom_events
        setting = (h.model.remat, h.model.microbatches)
        weights = h.model.get_weights()
        model = h = None
        _free_memory()
        ref = _compile(kp.loss_scaled(build(), remat="full"))
        ref.set_weights(initial)
        t0 = time.perf_counter()
        ref.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        t_ref = time.perf_counter() - t0
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, ref.get_weights()))
        ref = None
        error = None
        if not events:
            error = f"no out-of-memory happened at batch {batch}: {why} was expected to fail"
        elif setting != ("full", 1):
            error = f"ended with (remat, microbatches) = {setting}, not ('full', 1)"
        elif diff > WEIGHT_TOLERANCE:
            error = f"weights differ from remat from the start by {diff:.2e}"
        note = (
            f"{why}; events {[e['strategy'] for e in events]}, batch kept at {batch}; weights "
            f"vs remat='full' from the start: max |diff| {diff:.1e}; time lost "
            f"{t_retry - t_ref:.1f} s (retry run {t_retry:.1f} s, reference {t_ref:.1f} s)"
        )
        rows.append(
            _row(
                ctx,
                "6/oom_fixed_by_remat",
                case,
                note=note,
                error=error,
                batch=batch,
                oom_events=events,
                max_weight_diff=diff,
                retry_s=t_retry,
                reference_s=t_ref,
                time_lost_s=t_retry - t_ref,
            )
        )
    except Exception as exc:
        rows.append(_row(ctx, "6/oom_fixed_by_remat", case, error=_error_text(exc), batch=batch))
    finally:
        x = y = None
        _free_memory()
