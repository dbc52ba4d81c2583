"""keras-perf without its optional packages: the core needs Keras and NumPy only.

Each test runs a child Python in which the optional packages cannot be imported (as after
`pip install keras-perf jax`): `sys.modules[name] = None` is Python's own way to make
`import name` fail and `importlib.util.find_spec(name)` answer None. The child runs the
pieces that must work without them and checks that the pieces that need one raise an
ImportError naming the keras-perf extra to install.
"""

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
