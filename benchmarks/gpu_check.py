"""GPU check: every GPU claim of keras-perf on the CUDA device present, on JAX and on torch.

Four sections, each backend in child processes with KERAS_BACKEND set (TensorFlow is not
needed: Keras plus JAX or torch is enough):

1. Mixed precision: float32 vs mixed_float16 vs mixed_bfloat16 with our train step
   (`kp.loss_scaled`), examples/s of a matmul-bound MLP (4 x 8192 wide) and of ResNet50 at
   224 x 224 (`keras.applications.ResNet50(weights=None)`), the speed-up over float32, and
   `kp.TrainingMonitor`'s MFU beside a hand count of the FLOPs (MLP: 6 x params per example;
   ResNet50: 4.1 GMACs forward, x 2 FLOPs, x 3 for training) over `kp.peak_flops_for_device`.
2. Micro-batching memory: peak device memory from the backend's own allocator (torch
   `max_memory_allocated`, reset per setting; JAX `peak_bytes_in_use`, which cannot be reset,
   so each setting runs in its own process) and step time of ResNet50 at microbatches 1, 2,
   4, 8, at a batch that fills about 80 % of the device (from the per-example bytes measured
   at two small batches).
3. A real out-of-memory: a batch whose widest activation alone is 1.25 x the device memory;
   `kp.fit_with_oom_retry` recovers, its final weights equal a run that used the final
   micro-batch count from the start (float32, max |difference| <= 1e-5), the events and the
   time lost are reported; then `kp.find_max_microbatch` on the same batch.
4. Per-step cost of `kp.DistillationModel` vs plain `fit` of the student, and of
   `kp.PruningCallback` vs plain `fit` of the same model.
5. `kp.diagnose` on the device: its verdict on the three CPU cases of `bench_diagnose.py`
   (a `PyDataset` sleeping 20 ms per batch, a 64-32-10 MLP at batch 8, a 512-2048-2048-10 MLP
   with SGD at batch 512; synthetic data of digits' shape) and on ResNet50 at 224 x 224 fed by
   a `PyDataset` that flips and scales uint8 images in NumPy; its top what-if's predicted
   speed-up beside that of real 3-epoch fits with the change (alternated, 3 repeats, median);
   and its own time against `max_seconds`. On JAX it runs in a process of its own (JAX's peak
   memory cannot be reset, and the other sections' peaks would stand in for this model's).

`--dry-run` runs the same code on the CPU with tiny models (a small CNN instead of ResNet50,
an injected OOM as in tests/test_oom.py, since a CPU never runs out of memory, diagnose with a
3-second budget), in seconds:
it shows that every row is produced, and its figures are not measurements. Without a GPU and
without `--dry-run` the script stops at once with a message. A failing section (or case) is
reported in its row and the others still run; the JSON keeps every row.

Run (docs/gpu.md has the steps for a fresh GPU machine):

    python benchmarks/gpu_check.py [--dry-run] [--backends jax,torch] [--sections 1,2,3,4,5]
        [--json out.json] [--markdown table.md]
    python benchmarks/gpu_check.py --merge jax.json torch.json   # one table from split runs
    keras-perf bench --gpu [--dry-run] [--json out.json]

`--backends` defaults to KERAS_BACKEND when it is jax or torch, else to both.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BACKENDS = ("jax", "torch")
SECTIONS = (1, 2, 3, 4, 5)
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
MICROBATCHES = (1, 2, 4, 8)
MODELS = ("mlp", "convnet")
DIAGNOSE_CASES = ("input", "host", "compute", "resnet50")
# Never needed here: a worker reports any of these it finds imported.
OPTIONAL = ("tensorflow", "tf_keras", "tensorflow_model_optimization", "sklearn", "matplotlib")
RESNET50_MACS = 4.1e9  # forward multiply-adds at 224 x 224 (He et al. 2016, table 1: 3.8-4.1 G)
DRY_PEAK_FLOPS = 1e12  # nominal peak for the dry run, so that the MFU path runs on a CPU
WEIGHT_TOLERANCE = 1e-5

SIZES = {
    "gpu": {
        "mlp": {"inputs": 1024, "width": 8192, "depth": 4, "classes": 1000, "batch": 2048},
        "convnet": {"image": 224, "classes": 1000, "batch": 128},
        "steps": 30,  # per epoch; epoch 1 compiles, epoch 2 is measured
        "memory": {"probe_batch": 16, "fill": 0.8, "max_batch": 2048, "steps": 3},
        "oom": {"inputs": 64, "width": 32768, "over": 1.25, "steps": 2},
        "distill": {
            "inputs": 1024,
            "student": (2048, 2048),
            "teacher": (8192, 8192),
            "batch": 1024,
        },
        "prune": {"inputs": 1024, "widths": (4096, 4096), "batch": 1024, "frequency": 10},
        "child_groups": [[1], [2], [4], [8]],  # JAX: one process per micro-batch setting
        "diagnose": {
            "steps": 30,
            "max_seconds": 30,
            "resnet_max_seconds": 60,  # XLA's retraces of ResNet50 come out of the budget
            "sleep": 0.02,
            "batches": 60,
            "wide": (512, (2048, 2048)),
            "compute_rows": 8192,
            "resnet_batch": 64,
            "resnet_batches": 20,
            "pool": 64,
            "repeats": 3,
            "epochs": 3,
        },
    },
    "dry": {
        "mlp": {"inputs": 32, "width": 64, "depth": 2, "classes": 10, "batch": 32},
        "convnet": {"image": 32, "classes": 10, "batch": 16},
        "steps": 3,
        "memory": {"probe_batch": 4, "fill": 0.8, "max_batch": 8, "steps": 2, "batch": 8},
        "oom": {"inputs": 8, "width": 16, "batch": 32, "threshold": 8, "steps": 2},
        "distill": {"inputs": 16, "student": (16,), "teacher": (32, 32), "batch": 32},
        "prune": {"inputs": 16, "widths": (32, 32), "batch": 32, "frequency": 2},
        # Two processes, not four: the child path runs, in seconds (no device peak on a CPU).
        "child_groups": [[1], [2, 4, 8]],
        "diagnose": {
            "steps": 6,
            "max_seconds": 3,
            "resnet_max_seconds": 3,
            "sleep": 0.005,
            "batches": 12,
            "wide": (64, (128, 128)),
            "compute_rows": 2048,
            "resnet_batch": 8,
            "resnet_batches": 6,
            "pool": 16,
            "repeats": 1,
            "epochs": 1,
        },
    },
}


def expected_ids(sections=SECTIONS, microbatches=MICROBATCHES) -> list[str]:
    """The row ids a run of `sections` produces, in table order (no Keras needed)."""
    ids = []
    for s in sections:
        if s == 1:
            ids += [f"1/{m}/{p}" for m in MODELS for p in POLICIES]
        elif s == 2:
            ids += [f"2/microbatches={k}" for k in microbatches]
        elif s == 3:
            ids += ["3/oom_retry", "3/find_max_microbatch"]
        elif s == 4:
            ids += [
                "4/distillation/plain_student",
                "4/distillation/DistillationModel",
                "4/pruning/plain",
                "4/pruning/PruningCallback",
            ]
        elif s == 5:
            ids += [f"5/{case}" for case in DIAGNOSE_CASES]
    return ids


# What each row is compared with: (baseline id, figure). Ratios are computed once all rows
# are in, because on JAX a row and its baseline can come from different processes.
def _baseline(row_id: str) -> tuple[str, str] | None:
    parts = row_id.split("/")
    if parts[0] == "1" and parts[2] != "float32":
        return f"1/{parts[1]}/float32", "examples_per_s"
    if parts[0] == "2" and parts[1] != "microbatches=1":
        return "2/microbatches=1", "step_ms"
    if row_id == "4/distillation/DistillationModel":
        return "4/distillation/plain_student", "step_ms"
    if row_id == "4/pruning/PruningCallback":
        return "4/pruning/plain", "step_ms"
    return None


# --------------------------------------------------------------------------- worker side
# Everything below up to the orchestrator runs in a child process with KERAS_BACKEND set.


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


# ---------------------------------------------------------------- section 1: precision
def section_mixed_precision(ctx, rows: list) -> None:
    import keras

    import keras_perf as kp

    steps = ctx.sizes["steps"]
    for kind in MODELS:
        for policy in POLICIES:
            row_id = f"1/{kind}/{policy}"
            try:
                keras.mixed_precision.set_global_policy(policy)
                if kind == "mlp":
                    s = ctx.sizes["mlp"]
                    base = mlp(s["inputs"], [s["width"]] * s["depth"], s["classes"])
                    hand = 6.0 * base.count_params()
                    label = f"MLP {s['inputs']}-{s['depth']}x{s['width']}-{s['classes']}"
                    hand_how = "6 x params"
                    data = _batches((s["inputs"],), s["classes"], s["batch"])
                else:
                    s = ctx.sizes["convnet"]
                    base, label, hand = convnet(ctx)
                    hand_how = "3 x 2 x 4.1 GMACs" if not ctx.dry else "3 x 2 x MACs by hand"
                    data = _batches((s["image"], s["image"], 3), s["classes"], s["batch"])
                model = _compile(kp.loss_scaled(base))
                compute = keras.mixed_precision.global_policy().compute_dtype
                peak = ctx.peak_flops(compute)
                r = timed_fit(
                    ctx, model, data, steps, peak_flops=DRY_PEAK_FLOPS if ctx.dry else None
                )
                monitor_flops = kp.estimate_flops_per_example(model)
                mfu_hand = hand * r["examples_per_s"] / peak if peak else None
                note = (
                    f"FLOPs/example: monitor {_num(monitor_flops)}, hand {_num(hand)} "
                    f"({hand_how}); peak {_num(peak)} FLOP/s ({compute})"
                )
                if ctx.dry:
                    note += " [nominal]"
                if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
                    note += "; loss scaled"
                rows.append(
                    _row(
                        ctx,
                        row_id,
                        f"{label}, {policy}, batch {s['batch']}",
                        examples_per_s=r["examples_per_s"],
                        step_ms=r["step_ms"],
                        mfu_monitor=r["mfu"],
                        mfu_hand=mfu_hand,
                        note=note,
                        flops_monitor=monitor_flops,
                        flops_hand=hand,
                        peak_flops=peak,
                        batch=s["batch"],
                    )
                )
            except Exception as exc:  # one case failing leaves the others to run
                rows.append(_row(ctx, row_id, f"{kind}, {policy}", error=_error_text(exc)))
            finally:
                base = model = data = None
                _free_memory()


# ------------------------------------------------------------- section 2: micro-batching
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


# ---------------------------------------------------------------- section 3: real OOM
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
        h = kp.fit_with_oom_retry(model, x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
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


# ------------------------------------------------------- section 4: distillation, pruning
def section_distill_prune(ctx, rows: list) -> None:
    import keras

    import keras_perf as kp

    steps = ctx.sizes["steps"]
    d = ctx.sizes["distill"]
    data = _batches((d["inputs"],), 10, d["batch"])
    student_shape = f"MLP {d['inputs']}-{'-'.join(map(str, d['student']))}-10"
    teacher_shape = f"{d['inputs']}-{'-'.join(map(str, d['teacher']))}-10"

    def per_step(row_id, case, data, make, note=""):
        try:
            model, cbs, extra = make()
            r = timed_fit(ctx, model, data, steps, callbacks=cbs)
            rows.append(
                _row(
                    ctx,
                    row_id,
                    case,
                    examples_per_s=r["examples_per_s"],
                    step_ms=r["step_ms"],
                    note=(note + extra(model)).strip("; "),
                )
            )
        except Exception as exc:
            rows.append(_row(ctx, row_id, case, error=_error_text(exc)))
        finally:
            _free_memory()

    def plain_student():
        s = mlp(d["inputs"], d["student"], 10, name="student")
        s.compile(keras.optimizers.Adam(1e-3), _sce())
        return s, [], lambda m: ""

    def distiller():
        teacher = mlp(d["inputs"], d["teacher"], 10, name="teacher")
        student = mlp(d["inputs"], d["student"], 10, name="student")
        model = kp.DistillationModel(student, teacher, temperature=3.0, alpha=0.7)
        model.compile(optimizer=keras.optimizers.Adam(1e-3))
        return model, [], lambda m: ""

    per_step(
        "4/distillation/plain_student",
        f"plain fit of the student {student_shape}, batch {d['batch']}",
        data,
        plain_student,
    )
    per_step(
        "4/distillation/DistillationModel",
        f"DistillationModel, teacher {teacher_shape}, batch {d['batch']}",
        data,
        distiller,
        note="includes the frozen teacher's forward pass",
    )

    p = ctx.sizes["prune"]
    data = _batches((p["inputs"],), 10, p["batch"])
    shape = f"MLP {p['inputs']}-{'-'.join(map(str, p['widths']))}-10, batch {p['batch']}"

    def plain():
        model = mlp(p["inputs"], p["widths"], 10)
        model.compile(keras.optimizers.Adam(1e-3), _sce())
        return model, [], lambda m: ""

    def pruned():
        model = mlp(p["inputs"], p["widths"], 10)
        model.compile(keras.optimizers.Adam(1e-3), _sce())
        cb = kp.PruningCallback(kp.ConstantSparsity(0.8, begin_step=0, frequency=p["frequency"]))
        return model, [cb], lambda m: f"; sparsity reached {cb.sparsity:.2f}"

    per_step("4/pruning/plain", f"plain fit, {shape}", data, plain)
    per_step(
        "4/pruning/PruningCallback",
        f"PruningCallback, {shape}",
        data,
        pruned,
        note=f"ConstantSparsity 0.8, masks updated every {p['frequency']} steps",
    )


# ------------------------------------------------------------------ section 5: diagnose
def section_diagnose(ctx, rows: list) -> None:
    import keras
    import numpy as np

    import keras_perf as kp

    sys.path.insert(0, str(HERE))
    from _diagnose_cases import Augmented, Sleepy, real_speedup

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


SECTION_RUNNERS = {
    1: section_mixed_precision,
    3: section_oom,
    4: section_distill_prune,
    5: section_diagnose,
}


def worker(args) -> int:
    """Run `args.sections` on this process's backend; write {"info", "rows"} to args.json."""
    out = Path(args.json)
    sections = [int(s) for s in args.sections.split(",")]
    microbatches = [int(k) for k in args.microbatches.split(",")]
    want = expected_ids(sections, microbatches)
    result = {"info": None, "rows": [], "imported_optional": []}

    def save():
        result["imported_optional"] = [n for n in OPTIONAL if sys.modules.get(n) is not None]
        out.write_text(json.dumps(result, indent=1, default=str))

    ctx = Context(args.dry_run)
    result["info"] = ctx.info()
    if not args.dry_run and ctx.gpu is None:
        why = (
            f"{ctx.backend} sees no GPU (its devices: "
            f"{[d['name'] for d in _list_devices()]}); install its CUDA build (docs/gpu.md)"
        )
        result["rows"] = [_row(ctx, i, i, error=why) for i in want]
        save()
        return 0
    for section in sections:
        before = len(result["rows"])
        rows = result["rows"]
        print(f"[{ctx.backend}] section {section} ...", flush=True)
        t0 = time.perf_counter()
        try:
            if section == 2:
                section_memory(ctx, rows, microbatches, args.batch)
            else:
                SECTION_RUNNERS[section](ctx, rows)
        except Exception as exc:  # a section-wide failure: its missing rows say why
            error = _error_text(exc)
            have = {r["id"] for r in rows}
            rows += [
                _row(ctx, i, i, error=error)
                for i in expected_ids([section], microbatches)
                if i not in have
            ]
            _free_memory()
        print(
            f"[{ctx.backend}] section {section}: {len(rows) - before} rows in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        save()
    return 0


def _list_devices():
    import keras_perf as kp

    return kp.backend.list_devices()


# ------------------------------------------------------------------------ orchestrator
def cuda_present() -> bool:
    """Whether this machine has an NVIDIA GPU, without importing any framework."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return listed.returncode == 0 and "GPU " in listed.stdout


def run_child(
    backend: str, dry: bool, sections, timeout: float, microbatches=MICROBATCHES, batch=None
) -> dict:
    """Run a worker in a fresh process; its result, or error rows for what it owed."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--json",
            str(out),
            "--sections",
            ",".join(map(str, sections)),
            "--microbatches",
            ",".join(map(str, microbatches)),
        ]
        cmd += ["--dry-run"] if dry else []
        cmd += ["--batch", str(batch)] if batch else []
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if dry:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is a CPU run, GPU or not
            env["JAX_PLATFORMS"] = "cpu"
        tail: list[str] = []
        t0 = time.perf_counter()
        error = None
        with subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            import threading

            timer = threading.Timer(timeout, proc.kill)
            timer.start()
            for line in proc.stdout:
                print(
                    f"  {line.rstrip()}"
                    if line.startswith("[")
                    else f"  [{backend}] {line.rstrip()}",
                    flush=True,
                )
                tail = (tail + [line.strip()])[-5:]
            proc.wait()
            timed_out = not timer.is_alive() and time.perf_counter() - t0 >= timeout
            timer.cancel()
        result = None
        if out.exists():
            try:
                result = json.loads(out.read_text())
            except ValueError:
                result = None
        if timed_out:
            error = f"timed out after {timeout:.0f} s"
        elif proc.returncode != 0:
            error = f"the {backend} process exited ({proc.returncode}): " + " | ".join(tail)
        if result is None:
            result = {"info": None, "rows": [], "imported_optional": []}
            error = error or "the worker wrote no rows: " + " | ".join(tail)
        have = {r["id"] for r in result["rows"]}
        for i in expected_ids(sections, microbatches):
            if i not in have:
                result["rows"].append(
                    {
                        "id": i,
                        "section": int(i[0]),
                        "backend": backend,
                        "case": i,
                        "error": error or "row missing",
                        "dry_run": dry,
                        "note": "",
                    }
                )
        result["seconds"] = time.perf_counter() - t0
        return result


def run_backend(backend: str, dry: bool, sections, timeout: float, on_part=None) -> dict:
    """Every section on one backend. On JAX each micro-batch group, and section 5, gets its own
    process (JAX cannot reset its peak memory, which both read), and no process holds the
    device while another runs."""
    sizes = SIZES["dry" if dry else "gpu"]
    parts = []
    alone = (2, 5) if backend == "jax" else ()
    if 2 in alone and 2 in sections:
        batch = None
        for group in sizes["child_groups"]:
            res = run_child(backend, dry, [2], timeout, microbatches=group, batch=batch)
            batch = batch or next((r.get("batch") for r in res["rows"] if r.get("batch")), None)
            parts.append(res)
            if on_part:
                on_part([r for p in parts for r in p["rows"]])
    rest = [s for s in sections if s not in alone]
    if rest:
        parts.append(run_child(backend, dry, rest, timeout))
    if 5 in alone and 5 in sections:
        parts.append(run_child(backend, dry, [5], timeout))
    rows = [r for p in parts for r in p["rows"]]
    order = {i: n for n, i in enumerate(expected_ids(sections))}
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    return {
        "info": next((p["info"] for p in parts if p["info"]), None),
        "rows": rows,
        "imported_optional": sorted({n for p in parts for n in p["imported_optional"]}),
        "processes": len(parts),
        "seconds": sum(p["seconds"] for p in parts),
    }


def add_ratios(rows: list[dict]) -> None:
    """Each row's figure over its baseline's (see `_baseline`), where both are known."""
    by_key = {(r["backend"], r["id"]): r for r in rows}
    for r in rows:
        spec = _baseline(r["id"])
        r.setdefault("ratio", None)
        if spec is None:
            continue
        base = by_key.get((r["backend"], spec[0]))
        if base and r.get(spec[1]) and base.get(spec[1]):
            r["ratio"] = r[spec[1]] / base[spec[1]]
            r["ratio_of"] = spec[1]
            r["baseline"] = spec[0]


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or abs(v) >= 1e4:
        return f"{v:.3g}" if abs(v) >= 1e4 else str(v)
    return f"{v:.3g}"


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"


HEAD = [
    "section",
    "backend",
    "case",
    "examples/s",
    "ms/step",
    "vs baseline",
    "peak memory",
    "MFU monitor",
    "MFU hand",
    "note",
]
SECTION_NAMES = {
    1: "1 mixed precision",
    2: "2 micro-batch memory",
    3: "3 OOM recovery",
    4: "4 distill / prune",
    5: "5 diagnose",
}
RATIO_WORDS = {
    "examples_per_s": "x speed",
    "step_ms": "x time",
    "predicted_over_real": " predicted/real",
}


def table(rows: list[dict]) -> str:
    """The rows as one Markdown table."""
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for r in rows:
        note = ("dry-run; " if r.get("dry_run") else "") + (r.get("note") or "")
        if r.get("error"):
            note = ("dry-run; " if r.get("dry_run") else "") + "ERROR: " + r["error"]
        ratio = r.get("ratio")
        ratio = "-" if ratio is None else f"{ratio:.2f}{RATIO_WORDS[r['ratio_of']]}"
        mfu = [("-" if r.get(k) is None else f"{r[k]:.1%}") for k in ("mfu_monitor", "mfu_hand")]
        cells = [
            SECTION_NAMES.get(r["section"], str(r["section"])),
            r["backend"],
            r["case"],
            _num(r.get("examples_per_s")),
            _num(r.get("step_ms")),
            ratio,
            _gib(r.get("peak_memory_bytes")),
            *mfu,
            note.strip("; "),
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def title(result: dict) -> str:
    devices = "; ".join(
        f"{b}: {i['device']} ({_gib(i['memory_limit_bytes'])} usable), "
        + ", ".join(f"{k} {v}" for k, v in i["versions"].items())
        for b, i in result["devices"].items()
        if i
    )
    mode = (
        "DRY RUN on the CPU, tiny sizes: every row runs, the figures are not measurements"
        if result["mode"] == "dry-run"
        else "GPU run"
    )
    return (
        f"keras-perf GPU check ({mode})\n\nDevice: {devices or 'unknown'}\n\n"
        f"Machine: {result['machine']}\n"
    )


def orchestrate(args) -> int:
    dry = args.dry_run
    if not dry and not cuda_present():
        print(
            "gpu_check: no NVIDIA GPU on this machine (no /dev/nvidia* device, or "
            "CUDA_VISIBLE_DEVICES hides them). Run with --dry-run for the CPU smoke run of "
            "the whole script, or see docs/gpu.md to run it on a GPU machine.",
            file=sys.stderr,
        )
        return 2
    backends = _parse_backends(args.backends)
    sections = sorted({int(s) for s in args.sections.split(",")})
    t0 = time.perf_counter()
    result = {
        "mode": "dry-run" if dry else "gpu",
        "machine": _machine(),
        "devices": {},
        "seconds": {},
        "processes": {},
        "imported_optional": {},
        "rows": [],
    }
    for backend in backends:
        print(f"{backend}: sections {sections}{' (dry-run)' if dry else ''} ...", flush=True)

        def save_partial(rows):
            if args.json:  # a run stopped later keeps what it measured
                _write(args.json, dict(result, rows=result["rows"] + rows))

        res = run_backend(backend, dry, sections, args.timeout, on_part=save_partial)
        result["devices"][backend] = res["info"]
        result["seconds"][backend] = res["seconds"]
        result["processes"][backend] = res["processes"]
        result["imported_optional"][backend] = res["imported_optional"]
        result["rows"] += res["rows"]
        print(
            f"{backend}: done in {res['seconds']:.1f} s ({res['processes']} processes)", flush=True
        )
        if args.json:  # after each backend: a run stopped later keeps what it measured
            _write(args.json, result)
    result["total_s"] = time.perf_counter() - t0
    return report(result, args)


def report(result: dict, args) -> int:
    add_ratios(result["rows"])
    text = title(result) + "\n" + table(result["rows"])
    print()
    print(text)
    seconds = ", ".join(f"{b} {s:.0f} s" for b, s in result["seconds"].items())
    print(f"\n{seconds}")
    if args.json:
        _write(args.json, result)
        print(f"JSON written to {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
        print(f"Markdown table written to {args.markdown}")
    return 1 if any(r.get("error") for r in result["rows"]) else 0


def merge(paths: list[str], args) -> int:
    """One table from the JSON of several runs (say one per backend on a time-limited box)."""
    result = None
    for p in paths:
        part = json.loads(Path(p).read_text())
        if result is None:
            result = part
            continue
        for key in ("devices", "seconds", "processes", "imported_optional"):
            result[key].update(part.get(key, {}))
        result["rows"] += part["rows"]
        if part["mode"] != result["mode"]:
            result["mode"] = "mixed"
    return report(result, args)


def _write(path, result) -> None:
    Path(path).write_text(json.dumps(result, indent=1, default=str))


def _machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{platform.platform(terse=True)}, Python {platform.python_version()}"
    )


def _parse_backends(text: str | None) -> list[str]:
    if text is None:
        current = os.environ.get("KERAS_BACKEND")
        return [current] if current in BACKENDS else list(BACKENDS)
    backends = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise SystemExit(
            f"gpu_check: --backends takes jax and/or torch (the GPU check does not "
            f"run on TensorFlow), got {text!r}"
        )
    return backends


def _sections(text: str) -> str:
    try:
        values = {int(s) for s in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers from 1 to 5, got {text!r}") from None
    if not values or not values <= set(SECTIONS):
        raise argparse.ArgumentTypeError(f"expected numbers from 1 to 5, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the whole script on the CPU with tiny sizes (a smoke run, seconds)",
    )
    p.add_argument(
        "--backends",
        default=None,
        help="jax and/or torch, comma-separated (default: KERAS_BACKEND if it is "
        "one of them, else both)",
    )
    p.add_argument(
        "--sections",
        type=_sections,
        default="1,2,3,4,5",
        help="which sections to run (default: %(default)s)",
    )
    p.add_argument("--json", metavar="PATH", help="write every row and the devices as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the table to PATH")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per child process (default: 300 dry-run, 1800 on a GPU)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="print one table from the JSON files of earlier runs; runs nothing",
    )
    # Internal: one child process's work.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--microbatches", default=",".join(map(str, MICROBATCHES)), help=argparse.SUPPRESS
    )
    p.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.timeout is None:
        args.timeout = 300.0 if args.dry_run else 1800.0
    if args.worker:
        return worker(args)
    if args.merge:
        return merge(args.merge, args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
