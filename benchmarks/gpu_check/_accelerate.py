"""Section 7: `kp.accelerate` on the device, against plain `fit` and the bare framework.

The MLP (section 1's sizes, Adam): plain `fit`, `fit` after
`kp.accelerate`, and the bare floor (`benchmarks._floors.raw_step`: `jax.jit`, or torch eager
and under `torch.compile`, the faster of the two, on the device). ResNet50 under
`mixed_bfloat16`: plain `fit` and `fit` after `kp.accelerate` (where Keras' eager torch ran at
16 % of the float32 peak on an H100 and bfloat16 bought nothing). Each accelerated row's note
says what accelerate chose and its `r.speedup`; the ratios are against the plain row (and the
floor's against the accelerated one: how far `fit` after accelerate is from the framework).
"""

from __future__ import annotations

import time

import numpy as np

from ._common import (
    _batches,
    _error_text,
    _free_memory,
    _num,
    _row,
    _sce,
    convnet,
    mlp,
    timed_row,
)


def _adam(model):
    import keras

    model.compile(keras.optimizers.Adam(1e-3), _sce())
    return model


def _accelerated(ctx, model, data):
    """`model` after `kp.accelerate` on its first batches, and a note on what it chose."""
    import keras_perf as kp

    a = ctx.sizes["accelerate"]
    x, y = data[0]
    xs = np.concatenate([x] * a["batches"])  # the same batch again: only speed is measured
    ys = np.concatenate([y] * a["batches"])
    r = kp.accelerate(model, xs, ys, batch_size=len(x), max_seconds=a["max_seconds"])
    chosen = r.chosen or "nothing (the model's own settings)"
    return f"accelerate chose {chosen}, applied {r.applied}; r.speedup {r.speedup:.2f}x"


def _floor(ctx, s, data) -> tuple[float, str]:
    """Examples/s of the bare framework's MLP step on this device (faster of eager and
    compiled on torch), and a note."""
    import keras

    from benchmarks._floors import raw_step

    x, y = data[0]
    sizes = (s["inputs"], *([s["width"]] * s["depth"]), s["classes"])
    backend = keras.backend.backend()
    if backend == "torch":
        device = "cuda" if ctx.gpu else None
        runs = {
            "eager": raw_step(x, y, sizes=sizes, device=device),
            "torch.compile": raw_step(x, y, sizes=sizes, device=device, compiled=True),
        }
    else:
        runs = {"jax.jit": raw_step(x, y, sizes=sizes)}
    speeds = {}
    for name, run in runs.items():
        t0 = time.perf_counter()
        for _ in range(ctx.sizes["steps"]):
            run()
        speeds[name] = len(x) * ctx.sizes["steps"] / (time.perf_counter() - t0)
    best = max(speeds, key=speeds.get)
    note = "; ".join(f"{k} {_num(v)} ex/s" for k, v in speeds.items())
    return speeds[best], f"bare {backend} ({best} the faster): {note}"


def section_accelerate(ctx, rows: list) -> None:
    import keras

    steps = ctx.sizes["steps"]
    s = ctx.sizes["mlp"]
    mlp_data = _batches((s["inputs"],), s["classes"], s["batch"])
    label = f"MLP {s['inputs']}-{s['depth']}x{s['width']}-{s['classes']}, Adam, batch {s['batch']}"

    def fit_row(row_id, case, make, data, accelerate, policy="float32"):
        def build():
            model = make()
            note = _accelerated(ctx, model, data) if accelerate else "plain Keras fit"
            return model, [], lambda m: note

        keras.mixed_precision.set_global_policy(policy)
        try:
            timed_row(ctx, rows, row_id, case, build, data, steps)
        finally:
            keras.mixed_precision.set_global_policy("float32")

    def make_mlp():
        keras.utils.set_random_seed(0)
        return _adam(mlp(s["inputs"], [s["width"]] * s["depth"], s["classes"]))

    fit_row("7/mlp/plain", label, make_mlp, mlp_data, accelerate=False)
    fit_row("7/mlp/accelerate", label + ", after kp.accelerate", make_mlp, mlp_data, True)
    try:
        speed, note = _floor(ctx, s, mlp_data)
        rows.append(
            _row(
                ctx,
                "7/mlp/floor",
                label + ", bare framework",
                examples_per_s=speed,
                step_ms=1000 * s["batch"] / speed,
                note=note,
            )  # fmt: skip
        )
    except Exception as exc:
        rows.append(_row(ctx, "7/mlp/floor", label + ", bare framework", error=_error_text(exc)))
    finally:
        _free_memory()

    c = ctx.sizes["convnet"]
    conv_data = _batches((c["image"], c["image"], 3), c["classes"], c["batch"])

    def make_convnet():
        keras.utils.set_random_seed(0)
        return _adam(convnet(ctx)[0])

    name = "ResNet50 224x224" if not ctx.dry else f"tiny CNN {c['image']}x{c['image']}"
    case = f"{name}, mixed_bfloat16, Adam, batch {c['batch']}"
    fit_row("7/convnet/bf16/plain", case, make_convnet, conv_data, False, "mixed_bfloat16")
    fit_row(
        "7/convnet/bf16/accelerate",
        case + ", after kp.accelerate",
        make_convnet,
        conv_data,
        True,
        "mixed_bfloat16",
    )
