"""`python -m benchmarks.gpu_check`: see the package's docstring."""

import sys

from . import main

sys.exit(main())
