"""Shared measuring code for the benchmark scripts (not a benchmark itself).

Every claim is a ratio of keras-perf against plain Keras, measured in one process with the two
variants alternated A B B A (so drift and warm-up hit both alike), repeated, and summarised by
the median. Wall time and process CPU time (`time.process_time()`) are both recorded: on a shared
machine wall time is noisy, CPU time of the same work much less so.

A claim about the time of one training step can use `interleaved(...)` with `one_step(...)`
instead: single compiled steps alternated step by step, which resolves a few percent where
whole epochs of `fit` (with its loop around the step) cannot on a shared machine.

A script calls `abba(...)` per claim, builds rows with `row(...)`, and ends with
`finish(rows, args)`, which prints a table and, with `--json PATH`, writes the rows for
`keras-perf bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The repository root: the folder holding this package, put on a child process's path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_command(module: str, env: dict | None = None) -> tuple[list[str], dict]:
    """`python -m module` for a module of this package, and its environment: `env` (default:
    this process's) with the repository root first on `PYTHONPATH`, so that the package
    imports whatever the child's working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return [sys.executable, "-m", module], env


def add_mode_flags(p: argparse.ArgumentParser) -> None:
    """`--quick` and `--smoke` on a script's parser (read back with `resolve_modes`)."""
    p.add_argument("--quick", action="store_true", help="fewer repeats and steps (a short run)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the tiniest sizes, one repeat: proves the script runs and writes its rows (CI); "
        "its figures are not the claims'. Implies --quick",
    )


def resolve_modes(args: argparse.Namespace) -> argparse.Namespace:
    """`--smoke` is `--quick` and less: a script reads `args.quick` for what both shrink and
    `args.smoke` for what only the smoke run leaves out."""
    args.quick = args.quick or args.smoke
    return args


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    add_mode_flags(p)
    p.add_argument("--json", metavar="PATH", help="write the result rows as JSON to PATH")
    return resolve_modes(p.parse_args())


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Run `fn` once; return (wall seconds, process CPU seconds)."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def abba(baseline: Callable[[], object], candidate: Callable[[], object], repeats: int = 5) -> dict:
    """Time `candidate` against `baseline` in A B B A order, `repeats` times.

    Each callable does one unit of work (say, one epoch of `fit`) and must already be warmed up
    (compiled). Returns the median candidate/baseline ratios of wall and CPU time, each pair's
    ratios and their spread (min, max).
    """
    wall, cpu = [], []
    for _ in range(repeats):
        a1 = timed(baseline)
        b1 = timed(candidate)
        b2 = timed(candidate)
        a2 = timed(baseline)
        wall.append((b1[0] + b2[0]) / (a1[0] + a2[0]))
        cpu.append((b1[1] + b2[1]) / max(a1[1] + a2[1], 1e-9))
    return summarize(wall, cpu)


def one_step(model, x, y) -> Callable[[], object]:
    """A callable running one step of `model`'s own compiled train function on (x, y).

    The same function `fit` calls per batch (built by `model.make_train_function()`), without
    `fit`'s loop around it, and it waits for the step to finish. `model` must be compiled and
    have been fitted once (so it is built and the function traced). On JAX the state travels
    from call to call as in `fit` (donated buffers); the model's variables are not updated.
    """
    import keras

    backend = keras.backend.backend()
    model.make_train_function()
    fn = model.train_function
    if backend == "tensorflow":
        import tensorflow as tf

        data = (tf.constant(x), tf.constant(y))

        def run():
            return [v.numpy() for v in tf.nest.flatten(fn(iter([data])))]

    elif backend == "jax":
        import jax

        data = (jax.numpy.asarray(x), jax.numpy.asarray(y))
        state = [
            [jax.numpy.array(v.value) for v in variables]
            for variables in (
                model.trainable_variables,
                model.non_trainable_variables,
                model.optimizer.variables,
                model.metrics_variables,
            )
        ]
        holder = {"state": tuple(state)}

        def run():
            logs, holder["state"] = fn(holder["state"], iter([data]))
            return jax.block_until_ready((logs, holder["state"]))

    else:
        data = (keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y))

        def run():
            return {k: float(v) for k, v in fn([data]).items()}

    return run


def interleaved(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    steps: int = 400,
    blocks: int = 8,
) -> dict:
    """Time single steps of `candidate` against `baseline`, alternating step by step.

    Steps alternate A B, B A, ... so that load changing on the machine hits both alike. The
    steps are cut into `blocks` consecutive blocks; each block gives the ratio of the median
    step times (wall and CPU), and the result is the median over blocks with their spread.
    Both callables must be warmed up (compiled).
    """
    times: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    for i in range(steps):
        order = (
            (("a", baseline), ("b", candidate))
            if i % 2 == 0
            else (("b", candidate), ("a", baseline))
        )
        for key, fn in order:
            times[key].append(timed(fn))
    per = max(steps // blocks, 1)
    wall, cpu = [], []
    for start in range(0, per * blocks, per):
        a, b = times["a"][start : start + per], times["b"][start : start + per]
        if not a:
            break
        wall.append(statistics.median(t[0] for t in b) / statistics.median(t[0] for t in a))
        cpu.append(
            statistics.median(t[1] for t in b) / max(statistics.median(t[1] for t in a), 1e-9)
        )
    result = summarize(wall, cpu)
    result["step_ms"] = 1e3 * statistics.median(t[0] for t in times["a"])
    result["step_cpu_ms"] = 1e3 * statistics.median(t[1] for t in times["a"])
    return result


def summarize(wall: list[float], cpu: list[float]) -> dict:
    """Median ratios and their spread (min, max) from per-repeat wall and CPU ratios."""
    return {
        "wall_ratio": statistics.median(wall),
        "cpu_ratio": statistics.median(cpu),
        "wall_spread": (min(wall), max(wall)),
        "cpu_spread": (min(cpu), max(cpu)),
        "repeats": len(wall),
    }


def row(claim: str, result: dict, target: str, backend: str | None = None, note: str = "") -> dict:
    """One table row: the claim, the measured ratios, the target beside them."""
    import keras

    return {
        "claim": claim,
        "backend": backend or keras.backend.backend(),
        "wall_ratio": round(result["wall_ratio"], 3),
        "cpu_ratio": round(result["cpu_ratio"], 3) if result.get("cpu_ratio") is not None else None,
        "wall_spread": [round(v, 3) for v in result.get("wall_spread", ())],
        "cpu_spread": [round(v, 3) for v in result.get("cpu_spread", ())],
        "repeats": result.get("repeats"),
        "target": target,
        "note": note,
    }


def accuracy_row(claim: str, accuracies, target: str, note: str = "") -> dict:
    """A table row of accuracies over seeds: the mean in the ratio column, min-max beside it."""
    import keras

    return {
        "claim": claim,
        "backend": keras.backend.backend(),
        "wall_ratio": round(float(statistics.mean(accuracies)), 4),
        "cpu_ratio": None,
        "wall_spread": [round(min(accuracies), 4), round(max(accuracies), 4)],
        "cpu_spread": [],
        "repeats": len(accuracies),
        "target": target,
        "note": note,
    }


def digits():
    """scikit-learn's bundled digits scaled to [0, 1], split 1437/360 in a fixed order."""
    from keras_perf.data import load_digits_split

    return load_digits_split(seed=0, sizes=(1437,))


def mlp(
    widths,
    inputs: int = 64,
    classes: int = 10,
    *,
    seed: int | None = None,
    name: str | None = None,
    functional: bool = False,
    optimizer=None,
    metrics=None,
    keras_module=None,
):
    """An MLP `inputs`-`widths`...-`classes` of Dense layers, ReLU between, logits out.

    Args:
        widths: Units of the hidden layers, in order.
        inputs: Input features. Defaults to `64` (digits).
        classes: Units of the output layer (no activation). Defaults to `10`.
        seed: If not `None`, `keras.utils.set_random_seed(seed)` before the layers are made.
        name: The model's name (`None`: Keras's default).
        functional: `True` builds a functional `Model` (`Input` to logits), `False` a
            `Sequential`.
        optimizer: If not `None`, the model is compiled by `compile_sce` with it.
        metrics: Passed to `compile_sce` (with `optimizer` only).
        keras_module: The Keras to build with (`tf_keras` for the legacy references); `None`:
            `keras`.
    """
    k = keras_module
    if k is None:
        import keras as k
    if seed is not None:
        k.utils.set_random_seed(seed)
    dense = [k.layers.Dense(w, activation="relu") for w in widths] + [k.layers.Dense(classes)]
    if functional:
        inp = k.Input((inputs,))
        h = inp
        for layer in dense:
            h = layer(h)
        model = k.Model(inp, h, **({"name": name} if name else {}))
    else:
        model = k.Sequential([k.Input((inputs,)), *dense], name=name)
    if optimizer is not None:
        compile_sce(model, optimizer, metrics, keras_module=k)
    return model


def compile_sce(model, optimizer, metrics=None, keras_module=None):
    """Compile `model` with `optimizer` and sparse categorical cross-entropy on logits."""
    k = keras_module
    if k is None:
        import keras as k
    kwargs = {} if metrics is None else {"metrics": metrics}
    model.compile(optimizer, k.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


def finish(rows: list[dict], args: argparse.Namespace) -> None:
    """Print the rows as a table; write them to `--json` if given."""
    for r in rows:
        spread = f"wall {r['wall_spread']} cpu {r['cpu_spread']}"
        print(
            f"{r['claim']:<55} {r['backend']:<10} wall {r['wall_ratio']:<6} cpu {r['cpu_ratio']!s:<6} "
            f"target {r['target']:<10} ({spread}, n={r['repeats']}) {r['note']}"
        )
    if args.json:
        from keras_perf.bench import machine

        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=1)
