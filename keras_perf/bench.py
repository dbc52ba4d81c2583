"""`keras-perf bench`: run every `benchmarks.bench_*` module and print one table.

Each module measures one claim as a ratio against plain Keras (ABBA, median of repeats; see
benchmarks/_harness.py) and writes its rows as JSON; this runner starts each one in its own
process (`python -m benchmarks.bench_x`: a fresh backend, no state carried between claims),
collects the rows and prints them with the target beside each figure. `--quick` (fewer repeats
and steps) runs the modules one after another in a single process instead, which saves one
backend import per module (about 8 s each for TensorFlow on 2 cores). `--smoke` runs them the
same way on their tiniest sizes, once: it proves every script runs and writes its rows (CI's
check), and its figures are not the claims'. The benchmarks
live in the repository, not in the installed package: run from a checkout, or point `--dir` at
its `benchmarks/` folder; without one the command says so in one line and exits with code 2.

`--gpu` runs the `benchmarks.gpu_check` package instead (the GPU claims, on JAX and torch;
`--dry-run` runs it on the CPU with tiny sizes). See docs/gpu.md.
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

# A checkout keeps the benchmarks beside the keras_perf package; a pip install has none there.
CHECKOUT_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
NOT_INSTALLED = (
    "the benchmarks are not installed with the package, they live in the keras-perf "
    "repository: clone it and run `keras-perf bench` from its root (or pass --dir "
    "PATH/TO/keras-perf/benchmarks)"
)


def find_benchmarks(directory: str | None = None) -> Path:
    """The benchmarks folder: `directory`, else `./benchmarks`, else the checkout's own.

    Raises FileNotFoundError, with a one-line message that says what to do, where there is none.
    """
    if directory is None:
        for c in (Path.cwd() / "benchmarks", CHECKOUT_BENCHMARKS):
            if c.is_dir() and any(c.glob("bench_*.py")):
                return c.resolve()
        raise FileNotFoundError(NOT_INSTALLED)
    folder = Path(directory).resolve()
    if not (folder.is_dir() and any(folder.glob("bench_*.py"))):
        raise FileNotFoundError(f"--dir {directory}: no bench_*.py modules in {folder}")
    if not folder.name.isidentifier():
        raise FileNotFoundError(
            f"--dir {directory}: the folder's name must be a Python identifier, since its "
            f"modules run as `python -m {folder.name}.bench_x`"
        )
    return folder


def module_name(script: Path) -> str:
    """`benchmarks/bench_x.py` -> `benchmarks.bench_x` (run with the folder's parent as cwd)."""
    return f"{script.parent.name}.{script.stem}"


def _child_env(backend: str, root: Path) -> dict:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    return env


def run_script(script: Path, backend: str, quick: bool, timeout: float) -> dict:
    """Run one benchmark module (`python -m`, from the folder's parent); returns
    {"script", "backend", "rows", "seconds", "error"}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", module_name(script), "--json", str(out)]
        cmd += ["--quick"] if quick else []
        root = script.parent.parent
        env = _child_env(backend, root)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout
            )
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


# Runs in the child process of a quick run (started in the folder's parent): every module in
# turn, in this one interpreter. Markers on stdout tell the parent when one starts and ends.
_DRIVER = r"""
import json, resource, runpy, sys, time, traceback
jobs, flag = json.loads(sys.argv[1]), sys.argv[2]
def cpu():
    return sum(
        u.ru_utime + u.ru_stime
        for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )
for job in jobs:
    print("@@start " + job["script"], flush=True)
    sys.argv = [job["script"], flag, "--json", job["json"]]
    t0, c0, error = time.perf_counter(), cpu(), None
    try:
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            error = f"exit {e.code}"
    except BaseException as e:
        error = " | ".join(traceback.format_exception_only(type(e), e)).strip()[-500:]
    done = {"seconds": time.perf_counter() - t0, "cpu_seconds": cpu() - c0, "error": error}
    print("@@done " + json.dumps(done), flush=True)
"""


# The whole `--quick` run, all scripts in one process. Past it, the script running and those
# after it are reported as failed. On a 2-core machine shared with other test runs the 14
# scripts took 610 s on TensorFlow (2026-11-26), past the 600 s this was before.
QUICK_BUDGET_S = 900
# The whole `--smoke` run: a guard against a hang, not a time limit (about 5 minutes of CPU on
# TensorFlow since issue 42's trim, 7 before, docs/development.md; 8 of the 16 scripts took
# 600 s under load 8-10 before it).
SMOKE_BUDGET_S = 1800


def run_in_one_process(
    scripts: list[Path],
    backend: str,
    timeout: float,
    on_start: Callable[[Path], None],
    on_done: Callable[[dict], None],
    flag: str = "--quick",
) -> list[dict]:
    """Run `scripts` with `flag` (`--quick` or `--smoke`) one after another in one child
    process (see `_DRIVER`).

    `on_start(script)` is called when a script starts and `on_done(result)` when it ends, with
    the dict `run_script` returns (and `cpu_seconds`: the process's and its children's CPU
    time). A script that fails or raises gets an `error`; a timeout (for the whole batch)
    fails the script then running and those after it.
    """
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [
            {"script": str(s), "module": module_name(s), "json": str(Path(tmp) / f"{s.stem}.json")}
            for s in scripts
        ]
        root = scripts[0].parent.parent
        env = _child_env(backend, root)
        cmd = [sys.executable, "-c", _DRIVER, json.dumps(jobs), flag]
        t0 = time.perf_counter()
        current = None
        tail: list[str] = []
        # Its own process group: the watchdog kills the scripts' children too (bench_remat
        # re-runs itself in a child), which would otherwise hold the pipe open and keep this
        # loop waiting after the driver was killed.
        with subprocess.Popen(
            cmd,
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        ) as proc:
            # A watchdog, not a check per line: a script that hangs prints nothing.
            watchdog = threading.Timer(timeout, _kill_group, (proc,))
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
                            "cpu_seconds": done["cpu_seconds"],
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


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill `proc` and every process of its group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError, AttributeError):
        proc.kill()


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
    """The command line of `keras-perf bench --gpu`: `python -m benchmarks.gpu_check` and its
    flags (run from the folder's parent)."""
    cmd = [sys.executable, "-m", f"{folder.name}.gpu_check"]
    cmd += ["--dry-run"] if args.dry_run else []
    cmd += ["--backends", args.backends or "jax,torch"]
    for flag in ("json", "markdown"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    return cmd


def run_gpu_check(args, folder: Path) -> int:
    """`keras-perf bench --gpu`: run the `benchmarks.gpu_check` package (it starts its own
    processes, one backend at a time, and prints one table); returns its exit code."""
    if args.quick or getattr(args, "smoke", False) or args.only:
        print(
            "keras-perf bench: --quick, --smoke and --only do not apply to --gpu (use --dry-run for "
            "a smoke run; `python -m benchmarks.gpu_check --sections 1,3` runs some "
            "sections)",
            file=sys.stderr,
        )
        return 2
    if not (folder / "gpu_check" / "__main__.py").is_file():
        print(f"keras-perf bench: no gpu_check package in {folder}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder.parent), env.get("PYTHONPATH")) if p)
    # Relative --json / --markdown paths name files in the caller's folder, not the child's.
    for flag in ("json", "markdown"):
        if getattr(args, flag):
            setattr(args, flag, os.path.abspath(getattr(args, flag)))
    return subprocess.call(gpu_command(args, folder), env=env, cwd=folder.parent)


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

    smoke = getattr(args, "smoke", False)
    mode = "smoke" if smoke else "quick" if args.quick else None

    def announce(script: Path, backend: str) -> None:
        print(f"running {script.name} ({backend}{f', {mode}' if mode else ''}) ...", flush=True)

    def report(res: dict) -> None:
        cpu = f" ({res['cpu_seconds']:.0f} s CPU)" if res.get("cpu_seconds") is not None else ""
        print(
            f"  {len(res['rows'])} rows in {res['seconds']:.0f} s{cpu}"
            + (f"; FAILED: {res['error']}" if res["error"] else ""),
            flush=True,
        )
        results.append(res)

    for backend in backends:
        if mode:
            run_in_one_process(
                scripts,
                backend,
                SMOKE_BUDGET_S if smoke else QUICK_BUDGET_S,
                lambda s, b=backend: announce(s, b),
                report,
                flag=f"--{mode}",
            )
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
            + (f" --{mode}" if mode else "")
            + (f" --backends {args.backends}" if args.backends else "")
        )
        Path(args.markdown).write_text(
            f"Command: `{cmd}`\n\nMachine: {machine()}\n\n{table(results, markdown=True)}\n"
        )
        print(f"Markdown table written to {args.markdown}")
    return 1 if any(r["error"] for r in results) else 0


def _current_backend() -> str:
    return os.environ.get("KERAS_BACKEND", "tensorflow")
