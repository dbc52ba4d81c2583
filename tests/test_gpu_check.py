"""benchmarks.gpu_check: the GPU check runs end to end on the CPU (`--dry-run`).

No GPU is needed: the dry run takes the same code path with tiny models and an injected OOM.
It runs in a child process in which TensorFlow, tf_keras, tfmot, scikit-learn and matplotlib
cannot be imported (a GPU machine need have none of them), nor the other of JAX and torch (the
check runs the backend that is installed and says the other is not), through a
`sitecustomize` module that blocks them in the child and in every process it starts. The GPU
kit is JAX/torch only: on the TensorFlow backend the end-to-end test is skipped.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import keras
import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import _orchestrate

ROOT = Path(__file__).resolve().parent.parent
MODULE = ["-m", "benchmarks.gpu_check"]
BACKEND = keras.backend.backend()
OTHER = {"jax": "torch", "torch": "jax"}.get(BACKEND)
BLOCKED = ["tensorflow", "tf_keras", "tensorflow_model_optimization", "sklearn", "matplotlib"]
HEAVY = ("keras", "tensorflow", "jax", "torch")


def _env(tmp_path, **extra):
    """This checkout on the path; `sitecustomize` blocking `BLOCKED` in every child process."""
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import os, sys
            for name in os.environ.get("KP_TEST_BLOCK", "").split(","):
                if name:
                    sys.modules[name] = None  # `import name` raises ModuleNotFoundError
            """
        )
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KP_TEST_BLOCK=",".join(BLOCKED), **extra)
    parts = (str(tmp_path), str(ROOT), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    return env


@pytest.mark.slow
@pytest.mark.backends("jax", "torch")
def test_dry_run_gives_every_row_without_tensorflow_nor_the_other_backend(tmp_path):
    # Both backends asked for (`keras-perf bench --gpu`'s default), the other not installed:
    # this one runs in full, the other is said to be missing, and the exit code is 0.
    out, md = tmp_path / "out.json", tmp_path / "table.md"
    env = _env(tmp_path)
    env["KP_TEST_BLOCK"] += "," + OTHER
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_perf",
            "bench",
            "--gpu",
            "--dry-run",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"gpu_check: {OTHER} is not installed, so it is not run" in proc.stdout
    assert f"Not installed, not run: {OTHER}" in md.read_text()
    result = json.loads(out.read_text())
    assert result["not_installed"] == [OTHER] and list(result["devices"]) == [BACKEND]
    rows = result["rows"]
    assert [r["id"] for r in rows] == gpu_check.expected_ids()
    assert len(rows) == 32
    assert [r["error"] for r in rows] == [None] * 32
    assert all(r["dry_run"] and r["backend"] == BACKEND for r in rows)
    # Nothing optional was imported in any worker process (the blocker held, and nothing
    # needed TensorFlow: keras itself imports sklearn and matplotlib where installed).
    assert result["imported_optional"] == {BACKEND: []}
    assert result["devices"][BACKEND]["device"] == "CPU"
    # One table, one line per row, each marked as a dry run.
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    assert len(lines) == 1 + 32 and lines[0].startswith("| section | backend | case |")
    assert all("dry-run" in ln and "ERROR" not in ln for ln in lines[1:])
    assert [ln for ln in md.read_text().splitlines() if ln.startswith("| ")] == lines
    by_id = {r["id"]: r for r in rows}
    # 1: MFU from the monitor beside the hand count; speed-up against float32.
    for model in ("mlp", "convnet"):
        for policy in gpu_check.POLICIES:
            r = by_id[f"1/{model}/{policy}"]
            assert r["examples_per_s"] > 0 and 0 < r["mfu_monitor"] < 1
            assert r["mfu_hand"] == pytest.approx(
                r["flops_hand"] * r["examples_per_s"] / r["peak_flops"]
            )
            assert (r["ratio"] is None) == (policy == "float32")
    # MLP: the monitor's estimate (3 x forward, weights only) vs 6 x params (biases too).
    mlp = by_id["1/mlp/float32"]
    assert mlp["flops_hand"] == 6 * (32 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10)
    assert mlp["flops_monitor"] == 6 * (32 * 64 + 64 * 64 + 64 * 10)
    assert by_id["1/convnet/float32"]["flops_monitor"] == by_id["1/convnet/float32"]["flops_hand"]
    # 2: every micro-batch setting at the same batch, with a peak and a step-time ratio.
    for k in gpu_check.MICROBATCHES:
        r = by_id[f"2/microbatches={k}"]
        assert r["batch"] == 8 and r["peak_memory_bytes"] > 0 and r["step_ms"] > 0
        assert (r["ratio"] is None) == (k == 1)
    # 3: two injected OOMs (32 -> 16 -> 8 examples per slice), the same weights as 4
    # micro-batches from the start, and the probe's answer.
    oom = by_id["3/oom_retry"]
    assert [e["microbatches"] for e in oom["oom_events"]] == [1, 2]
    assert oom["final_microbatches"] == 4 and oom["max_weight_diff"] <= 1e-5
    assert by_id["3/find_max_microbatch"]["max_microbatch"] == 8
    # 4: per-step cost against its baseline.
    for row_id in ("4/distillation/DistillationModel", "4/pruning/PruningCallback"):
        assert by_id[row_id]["ratio"] > 0 and by_id[row_id]["ratio_of"] == "step_ms"
    # 5: diagnose's verdict, its shares, its own time, and its top change checked by real fits.
    for case in gpu_check.DIAGNOSE_CASES:
        r = by_id[f"5/{case}"]
        assert r["bottleneck"] in ("input", "host", "compute")
        assert abs(sum(r["shares"].values()) - 1) < 1e-9
        assert 0 < r["diagnose_s"] and r["max_seconds"] == 3
        if r["what_if"]:
            assert r["top"] == r["what_if"][0]["change"] and r["real"] > 0
            assert r["ratio"] == pytest.approx(r["predicted"] / r["real"])
    # 6: remat against none, per model: a peak, a step-time ratio and a memory ratio; then the
    # injected OOM fixed by remat at the same batch, with the weights of remat from the start.
    for model in ("mlp", "transformer", "resnet50"):
        none, full = by_id[f"6/{model}/remat=none"], by_id[f"6/{model}/remat=full"]
        assert none["peak_memory_bytes"] > 0 and full["peak_memory_bytes"] > 0
        assert none["ratio"] is None and full["ratio"] > 0 and full["memory_ratio"] > 0
    fixed = by_id["6/oom_fixed_by_remat"]
    assert [e["strategy"] for e in fixed["oom_events"]] == ["remat"]
    assert fixed["batch"] == 16 and fixed["max_weight_diff"] <= 1e-5


@pytest.mark.parametrize("cmd", [MODULE, ["-m", "keras_perf", "bench", "--gpu"]])
def test_without_a_gpu_it_stops_at_once_and_says_why(tmp_path, cmd):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *cmd],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(tmp_path, CUDA_VISIBLE_DEVICES=""),
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "no NVIDIA GPU on this machine" in proc.stderr and "--dry-run" in proc.stderr
    imported = {
        ln.rsplit("|", 1)[-1].strip().split(".")[0]
        for ln in proc.stderr.splitlines()
        if ln.startswith("import time:")
    }
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--dry-run"], "--dry-run and --json go with --gpu"),
        (["bench", "--gpu", "--quick"], "--quick, --smoke and --only do not apply to --gpu"),
        (["bench", "--gpu", "--smoke"], "--quick, --smoke and --only do not apply to --gpu"),
    ],
)
def test_cli_refuses_flags_that_do_not_go_together(capsys, argv, message):
    from keras_perf import cli

    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_builds_the_gpu_check_command():
    from keras_perf import bench, cli

    args = cli.build_parser().parse_args(["bench", "--gpu", "--dry-run", "--json", "o.json"])
    cmd = bench.gpu_command(args, ROOT / "benchmarks")
    assert cmd[1:] == [*MODULE, "--dry-run", "--backends", "jax,torch", "--json", "o.json"]


def test_script_refuses_tensorflow_and_unknown_sections():
    with pytest.raises(SystemExit, match="jax and/or torch"):
        gpu_check._parse_backends("tensorflow")
    with pytest.raises(SystemExit):
        gpu_check.build_parser().parse_args(["--sections", "8"])


def test_a_process_that_dies_leaves_an_error_in_each_of_its_rows():
    # An unknown backend makes the child fail at `import keras`: both rows of section 3 are
    # there, each saying so; the JSON the orchestrator keeps has no hole.
    res = gpu_check.run_child("no_such_backend", True, [3], timeout=120)
    assert [r["id"] for r in res["rows"]] == ["3/oom_retry", "3/find_max_microbatch"]
    assert all("no_such_backend process exited" in r["error"] for r in res["rows"])


@pytest.mark.backends("jax", "torch")
def test_a_failing_section_is_reported_in_its_rows_and_the_next_runs(tmp_path, monkeypatch):
    def broken(ctx, rows):
        rows.append(gpu_check._row(ctx, "3/oom_retry", "half done", note="ok"))
        raise RuntimeError("section 3 broke")

    calls = []
    monkeypatch.setitem(gpu_check.SECTION_RUNNERS, 3, broken)
    monkeypatch.setitem(gpu_check.SECTION_RUNNERS, 4, lambda ctx, rows: calls.append(4))
    out = tmp_path / "w.json"
    args = SimpleNamespace(
        json=str(out), sections="3,4", microbatches="1", dry_run=True, batch=None
    )
    assert gpu_check.worker(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["id"], r["error"]) for r in rows] == [
        ("3/oom_retry", None),
        ("3/find_max_microbatch", "RuntimeError: section 3 broke"),
    ]
    assert calls == [4]


def _stub_backend(ran):
    def run_backend(backend, dry, sections, timeout, on_part=None):
        ran.append(backend)
        rows = [
            {"id": i, "section": int(i[0]), "backend": backend, "case": i, "error": None}
            for i in gpu_check.expected_ids(sections)
        ]
        info = {"device": "CPU", "memory_limit_bytes": None, "versions": {}}
        return {"info": info, "rows": rows, "imported_optional": [], "processes": 1, "seconds": 1}

    return run_backend


def test_a_backend_that_is_not_installed_is_not_run_and_said(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(_orchestrate, "run_backend", _stub_backend(ran))
    monkeypatch.setattr(_orchestrate, "backend_installed", lambda b: b == "jax")
    out = tmp_path / "o.json"
    argv = ["--dry-run", "--backends", "jax,torch", "--sections", "3", "--json", str(out)]
    assert gpu_check.main(argv) == 0  # no error row for the missing backend
    stdout = capsys.readouterr().out
    assert ran == ["jax"]
    assert "gpu_check: torch is not installed, so it is not run (pip install torch" in stdout
    assert "Not installed, not run: torch" in stdout
    result = json.loads(out.read_text())
    assert result["not_installed"] == ["torch"]
    assert {r["backend"] for r in result["rows"]} == {"jax"} and len(result["rows"]) == 2
    # A merged table of a JAX-only and a torch-only run has both: nothing is "not installed".
    torch_part = dict(result, devices={"torch": result["devices"]["jax"]}, not_installed=["jax"])
    (tmp_path / "t.json").write_text(json.dumps(torch_part))
    assert gpu_check.main(["--merge", str(out), str(tmp_path / "t.json")]) == 0
    assert "Not installed" not in capsys.readouterr().out
    # Neither installed: nothing runs, one line says why, exit code 2.
    monkeypatch.setattr(_orchestrate, "backend_installed", lambda b: False)
    assert gpu_check.main(argv) == 2
    captured = capsys.readouterr()
    assert ran == ["jax"]
    assert captured.err == "gpu_check: nothing to run: jax and torch are not installed\n"


def test_backend_installed_finds_without_importing():
    assert _orchestrate.backend_installed(BACKEND)
    assert not _orchestrate.backend_installed("no_such_framework")


def test_ratios_and_table():
    rows = [
        {
            "id": "1/mlp/float32",
            "section": 1,
            "backend": "jax",
            "case": "a",
            "examples_per_s": 100.0,
            "error": None,
        },
        {
            "id": "1/mlp/mixed_bfloat16",
            "section": 1,
            "backend": "jax",
            "case": "b",
            "examples_per_s": 250.0,
            "mfu_monitor": 0.4,
            "error": None,
        },
        {
            "id": "2/microbatches=1",
            "section": 2,
            "backend": "torch",
            "case": "c",
            "step_ms": 10.0,
            "error": None,
        },
        {
            "id": "2/microbatches=8",
            "section": 2,
            "backend": "torch",
            "case": "d",
            "step_ms": 13.0,
            "peak_memory_bytes": 3 * 2**30,
            "error": None,
        },
        {
            "id": "2/microbatches=2",
            "section": 2,
            "backend": "jax",
            "case": "e",
            "step_ms": 13.0,
            "error": "out of memory",
        },
    ]
    gpu_check.add_ratios(rows)
    assert [r["ratio"] for r in rows] == [None, 2.5, None, 1.3, None]  # jax has no mb=1 row
    text = gpu_check.table(rows).splitlines()
    assert "| 2.50x speed |" in text[3] and "| 40.0% |" in text[3]
    assert "| 1.30x time | 3.00 GiB |" in text[5]
    assert text[6].endswith("| ERROR: out of memory |")


def test_remat_rows_report_time_and_memory_against_no_remat():
    rows = [
        {
            "id": f"6/transformer/remat={mode}",
            "section": 6,
            "backend": "torch",
            "case": mode,
            "step_ms": ms,
            "peak_memory_bytes": peak,
            "error": None,
        }
        for mode, ms, peak in (("none", 100.0, 8 * 2**30), ("full", 124.0, 2**30))
    ]
    gpu_check.add_ratios(rows)
    assert rows[0]["ratio"] is None and rows[1]["ratio"] == pytest.approx(1.24)
    assert rows[1]["memory_ratio"] == pytest.approx(8.0)
    line = gpu_check.table(rows).splitlines()[3]
    assert "| 1.24x time | 1.00 GiB |" in line
    assert "peak memory of remat=none / this: 8.00" in line
    assert gpu_check.expected_ids([6])[-1] == "6/oom_fixed_by_remat"
