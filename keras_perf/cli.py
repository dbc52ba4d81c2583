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


def _not_yet(name: str):
    def run(args: argparse.Namespace) -> int:
        print(f"keras-perf {name}: not available yet in this version.")
        return 0

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-perf",
        description="Faster, smaller, harder-to-break Keras 3 training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{doctor,demo,bench}")
    p = sub.add_parser("doctor", help="environment, backend, devices, mixed-precision support")
    p.set_defaults(func=doctor)
    p = sub.add_parser("demo", help="the whole pipeline on bundled real data, report and plots")
    p.set_defaults(func=_not_yet("demo"))
    p = sub.add_parser("bench", help="overhead and speed of every piece against plain Keras")
    p.set_defaults(func=_not_yet("bench"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
