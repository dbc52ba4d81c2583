"""`keras-perf bench`: run every `benchmarks/bench_*.py` script and print one table.

Each script measures one claim as a ratio against plain Keras (ABBA, median of repeats; see
benchmarks/_harness.py) and writes its rows as JSON; this runner starts each script in its own
process (a fresh backend, no state carried between claims), collects the rows and prints them
with the target beside each figure. `--quick` (a smoke run: fewer repeats and steps) runs the
scripts one after another in a single process instead, which saves one backend import per
script (about 8 s each for TensorFlow on 2 cores). The scripts live in the source tree, not in the installed
package: run from a checkout, or point `--dir` at a `benchmarks/` folder.

`--gpu` runs `benchmarks/gpu_check.py` instead (the GPU claims, on JAX and torch; `--dry-run`
runs it on the CPU with tiny sizes). See docs/gpu.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path


def find_benchmarks(directory: str | None = None) -> Path:
    """The benchmarks folder: `directory`, else `./benchmarks`, else the checkout's own."""
    candidates = (
        [Path(directory)]
        if directory
        else [
            Path.cwd() / "benchmarks",
            Path(__file__).resolve().parent.parent / "benchmarks",
        ]
    )
    for c in candidates:
        if c.is_dir() and any(c.glob("bench_*.py")):
            return c
    where = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"No benchmarks/bench_*.py scripts found (looked in {where}). The benchmark scripts "
        "ship with the source checkout: run `keras-perf bench` from the repository root or "
        "pass `--dir PATH/TO/benchmarks`."
    )


def run_script(script: Path, backend: str, quick: bool, timeout: float) -> dict:
    """Run one benchmark script; returns {"script", "backend", "rows", "seconds", "error"}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(script), "--json", str(out)] + (["--quick"] if quick else [])
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        root = str(script.parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return _failed(script, backend, t0, f"timed out after {timeout:.0f} s")
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return _failed(script, backend, t0, f"exit {proc.returncode}: " + " | ".join(tail))
        rows = json.loads(out.read_text())["rows"]
    return {
        "script": script.name,
        "backend": backend,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "error": None,
    }


# Runs in the child process of a quick run: every script in turn, in this one interpreter.
# Markers on stdout tell the parent when a script starts and ends.
_DRIVER = r"""
import json, os, runpy, sys, time, traceback
jobs = json.loads(sys.argv[1])
sys.path.insert(0, os.path.dirname(jobs[0]["script"]))
for job in jobs:
    print("@@start " + job["script"], flush=True)
    sys.argv = [job["script"], "--quick", "--json", job["json"]]
    t0, error = time.perf_counter(), None
    try:
        runpy.run_path(job["script"], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            error = f"exit {e.code}"
    except BaseException as e:
        error = " | ".join(traceback.format_exception_only(type(e), e)).strip()[-500:]
    print("@@done " + json.dumps({"seconds": time.perf_counter() - t0, "error": error}), flush=True)
"""


def run_in_one_process(
    scripts: list[Path],
    backend: str,
    timeout: float,
    on_start: Callable[[Path], None],
    on_done: Callable[[dict], None],
) -> list[dict]:
    """Run `scripts` with `--quick` one after another in one child process (see `_DRIVER`).

    `on_start(script)` is called when a script starts and `on_done(result)` when it ends, with
    the dict `run_script` returns. A script that fails or raises gets an `error`; a timeout
    (for the whole batch) fails the script then running and those after it.
    """
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [{"script": str(s), "json": str(Path(tmp) / f"{s.stem}.json")} for s in scripts]
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        root = str(scripts[0].parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-c", _DRIVER, json.dumps(jobs)]
        t0 = time.perf_counter()
        current = None
        tail: list[str] = []
        with subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            # A watchdog, not a check per line: a script that hangs prints nothing.
            watchdog = threading.Timer(timeout, proc.kill)
            watchdog.start()
            for line in proc.stdout:
                if line.startswith("@@start "):
                    current = Path(line[8:].strip())
                    on_start(current)
                    tail = []
                elif line.startswith("@@done ") and current is not None:
                    done = json.loads(line[7:])
                    job = jobs[len(results)]
                    rows, error = [], done["error"]
                    if error is None:
                        try:
                            rows = json.loads(Path(job["json"]).read_text())["rows"]
                        except (OSError, ValueError, KeyError) as e:
                            error = f"no rows written ({e})"
                    if error:
                        error += "".join(f" | {t}" for t in tail[-3:])
                    results.append(
                        {
                            "script": current.name,
                            "backend": backend,
                            "rows": rows,
                            "seconds": done["seconds"],
                            "error": error,
                        }
                    )
                    on_done(results[-1])
                    current = None
                else:
                    tail.append(line.rstrip())
            proc.wait()
            timed_out = not watchdog.is_alive() and time.perf_counter() - t0 >= timeout
            watchdog.cancel()
        for s in scripts[len(results) :]:
            why = (
                f"timed out after {timeout:.0f} s"
                if timed_out
                else f"the benchmark process exited ({proc.returncode}): " + " | ".join(tail[-3:])
            )
            results.append(_failed(s, backend, time.perf_counter(), why))
            on_done(results[-1])
    return results


def _failed(script, backend, t0, error):
    return {
        "script": script.name,
        "backend": backend,
        "rows": [],
        "seconds": time.perf_counter() - t0,
        "error": error,
    }


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _spread(r: dict) -> str:
    parts = []
    for key in ("wall_spread", "cpu_spread"):
        s = r.get(key) or []
        if len(s) == 2:
            parts.append(f"{key.split('_')[0]} {s[0]:.2f}-{s[1]:.2f}")
    return ", ".join(parts)


def table(results: list[dict], markdown: bool = False) -> str:
    """The rows of every script as one table (plain text or Markdown)."""
    head = ["claim", "backend", "wall ratio", "CPU ratio", "target", "spread", "n", "note"]
    body = []
    for res in results:
        if res["error"]:
            body.append(
                [res["script"], res["backend"], "FAILED", "", "", "", "", res["error"][:200]]
            )
        for r in res["rows"]:
            body.append(
                [
                    r["claim"],
                    r["backend"],
                    _fmt(r["wall_ratio"]),
                    _fmt(r.get("cpu_ratio")),
                    r["target"],
                    _spread(r),
                    _fmt(r.get("repeats")),
                    r.get("note", ""),
                ]
            )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(out)


def machine() -> str:
    import keras

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{platform.platform(terse=True)}, Python {platform.python_version()}, "
        f"Keras {keras.__version__}"
    )


def gpu_command(args, folder: Path) -> list[str]:
    """The command line of `keras-perf bench --gpu`: benchmarks/gpu_check.py and its flags."""
    cmd = [sys.executable, str(folder / "gpu_check.py")]
    cmd += ["--dry-run"] if args.dry_run else []
    cmd += ["--backends", args.backends or "jax,torch"]
    for flag in ("json", "markdown"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    return cmd


def run_gpu_check(args, folder: Path) -> int:
    """`keras-perf bench --gpu`: run benchmarks/gpu_check.py (it starts its own processes, one
    backend at a time, and prints one table); returns its exit code."""
    if args.quick or args.only:
        print(
            "keras-perf bench: --quick and --only do not apply to --gpu (use --dry-run for "
            "a smoke run; `python benchmarks/gpu_check.py --sections 1,3` runs some "
            "sections)",
            file=sys.stderr,
        )
        return 2
    if not (folder / "gpu_check.py").is_file():
        print(f"keras-perf bench: no gpu_check.py in {folder}", file=sys.stderr)
        return 2
    return subprocess.call(gpu_command(args, folder))


def main(args) -> int:
    """Entry point for `keras-perf bench` (args from the CLI parser)."""
    gpu = getattr(args, "gpu", False)
    if not gpu and (getattr(args, "dry_run", False) or getattr(args, "json", None)):
        print("keras-perf bench: --dry-run and --json go with --gpu", file=sys.stderr)
        return 2
    try:
        folder = find_benchmarks(args.dir)
    except FileNotFoundError as e:
        print(f"keras-perf bench: {e}", file=sys.stderr)
        return 2
    if gpu:
        return run_gpu_check(args, folder)
    scripts = sorted(folder.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if any(o in s.name for o in args.only.split(","))]
        if not scripts:
            print(f"keras-perf bench: no script matches --only {args.only!r}", file=sys.stderr)
            return 2
    backends = args.backends.split(",") if args.backends else [_current_backend()]
    unknown = [b for b in backends if b not in ("tensorflow", "jax", "torch")]
    if unknown:
        print(
            f"keras-perf bench: unknown backend(s) {unknown} in --backends; "
            "use tensorflow, jax and/or torch",
            file=sys.stderr,
        )
        return 2
    results = []
    t0 = time.perf_counter()

    def announce(script: Path, backend: str) -> None:
        print(f"running {script.name} ({backend}{', quick' if args.quick else ''}) ...", flush=True)

    def report(res: dict) -> None:
        print(
            f"  {len(res['rows'])} rows in {res['seconds']:.0f} s"
            + (f"; FAILED: {res['error']}" if res["error"] else ""),
            flush=True,
        )
        results.append(res)

    for backend in backends:
        if args.quick:
            run_in_one_process(scripts, backend, 600, lambda s, b=backend: announce(s, b), report)
            continue
        for script in scripts:
            announce(script, backend)
            report(run_script(script, backend, False, 3600))
    total = time.perf_counter() - t0
    print()
    print(table(results))
    print(f"\n{machine()}; {total:.0f} s in all")
    if args.markdown:
        cmd = (
            "keras-perf bench"
            + (" --quick" if args.quick else "")
            + (f" --backends {args.backends}" if args.backends else "")
        )
        Path(args.markdown).write_text(
            f"Command: `{cmd}`\n\nMachine: {machine()}\n\n{table(results, markdown=True)}\n"
        )
        print(f"Markdown table written to {args.markdown}")
    return 1 if any(r["error"] for r in results) else 0


def _current_backend() -> str:
    return os.environ.get("KERAS_BACKEND", "tensorflow")
