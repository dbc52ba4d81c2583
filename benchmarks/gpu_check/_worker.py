"""One child process's work: the sections asked for, on this process's backend."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ._accelerate import section_accelerate
from ._common import Context, _error_text, _free_memory, _row
from ._config import OPTIONAL, expected_ids
from ._diagnose import section_diagnose
from ._distill_prune import section_distill_prune
from ._microbatch import section_memory
from ._oom import section_oom
from ._precision import section_mixed_precision
from ._remat import section_remat

SECTION_RUNNERS = {
    1: section_mixed_precision,
    3: section_oom,
    4: section_distill_prune,
    5: section_diagnose,
    6: section_remat,
    7: section_accelerate,
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
