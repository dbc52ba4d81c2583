"""scikit-learn's bundled 8x8 digits, as the demo, the benchmarks and the tests load them."""

from __future__ import annotations

import numpy as np

from keras_perf._imports import require


def load_digits_split(seed: int | None = 0, sizes: tuple[int, ...] = (1077, 360)):
    """The 1,797 digits as `(x, y)` parts: `x` float32 in [0, 1] (pixels / 16), `y` int32.

    Args:
        seed: Seed of the permutation applied before splitting, or `None` for scikit-learn's
            order. Defaults to `0`.
        sizes: Sizes of the leading parts; the last part holds the rest. Defaults to
            `(1077, 360)`: train 1077, validation 360, test 360 (the demo's split).
            `(1437,)` gives train 1437 / test 360, `()` everything as one part.

    Returns:
        A tuple of `len(sizes) + 1` pairs `(x, y)`, `x` of shape `(n, 64)`.

    Raises:
        ImportError: scikit-learn is not installed (the message names the `demo` extra).
    """
    require("sklearn", "load_digits_split", extra="demo")
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images.reshape(len(data.images), -1) / 16.0).astype("float32")
    y = data.target.astype("int32")
    if seed is not None:
        idx = np.random.default_rng(seed).permutation(len(x))
        x, y = x[idx], y[idx]
    bounds = np.cumsum([0, *sizes, len(x) - sum(sizes)])
    return tuple((x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
