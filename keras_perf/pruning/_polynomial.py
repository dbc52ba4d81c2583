"""tfmot's `PolynomialDecay` value bit for bit: float32 arithmetic and the C library's `powf`."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys

import numpy as np


def _f32(x) -> float:
    """`x` rounded to float32, as tfmot's TF ops compute it, returned as a Python float."""
    return float(np.float32(x))


def _load_powf():
    """The C library's `powf`: what TensorFlow's scalar `Pow` kernel computes (`std::pow`).

    Looked up on first use: the process's own symbols first (POSIX; Python links libm), then
    the math library by name.
    """
    if sys.platform == "win32":
        candidates = [lambda: ctypes.CDLL("ucrtbase"), lambda: ctypes.CDLL("msvcrt")]
    else:
        candidates = [lambda: ctypes.CDLL(None), lambda: ctypes.CDLL(ctypes.util.find_library("m"))]
    for load in candidates:
        try:
            fn = load().powf
        except (OSError, AttributeError, TypeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
        return fn
    return None


_POWF: list = []  # [powf or None], filled on first use


def _powf(x: np.float32, y: np.float32) -> np.float32:
    """float32 `x ** y` exactly as TensorFlow's scalar `Pow` gives it (the C `powf`).

    NumPy's float32 `power` is not that function (it differs on about a third of inputs), and
    neither is the double `pow` rounded to float32 (about 1 in 1,000). Without a C `powf` (no
    such platform is known) the double result rounded to float32 is used.
    """
    if not _POWF:
        _POWF.append(_load_powf())
    if _POWF[0] is not None:
        return np.float32(_POWF[0](float(x), float(y)))
    return np.float32(math.pow(float(x), float(y)))


def _polynomial_sparsity(schedule, step: int, in_graph: bool = True) -> float:
    """tfmot's `PolynomialDecay` sparsity at `step`, bit for bit, as a Python float.

    tfmot computes, in float32, `p = min(1, max(0, float(step - begin) / (end - begin)))` and
    `(initial - final) * pow(1 - p, power) + final`. TensorFlow evaluates that in two ways:

    - eagerly (`in_graph=False`): as written; `pow` is the C `powf`;
    - inside a `tf.function` (`in_graph=True`, how tfmot evaluates it during `fit`), Grappler
      rewrites the graph first: the division by the constant span becomes a multiplication by
      its float32 reciprocal; `pow(d, 2)` becomes `(p - 1)**2`, `pow(d, 0.5)` `sqrt(d)`,
      `pow(d, 3)` `d * d**2` with the constant factor pushed into it,
      `((initial - final) * d) * d**2`, `pow(d, 1)` `d`.

    The two differ by one float32 ulp on a few percent of steps.
    """
    f32 = np.float32
    begin, end = schedule.begin_step, schedule.end_step
    span = f32(end - begin)
    num = f32(step - begin)
    if span == 0:  # tfmot: 0/0 = nan at begin_step; we jump to `final` there (documented).
        p = f32(1.0 if step >= begin else 0.0)
    elif in_graph:
        p = num * (f32(1.0) / span)
    else:
        p = num / span
    p = min(f32(1.0), max(f32(0.0), p))
    d = f32(1.0) - p
    power = f32(schedule.power)
    scale = f32(schedule.initial_sparsity - schedule.final_sparsity)
    final = f32(schedule.final_sparsity)
    if in_graph and power == 3:
        return float((scale * d) * (d * d) + final)
    if in_graph and power == 2:
        decay = (p - f32(1.0)) * (p - f32(1.0))
    elif in_graph and power == 0.5:
        decay = np.sqrt(d)
    elif power == 1:
        decay = d
    else:
        decay = _powf(d, power)
    return float(scale * f32(decay) + final)
