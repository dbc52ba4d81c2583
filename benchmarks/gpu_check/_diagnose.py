"""Section 5: `kp.diagnose` on the device, its top what-if beside real fits, its own time."""

from __future__ import annotations

import time

from ._common import _compile, _error_text, _free_memory, _row, _sce, convnet, mlp
from ._config import DIAGNOSE_CASES


def section_diagnose(ctx, rows: list) -> None:
    import keras
    import numpy as np

    import keras_perf as kp

    from .._diagnose_cases import Augmented, Sleepy, real_speedup

    s = ctx.sizes["diagnose"]
    rng = np.random.default_rng(0)
    x = rng.random((1437, 64), dtype="float32")  # digits' shape (no scikit-learn here)
    y = rng.integers(0, 10, 1437).astype("int32")
    inputs, widths = s["wide"]
    xw = rng.standard_normal((s["compute_rows"], inputs), dtype="float32")
    yw = rng.integers(0, 10, s["compute_rows"]).astype("int32")
    c = ctx.sizes["convnet"]
    images = rng.integers(0, 256, (s["pool"], c["image"], c["image"], 3), dtype="uint8")
    labels = rng.integers(0, c["classes"], s["pool"]).astype("int32")

    def small():
        keras.utils.set_random_seed(0)
        model = mlp(64, (32,), 10)
        model.compile(keras.optimizers.Adam(1e-3), _sce())
        return model

    def wide():
        keras.utils.set_random_seed(0)
        return _compile(mlp(inputs, widths, 10))

    def resnet():
        keras.utils.set_random_seed(0)
        return _compile(convnet(ctx)[0])

    wide_name = f"MLP {inputs}-{'-'.join(map(str, widths))}-10, SGD, batch 512"
    cases = {
        "input": (
            f"PyDataset sleeping {1000 * s['sleep']:.0f} ms per batch of 16, MLP 64-32-10",
            "input",
            small,
            {"x": Sleepy(x, y, s["batches"], sleep=s["sleep"])},
            s["max_seconds"],
        ),
        "host": (
            "MLP 64-32-10 at batch 8, arrays of digits' shape",
            "host",
            small,
            {"x": x, "y": y, "batch_size": 8},
            s["max_seconds"],
        ),
        "compute": (
            wide_name,
            "compute",
            wide,
            {"x": xw, "y": yw, "batch_size": 512},
            s["max_seconds"],
        ),
        "resnet50": (
            f"{convnet(ctx)[1]}, PyDataset flipping uint8 images in NumPy, batch "
            f"{s['resnet_batch']}",
            None,
            resnet,
            {"x": Augmented(images, labels, s["resnet_batches"], s["resnet_batch"])},
            s["resnet_max_seconds"],
        ),
    }
    for case in DIAGNOSE_CASES:
        label, on_cpu, make, data, max_seconds = cases[case]
        row_id = f"5/{case}"
        try:
            model = make()
            t0 = time.perf_counter()
            d = kp.diagnose(model, steps=s["steps"], max_seconds=max_seconds, **data)
            cost = time.perf_counter() - t0
            print(d, flush=True)
            shares = ", ".join(f"{k} {v:.2f}" for k, v in d.shares.items())
            note = f"verdict {d.bottleneck} ({shares})"
            if on_cpu is not None:
                note += f"; on a CPU: {on_cpu}"
            note += f"; diagnose {cost:.1f} s of {max_seconds} s + set-up {d.trace_seconds:.1f} s"
            fields = {
                "bottleneck": d.bottleneck,
                "shares": d.shares,
                "what_if": d.what_if,
                "diagnose_s": cost,
                "max_seconds": max_seconds,
                "trace_s": d.trace_seconds,
                "peak_memory_bytes": d.peak_memory_bytes,
            }
            if d.what_if:
                top = d.what_if[0]
                model = None
                _free_memory()
                real, ratios = real_speedup(top["change"], make, data, s["repeats"], s["epochs"])
                note += (
                    f"; top: {top['change']}, predicted {top['speedup']:.2f}x, real "
                    f"{real:.2f}x ({s['epochs']}-epoch fits, {s['repeats']} repeats)"
                )
                fields.update(
                    top=top["change"],
                    predicted=top["speedup"],
                    real=real,
                    real_spread=[min(ratios), max(ratios)],
                    ratio=top["speedup"] / real,
                    ratio_of="predicted_over_real",
                )
            rows.append(
                _row(
                    ctx,
                    row_id,
                    label,
                    examples_per_s=d.examples_per_s,
                    step_ms=1000 * d.seconds_per_step["together"],
                    note=note,
                    **fields,
                )
            )
        except Exception as exc:  # one case failing leaves the others to run
            rows.append(_row(ctx, row_id, label, error=_error_text(exc)))
        finally:
            model = None
            _free_memory()
