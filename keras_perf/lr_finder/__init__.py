"""The learning-rate range test: `find_learning_rate` and its result, `LRFinderResult`.

The parts: `_finder` (`find_learning_rate`: arguments, the learning-rate swap, the `fit` that
runs the test and its callback), `_state` (what a `fit` changes in a model, saved and put
back), `_curve` (smoothing, the divergence rule, `steepest_descent`, `LRFinderResult` and its
plot). The one private Keras attribute it reads (an optimizer's schedule object) is read
through `keras_perf._keras_internals.learning_rate_source`.
"""

from keras_perf.lr_finder._curve import LRFinderResult, steepest_descent
from keras_perf.lr_finder._finder import find_learning_rate

__all__ = ["LRFinderResult", "find_learning_rate", "steepest_descent"]
