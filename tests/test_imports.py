"""keras-perf without its optional packages: the core needs Keras and NumPy only.

Each test runs a child Python in which the optional packages cannot be imported (as after
`pip install keras-perf jax`): `sys.modules[name] = None` is Python's own way to make
`import name` fail and `importlib.util.find_spec(name)` answer None. The child runs the
pieces that must work without them and checks that the pieces that need one raise an
ImportError naming the keras-perf extra to install.
"""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import pytest

from keras_perf import _imports

ROOT = Path(__file__).resolve().parent.parent
BACKEND = keras.backend.backend()

# Never needed by the core; TensorFlow is blocked too unless it is the backend under test.
OPTIONAL = ["tf_keras", "tensorflow_model_optimization", "matplotlib", "sklearn"]

_CHILD = textwrap.dedent(
    """
    import sys

    BLOCKED = sys.argv[1].split(",")
    for name in BLOCKED:
        sys.modules[name] = None  # `import name` raises ModuleNotFoundError

    import keras
    import numpy as np

    import keras_perf as kp

    def expect_import_error(fn, extra):
        try:
            fn()
        except ImportError as e:
            assert f"keras-perf[{extra}]" in str(e), str(e)
            print(f"ImportError names [{extra}]")
        else:
            raise AssertionError(f"no ImportError; expected one naming [{extra}]")

    rng = np.random.default_rng(0)
    x = rng.random((96, 8), dtype="float32")
    y = rng.integers(0, 3, 96)

    def mlp(width):
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(3)]
        )

    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    teacher = kp.loss_scaled(mlp(32))
    teacher.compile("adam", sce, metrics=["accuracy"])
    mon = kp.TrainingMonitor()
    pruning = kp.PruningCallback(kp.ConstantSparsity(0.5, begin_step=0, frequency=1))
    stop = kp.EarlyStopping(monitor="val_loss", patience=5)
    hist = teacher.fit(x, y, epochs=2, batch_size=32, validation_data=(x, y), verbose=0,
                       callbacks=[mon, pruning, stop])
    assert len(hist.history["loss"]) == 2 and np.isfinite(hist.history["loss"]).all()
    assert abs(pruning.sparsity - 0.5) < 0.05, pruning.sparsity
    assert mon.summary()["epochs"] == 2

    student = mlp(8)
    distiller = kp.DistillationModel(student, teacher, temperature=2.0, alpha=0.5)
    distiller.compile(optimizer="adam")
    hist = distiller.fit(x, y, epochs=1, batch_size=32, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    assert kp.compression_report(student)["total"]["params"] == 8 * 8 + 8 + 8 * 3 + 3
    print("fit ok:", keras.backend.backend())

    expect_import_error(lambda: mon.plot(sys.argv[2] + "/monitor.png"), "plot")
    if "tensorflow" in BLOCKED:
        expect_import_error(lambda: kp.export_tflite(student, sys.argv[2] + "/s.tflite"),
                            "tensorflow")
    print("blocked still absent:", [n for n in BLOCKED if sys.modules.get(n) is not None])
    """
)


def _run_child(backend: str, blocked: list[str], tmp_path) -> str:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, ",".join(blocked), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_every_piece_runs_without_optional_packages(tmp_path):
    # On JAX and torch TensorFlow is optional too (`pip install keras-perf jax`).
    blocked = OPTIONAL + ([] if BACKEND == "tensorflow" else ["tensorflow"])
    out = _run_child(BACKEND, blocked, tmp_path)
    assert f"fit ok: {BACKEND}" in out
    assert "ImportError names [plot]" in out
    if BACKEND != "tensorflow":
        assert "ImportError names [tensorflow]" in out
    assert "blocked still absent: []" in out
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_require_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install 'keras-perf\[plot\]'") as info:
        _imports.require("matplotlib_not_there_at_all", "a plot", extra="plot")
    assert "a plot needs matplotlib_not_there_at_all" in str(info.value)
    _imports.require("numpy", "anything")  # installed: no error, nothing imported


def test_require_sees_a_blocked_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(
        ImportError, match=r"TrainingMonitor.plot needs matplotlib.*keras-perf\[plot\]"
    ):
        _imports.require("matplotlib", "TrainingMonitor.plot")


@pytest.mark.parametrize(
    "module, extra",
    [("tensorflow", "tensorflow"), ("sklearn", "demo"), ("tensorflow_model_optimization", "tfmot")],
)
def test_require_knows_each_optional_module_s_extra(monkeypatch, module, extra):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=rf"keras-perf\[{extra}\]"):
        _imports.require(module, "x")


def test_extras_in_pyproject_match_the_messages():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(extras["dependencies"]) == ["keras>=3.8", "numpy>=1.24"]
    optional = extras["optional-dependencies"]
    for module, (dist, extra) in _imports.EXTRAS.items():
        assert any(req.startswith(dist) for req in optional[extra]), (module, extra)


# -- the import graph: layers run one way, no cycles -------------------------------------------
#
# Read from the source with `ast` (nothing is imported): every `import` and `from ... import`,
# at module level and inside functions alike, and `importlib.import_module("literal")`. An
# import of `a.b.c` also runs the packages `a.b` and `a` first, so it counts as an import of
# them too (except the packages the importer itself lies in, and the root `keras_perf`).

# Who may import whom, lowest first. A module in one of these groups (longest prefix wins) may
# import keras_perf modules of its own group and of the groups named for it, nothing else;
# every module in no group belongs to a feature above them all and may import any of them.
LAYERS = {
    # The neutral ground floor: Keras, the standard library and each other only.
    "ground": (
        (
            "keras_perf._cpu",
            "keras_perf._imports",
            "keras_perf._host_memory",
            "keras_perf._keras_internals",
            "keras_perf._masks",
            "keras_perf._utils",
        ),
        (),
    ),
    # The backend dispatch and its implementation modules.
    "backend": (("keras_perf.backend",), ("ground",)),
    # The shared train step, beside (not above) the backend.
    "train_step_base": (
        (
            "keras_perf.train_step._base",
            "keras_perf.train_step._remat",
            "keras_perf.train_step._settings",
        ),
        ("ground",),
    ),
    # The backend train steps and the public train-step API, above both.
    "train_step": (("keras_perf.train_step",), ("ground", "backend", "train_step_base")),
    # The reading of `fit`'s inputs, shared by the tools above it (diagnose, accelerate, oom,
    # lr_finder); it checks train-step settings, so it sits above the train step.
    "inputs": (
        ("keras_perf._inputs",),
        ("ground", "backend", "train_step_base", "train_step"),
    ),
}


def import_graph(root: Path = ROOT, package: str = "keras_perf") -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (dotted names), read with `ast`."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's own package, level - 1 up
                    up = own_package.split(".")[: len(own_package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in files else base)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.add(node.args[0].value)
        targets = set()
        for target in found:
            if target != package and not target.startswith(package + "."):
                continue
            parts = target.split(".")
            for i in range(2, len(parts) + 1):  # the module and the packages it lies in
                candidate = ".".join(parts[:i])
                if candidate in files and not (name + ".").startswith(candidate + "."):
                    targets.add(candidate)
            if target == package:
                targets.add(package)
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one node: each holds at least one cycle."""
    nodes = set(graph) | {t for ts in graph.values() for t in ts}
    reach = {}
    for start in nodes:
        seen, todo = set(), [start]
        while todo:
            for t in graph.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        reach[start] = seen
    groups = {frozenset({n} | {m for m in reach[n] if n in reach[m]}) for n in nodes}
    return sorted((g for g in groups if len(g) > 1), key=sorted)


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between top-level units: `keras_perf.<package or module>`."""

    def unit(name):
        return ".".join(name.split(".")[:2])

    units = {}
    for name, targets in graph.items():
        units.setdefault(unit(name), set()).update(
            unit(t) for t in targets if unit(t) != unit(name)
        )
    return units


def layer_violations(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Each import from a module of a layer to a module it may not import (one above it)."""

    def group(name):
        best = None
        for key, (prefixes, _) in layers.items():
            for prefix in prefixes:
                if name == prefix or name.startswith(prefix + "."):
                    if best is None or len(prefix) > best[1]:
                        best = (key, len(prefix))
        return best and best[0]

    problems = []
    for name, targets in sorted(graph.items()):
        own = group(name)
        if own is None:
            continue
        allowed = {own, *layers[own][1]}
        for target in sorted(targets):
            if group(target) not in allowed:
                problems.append(f"{name} ({own}) imports {target} ({group(target) or 'above'})")
    return problems


def _reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for t in graph.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_import_graph_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import low\n")
    (pkg / "low.py").write_text("def f():\n    from pkg.sub import high\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "high.py").write_text(
        "import importlib\nfrom . import other\nfrom ..low import f\n"
        "importlib.import_module('pkg.low')\n"
    )
    (pkg / "sub" / "other.py").write_text("import pkg\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.low"] == {"pkg.sub", "pkg.sub.high"}  # in a function, and its package
    assert graph["pkg.sub.high"] == {"pkg.sub.other", "pkg.low"}  # relative, importlib
    assert graph["pkg.sub.other"] == {"pkg"}
    # pkg.low <-> pkg.sub.high, and pkg -> pkg.low -> pkg.sub.high -> pkg.sub.other -> pkg.
    assert find_cycles(graph) == [frozenset({"pkg", "pkg.low", "pkg.sub.high", "pkg.sub.other"})]


def test_checks_find_a_cycle_and_an_import_upwards():
    graph = {
        "keras_perf._utils": {"keras_perf.backend"},  # the ground floor reaching up
        "keras_perf.backend": {"keras_perf.train_step"},
        "keras_perf.train_step": {"keras_perf.backend"},
    }
    assert find_cycles(graph) == [frozenset({"keras_perf.backend", "keras_perf.train_step"})]
    assert layer_violations(graph) == [
        "keras_perf._utils (ground) imports keras_perf.backend (backend)",
        "keras_perf.backend (backend) imports keras_perf.train_step (train_step)",
    ]
    assert layer_violations({"keras_perf.train_step.jax": {"keras_perf.backend.jax"}}) == []


def test_no_import_runs_up_a_layer():
    assert layer_violations(import_graph()) == []


def test_no_cycle_between_packages():
    # export -> quantization was a circle hidden by imports inside functions until the QAT
    # export moved to export/_qat.py: imports inside functions count here.
    assert find_cycles(unit_graph(import_graph())) == []


def test_no_cycle_between_modules():
    assert find_cycles(import_graph()) == []


@pytest.mark.parametrize(
    "module", ["keras_perf._utils", "keras_perf._keras_internals", "keras_perf.train_step._base"]
)
def test_neutral_modules_never_reach_the_backend(module):
    graph = import_graph()
    assert module in graph
    assert not [m for m in _reachable(graph, module) if m.startswith("keras_perf.backend")]


def test_the_backend_never_reaches_the_train_step():
    graph = import_graph()
    backend = [m for m in graph if m == "keras_perf.backend" or m.startswith("keras_perf.backend.")]
    assert len(backend) >= 5
    for module in backend:
        reached = _reachable(graph, module)
        assert not [m for m in reached if m.startswith("keras_perf.train_step")], module


# -- packages share through their `__init__`, never through each other's private modules -------
#
# `keras_perf.<a>._x` is package `a`'s own business: a module outside `keras_perf.<a>` imports
# what `a` offers from `keras_perf.<a>` itself (its public names, and the package-internal names
# its `__init__` re-exports for the other packages, as optax does), or from a shared module on
# the top level (`keras_perf._x`). Each exception below is one import that is still waiting
# for its move, with the reason.
PRIVATE_IMPORT_EXCEPTIONS: set[tuple[str, str]] = set()


def private_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for each import of a package's private module from outside it."""
    found = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            parts = target.split(".")
            owner = ".".join(parts[:2])
            private = any(p.startswith("_") for p in parts[2:])
            if private and owner in graph and not (name + ".").startswith(owner + "."):
                found.append((name, target))
    return found


def test_private_imports_finds_a_borrowed_private_module():
    graph = {
        "keras_perf.pruning": set(),
        "keras_perf.pruning._base": set(),
        "keras_perf.pruning._callback": {"keras_perf.pruning._base"},  # its own: fine
        "keras_perf.oom._state": {"keras_perf.pruning", "keras_perf.pruning._base"},
        "keras_perf.demo": {"keras_perf._utils", "keras_perf.pruning"},  # the top level: fine
    }
    assert private_imports(graph) == [("keras_perf.oom._state", "keras_perf.pruning._base")]


def test_no_package_imports_another_package_s_private_module():
    found = private_imports(import_graph())
    assert [f for f in found if f not in PRIVATE_IMPORT_EXCEPTIONS] == []


# -- private Keras is read in one module ---------------------------------------------------
#
# `keras_perf/_keras_internals.py` stays on the ground floor, not in `backend/`: what it reads
# is Keras' own (backend-neutral) private state, and the ground floor (`_utils`,
# `train_step._base`) needs it; in `backend/` every reader would run the backend dispatch first.
KERAS_PRIVATE_GRAPH_ATTRIBUTES = ("_keras_history", "_inbound_nodes", "_outbound_nodes")
# Files allowed to read one directly besides `_keras_internals` (none: every reader moved there).
GRAPH_ATTRIBUTE_EXCEPTIONS: set[str] = set()


def _source_files():
    for path in sorted((ROOT / "keras_perf").rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def test_only_keras_internals_imports_private_keras():
    found = []
    for name, source in _source_files():
        for node in ast.walk(ast.parse(source)):
            modules = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module or ""]
                if node.module == "keras":
                    modules += [f"keras.{alias.name}" for alias in node.names]
            if any(m == "keras.src" or m.startswith("keras.src.") for m in modules):
                found.append(name)
    assert found and set(found) == {"keras_perf/_keras_internals.py"}


def test_only_keras_internals_reads_keras_graph_attributes():
    found = {
        name
        for name, source in _source_files()
        for node in ast.walk(ast.parse(source))
        if (isinstance(node, ast.Attribute) and node.attr in KERAS_PRIVATE_GRAPH_ATTRIBUTES)
        or (isinstance(node, ast.Constant) and node.value in KERAS_PRIVATE_GRAPH_ATTRIBUTES)
    }
    assert "keras_perf/_keras_internals.py" in found
    assert found - GRAPH_ATTRIBUTE_EXCEPTIONS == {"keras_perf/_keras_internals.py"}
