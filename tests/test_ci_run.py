"""`.ci/run` stops at the first failing step: run on stub `pip`, `python` and `ruff`.

The script is copied into a temporary repository layout; `KP_VENV` points to a fake virtual
environment whose `bin/activate` puts the stubs first on PATH. Each stub appends its command
line to a log, so a test sees which steps ran. Nothing is installed and no test suite runs.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# .ci/run on stubs: no backend is imported, so the checks run once, on TensorFlow.
pytestmark = pytest.mark.backends("tensorflow")

# Exits $FAIL_RC when its command line contains $FAIL_ON (and, if set, KERAS_BACKEND is
# $FAIL_BACKEND); else 0.
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $* [${KERAS_BACKEND:-tensorflow}]" >> "$STUB_LOG"
if [ -n "${FAIL_ON:-}" ] && [[ "$(basename "$0") $*" == *"$FAIL_ON"* ]] \\
   && { [ -z "${FAIL_BACKEND:-}" ] || [ "${KERAS_BACKEND:-tensorflow}" = "$FAIL_BACKEND" ]; }; then
  exit "$FAIL_RC"
fi
exit 0
"""


def _run_ci(tmp_path, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    repo, venv = tmp_path / "repo", tmp_path / "venv"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "pip", "ruff"):
        (venv / "bin" / name).write_text(STUB)
        (venv / "bin" / name).chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    log = tmp_path / "log"
    log.touch()
    run_env = {**os.environ, "FAIL_RC": "1", "KP_VENV": str(venv), "STUB_LOG": str(log), **env}
    run_env.pop("KERAS_BACKEND", None)
    proc = subprocess.run(
        ["bash", str(repo / ".ci" / "run")], capture_output=True, text=True, timeout=60, env=run_env
    )
    return proc, log.read_text().splitlines()


def test_stubs_let_the_whole_run_pass(tmp_path):
    # The harness itself: with no failing step every stage runs, three backends of pytest.
    proc, log = _run_ci(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert log[:2] == [
        "pip install -e .[test] [tensorflow]",
        "python -m pytest [tensorflow]",
    ]
    assert "ruff check . [tensorflow]" in log
    assert {ln.rsplit(" ", 1)[1] for ln in log if "-m pytest" in ln} == {
        "[tensorflow]",
        "[jax]",
        "[torch]",
    }
    # Every backend runs its slow tier (less the `heavy` cases, run by hand), and its `timing`
    # tests alone in one process after it:
    # TensorFlow's default tier is the README's command, JAX's and PyTorch's share a session
    # with their slow tier (less the TF-only cases).
    k = "-k not resnet50 and not efficientnet and not pairs_of_pieces and not test_doctests"
    assert [ln for ln in log if "-m pytest" in ln] == [
        "python -m pytest [tensorflow]",
        f"python -m pytest -m not timing and not heavy {k} [jax]",
        "python -m pytest -m timing -n 0 [jax]",
        f"python -m pytest -m not timing and not heavy {k} [torch]",
        "python -m pytest -m timing -n 0 [torch]",
        "python -m pytest -m slow and not timing and not heavy [tensorflow]",
        "python -m pytest -m timing -n 0 [tensorflow]",
    ]


def test_failed_install_stops_the_run_before_pytest(tmp_path):
    # Was: `pip install -e ".[test]" && python -m pytest` under `set -e` went on to the lint
    # stage and the JAX tests after the install failed.
    proc, log = _run_ci(tmp_path, FAIL_ON=".[test]")
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert log == ["pip install -e .[test] [tensorflow]"]
    assert "=== lint" not in proc.stdout


@pytest.mark.parametrize("backend, ran", [("tensorflow", 2), ("jax", 8)])
def test_pytest_collecting_no_tests_fails_the_run(tmp_path, backend, ran):
    # pytest's exit code 5 ("no tests collected") fails the run at that stage.
    proc, log = _run_ci(tmp_path, FAIL_ON="-m pytest", FAIL_RC="5", FAIL_BACKEND=backend)
    assert proc.returncode == 5, proc.stdout[-2000:]
    assert len(log) == ran and log[-1].startswith("python -m pytest"), log
    assert log[-1].endswith(f"[{backend}]"), log
    if backend == "jax":  # through run_pytest, which says why
        assert "pytest collected no tests: failing CI" in proc.stderr
