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
