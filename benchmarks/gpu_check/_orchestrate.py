"""The parent process: one child process per backend (or per part), one table at the end."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .._harness import module_command
from ._config import BACKENDS, MICROBATCHES, SIZES, expected_ids
from ._table import add_ratios, table, title


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


# What to install where a backend's framework is missing (the CUDA builds; docs/gpu.md).
INSTALL = {"jax": 'pip install -U "jax[cuda12]"', "torch": "pip install torch"}


def backend_installed(backend: str) -> bool:
    """Whether `backend`'s framework is installed here (found, not imported: no start-up)."""
    return importlib.util.find_spec(backend) is not None


def installed_backends(backends: list[str]) -> tuple[list[str], list[str]]:
    """`backends` split into (installed, not installed), each saying so on stdout."""
    missing = [b for b in backends if not backend_installed(b)]
    for b in missing:
        print(f"gpu_check: {b} is not installed, so it is not run ({INSTALL[b]} to run it)")
    return [b for b in backends if b not in missing], missing


def run_child(
    backend: str, dry: bool, sections, timeout: float, microbatches=MICROBATCHES, batch=None
) -> dict:
    """Run a worker in a fresh process; its result, or error rows for what it owed."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        cmd, env = module_command(__package__, env)  # python -m benchmarks.gpu_check
        cmd += [
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
    backends, missing = installed_backends(_parse_backends(args.backends))
    if not backends:
        print(
            f"gpu_check: nothing to run: {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed",
            file=sys.stderr,
        )
        return 2
    sections = sorted({int(s) for s in args.sections.split(",")})
    t0 = time.perf_counter()
    result = {
        "mode": "dry-run" if dry else "gpu",
        "machine": _machine(),
        "devices": {},
        "seconds": {},
        "processes": {},
        "imported_optional": {},
        "not_installed": missing,
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
    """One table from the JSON of several runs (say one per backend, or some sections at a time)."""
    result = None
    for p in paths:
        part = json.loads(Path(p).read_text())
        if result is None:
            result = part
            continue
        for key in ("devices", "seconds", "processes", "imported_optional"):
            result[key].update(part.get(key, {}))
        result["rows"] += part["rows"]
        result["not_installed"] = result.get("not_installed", []) + part.get("not_installed", [])
        if part["mode"] != result["mode"]:
            result["mode"] = "mixed"
    # A backend missing from one run and measured by another was measured.
    missing = set(result.get("not_installed", [])) - set(result["devices"])
    result["not_installed"] = sorted(missing)
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
