"""GPU check: every GPU claim of keras-perf on the CUDA device present, on JAX and on torch.

Six sections, each backend in child processes with KERAS_BACKEND set (TensorFlow is not
needed: Keras plus JAX or torch is enough; a backend that is not installed is not run, and the
output says so):

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
6. Gradient checkpointing (`kp.loss_scaled(model, remat="full")` vs none) on a deep MLP
   (16 x 4096 gelu), a Transformer encoder (seq 512, d 512, 4 blocks) and ResNet50 at 64 x 64:
   the peak memory of one step from `kp.backend.step_memory` (torch: the CUDA allocator's peak;
   JAX: XLA's memory analysis of the step compiled for the GPU) and the step time; then a real
   out-of-memory that `kp.fit_with_oom_retry(strategies=("remat",))` fixes without changing
   the batch (a 64-layer gelu MLP whose plain step saves about 1.25 x the device's memory).

`--dry-run` runs the same code on the CPU with tiny models (a small CNN instead of ResNet50,
an injected OOM as in tests/test_oom.py, since a CPU never runs out of memory, diagnose with a
3-second budget), in a few minutes on a small CPU: it shows that every row is produced, and
its figures are not measurements. Without a GPU and without `--dry-run` the check stops at
once with a message. A failing section (or case) is reported in its row and the others still
run; the JSON keeps every row.

Run from the repository root (docs/gpu.md has the steps for a fresh GPU machine):

    python -m benchmarks.gpu_check [--dry-run] [--backends jax,torch] [--sections 1,2,3,4,5,6]
        [--json out.json] [--markdown table.md]
    python -m benchmarks.gpu_check --merge jax.json torch.json   # one table from split runs
    keras-perf bench --gpu [--dry-run] [--json out.json]

`--backends` defaults to KERAS_BACKEND when it is jax or torch, else to both.

Modules: `_config` (sizes, row ids), `_common` (what the sections share), one module per
section (`_precision`, `_microbatch`, `_oom`, `_distill_prune`, `_diagnose`, `_remat`), `_worker` (one
child process's sections), `_orchestrate` (the child processes, per backend) and `_table`.
"""

from __future__ import annotations

import argparse

from ._common import _row
from ._config import (
    DIAGNOSE_CASES,
    MICROBATCHES,
    POLICIES,
    SECTIONS,
    expected_ids,
)
from ._orchestrate import _parse_backends, merge, orchestrate, run_child
from ._table import add_ratios, table
from ._worker import SECTION_RUNNERS, worker

__all__ = [
    "DIAGNOSE_CASES",
    "MICROBATCHES",
    "POLICIES",
    "SECTIONS",
    "SECTION_RUNNERS",
    "_parse_backends",
    "_row",
    "add_ratios",
    "build_parser",
    "expected_ids",
    "main",
    "run_child",
    "table",
    "worker",
]

_SECTIONS_WANTED = f"expected numbers from {min(SECTIONS)} to {max(SECTIONS)}"


def _sections(text: str) -> str:
    try:
        values = {int(s) for s in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(_SECTIONS_WANTED + f", got {text!r}") from None
    if not values or not values <= set(SECTIONS):
        raise argparse.ArgumentTypeError(_SECTIONS_WANTED + f", got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the whole check on the CPU with tiny sizes (a smoke run, minutes)",
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
        default=",".join(map(str, SECTIONS)),
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
