"""What each precision is worth here: measured matmul, convolution and training-step speed.

`kp.precision_report()` times a matmul and a 3x3 convolution in float32, bfloat16 and float16
on the current backend and device, and, on a CPU whose bfloat16 kernels are clearly faster, a
small Keras training step (a Dense model and a Conv model) under `float32` and
`mixed_bfloat16`. A kernel ratio alone misleads: torch's bfloat16 convolutions are 2.2x
faster on an AMX CPU, yet a Keras CNN trains 0.66x as fast there (casts and layout changes
around each layer), so the training step decides. The result is computed once per process.
"""

from __future__ import annotations

import statistics
import time

import keras
import numpy as np

from keras_perf import backend as _backend
from keras_perf._cpu import cpu_info
from keras_perf._utils import ReadOnlyReport

__all__ = ["precision_report", "PrecisionReport", "SPEEDUP_THRESHOLD", "slower_than_float32"]

DTYPES = ("float32", "bfloat16", "float16")
#: `"auto"` picks mixed_bfloat16 on a CPU only when every layer family measured (the Dense and
#: the Conv training step) runs at least this many times as fast as in float32.
SPEEDUP_THRESHOLD = 1.3
# Half-precision units a CPU advertises in /proc/cpuinfo (Linux).
_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "amx_fp16", "avx512_fp16", "amx_tile")
_CACHE: dict = {}
# On a CPU, a half dtype whose warm-up call costs over _GIVE_UP times float32's call is not
# timed further: far from the 1.3x auto needs (see `_measure_kernels`).
_GIVE_UP = 4.0


class PrecisionReport(ReadOnlyReport):
    """What `kp.precision_report()` measured: a read-only mapping that prints as a table.

    Keys: `backend`, `device` (`kind`, `name`; on a Linux CPU also `half_precision_units`, the
    bfloat16/float16/AMX flags /proc/cpuinfo lists), `tflops` (matmul TFLOP/s per dtype, None
    where the dtype cannot run), `conv_tflops` (the same for the convolution), `speedup`
    (bfloat16 over float32: `matmul`, `conv`, and the Keras training steps `dense_step`,
    `conv_step`; float16 over float32: `float16_matmul`, `float16_conv`; None where not
    measured), `policy` (what `"auto"` picks), `reason` (why, in
    words) and `seconds` (how long the measurement took).
    """

    def __init__(self, data: dict):
        self._data = dict(data)

    def to_dict(self) -> dict:
        """A JSON-serialisable copy of the report."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._data.items()}

    def __str__(self) -> str:
        d = self._data
        dev = d["device"]
        units = dev.get("half_precision_units")
        where = f"{dev['kind']}: {dev['name']}"
        if units is not None:
            where += f" [{' '.join(units) or 'no bf16/fp16 units'}]"
        lines = [f"precision report ({d['backend']}, {where})"]
        lines.append(f"{'dtype':<10}{'matmul TFLOP/s':>16}{'conv TFLOP/s':>14}")
        for dtype in DTYPES:
            cells = [_fmt(d["tflops"].get(dtype)), _fmt(d["conv_tflops"].get(dtype))]
            lines.append(f"{dtype:<10}{cells[0]:>16}{cells[1]:>14}")
        s = d["speedup"]
        names = (("matmul", "matmul"), ("conv", "conv"), ("dense_step", "Dense train step"))
        names += (("conv_step", "Conv train step"),)
        parts = [f"{label} {s[k]:.2f}x" for k, label in names if s.get(k) is not None]
        if parts:
            lines.append("bfloat16 / float32 speed: " + ", ".join(parts))
        parts = [f"{op} {s[f'float16_{op}']:.2f}x" for op in ("matmul", "conv")]
        if all(s.get(f"float16_{op}") is not None for op in ("matmul", "conv")):
            lines.append("float16 / float32 speed: " + ", ".join(parts))
        lines.append(f"'auto' picks {d['policy']}: {d['reason']}")
        return "\n".join(lines)

    __repr__ = __str__


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _cpu_info() -> dict:
    """The CPU's model name and half-precision flags from /proc/cpuinfo (Linux), else {}."""
    name, flags = cpu_info()
    if name is None and not flags:
        return {}
    info = {} if name is None else {"name": name}
    info["half_precision_units"] = [f for f in _CPU_FLAGS if f in flags]
    return info


def _device() -> dict:
    devices = _backend.list_devices()
    accelerators = [d for d in devices if d["kind"] in ("GPU", "TPU")]
    if accelerators:
        return {"kind": accelerators[0]["kind"], "name": str(accelerators[0]["name"])}
    info = {"kind": "CPU", "name": "cpu"}
    info.update(_cpu_info())
    return info


def _time_calls(
    fn, on_cpu: bool, budget_s: float, min_calls: int = 3, max_calls: int = 30, give_up_s=None
):
    """Seconds per call of `fn` (one warm-up call first): (min wall time, median cost), the
    cost being process CPU time on a CPU (other processes' load does not inflate it) and wall
    time on an accelerator. A warm-up call costing more than `give_up_s` is the measurement
    (its one-time costs only make it slower)."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    first = (time.perf_counter() - w, time.process_time() - c)
    if give_up_s is not None and first[1 if on_cpu else 0] > give_up_s:
        return first[0], max(first[1 if on_cpu else 0], 1e-9)
    walls, cpus = [], []
    start = time.perf_counter()
    while len(walls) < max_calls and (
        len(walls) < min_calls or time.perf_counter() - start < budget_s
    ):
        w, c = time.perf_counter(), time.process_time()
        fn()
        cpus.append(time.process_time() - c)
        walls.append(time.perf_counter() - w)
    cost = statistics.median(cpus if on_cpu else walls)
    return min(walls), max(cost, 1e-9)


def _flops(op: str, size: int) -> float:
    return 2.0 * size**3 if op == "matmul" else 2.0 * 16 * size**2 * 64 * 64 * 9


def _measure_kernels(on_cpu: bool) -> dict:
    """`{op: {dtype: (tflops or None, cost per call or None)}}` for matmul and conv."""
    size = {"matmul": 768, "conv": 16} if on_cpu else {"matmul": 4096, "conv": 64}
    out = {}
    for op in ("matmul", "conv"):
        out[op] = {}
        flops = _flops(op, size[op])
        for dtype in DTYPES:
            f32 = out[op].get("float32", (None, None))[1]
            # On a CPU without bfloat16/float16 units these are emulated: torch's bfloat16
            # 768x768 matmul costs about 5 s of CPU on an AVX2 EPYC, 100x float32; its
            # warm-up call is then the measurement (the report is meant to take a second).
            give_up = f32 * _GIVE_UP if on_cpu and f32 is not None else None
            try:
                fn = _backend.kernel_op(op, dtype, size[op])
                wall, cost = _time_calls(fn, on_cpu, 0.05, 2, give_up_s=give_up)
            except Exception:  # noqa: BLE001 - a dtype without a kernel here cannot run: None
                out[op][dtype] = (None, None)
                continue
            out[op][dtype] = (flops / wall / 1e12, cost)
    return out


def _step_model(family: str, policy: str):
    """A small model of one layer family, every layer named and seeded, so building it moves
    no global counter or random state; the last layer computes in float32."""
    dt = keras.DTypePolicy(policy)
    init = keras.initializers.GlorotUniform(seed=0)
    tag = f"_kp_precision_{family}_{policy}"
    if family == "dense":
        inputs = keras.Input((512,), name=f"in{tag}")
        x = keras.layers.Dense(1024, "relu", kernel_initializer=init, dtype=dt, name=f"d1{tag}")(
            inputs
        )
        x = keras.layers.Dense(1024, "relu", kernel_initializer=init, dtype=dt, name=f"d2{tag}")(x)
        shape, batch = (512,), 256
    else:
        inputs = keras.Input((16, 16, 32), name=f"in{tag}")
        x = inputs
        for i in (1, 2):
            x = keras.layers.Conv2D(
                64,
                3,
                padding="same",
                activation="relu",
                kernel_initializer=init,
                dtype=dt,
                name=f"c{i}{tag}",
            )(x)
        x = keras.layers.GlobalAveragePooling2D(dtype=dt, name=f"gap{tag}")(x)
        shape, batch = (16, 16, 32), 32
    outputs = keras.layers.Dense(10, kernel_initializer=init, dtype="float32", name=f"out{tag}")(x)
    model = keras.Model(inputs, outputs, name=f"model{tag}")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3, name=f"adam{tag}"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype("float32")
    y = rng.integers(0, 10, size=(batch,))
    return lambda: model.train_on_batch(x, y)


def _measure_steps() -> dict:
    """bfloat16-over-float32 speed of a Keras training step (forward, backward, Adam) of a
    small Dense and a small Conv model, by process CPU time, the two policies alternated."""
    out = {}
    for family in ("dense", "conv"):
        steps = {p: _step_model(family, p) for p in ("float32", "mixed_bfloat16")}
        costs = {p: [] for p in steps}
        for policy in steps:
            steps[policy]()  # trace / warm up
        for order in (("float32", "mixed_bfloat16"), ("mixed_bfloat16", "float32")):
            for policy in order:
                c = time.process_time()
                steps[policy]()
                costs[policy].append(time.process_time() - c)
        out[f"{family}_step"] = sum(costs["float32"]) / max(sum(costs["mixed_bfloat16"]), 1e-9)
    return out


def auto_policy(devices: list[dict] | None = None) -> str:
    """The policy the device rule picks for `devices` (GPUs and TPUs; float32 on CPUs).

    `setup_mixed_precision("auto")` follows this rule where an accelerator is visible and
    `kp.precision_report()`'s measurement on a CPU.

    Args:
        devices: Device dicts as returned by `kp.device_report()`. Defaults to the devices of
            the current backend.

    Returns:
        `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`.
    """
    devices = _backend.list_devices() if devices is None else devices
    gpus = [d for d in devices if d["kind"] == "GPU"]
    capabilities = [tuple(d.get("compute_capability") or (0, 0)) for d in gpus]
    if gpus and min(capabilities) >= (8, 0):
        # bfloat16 tensor cores (Ampere and newer) at float16's rate, without loss scaling:
        # on an H100, Keras `fit` of a matmul-bound MLP ran 3.97x float32 in bfloat16 and
        # 3.14x in loss-scaled float16 on torch, 1.73x / 1.78x on JAX (docs/BENCHMARKS.md).
        return "mixed_bfloat16"
    if gpus and min(capabilities) >= (7, 0):
        return "mixed_float16"
    if any(d["kind"] == "TPU" for d in devices):
        return "mixed_bfloat16"
    return "float32"


def _decide(device: dict, speedup: dict, measure_steps) -> tuple[str, str]:
    """The policy `"auto"` picks and why; `measure_steps()` runs only where it decides."""
    if device["kind"] != "CPU":
        policy = auto_policy()
        return policy, (
            f"by the {device['kind']} rule: mixed_bfloat16 on CUDA GPUs of compute capability "
            ">= 8.0 (bfloat16 tensor cores, no loss scaling), mixed_float16 on 7.x (float16 "
            "tensor cores), mixed_bfloat16 on TPUs, else float32"
        )
    t = SPEEDUP_THRESHOLD
    kernels = [speedup[k] for k in ("matmul", "conv") if speedup.get(k) is not None]
    if not kernels or max(kernels) < t:
        shown = ", ".join(
            f"{k} {speedup[k]:.2f}x" for k in ("matmul", "conv") if speedup.get(k) is not None
        )
        return "float32", (
            f"bfloat16 kernels are not clearly faster than float32 here ({shown or 'no kernel'};"
            f" mixed_bfloat16 needs >= {t}x)"
        )
    speedup.update(measure_steps())
    steps = {"Dense": speedup["dense_step"], "Conv": speedup["conv_step"]}
    shown = ", ".join(f"{k} {v:.2f}x" for k, v in steps.items())
    if min(steps.values()) >= t:
        return "mixed_bfloat16", (
            f"a Keras training step runs >= {t}x as fast in mixed_bfloat16 as in float32 on "
            f"every layer family measured ({shown})"
        )
    slow = [k for k, v in steps.items() if v < t]
    return "float32", (
        f"bfloat16 kernels are faster, but a Keras training step is not >= {t}x as fast in "
        f"mixed_bfloat16 on {' and '.join(slow)} layers ({shown})"
    )


def cpu_policy_to_try() -> tuple[str | None, str]:
    """The half-precision policy worth timing on this CPU, without measuring anything new.

    `diagnose` times it on the user's own model. This process's `precision_report()` decides
    where it has run; otherwise a CPU with bfloat16 units (`avx512_bf16`, `amx_bf16`) is tried
    with `mixed_bfloat16` and one without is not.

    Returns:
        `(policy, reason)`: `policy` is `"mixed_bfloat16"`, or `None` with the reason it is not
        worth trying.
    """
    report = _CACHE.get("report")
    if report is not None and report["device"]["kind"] == "CPU":
        if report["policy"] == "float32":
            return None, f"kp.precision_report() measured it: {report['reason']}"
        return report["policy"], report["reason"]
    units = [f for f in _cpu_info().get("half_precision_units", []) if "bf16" in f]
    if not units:
        return None, "this CPU has no bfloat16 units (avx512_bf16, amx_bf16)"
    return "mixed_bfloat16", f"this CPU has bfloat16 units ({', '.join(units)})"


def measured_peak_flops(dtype: str) -> float | None:
    """Measured matmul FLOP/s of `dtype` on this backend and device: the peak MFU is taken
    against on a CPU, where no data sheet applies. Uses this process's precision report where
    there is one, else times the matmuls and convolutions alone (about a second, once)."""
    report = _CACHE.get("report")
    if report is not None:
        tflops = report["tflops"].get(dtype)
    else:
        if _CACHE.get("kernels") is None:
            _CACHE["kernels"] = _measure_kernels(_device()["kind"] == "CPU")
        tflops = _CACHE["kernels"]["matmul"].get(dtype, (None, None))[0]
    return None if tflops is None else tflops * 1e12


def precision_report(refresh: bool = False) -> PrecisionReport:
    """Measure which precision is fastest on this backend and device; cached per process.

    Times a matmul and a 3x3 convolution in float32, bfloat16 and float16 (about a second;
    on a CPU, a half dtype whose first call is over 4x slower than float32 is timed once),
    then, on a CPU whose bfloat16 kernels are at least `SPEEDUP_THRESHOLD` (1.3) times as fast
    as float32, a Keras training step of a small Dense and a small Conv model under each of
    `float32` and `mixed_bfloat16` (a few seconds more, mostly tracing). `"auto"` picks
    `mixed_bfloat16` there only when both training steps are >= 1.3x as fast, else `float32`;
    on GPUs and TPUs it follows the device rule of `kp.setup_mixed_precision`. Kernel speed is
    compared by process CPU time on a CPU (unaffected by other processes), TFLOP/s are from
    the fastest call's wall time. Nothing global changes: not the dtype policy, not Keras'
    random state or layer names.

    Args:
        refresh: Measure again instead of returning this process's earlier result.
            Defaults to `False`.

    Returns:
        A `PrecisionReport`: a mapping with `backend`, `device`, `tflops` (matmul TFLOP/s per
        dtype, None where the dtype cannot run), `conv_tflops`, `speedup`, `policy`, `reason`
        and `seconds`; it prints as a table, `to_dict()` gives a plain dict.

    Raises:
        TypeError: `refresh` is not a bool.

    Example:
        >>> import keras_perf as kp
        >>> report = kp.precision_report()
        >>> report["policy"] in ("float32", "mixed_bfloat16", "mixed_float16")
        True
    """
    if not isinstance(refresh, bool):
        raise TypeError(f"`refresh` must be a bool, got {refresh!r}.")
    if _CACHE.get("report") is not None and not refresh:
        return _CACHE["report"]
    start = time.perf_counter()
    device = _device()
    on_cpu = device["kind"] == "CPU"
    kernels = _CACHE.get("kernels") if not refresh else None
    kernels = kernels or _measure_kernels(on_cpu)
    speedup = {"matmul": None, "conv": None, "dense_step": None, "conv_step": None}
    for op, per_dtype in kernels.items():
        f32 = per_dtype["float32"][1]
        for dtype, key in (("bfloat16", op), ("float16", f"float16_{op}")):
            half = per_dtype[dtype][1]
            speedup[key] = f32 / half if f32 is not None and half is not None else None
    policy, reason = _decide(device, speedup, _measure_steps)
    report = PrecisionReport(
        {
            "backend": _backend.BACKEND,
            "device": device,
            "tflops": {dt: kernels["matmul"][dt][0] for dt in DTYPES},
            "conv_tflops": {dt: kernels["conv"][dt][0] for dt in DTYPES},
            "speedup": speedup,
            "policy": policy,
            "reason": reason,
            "seconds": time.perf_counter() - start,
        }
    )
    _CACHE.update(report=report, kernels=kernels)
    return report


def slower_than_float32(policy: str, report=None) -> str | None:
    """Why `policy` was measured slower than float32 here (a sentence), or None.

    A bfloat16 policy is slower where a measured Keras training step is (else where the
    bfloat16 matmul is); a float16 policy where the float16 matmul or convolution is. Speed
    ratios below 1.0 count, so noise around parity does not.

    Args:
        policy: A dtype policy name, e.g. `"mixed_bfloat16"`.
        report: A `PrecisionReport`. Defaults to `precision_report()` (this process's).
    """
    dtype = keras.DTypePolicy(policy).compute_dtype
    if dtype not in ("bfloat16", "float16"):
        return None
    report = precision_report() if report is None else report
    s = report["speedup"]
    where = f"{report['backend']} on {report['device']['kind']}"
    if dtype == "bfloat16":
        named = {
            "Dense training step": s.get("dense_step"),
            "Conv training step": s.get("conv_step"),
        }
        if all(v is None for v in named.values()):
            named = {"matmul": s.get("matmul")}
    else:
        named = {"matmul": s.get("float16_matmul"), "convolution": s.get("float16_conv")}
    slow = {k: v for k, v in named.items() if v is not None and v < 1.0}
    if not slow:
        return None
    shown = ", ".join(f"{k} {v:.2f}x" for k, v in slow.items())
    return f"{policy} was measured slower than float32 here ({where}: {shown} the float32 speed)"
