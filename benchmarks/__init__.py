"""The benchmarks of keras-perf: one module per claim, run as `python -m benchmarks.<name>`.

Run from the repository root (or with it on `PYTHONPATH`); `keras-perf bench` runs every
`bench_*` module and prints one table (docs/BENCHMARKS.md). The modules whose name starts
with an underscore are shared helpers, not benchmarks.
"""

import os

# Before any module of the package imports TensorFlow: its C++ start-up logs stay quiet.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
