"""Worker-side helpers shared by the sections: the context, rows, models, data, timed fits.

Everything here runs in a child process with KERAS_BACKEND set; frameworks are imported
inside the functions, so that the orchestrator never imports one.
"""

from __future__ import annotations

import sys
import traceback

from ._config import DRY_PEAK_FLOPS, RESNET50_MACS, SIZES


class Context:
    """What a worker knows: sizes, backend, device, peak FLOP/s."""

    def __init__(self, dry: bool):
        import keras

        import keras_perf as kp

        self.dry = dry
        self.sizes = SIZES["dry" if dry else "gpu"]
        self.backend = keras.backend.backend()
        gpus = [d for d in kp.backend.list_devices() if d["kind"] == "GPU"]
        self.gpu = gpus[0] if gpus else None
        self.device = self.gpu["name"] if self.gpu else "CPU"
        self.limit = self.gpu["memory_bytes"] if self.gpu else None

    def peak_flops(self, dtype: str) -> float | None:
        import keras_perf as kp

        if self.dry:
            return DRY_PEAK_FLOPS
        return kp.peak_flops_for_device(self.device, dtype)

    def info(self) -> dict:
        import keras

        versions = {"keras": keras.__version__}
        framework = sys.modules.get(self.backend)
        versions[self.backend] = getattr(framework, "__version__", "?")
        return {
            "backend": self.backend,
            "device": self.device,
            "memory_limit_bytes": self.limit,
            "peak_flops_float32": self.peak_flops("float32"),
            "peak_flops_16bit": self.peak_flops("bfloat16"),
            "versions": versions,
        }


def _row(ctx, row_id: str, case: str, **fields) -> dict:
    row = {
        "id": row_id,
        "section": int(row_id[0]),
        "backend": ctx.backend,
        "case": case,
        "examples_per_s": None,
        "step_ms": None,
        "peak_memory_bytes": None,
        "mfu_monitor": None,
        "mfu_hand": None,
        "note": "",
        "error": None,
        "dry_run": ctx.dry,
    }
    row.update(fields)
    return row


def _error_text(exc: BaseException) -> str:
    text = " ".join(traceback.format_exception_only(type(exc), exc)).strip()
    return " ".join(text.split())[:400]


def _free_memory() -> None:
    import keras

    import keras_perf as kp

    keras.mixed_precision.set_global_policy("float32")
    keras.backend.clear_session()
    kp.backend.clear_memory()


def cycle(batches: list, steps: int):
    """A `keras.utils.PyDataset` of `steps` batches cycling over a few fixed ones: little
    host memory, no data preparation in the timed steps."""
    import keras

    class _Cycle(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()

        def __len__(self):
            return steps

        def __getitem__(self, i):
            return batches[i % len(batches)]

    return _Cycle()


def _batches(shape, classes: int, batch: int, n: int = 2, seed: int = 0) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((batch, *shape), dtype="float32"),
            rng.integers(0, classes, batch).astype("int32"),
        )
        for _ in range(n)
    ]


def mlp(inputs: int, widths, classes: int, activation="relu", name="mlp"):
    import keras

    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(w, activation=activation) for w in widths]
    return keras.Sequential(layers + [keras.layers.Dense(classes)], name=name)


def convnet(ctx):
    """ResNet50 (GPU) or a tiny CNN (dry run), logits out, and its hand-counted FLOPs."""
    import keras

    s = ctx.sizes["convnet"]
    if not ctx.dry:
        model = keras.applications.ResNet50(
            weights=None,
            input_shape=(s["image"], s["image"], 3),
            classes=s["classes"],
            classifier_activation=None,
        )
        return model, "ResNet50 224x224", 3 * 2 * RESNET50_MACS
    n = s["image"]
    model = keras.Sequential(
        [
            keras.Input((n, n, 3)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(s["classes"]),
        ],
        name="tiny_cnn",
    )
    # Multiply-adds per example, by hand: two 3x3 convolutions at their output sizes and the
    # classifier. Training = 3 x forward, forward FLOPs = 2 x MACs.
    macs = n * n * 3 * 3 * 3 * 16 + (n // 2) ** 2 * 3 * 3 * 16 * 32 + 32 * s["classes"]
    return model, f"tiny CNN {n}x{n}", 3 * 2 * macs


def _sce():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compile(model, lr=0.01):
    import keras

    model.compile(keras.optimizers.SGD(lr, momentum=0.9), _sce())
    return model


def timed_fit(ctx, model, data, steps: int, callbacks=(), peak_flops=None) -> dict:
    """Two epochs of `fit` with a `kp.TrainingMonitor`; the second epoch's figures."""
    import keras_perf as kp

    mon = kp.TrainingMonitor(peak_flops=peak_flops)
    model.fit(cycle(data, steps), epochs=2, verbose=0, callbacks=[mon, *callbacks])
    rec = mon.history[-1]
    batch = int(data[0][0].shape[0])
    step_s = rec["epoch_time_s"] / rec["steps"]
    return {
        "examples_per_s": batch / step_s,
        "step_ms": 1000 * step_s,
        "mfu": rec.get("mfu"),
        "monitor_examples_per_s": rec.get("examples_per_s"),
    }


def timed_row(ctx, rows: list, row_id: str, case: str, make, data, steps: int) -> None:
    """One row of `timed_fit`: `make()` returns (model, callbacks, note), `note(model)` read
    after the fit; any failure becomes the row's error (one case failing leaves the others)."""
    try:
        model, callbacks, note = make()
        r = timed_fit(ctx, model, data, steps, callbacks=callbacks)
        rows.append(
            _row(
                ctx,
                row_id,
                case,
                examples_per_s=r["examples_per_s"],
                step_ms=r["step_ms"],
                note=note(model),
            )  # fmt: skip
        )
    except Exception as exc:
        rows.append(_row(ctx, row_id, case, error=_error_text(exc)))
    finally:
        _free_memory()


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or abs(v) >= 1e4:
        return f"{v:.3g}" if abs(v) >= 1e4 else str(v)
    return f"{v:.3g}"


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"
