"""`tensorflow_with_bfc(code)`: run test code in a child Python on TensorFlow's BFC allocator.

TensorFlow's CPU allocator counts what a compiled step allocates only as the BFC allocator,
which `TF_CPU_ALLOCATOR_USE_BFC=true` selects before TensorFlow is imported: the test
processes have imported it already, so the tests that read that count run a child.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tensorflow_with_bfc(code: str):
    """Run `code` (its last printed line must be JSON) with the repository and tests/ on the
    path; returns that line, parsed. Fails the test with the child's stderr if it fails."""
    env = dict(
        os.environ,
        KERAS_BACKEND="tensorflow",
        TF_CPU_ALLOCATOR_USE_BFC="true",
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
