import subprocess
import sys

import pytest

from keras_perf import cli


def test_doctor_prints_table(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key in ("python", "keras", "backend", "tensorflow", "policy 'auto' would pick", "devices", "CPU"):
        assert key in out


def test_help_lists_subcommands():
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    for name in ("doctor", "demo", "bench"):
        assert name in proc.stdout


def test_unknown_subcommand_fails():
    with pytest.raises(SystemExit) as info:
        cli.main(["frobnicate"])
    assert info.value.code == 2


# --- demo -------------------------------------------------------------------------------

REPORT_ROW_KEYS = {"model", "accuracy", "params", "nonzero", "gzip_bytes", "tflite_bytes",
                   "examples_per_s", "time_s"}


@pytest.mark.slow
@pytest.mark.backends("tensorflow", "jax")
def test_demo_runs_end_to_end(tmp_path, capsys):
    import json

    out = tmp_path / "demo"
    assert cli.main(["demo", "--epochs", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["epochs"] == 1
    names = [r["model"] for r in report["rows"]]
    assert names == ["teacher", "student alone", "distilled", "pruned 80%", "TFLite dynamic", "TFLite int8"]
    for r in report["rows"]:
        assert set(r) == REPORT_ROW_KEYS
        assert 0.15 <= r["accuracy"] <= 1.0, r     # one epoch (17 steps): above chance (0.1)
        assert r["params"] > 0 and 0 < r["nonzero"] <= r["params"]
    rows = {r["model"]: r for r in report["rows"]}
    assert rows["teacher"]["accuracy"] >= 0.6      # the wide teacher learns fast
    assert rows["teacher"]["params"] > 10 * rows["distilled"]["params"]
    # 80 % of the kernels are zero after pruning; biases are not pruned.
    assert rows["pruned 80%"]["nonzero"] < 0.3 * rows["pruned 80%"]["params"]
    assert rows["TFLite int8"]["tflite_bytes"] < rows["TFLite dynamic"]["tflite_bytes"] * 1.5
    for name in report["files"]:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in ("teacher.png", "summary.png", "teacher.jsonl", "student_int8.tflite"):
        assert name in report["files"]
    assert "TFLite int8" in printed and "gzip B" in printed


def test_demo_rejects_bad_epochs():
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf.cli", "demo", "--epochs", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "--epochs" in proc.stderr and ">= 1" in proc.stderr


def test_demo_rejects_unknown_backend():
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf.cli", "demo", "--backend", "theano"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "--backend" in proc.stderr and "tensorflow" in proc.stderr


# --- bench ------------------------------------------------------------------------------


def test_bench_rejects_unknown_backend(capsys):
    assert cli.main(["bench", "--backends", "theano"]) == 2
    assert "theano" in capsys.readouterr().err


def test_bench_without_scripts_says_where_it_looked(tmp_path, capsys):
    assert cli.main(["bench", "--dir", str(tmp_path)]) == 2
    assert "bench_*.py" in capsys.readouterr().err


_GOOD_SCRIPT = """
import json, sys
args = sys.argv[1:]
rows = [{"claim": "tiny claim", "backend": "tensorflow", "wall_ratio": 1.25, "cpu_ratio": 0.5,
         "target": "<= 2", "repeats": 3, "note": "stub " + ("quick" if "--quick" in args else "full")}]
json.dump({"rows": rows}, open(args[args.index("--json") + 1], "w"))
"""


@pytest.mark.parametrize("quick", [True, False])
def test_bench_reports_rows_and_failures_per_script(tmp_path, capsys, monkeypatch, quick):
    # Stub scripts: one good, one raising, one exiting non-zero. Each is reported on its own,
    # the good rows still print, and the exit code says something failed.
    (tmp_path / "bench_a.py").write_text(_GOOD_SCRIPT)
    (tmp_path / "bench_b.py").write_text("raise RuntimeError('broken on purpose')\n")
    (tmp_path / "bench_c.py").write_text("import sys; sys.exit(3)\n")
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    args = ["bench", "--dir", str(tmp_path)] + (["--quick"] if quick else [])
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    for name in ("bench_a.py", "bench_b.py", "bench_c.py"):
        assert f"running {name}" in out
    assert "1 rows in" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("tiny claim"))
    assert "1.250" in row and "0.500" in row and "<= 2" in row
    assert ("stub quick" if quick else "stub full") in row
    assert out.count("FAILED") == 2 * 2  # once as each script ends, once in the table
    assert "broken on purpose" in out
    assert "exit 3" in out


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_bench_quick_prints_every_row(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    md = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "-m", "keras_perf.cli", "bench", "--quick", "--markdown", str(md)],
        capture_output=True, text=True, timeout=900, cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scripts = sorted(p.name for p in (root / "benchmarks").glob("bench_*.py"))
    for name in scripts:
        assert f"running {name}" in proc.stdout
    assert "FAILED" not in proc.stdout
    table = md.read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| claim")]
    assert len(rows) >= len(scripts)              # every script contributes its claims


def test_bench_quick_kills_a_script_that_hangs(tmp_path):
    import time

    from keras_perf.bench import run_in_one_process

    (tmp_path / "bench_a.py").write_text(_GOOD_SCRIPT)
    (tmp_path / "bench_b.py").write_text("import time; time.sleep(120)\n")  # prints nothing
    (tmp_path / "bench_c.py").write_text(_GOOD_SCRIPT)
    scripts = sorted(tmp_path.glob("bench_*.py"))
    started, done = [], []
    t0 = time.perf_counter()
    results = run_in_one_process(scripts, "tensorflow", 5.0, started.append, done.append)
    assert time.perf_counter() - t0 < 60
    assert [r["script"] for r in results] == ["bench_a.py", "bench_b.py", "bench_c.py"]
    assert results[0]["error"] is None and len(results[0]["rows"]) == 1
    assert "timed out after 5 s" in results[1]["error"]
    assert "timed out" in results[2]["error"]  # never started
    assert done == results and [p.name for p in started] == ["bench_a.py", "bench_b.py"]
