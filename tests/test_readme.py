"""The README's two commands are the ones CI and users run."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Text of README.md and .ci/run: no backend involved, so the checks run once, on TensorFlow.
pytestmark = pytest.mark.backends("tensorflow")
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest'


def _bash_blocks(text):
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_readme_has_install_demo_and_test_commands():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert 'pip install ".[tensorflow,demo]" && keras-perf demo' in blocks[0]
    assert TEST_COMMAND in blocks[1]


def test_ci_runs_the_readme_test_command_on_three_backends():
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci
    assert "KERAS_BACKEND=jax" in ci and "KERAS_BACKEND=torch" in ci
    assert "set -euo pipefail" in ci  # pytest exit code 5 (no tests) fails the run
