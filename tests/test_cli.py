import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keras_perf import cli

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("keras", "tensorflow", "jax", "torch", "tf_keras", "matplotlib", "sklearn")


def _env(**extra):
    """The environment for a child `keras-perf`: this checkout first on the path."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _imported(cmd: list[str], **env) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime <cmd>`; the process and the top-level modules it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *cmd],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(**env),
        cwd=ROOT,
    )
    modules = {
        ln.rsplit("|", 1)[-1].strip().split(".")[0]
        for ln in proc.stderr.splitlines()
        if ln.startswith("import time:")
    }
    return proc, modules


def test_doctor_prints_table(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key in (
        "python",
        "keras",
        "backend",
        "tensorflow",
        "policy 'auto' would pick",
        "devices",
        "CPU",
    ):
        assert key in out


def test_help_lists_subcommands():
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    for name in ("doctor", "demo", "bench"):
        assert name in proc.stdout


@pytest.mark.parametrize(
    "args, code",
    [
        (["--help"], 0),
        (["demo", "--help"], 0),
        (["bench", "--help"], 0),
        (["demo", "--epochs", "0"], 2),
        (["frobnicate"], 2),
    ],
)
def test_help_and_argument_errors_import_no_backend(args, code):
    # `python -m keras_perf --help` answers before Keras is imported (was: Keras, and with it
    # TensorFlow, imported by `import keras_perf`, ~9 s on 2 busy cores).
    proc, modules = _imported(["-m", "keras_perf", *args])
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "keras_perf" in modules and "argparse" in modules
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    assert "usage: keras-perf" in proc.stdout + proc.stderr


def test_console_script_help_imports_no_backend(tmp_path):
    # The launcher pip writes for `[project.scripts] keras-perf = "keras_perf.cli:main"`.
    script = tmp_path / "keras-perf"
    script.write_text(
        "import re, sys\nfrom keras_perf.cli import main\n"
        "if __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        "    sys.exit(main())\n"
    )
    proc, modules = _imported([str(script), "demo", "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--epochs" in proc.stdout
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


# The command's `--help`, run in-process in a fresh Python: which heavy modules it leaves loaded.
_HELP_CHILD = """
import sys
from keras_perf.cli import main
try:
    main(["--help"])
except SystemExit as e:
    code = e.code
print("exit", code, "loaded:", sorted(m for m in {heavy} if m in sys.modules))
"""


def test_help_leaves_keras_out_of_sys_modules():
    # `import keras_perf` is lazy (keras_perf/__init__.py): `--help` needs no Keras, the reason
    # it answers in ~0.2 s instead of the ~10 s TensorFlow takes to import.
    proc = subprocess.run(
        [sys.executable, "-c", _HELP_CHILD.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: keras-perf" in proc.stdout
    assert "exit 0 loaded: []" in proc.stdout, proc.stdout[-500:]


def test_lazy_names_resolve_once_and_are_listed():
    import keras_perf as kp

    assert set(kp.__all__) == set(kp._EXPORTS) and len(kp.__all__) == len(set(kp.__all__))
    assert set(kp.__all__) <= set(dir(kp))
    for name in kp.__all__:
        value = getattr(kp, name)
        assert vars(kp)[name] is value  # cached in the module's namespace
        module = sys.modules[kp._EXPORTS[name]]
        assert value is (module if module.__name__ == f"keras_perf.{name}" else vars(module)[name])
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        kp.nope  # noqa: B018


# A fresh Python that imports keras_perf (first or after Keras) and loads models of our classes.
_LOAD_CHILD = """
import sys
order, folder = sys.argv[1], sys.argv[2]
if order == "keras_perf first":
    import keras_perf
    assert "keras" not in sys.modules
    import keras
else:
    import keras
    import keras_perf
import numpy as np

x = np.load(folder + "/x.npy")
for name in ("qat", "scaled", "distiller"):
    model = keras.saving.load_model(f"{folder}/{name}.keras")
    np.save(f"{folder}/{name}_loaded.npy", model.predict(x, verbose=0))
    ours = sorted({type(o).__name__ for o in [model, *model.layers]
                   if type(o).__module__.startswith("keras_perf")})
    print(name, ours)
"""


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """A QAT model, a loss-scaled model and a DistillationModel saved as .keras files."""
    import keras
    import numpy as np

    import keras_perf as kp

    folder = tmp_path_factory.mktemp("saved")
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 8), dtype="float32"), rng.integers(0, 3, 32)
    np.save(folder / "x.npy", x)

    def mlp(width):
        keras.utils.set_random_seed(1)
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(3)]
        )

    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    models = {
        "qat": kp.quantize_aware(mlp(8)),
        "scaled": kp.loss_scaled(mlp(8), microbatches=2),
        "distiller": kp.DistillationModel(mlp(4), mlp(16), temperature=2.0),
    }
    for name, model in models.items():
        if name == "distiller":
            model.compile("adam")
        else:
            model.compile("adam", sce)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        model.save(folder / f"{name}.keras")
        np.save(folder / f"{name}_saved.npy", model.predict(x, verbose=0))
    return folder


@pytest.mark.parametrize("order", ["keras_perf first", "keras first"])
def test_bare_import_registers_our_classes_for_load_model(saved_models, order):
    # The names are lazy, but `keras.saving.load_model` needs our classes registered: once
    # Keras is imported (before or after keras_perf), keras_perf registers all of them.
    import numpy as np

    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_CHILD, order, str(saved_models)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(TF_CPP_MIN_LOG_LEVEL="3"),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines() if " [" in ln)
    assert "QuantizedDense" in lines["qat"], lines
    assert "LossScaledModel" in lines["scaled"], lines
    assert "DistillationModel" in lines["distiller"], lines
    for name in ("qat", "scaled", "distiller"):
        np.testing.assert_allclose(
            np.load(saved_models / f"{name}_loaded.npy"),
            np.load(saved_models / f"{name}_saved.npy"),
            rtol=1e-6,
            atol=1e-6,
        )


@pytest.mark.slow  # child processes importing the backend
def test_diagnose_command_loads_a_model_of_our_classes(saved_models):
    # `keras-perf diagnose MODEL.keras`: the command imports Keras only after parsing, and our
    # classes must be registered by then (a LossScaledModel here).
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_perf",
            "diagnose",
            str(saved_models / "scaled.keras"),
            "--steps",
            "2",
            "--max-seconds",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert isinstance(result, dict) and result, proc.stdout[-2000:]


@pytest.mark.slow  # child processes importing the backend
def test_python_m_keras_perf_doctor_hides_native_logs():
    # TensorFlow 2.21 logs "I0000 ... oneDNN custom operations are on", "cudart_stub.cc ...
    # Could not find cuda drivers" and "E0000 ... failed call to cuInit" through absl on import
    # and device start-up, TF_CPP_MIN_LOG_LEVEL or not (tensorflow/tensorflow#100442).
    env = _env(KERAS_BACKEND=os.environ.get("KERAS_BACKEND", "tensorflow"))
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf", "doctor"],
        capture_output=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert b"keras-perf doctor" in proc.stdout and b"devices" in proc.stdout
    native = re.compile(rb"^[IWEF]\d{4} |^\d{4}-\d\d-\d\d [\d:.]+: [IWEF] |absl::")
    for line in (proc.stdout + proc.stderr).splitlines():
        assert not native.search(line), line


def test_native_log_filter_drops_only_native_lines(capfd):
    lines = [
        b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        b"I0000 00:00:1795556549.267741   13659 port.cc:153] oneDNN custom operations are on.\n",
        b"E0000 00:00:1795556575.286610   14053 cuda_platform.cc:52] failed call to cuInit\n",
        b"2025-09-17 14:44:05.157831: I external/local_xla/xla/tsl/cuda/cudart_stub.cc:32] x\n",
        b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n",
        b"fully_quantize: 0, inference_type: 6, input_inference_type: INT8\n",
    ]
    kept = [
        b"UserWarning: something the user should see\n",
        b"Traceback (most recent call last):\n",
        b"E0000 is not a log line without its header\n",
    ]
    with cli.NativeLogFilter():
        for line in lines + kept:
            os.write(2, line)
    assert capfd.readouterr().err == b"".join(kept).decode()


@pytest.mark.parametrize(
    "verbose, user, expected",
    [
        (False, None, "3"),  # quiet by default
        (False, "0", "0"),  # the user's own setting is kept
        (True, None, None),  # --verbose: TensorFlow's default, everything shows
    ],
)
def test_quiet_native_logs_keeps_user_setting(verbose, user, expected):
    environ = {} if user is None else {"TF_CPP_MIN_LOG_LEVEL": user}
    cli.quiet_native_logs(verbose, environ)
    assert environ.get("TF_CPP_MIN_LOG_LEVEL") == expected


@pytest.mark.parametrize(
    "argv", [["--verbose", "doctor"], ["doctor", "--verbose"], ["doctor", "-v"]]
)
def test_verbose_before_or_after_the_subcommand(argv):
    assert cli.build_parser().parse_args(argv).verbose is True
    assert not hasattr(cli.build_parser().parse_args(["doctor"]), "verbose")


def test_unknown_subcommand_fails():
    with pytest.raises(SystemExit) as info:
        cli.main(["frobnicate"])
    assert info.value.code == 2


# --- demo -------------------------------------------------------------------------------

LEVER_KEYS = {"lever", "baseline", "with", "gain", "unit", "note"}
LEVERS = (
    "training speed: kp.accelerate",
    "memory: remat full",
    "memory: 4 micro-batches",
    "distillation, 10% labels",
    "pruning 85%: accuracy",
    "pruning 85%: size",
    "channel pruning + shrink: params",
    "channel pruning + shrink: latency",
    "learning rate: range test",
)


def _check_quick_demo(out, printed):
    """What `keras-perf demo --quick` must give on every backend: one row per lever, with
    the keys of the issue, gains that agree with their baseline and value, and the plot."""
    import json

    report = json.loads((out / "report.json").read_text())
    levers = report["levers"]
    names = [r["lever"] for r in levers]
    for name in LEVERS:
        assert any(n.startswith(name) for n in names), (name, names)
    assert any(n.startswith("deploy: float file vs Keras, batch 1") for n in names), names
    assert any(n.startswith("deploy: onnx-int8 vs float, batch 64") for n in names), names
    for r in levers:
        assert LEVER_KEYS <= set(r), r
        assert r["unit"] and isinstance(r["note"], str), r
        if r["baseline"] is not None and r["with"] is not None:
            assert r["gain"] is not None, r
            if r["gain_unit"] == "points":
                assert r["gain"] == pytest.approx(r["with"] - r["baseline"], abs=0.02), r
            else:
                assert r["gain"] > 0, r
            if not r["pays"] and r["lever"] != "pruning 85%: size":
                assert r["note"].startswith("does not pay here: "), r
    speed = next(r for r in levers if r["lever"].startswith("training speed"))
    assert speed["baseline"] > 0  # plain fit, measured
    import keras_perf as kp

    if getattr(kp, "accelerate", None) is None:
        assert speed["note"] == "kp.accelerate not available in this build"
        assert speed["with"] is None and speed["gain"] is None
    else:  # fit after kp.accelerate, measured, with accelerate's own figure beside it
        assert speed["with"] > 0 and "accelerate's own measure" in speed["note"], speed
    rows = {r["model"]: r for r in report["rows"]}
    assert rows["teacher"]["params"] > 10 * rows["student distilled"]["params"]
    pruned = rows["teacher pruned 85%"]
    assert pruned["nonzero"] < 0.2 * pruned["params"]  # 85 % of the kernels are zero
    assert rows["teacher channel-pruned, shrunk"]["params"] < 0.25 * rows["teacher"]["params"]
    for name in report["files"]:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert {"summary.png", "teacher.png", "lr.png", "report.json"} <= set(report["files"])
    assert report["process_cpu_s"] > 0
    assert "gain" in printed and "distillation, 10% labels" in printed


# Slow tier (CI's TensorFlow slow stage): 44 s, the README's test command's longest test; the
# README's other command runs the whole demo, and the fast tests below check its parts.
@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_demo_quick_shows_every_lever_against_its_baseline(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--quick", "--out", str(out)]) == 0
    _check_quick_demo(out, capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.backends("jax", "torch")
def test_demo_quick_shows_every_lever_on_jax_and_torch(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--quick", "--out", str(out)]) == 0
    _check_quick_demo(out, capsys.readouterr().out)


@pytest.mark.slow  # 24 s; the default tier's --quick demo test runs the same row
def test_demo_training_speed_row_uses_accelerate(tmp_path):
    """The speed row measures plain `fit` against `fit` after the real `kp.accelerate`."""
    from keras_perf.data import load_digits_split
    from keras_perf.demo import _levers
    from keras_perf.demo._common import Demo, Settings

    train, val, test = load_digits_split(seed=0)
    demo = Demo(tmp_path, Settings.quick(), False, train, val, test)
    _levers.training_speed(demo)
    (row,) = demo.levers
    assert row["baseline"] > 0 and row["with"] > 0, row
    # The gain is rounded to 2 decimals (0.11 for a ratio of 0.1066).
    assert row["gain"] == pytest.approx(row["with"] / row["baseline"], abs=0.0051), row
    assert "exact" in row["note"] and "accelerate's own measure" in row["note"], row


@pytest.mark.backends("tensorflow")
def test_demo_training_speed_row_reads_accelerate_as_api_md_14_says(tmp_path, monkeypatch):
    """`kp.accelerate` is built on another branch: the row is checked here against a stand-in
    that keeps API.md §14's contract (`chosen`, `speedup`, `rows`, `to_dict`)."""
    import keras_perf as kp
    from keras_perf.data import load_digits_split
    from keras_perf.demo import _levers
    from keras_perf.demo._common import Demo, Settings

    calls = []

    class Result:
        chosen = {"steps_per_execution": 8}
        speedup = 1.7
        rows = [{"candidate": "spe=8", "exact": True, "chosen": True}]

        def to_dict(self):
            return {"chosen": self.chosen, "speedup": self.speedup, "rows": self.rows}

    def accelerate(model, x, y=None, batch_size=None, *, max_seconds=60):
        calls.append((batch_size, max_seconds))
        model.compile(model.optimizer, model.loss, steps_per_execution=8)
        return Result()

    monkeypatch.setattr(kp, "accelerate", accelerate, raising=False)
    train, val, test = load_digits_split(seed=0)
    demo = Demo(tmp_path, Settings.quick(), False, train, val, test)
    _levers.training_speed(demo)
    (row,) = demo.levers
    assert calls == [(64, 5.0)]
    assert row["baseline"] > 0 and row["with"] > 0, row
    assert row["gain"] == pytest.approx(row["with"] / row["baseline"], abs=0.01), row
    assert "exact weights" in row["note"] and "own measure x1.70" in row["note"], row
    assert demo.stages["accelerate"]["speedup"] == 1.7


def test_demo_lever_gain_reads_the_same_way_for_every_unit():
    from keras_perf.demo._common import lever

    faster = lever("speed", 100.0, 250.0, "examples/s")
    smaller = lever("memory", 8.0, 2.0, "MiB", higher_is_better=False)
    better = lever("acc", 88.0, 92.5, "test accuracy %", points=True)
    worse = lever("acc", 95.0, 90.0, "test accuracy %", points=True, why_not="too sparse")
    assert (faster["gain"], smaller["gain"], better["gain"]) == (2.5, 4.0, 4.5)
    assert faster["pays"] and smaller["pays"] and better["pays"]
    assert worse["gain"] == -5.0 and not worse["pays"]
    assert worse["note"] == "does not pay here: too sparse"
    # Pruning trades a little accuracy: within its tolerance the lever pays, no excuse noted.
    kept = lever("acc", 97.8, 97.2, "test accuracy %", points=True, tolerance=1.0, why_not="x")
    assert kept["gain"] == -0.6 and kept["pays"] and kept["note"] == ""
    missing = lever("speed", 100.0, None, "examples/s", note="not available")
    assert missing["gain"] is None and missing["note"] == "not available"


def test_demo_progress_bar_shows_each_epochs_own_values(capsys):
    from keras_perf.demo import _StageBar

    bar = _StageBar("[stage]", epochs=3)
    bar.on_train_begin()
    epochs = [
        {"loss": 3.0, "val_accuracy": 0.2},
        {"loss": 1.0, "val_accuracy": 0.6},
        {"loss": 0.5, "val_accuracy": 0.9},
    ]
    shown = []
    for i, logs in enumerate(epochs):
        bar.on_epoch_end(i, logs)
        shown.append(re.split(r"[\r\n]", capsys.readouterr().out.strip())[-1])
    bar.on_train_end()
    # Each epoch's line carries that epoch's values (was: the mean over the epochs so far,
    # loss 2.0 at epoch 2).
    for i, (line, logs) in enumerate(zip(shown, epochs)):
        assert f"{i + 1}/3" in line
        assert f"loss: {logs['loss']:.4f}" in line, line
        assert f"val_accuracy: {logs['val_accuracy']:.4f}" in line, line


def test_demo_progress_bar_says_when_stopped_early(capsys):
    from keras_perf.demo import _StageBar

    bar = _StageBar("[stage]", epochs=10)
    bar.on_train_begin()
    bar.on_epoch_end(0, {"loss": 1.0})
    bar.on_train_end()
    assert "stopped after 1 of 10 epochs" in capsys.readouterr().out


def test_demo_summary_plot_has_one_panel_per_unit_with_honest_axes(tmp_path):
    pytest.importorskip("matplotlib")
    from keras_perf.demo import _summary_plot
    from keras_perf.demo._common import lever

    levers = [
        lever("speed", 2000.0, 5000.0, "examples/s"),
        lever("memory: remat", 6.0, 4.0, "MiB", higher_is_better=False),
        lever("memory: micro", 6.0, 2.0, "MiB", higher_is_better=False),
        lever("distillation", 89.0, 92.6, "test accuracy %", points=True),
        lever("pruning", 97.0, 96.5, "test accuracy %", points=True, why_not="costs"),
        lever("accelerate", 2000.0, None, "examples/s/2", note="not available"),
    ]
    fig = _summary_plot(levers, tmp_path / "summary.png")
    assert (tmp_path / "summary.png").stat().st_size > 0
    # One panel per unit that has a measured pair (the row without one is left out).
    assert [ax.get_title() for ax in fig.axes] == ["examples/s", "MiB", "test accuracy %"]
    for ax in fig.axes:
        assert ax.get_xlim()[0] == 0 and ax.get_xscale() == "linear"  # from 0, linear
        assert all(p.get_width() < ax.get_xlim()[1] for p in ax.patches)
    acc = fig.axes[2]
    assert acc.get_xlim()[1] == 100  # accuracy in % on its whole range
    assert sorted(round(p.get_width(), 1) for p in acc.patches) == [89.0, 92.6, 96.5, 97.0]
    # The lever that does not pay is drawn in its own colour, explained by the legend.
    colours = {p.get_facecolor() for p in acc.patches}
    assert len(colours) == 3
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["baseline", "with the lever", "with the lever, where it does not pay"]


def test_demo_rejects_bad_epochs():
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf.cli", "demo", "--epochs", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--epochs" in proc.stderr and ">= 1" in proc.stderr


def test_demo_rejects_unknown_backend():
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf.cli", "demo", "--backend", "theano"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--backend" in proc.stderr and "tensorflow" in proc.stderr


# --- bench ------------------------------------------------------------------------------


# The bench runner on stub scripts and its argument checks: the children get KERAS_BACKEND
# from the test (or import no Keras), whatever the run's backend, so these run on TensorFlow.
BENCH_RUNNER = pytest.mark.backends("tensorflow")


@BENCH_RUNNER
def test_bench_rejects_unknown_backend(capsys):
    assert cli.main(["bench", "--backends", "theano"]) == 2
    assert "theano" in capsys.readouterr().err


@BENCH_RUNNER
def test_bench_without_scripts_says_where_it_looked(tmp_path, capsys):
    assert cli.main(["bench", "--dir", str(tmp_path)]) == 2
    assert "bench_*.py" in capsys.readouterr().err


@BENCH_RUNNER
@pytest.mark.parametrize("gpu", [[], ["--gpu"]])
def test_bench_after_a_plain_pip_install_says_it_needs_the_repository(tmp_path, gpu):
    # The package alone, as pip installs it (no benchmarks/ beside it), run from a folder
    # without benchmarks/: one line on stderr saying where the benchmarks are, exit code 2.
    import shutil
    from pathlib import Path

    site = tmp_path / "site-packages"
    package = Path(cli.__file__).resolve().parent
    shutil.copytree(package, site / "keras_perf", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf", "bench", *gpu],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "keras-perf repository: clone it and run `keras-perf bench` from its root" in (
        proc.stderr
    )


_GOOD_SCRIPT = """
import json, sys
args = sys.argv[1:]
rows = [{"claim": "tiny claim", "backend": "tensorflow", "wall_ratio": 1.25, "cpu_ratio": 0.5,
         "target": "<= 2", "repeats": 3,
         "note": "stub " + next((a[2:] for a in args if a in ("--quick", "--smoke")), "full")}]
json.dump({"rows": rows}, open(args[args.index("--json") + 1], "w"))
"""


def _stub_package(tmp_path):
    """A `benchmarks` package of stub modules, run as `python -m benchmarks.bench_x` from
    tmp_path (a regular package: it comes before the checkout's on the child's path)."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    return folder


@BENCH_RUNNER
@pytest.mark.parametrize("mode", ["quick", "smoke", "full"])
def test_bench_reports_rows_and_failures_per_script(tmp_path, capsys, monkeypatch, mode):
    # Stub modules: one good, one raising, one exiting non-zero. Each is reported on its own,
    # the good rows still print, and the exit code says something failed. Each script gets
    # the run's flag (`--quick`, `--smoke`, or none).
    folder = _stub_package(tmp_path)
    (folder / "bench_a.py").write_text(_GOOD_SCRIPT)
    (folder / "bench_b.py").write_text("raise RuntimeError('broken on purpose')\n")
    (folder / "bench_c.py").write_text("import sys; sys.exit(3)\n")
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    args = ["bench", "--dir", str(folder)] + ([f"--{mode}"] if mode != "full" else [])
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    for name in ("bench_a.py", "bench_b.py", "bench_c.py"):
        assert f"running {name}" in out
    assert "1 rows in" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("tiny claim"))
    assert "1.250" in row and "0.500" in row and "<= 2" in row
    assert f"stub {mode}" in row
    assert out.count("FAILED") == 2 * 2  # once as each script ends, once in the table
    assert "broken on purpose" in out
    assert "exit 3" in out


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_bench_smoke_runs_every_script_and_each_writes_its_rows(tmp_path):
    # CI's benchmark check: every script on its tiniest sizes (`--smoke`), in one process. It
    # proves each runs and writes its rows; the figures are `bench`'s and `--quick`'s to give.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    md = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf.cli", "bench", "--smoke", "--markdown", str(md)],
        capture_output=True,
        text=True,
        timeout=2400,  # every bench script in one process (killed past bench.SMOKE_BUDGET_S)
        cwd=root,
    )
    failed = [ln[:600] for ln in proc.stdout.splitlines() if "FAILED" in ln]
    assert proc.returncode == 0, "\n".join(failed) + proc.stdout[-2000:] + proc.stderr[-2000:]
    scripts = sorted(p.name for p in (root / "benchmarks").glob("bench_*.py"))
    # "running bench_x.py (tensorflow, smoke) ..." then "  N rows in S s (C s CPU)" per script.
    done = re.findall(r"running (\S+) \(tensorflow, smoke\) \.\.\.\n  (\d+) rows in", proc.stdout)
    assert [name for name, _ in done] == scripts, proc.stdout[-2000:]
    assert all(int(n) >= 1 for _, n in done), done
    assert "FAILED" not in proc.stdout
    table = md.read_text()
    assert table.startswith("Command: `keras-perf bench --smoke`")
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| claim")]
    assert len(rows) == sum(int(n) for _, n in done)


@BENCH_RUNNER
def test_bench_quick_and_smoke_do_not_go_together(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--quick", "--smoke"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@BENCH_RUNNER
def test_every_benchmark_script_takes_smoke_and_quick():
    """`bench --smoke` passes `--smoke` to every script: each parses it through the harness
    (`parse_args`, or `add_mode_flags` and `resolve_modes` on a parser of its own)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    scripts = sorted(folder.glob("bench_*.py"))
    missing = [
        s.name
        for s in scripts
        if "parse_args(__doc__" not in (text := s.read_text())
        and not ("add_mode_flags(" in text and "resolve_modes(" in text)
    ]
    assert len(scripts) >= 16 and not missing, missing


@BENCH_RUNNER
def test_bench_quick_kills_a_script_that_hangs(tmp_path):
    import time

    from keras_perf.bench import run_in_one_process

    folder = _stub_package(tmp_path)
    (folder / "bench_a.py").write_text(_GOOD_SCRIPT)
    # Prints nothing; and hangs in a child of its own too (bench_remat re-runs itself in a
    # child). Was: the watchdog killed the driver alone, and the child, holding the pipe,
    # kept the runner waiting until it ended.
    (folder / "bench_b.py").write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "time.sleep(120)\n"
    )
    (folder / "bench_c.py").write_text(_GOOD_SCRIPT)
    scripts = sorted(folder.glob("bench_*.py"))
    started, done = [], []
    t0 = time.perf_counter()
    results = run_in_one_process(scripts, "tensorflow", 5.0, started.append, done.append)
    assert time.perf_counter() - t0 < 60
    assert [r["script"] for r in results] == ["bench_a.py", "bench_b.py", "bench_c.py"]
    assert results[0]["error"] is None and len(results[0]["rows"]) == 1
    assert "timed out after 5 s" in results[1]["error"]
    assert "timed out" in results[2]["error"]  # never started
    assert done == results and [p.name for p in started] == ["bench_a.py", "bench_b.py"]


@pytest.mark.parametrize("case", ["file", "under_a_file", "unwritable"])
def test_bad_output_locations_are_argument_errors_before_anything_runs(tmp_path, capsys, case):
    # Regression: `demo --out FILE` trained nothing but failed deep in `mkdir` with a traceback.
    a_file = tmp_path / "report.txt"
    a_file.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    out = {"file": a_file, "under_a_file": a_file / "sub", "unwritable": locked / "new"}[case]
    if case == "unwritable" and os.access(locked, os.W_OK):
        pytest.skip("running as a user who can write anywhere")
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--out", str(out)])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--markdown", str(out if case != "file" else tmp_path)])
    assert exc.value.code == 2
    assert "--markdown" in capsys.readouterr().err


@BENCH_RUNNER
def test_benchmark_scripts_import_only_names_their_helpers_define():
    """A benchmark that imports a name its helper module no longer has fails only when
    `bench` runs it (slow tier); this reads the imports instead, in milliseconds."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    defined = {}
    for helper in folder.glob("_*.py"):
        tree = ast.parse(helper.read_text())
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):  # `X = ...` and `A, B = ...`
                for target in node.targets:
                    elts = target.elts if isinstance(target, ast.Tuple) else [target]
                    names |= {t.id for t in elts if isinstance(t, ast.Name)}
            elif isinstance(node, ast.ImportFrom | ast.Import):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        defined[helper.stem] = names
    missing = []
    for script in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in defined:
                missing += [
                    f"{script.name}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name not in defined[node.module]
                ]
    assert len(defined) >= 3 and not missing, missing


@BENCH_RUNNER
def test_benchmarks_are_a_package_that_never_edits_sys_path():
    """Every benchmark runs as `python -m benchmarks.<name>`: helpers are imported from the
    package, never found through a `sys.path` edit."""
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    assert (folder / "__init__.py").is_file() and (folder / "gpu_check" / "__main__.py").is_file()
    edits = [
        f"{p.relative_to(folder)}:{n}"
        for p in sorted(folder.rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "sys.path" in line
    ]
    assert not edits, edits


@pytest.mark.parametrize("content", [None, b"not a zip archive"])
def test_diagnose_command_says_in_one_line_why_a_file_cannot_be_loaded(tmp_path, capsys, content):
    # A missing file and a file that is not a .keras archive: one line on stderr, exit 2, no
    # traceback (Keras' own error for either is a traceback from inside its zip reader).
    from keras_perf import cli

    path = tmp_path / "model.keras"
    if content is not None:
        path.write_bytes(content)
    assert cli.main(["diagnose", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(path) in err
    assert ("no such file" if content is None else "not a saved Keras model") in err


def test_diagnose_synthetic_inputs_fill_open_dimensions_for_a_convolution():
    # `Input((None, None, 3))` with a valid 3x3 convolution: open dimensions used to become 1,
    # which the convolution cannot take; they get OPEN_DIMENSION, and the targets the shape of
    # the outputs on those inputs.
    import keras
    import numpy as np

    from keras_perf import cli

    inputs = keras.Input((None, None, 3))
    h = keras.layers.Conv2D(4, 3, padding="valid")(inputs)
    outputs = keras.layers.Conv2D(2, 3, padding="valid")(h)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    x, y = cli.synthetic_batch(model, 6)
    assert x.shape == (6, cli.OPEN_DIMENSION, cli.OPEN_DIMENSION, 3)
    assert y.shape == (6, cli.OPEN_DIMENSION - 4, cli.OPEN_DIMENSION - 4, 2)
    history = model.fit(x, y, batch_size=3, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_diagnose_synthetic_targets_are_class_ids_for_a_sparse_loss():
    import keras
    import numpy as np

    from keras_perf import cli

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = cli.synthetic_batch(model, 10)
    assert x.shape == (10, 5) and y.shape == (10,)
    assert y.dtype == np.int32 and 0 <= y.min() and y.max() < 7
