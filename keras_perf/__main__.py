"""`python -m keras_perf`: the `keras-perf` command."""

import sys

from keras_perf.cli import main

if __name__ == "__main__":
    sys.exit(main())
