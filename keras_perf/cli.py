"""The `keras-perf` command: `doctor`, `demo` and `bench`."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import sys

BACKENDS = ("tensorflow", "jax", "torch")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _table(rows: list[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GiB"


def doctor(args: argparse.Namespace) -> int:
    """Print the environment keras-perf sees, as readable tables."""
    import keras

    import keras_perf as kp

    tfmot = _version("tensorflow-model-optimization")
    if tfmot != "not installed":
        tf_keras = _version("tf-keras")
        tfmot += (
            f" (its pruning API needs legacy tf_keras: tf-keras {tf_keras}; keras-perf's "
            "pruning works on Keras 3 directly)"
        )
    env_rows = [
        ("python", platform.python_version()),
        ("platform", platform.platform(terse=True)),
        ("keras-perf", kp.__version__),
        ("keras", keras.__version__),
        ("backend", keras.backend.backend()),
        ("tensorflow", _version("tensorflow")),
        ("jax", _version("jax")),
        ("torch", _version("torch")),
        ("tensorflow-model-optimization", tfmot),
        ("global dtype policy", keras.mixed_precision.global_policy().name),
        ("policy 'auto' would pick", kp.mixed_precision.auto_policy()),
    ]
    print(_table(env_rows, "keras-perf doctor"))
    print()
    dev_rows = []
    for d in kp.device_report():
        cc = d["compute_capability"]
        cc = f"cc {cc[0]}.{cc[1]}" if cc else ""
        dev_rows.append((d["kind"], f"{d['name']}  memory {_fmt_bytes(d['memory_bytes'])}  {cc}".rstrip()))
    print(_table(dev_rows, "devices"))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _with_backend(args: argparse.Namespace, argv: list[str]) -> int | None:
    """Re-run this command under `--backend` when it differs from the current one.

    The backend is fixed when Keras is first imported, so a different one needs a fresh
    process; returns its exit code, or None when no switch is needed.
    """
    import os
    import subprocess

    current = os.environ.get("KERAS_BACKEND", "tensorflow")
    if args.backend is None or args.backend == current:
        return None
    env = dict(os.environ, KERAS_BACKEND=args.backend)
    return subprocess.call([sys.executable, "-m", "keras_perf.cli", *argv], env=env)


def demo(args: argparse.Namespace) -> int:
    """Run the whole pipeline on the bundled digits data (see keras_perf/demo.py)."""
    switched = _with_backend(args, args.argv)
    if switched is not None:
        return switched
    from keras_perf import demo as demo_module

    demo_module.run(out=args.out, epochs=args.epochs)
    return 0


def bench(args: argparse.Namespace) -> int:
    """Run benchmarks/bench_*.py and print one table (see keras_perf/bench.py)."""
    from keras_perf import bench as bench_module

    return bench_module.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-perf",
        description="Faster, smaller, harder-to-break Keras 3 training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{doctor,demo,bench}")
    p = sub.add_parser("doctor", help="environment, backend, devices, mixed-precision support")
    p.set_defaults(func=doctor)
    p = sub.add_parser("demo", help="the whole pipeline on bundled real data, report and plots")
    p.add_argument("--out", default="keras-perf-demo", help="output folder (default: %(default)s)")
    p.add_argument("--epochs", type=_positive_int, default=30,
                   help="epochs per training stage (default: %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="Keras backend (default: KERAS_BACKEND, else tensorflow)")
    p.set_defaults(func=demo)
    p = sub.add_parser("bench", help="overhead and speed of every piece against plain Keras")
    p.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run, < 2 min)")
    p.add_argument("--backends", default=None,
                   help="comma-separated backends to run each script under (default: current)")
    p.add_argument("--only", default=None, help="comma-separated substrings of script names")
    p.add_argument("--dir", default=None, help="benchmarks folder (default: ./benchmarks)")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="also write the table as Markdown to PATH")
    p.set_defaults(func=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
