"""Every `>>>` example in keras_perf runs, one test per module, on the backend under test.

The modules are found by walking the package, so a new module's examples run without being
listed here. An example belongs to the module whose file defines it (a class re-exported by a
package `__init__` is tested once, with its part, whatever its `__module__` says). Each
module's examples run in a fresh temporary working directory (files they write go there) after
`keras.utils.set_random_seed(0)` and with a cleared Keras session (layer names start at
"dense"), with ELLIPSIS and NORMALIZE_WHITESPACE. As in Keras' own docstrings, the examples
assume `import keras`, `import numpy as np` and `import keras_perf as kp`.
"""

import doctest
import importlib
import inspect
import pkgutil
import types

import keras
import numpy as np
import pytest

import keras_perf

BACKEND = keras.backend.backend()

# Modules whose examples apply to some backends only: module name -> (backends, reason).
# The per-backend code has no examples; importing it on another backend would only load (or
# lack) that framework.
BACKEND_ONLY = {
    f"keras_perf.{package}.{backend}": ((backend,), f"code for the {backend} backend only")
    for package in ("backend", "train_step")
    for backend in ("jax", "tensorflow", "torch")
}
for _module in ("torch_traced", "_torch_kp_step", "_torch_executions"):
    BACKEND_ONLY[f"keras_perf.train_step.{_module}"] = (
        ("torch",),
        "the PyTorch backend's traced step",
    )
# On TensorFlow, `find_max_batch_size` with a memory cap on a CPU needs the BFC allocator, set
# before TensorFlow is imported: tests/test_find_max_batch_size.py runs it in a child process.
BACKEND_ONLY["keras_perf.oom._batch_size"] = (
    ("jax", "torch"),
    "on TensorFlow needs TF_CPU_ALLOCATOR_USE_BFC=true: run by tests/test_find_max_batch_size.py",
)

# Modules whose examples need an optional package: module name -> top-level package to import.
NEEDS = {
    "keras_perf.export._convert": "tensorflow",
    "keras_perf.export._predict": "tensorflow",
    "keras_perf.export._compression": "tensorflow",
    "keras_perf.monitor._callback": "matplotlib",
}


def _module_names():
    names = [keras_perf.__name__]
    # A package that fails to import is still listed (its test then fails or skips), only its
    # submodules are not: hence the test below that names modules deep in the tree.
    for info in pkgutil.walk_packages(
        keras_perf.__path__, prefix="keras_perf.", onerror=lambda _: None
    ):
        names.append(info.name)
    return sorted(names)


def _defining_globals(obj):
    """The globals of the module whose source defines `obj`, or None if that is unknown."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if inspect.isfunction(obj):
        return obj.__globals__
    if inspect.isclass(obj):
        for member in vars(obj).values():
            found = _defining_globals(member) if not inspect.isclass(member) else None
            if found is not None:
                return found
    return None


class _FileFinder(doctest.DocTestFinder):
    """Finds the examples defined in a module's own file, whatever `__module__` says."""

    def _from_module(self, module, obj):
        found = _defining_globals(obj)
        if found is not None:
            return found is module.__dict__
        return super()._from_module(module, obj)


def _failures(module):
    """(examples run, failure reports) for `module`'s examples, each docstring from a fresh start."""
    tests = sorted(
        (t for t in _FileFinder().find(module) if t.examples), key=lambda t: t.lineno or 0
    )
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures = []
    for test in tests:
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        test.globs.update(GLOBS)
        out = []
        if runner.run(test, out=out.append, clear_globs=True).failed:
            failures.append("".join(out))
    return runner.tries, failures


MODULES = _module_names()
GLOBS = {"keras": keras, "np": np, "kp": keras_perf}


# The harness's own checks read files and run doctests of plain Python: backend-neutral, so
# they run on TensorFlow only (.ci/run leaves this file out on JAX and PyTorch by `-k`).
NEUTRAL = pytest.mark.backends("tensorflow")


@NEUTRAL
def test_walk_finds_the_packages_modules():
    assert "keras_perf.pruning._callback" in MODULES and "keras_perf.stopping._base" in MODULES
    assert len(MODULES) > 40


# Minutes per backend (each module's examples build and fit models): the slow tier, which CI
# runs on TensorFlow (.ci/run); the examples are backend-neutral code.
@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_examples(name, tmp_path, monkeypatch):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"{name}'s examples need {NEEDS[name]}")
    if name in BACKEND_ONLY and BACKEND not in BACKEND_ONLY[name][0]:
        pytest.skip(BACKEND_ONLY[name][1])
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] != "keras_perf":
            pytest.skip(f"{name} needs the optional package {e.name}")
        raise
    monkeypatch.chdir(tmp_path)
    _, failures = _failures(module)
    assert not failures, "\n".join(failures)


def _fake_module(source):
    module = types.ModuleType("fake_examples")
    exec(compile(source, "fake_examples.py", "exec"), module.__dict__)
    return module


@NEUTRAL
def test_a_wrong_example_fails_and_a_right_one_passes():
    source = 'def f():\n    """Doc.\n\n    >>> kp.__name__, np.zeros(2).shape\n    %s\n    """\n'
    tries, failures = _failures(_fake_module(source % "('keras_perf', (2,))"))
    assert (tries, failures) == (1, [])
    tries, failures = _failures(_fake_module(source % "('keras_perf', (3,))"))
    assert tries == 1 and len(failures) == 1 and "(3,)" in failures[0]


@NEUTRAL
def test_examples_belong_to_the_file_that_defines_them():
    """`keras_perf.pruning` re-exports `PruningCallback`: its examples run once, with its part."""
    import keras_perf.pruning
    import keras_perf.pruning._callback

    def names(module):
        return {t.name.rsplit(".", 1)[-1] for t in _FileFinder().find(module) if t.examples}

    assert "PruningCallback" in names(keras_perf.pruning._callback)
    assert "PruningCallback" not in names(keras_perf.pruning)
