"""The `keras-perf` command: `doctor`, `demo`, `bench` and `diagnose`.

Arguments are parsed before Keras is imported, so `--help` and argument errors answer at once
(`import keras_perf` imports no Keras: see keras_perf/__init__.py). Unless
`--verbose` is given, the command hides the native (C++) log lines TensorFlow and XLA print on
import and device start-up ("oneDNN custom operations are on", "failed call to cuInit", ...):
it sets `TF_CPP_MIN_LOG_LEVEL=3` where the user has not set it, and, because TensorFlow 2.19+
logs some of these lines through absl before reading that variable
(tensorflow/tensorflow#100442), it filters its own stderr for lines in the absl/glog format.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import re
import sys
import threading

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


# A native log line: absl/glog ("E0000 00:00:1795556460.69 11036 cuda_platform.cc:52] ..."),
# TensorFlow's older format ("2025-09-17 14:44:05.157831: I tensorflow/.../x.cc:32] ..."),
# absl's notice that logging started before it was initialised, the TFLite runtime's
# information lines ("INFO: Created TensorFlow Lite XNNPACK delegate for CPU.") and the TFLite
# quantizer's settings line ("fully_quantize: 0, inference_type: 6, ...").
NATIVE_LOG_LINE = re.compile(
    rb"^(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w./+-]+:\d+\] "
    rb"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] [\w./+-]+:\d+\] "
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    rb"|INFO: "
    rb"|fully_quantize: \d+, inference_type: )"
)


def quiet_native_logs(verbose: bool, environ=os.environ) -> dict:
    """Ask TensorFlow for errors only, unless `verbose` or the user chose a level.

    Must run before TensorFlow is imported. Returns the variables it set.
    """
    if verbose or "TF_CPP_MIN_LOG_LEVEL" in environ:
        return {}
    environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return {"TF_CPP_MIN_LOG_LEVEL": "3"}


class NativeLogFilter:
    """Drop native log lines (`NATIVE_LOG_LINE`) written to file descriptor 2.

    File descriptor 2 becomes a pipe; a thread copies every other line to the real stderr.
    Python's own `sys.stderr` goes through it too, so warnings and tracebacks still show.
    Use as a context manager; `stop()` restores file descriptor 2.
    """

    def __init__(self):
        self._saved = None
        self._thread = None

    def start(self) -> NativeLogFilter:
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._thread = threading.Thread(
            target=self._copy, args=(read_fd, self._saved), daemon=True, name="native-log-filter"
        )
        self._thread.start()
        return self

    @staticmethod
    def _copy(read_fd: int, out_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            for line in pipe:
                if not NATIVE_LOG_LINE.match(line):
                    os.write(out_fd, line)

    def stop(self) -> None:
        if self._saved is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # closes our end of the pipe; the thread reads to its end
        # A child process still holding the pipe would keep it open: do not wait forever.
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            os.close(self._saved)
        self._saved = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


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
        ("policy 'auto' would pick", kp.precision_report()["policy"]),
    ]
    print(_table(env_rows, "keras-perf doctor"))
    print()
    dev_rows = []
    for d in kp.device_report():
        cc = d["compute_capability"]
        cc = f"cc {cc[0]}.{cc[1]}" if cc else ""
        dev_rows.append(
            (d["kind"], f"{d['name']}  memory {_fmt_bytes(d['memory_bytes'])}  {cc}".rstrip())
        )
    print(_table(dev_rows, "devices"))
    print()
    print(kp.precision_report())
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _nearest_existing(path):
    """The path itself if it exists, else its closest existing parent."""
    import os

    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _writable_dir(text: str) -> str:
    """An output folder that exists and is writable, or can be created (checked, not made)."""
    import os

    found = _nearest_existing(text)
    if found == os.path.abspath(text) and not os.path.isdir(found):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    if not os.path.isdir(found):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {found!r} is a file")
    if not os.access(found, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {found!r} is not writable")
    return text


def _writable_file(text: str) -> str:
    """An output file whose folder exists (or can be created) and is writable."""
    import os

    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    _writable_dir(os.path.dirname(os.path.abspath(text)))
    return text


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
    return subprocess.call([sys.executable, "-m", "keras_perf", *argv], env=env)


def demo(args: argparse.Namespace) -> int:
    """Every lever against its baseline on the bundled digits data (see keras_perf/demo/)."""
    switched = _with_backend(args, args.argv)
    if switched is not None:
        return switched
    demo_module = importlib.import_module("keras_perf.demo")
    demo_module.run(out=args.out, epochs=args.epochs, quick=args.quick)
    return 0


def bench(args: argparse.Namespace) -> int:
    """Run the benchmarks.bench_* modules and print one table (see keras_perf/bench.py)."""
    bench_module = importlib.import_module("keras_perf.bench")  # needs no Keras to start
    return bench_module.main(args)


def diagnose(args: argparse.Namespace) -> int:
    """Diagnose a saved model's training speed on synthetic inputs of its shape."""
    import json

    import keras  # noqa: F401  (importing Keras registers keras-perf's classes)

    import keras_perf as kp

    # Importing Keras above registered keras-perf's classes (keras_perf/__init__.py), so a
    # model using them (a QAT layer, a LossScaledModel, ...) loads.
    model = _load_for_diagnose(args.model)
    if model is None:
        return 2
    if not getattr(model, "compiled", False) or model.optimizer is None:
        print(
            f"keras-perf diagnose: {args.model} was saved without its compile settings; "
            "compile it and save it again.",
            file=sys.stderr,
        )
        return 2
    batch = args.batch_size or 32
    x, y = synthetic_batch(model, batch * args.steps)
    d = kp.diagnose(model, x, y, batch_size=batch, steps=args.steps, max_seconds=args.max_seconds)
    if args.json:
        print(json.dumps(d.to_dict(), indent=2))
    else:
        print(d)
        print("note: synthetic inputs of the model's shape: the input share of real data differs.")
    return 0


# A dimension the model leaves open (`keras.Input((None, None, 3))`) gets this size in the
# synthetic inputs: large enough for the usual 3x3 and 5x5 kernels and a few poolings.
OPEN_DIMENSION = 32


def _load_for_diagnose(path: str):
    """The model saved at `path`, or None after one line on stderr saying why it cannot be."""
    import zipfile

    import keras

    if not os.path.isfile(path):
        print(f"keras-perf diagnose: no such file: {path}", file=sys.stderr)
        return None
    if not zipfile.is_zipfile(path):
        print(
            f"keras-perf diagnose: {path} is not a saved Keras model (a .keras file is a zip "
            "archive written by `model.save`).",
            file=sys.stderr,
        )
        return None
    try:
        return keras.saving.load_model(path)
    except Exception as exc:  # a user's file: report it, never a traceback
        print(f"keras-perf diagnose: cannot load {path}: {exc}", file=sys.stderr)
        return None


def synthetic_batch(model, n: int, seed: int = 0):
    """Synthetic inputs and targets of `model`'s shapes, `n` examples.

    Open dimensions get `OPEN_DIMENSION`; the targets take the shapes of the model's outputs on
    those inputs, so a model whose output size follows its input size gets matching targets.
    """
    import keras
    import numpy as np

    rng = np.random.default_rng(seed)

    def synthetic(tensor):
        shape = (n, *[d or OPEN_DIMENSION for d in tuple(tensor.shape)[1:]])
        dtype = str(getattr(tensor.dtype, "name", tensor.dtype))
        if "int" in dtype:
            return rng.integers(0, 2, shape).astype(dtype)
        return rng.normal(size=shape).astype(dtype)

    xs = [synthetic(t) for t in model.inputs]
    x = xs[0] if len(xs) == 1 else xs
    first = keras.tree.map_structure(lambda a: a[:2], x)
    outputs = keras.tree.flatten(model(first, training=False))
    loss = str(getattr(model, "loss", "")).lower()
    ys = []
    for out in outputs:
        shape = tuple(keras.ops.shape(out))[1:]
        if "sparse" in loss and shape:
            ys.append(rng.integers(0, int(shape[-1]), (n, *shape[:-1])).astype("int32"))
        else:
            ys.append(rng.normal(size=(n, *shape)).astype("float32"))
    y = ys[0] if len(ys) == 1 else ys
    return x, y


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    # `--verbose` is accepted before or after the subcommand; SUPPRESS keeps a subparser's
    # default from overwriting a `--verbose` given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show TensorFlow's and XLA's native log lines (hidden by default)",
    )
    parser = argparse.ArgumentParser(
        prog="keras-perf",
        description="Faster, smaller, harder-to-break Keras 3 training.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", metavar="{doctor,demo,bench,diagnose}")
    p = sub.add_parser(
        "doctor", parents=[common], help="environment, backend, devices, mixed-precision support"
    )
    p.set_defaults(func=doctor)
    p = sub.add_parser(
        "demo", parents=[common], help="every lever against its baseline on bundled real data"
    )
    p.add_argument(
        "--out",
        type=_writable_dir,
        default="keras-perf-demo",
        help="output folder (default: %(default)s)",
    )
    p.add_argument(
        "--epochs",
        type=_positive_int,
        default=30,
        help="the teacher's epochs at most (default: %(default)s)",
    )
    p.add_argument(
        "--quick", action="store_true", help="every lever, one seed, few epochs (a smoke run)"
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="Keras backend (default: KERAS_BACKEND, else tensorflow)",
    )
    p.set_defaults(func=demo)
    p = sub.add_parser(
        "bench", parents=[common], help="overhead and speed of every piece against plain Keras"
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help="fewer repeats and steps, every script in one process (minutes)",
    )
    mode.add_argument(
        "--smoke",
        action="store_true",
        help="every script once on its tiniest sizes, in one process: proves each runs and "
        "writes its rows (what CI runs); its figures are not the claims'",
    )
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated backends to run each script under (default: current)",
    )
    p.add_argument("--only", default=None, help="comma-separated substrings of script names")
    p.add_argument("--dir", default=None, help="benchmarks folder (default: ./benchmarks)")
    p.add_argument(
        "--markdown",
        type=_writable_file,
        default=None,
        metavar="PATH",
        help="also write the table as Markdown to PATH",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="the GPU check instead (benchmarks.gpu_check, JAX and torch; see docs/gpu.md)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="with --gpu: the whole check on the CPU, tiny sizes"
    )
    p.add_argument(
        "--json", default=None, metavar="PATH", help="with --gpu: write every row as JSON"
    )
    p.set_defaults(func=bench)
    p = sub.add_parser(
        "diagnose",
        parents=[common],
        help="where a saved model's training time goes (synthetic inputs of its shape)",
    )
    p.add_argument("model", help="a saved, compiled model (.keras)")
    p.add_argument(
        "--batch-size", type=_positive_int, default=None, help="batch size (default: 32)"
    )
    p.add_argument(
        "--steps", type=_positive_int, default=50, help="steps per measurement (default: 50)"
    )
    p.add_argument(
        "--max-seconds",
        type=_positive_float,
        default=60.0,
        help="time budget after the first trace (default: 60)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=diagnose)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `keras-perf` command; returns its exit code.

    Args:
        argv: The arguments, without the program name. Defaults to `sys.argv[1:]`.
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 2
    verbose = getattr(args, "verbose", False)
    quiet_native_logs(verbose)
    # Filter only where the native libraries are still to be loaded (not, say, under pytest).
    if verbose or any(m in sys.modules for m in ("tensorflow", "jax", "torch")):
        return int(args.func(args) or 0)
    with NativeLogFilter():
        return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
