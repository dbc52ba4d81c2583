"""What the GPU check runs: backends, sections, sizes (GPU and dry run), and the row ids."""

from __future__ import annotations

BACKENDS = ("jax", "torch")
SECTIONS = (1, 2, 3, 4, 5, 6, 7)
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
MICROBATCHES = (1, 2, 4, 8)
MODELS = ("mlp", "convnet")
DIAGNOSE_CASES = ("input", "host", "compute", "resnet50")
REMAT_MODELS = ("mlp", "transformer", "resnet50")
REMAT_MODES = ("none", "full")
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
        # kp.accelerate's data (batches of the section's batch size) and time budget
        "accelerate": {"batches": 8, "max_seconds": 30},
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
        "remat": {
            "mlp": {"inputs": 1024, "width": 4096, "depth": 16, "batch": 4096},
            "transformer": {"seq": 512, "d": 512, "heads": 8, "ff": 2048, "blocks": 4, "batch": 64},
            "resnet50": {"image": 64, "batch": 256},
            "steps": 3,
            # 64 gelu layers 1024 wide: plain saves 2 x 4 x 1024 x 64 bytes per example.
            "oom": {
                "inputs": 256,
                "width": 1024,
                "depth": 64,
                "over": 1.25,
                "steps": 2,
                # JAX trains the Transformer above instead: XLA's analysis of its plain step
                # on an H100 (2026-11-27), 9.40 GiB at batch 64 (weights and SGD state 0.1).
                "jax_transformer_bytes_per_example": 9.40 * 2**30 / 64,
            },
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
        "accelerate": {"batches": 4, "max_seconds": 1},
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
        "remat": {
            "mlp": {"inputs": 16, "width": 32, "depth": 4, "batch": 16},
            "transformer": {"seq": 8, "d": 16, "heads": 2, "ff": 32, "blocks": 1, "batch": 4},
            "resnet50": {"image": 16, "batch": 8},
            "steps": 1,
            "oom": {"inputs": 8, "width": 16, "depth": 3, "batch": 16, "steps": 2},
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
        elif s == 6:
            ids += [f"6/{m}/remat={r}" for m in REMAT_MODELS for r in REMAT_MODES]
            ids += ["6/oom_fixed_by_remat"]
        elif s == 7:
            ids += ["7/mlp/plain", "7/mlp/accelerate", "7/mlp/floor"]
            ids += ["7/convnet/bf16/plain", "7/convnet/bf16/accelerate"]
    return ids


# What each row is compared with: (baseline id, figure). Ratios are computed once all rows
# are in, because on JAX a row and its baseline can come from different processes.
def _baseline(row_id: str) -> tuple[str, str] | None:
    parts = row_id.split("/")
    if parts[0] == "1" and parts[2] != "float32":
        return f"1/{parts[1]}/float32", "examples_per_s"
    if parts[0] == "2" and parts[1] != "microbatches=1":
        return "2/microbatches=1", "step_ms"
    if parts[0] == "6" and parts[-1].startswith("remat=") and parts[-1] != "remat=none":
        return f"6/{parts[1]}/remat=none", "step_ms"
    if row_id == "4/distillation/DistillationModel":
        return "4/distillation/plain_student", "step_ms"
    if row_id == "4/pruning/PruningCallback":
        return "4/pruning/plain", "step_ms"
    if row_id == "7/mlp/accelerate":
        return "7/mlp/plain", "examples_per_s"
    if row_id == "7/mlp/floor":  # the bare framework's speed over fit's after accelerate
        return "7/mlp/accelerate", "examples_per_s"
    if row_id == "7/convnet/bf16/accelerate":
        return "7/convnet/bf16/plain", "examples_per_s"
    return None
