"""FLOP counts for MFU: training FLOPs per example of a model, peak FLOP/s of known accelerators.

Model FLOPs utilisation (MFU) is achieved model FLOP/s divided by the device's peak:
``mfu = flops_per_example * examples_per_s / peak_flops``. Both inputs are estimates, so both
can always be given by hand (`kp.TrainingMonitor(flops_per_example=..., peak_flops=...)`);
these helpers fill them in where that can be done honestly and return `None` otherwise.
"""

from __future__ import annotations

import math
import re

import keras

from keras_perf import backend as _backend
from keras_perf._utils import _direct_sublayers, iter_layers

__all__ = ["estimate_flops_per_example", "peak_flops_for_device"]

# Layers whose trainable weights do (almost) no arithmetic per example: a lookup, or a few
# element-wise operations per feature. They add nothing to the count.
_NEGLIGIBLE = (
    keras.layers.Embedding,
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
)
# Convolutions with kernel shape (*window, in_channels / groups, out) or, for the depthwise
# ones, (*window, in_channels, multiplier): each output position costs 2 * kernel.size FLOPs.
_CONVS = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
)


def _positions(layer, spatial_first: bool = False) -> int | None:
    """Number of positions a layer's kernel is applied at per example (product of the output's
    non-batch, non-channel dimensions), or None when the output shape is not known."""
    try:
        shape = tuple(layer.output.shape)
    except (AttributeError, ValueError, RuntimeError):
        return None
    inner = shape[2:] if spatial_first else shape[1:-1]
    if any(d is None for d in inner):
        return None
    return math.prod(inner)


def _forward_flops(layer) -> float | None:
    if isinstance(layer, keras.layers.Dense):
        positions = _positions(layer)
        return None if positions is None else 2.0 * math.prod(layer.kernel.shape) * positions
    if isinstance(layer, _CONVS):
        channels_first = getattr(layer, "data_format", "channels_last") == "channels_first"
        positions = _positions(layer, spatial_first=channels_first)
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            kernel = layer.depthwise_kernel
        return None if positions is None else 2.0 * math.prod(kernel.shape) * positions
    if isinstance(layer, _NEGLIGIBLE):
        return 0.0
    return None


def estimate_flops_per_example(model: keras.Model) -> float | None:
    """Estimate the training FLOPs per example of a built model, or return `None`.

    Counts the multiply-adds of every `Dense` (applied at each position of its input, so a
    Dense on a sequence counts once per token) and of every `Conv1D/2D/3D` and
    `DepthwiseConv1D/2D` (once per output position): forward FLOPs = 2 x kernel size x
    positions. Training costs about three forward passes (the backward pass computes gradients
    for both inputs and weights), so the estimate is 3 x forward; for an MLP this is the usual
    6 x parameters. Embedding and normalisation layers count as free; biases and activations
    are ignored.

    Shapes are read from the layers' symbolic outputs, so the model must be Sequential (with an
    `Input`) or Functional. Any other layer with trainable weights (recurrent, attention,
    transposed convolutions, custom layers) makes the estimate unknown: `None`, never a
    silent under-count. Pass `flops_per_example` to `kp.TrainingMonitor` for such models.

    Args:
        model: A built `keras.Model`.

    Returns:
        Estimated training FLOPs per example as a float, or `None` when it cannot be estimated.

    Example:
        >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32),
        ...                           keras.layers.Dense(10)])
        >>> kp.estimate_flops_per_example(model)  # 6 * (64*32 + 32*10)
        14208.0
    """
    if not _backend.is_functional(model):
        return None
    total = 0.0
    for layer in iter_layers(model):
        if _direct_sublayers(layer):  # a container: its leaves are counted themselves
            continue
        if not layer.trainable_weights:
            continue
        flops = _forward_flops(layer)
        if flops is None:
            return None
        total += flops
    return 3.0 * total if total > 0 else None


# Dense (no sparsity) peak throughput in TFLOP/s from NVIDIA's data sheets:
# (name pattern, float32 on CUDA cores, 16-bit on tensor cores). TF32, which TensorFlow turns
# on by default for float32 matmuls on Ampere and later, is not used: pass `peak_flops`
# yourself to measure against it.
_PEAK_TFLOPS = (
    (r"\bH200\b", 67.0, 989.0),
    (r"\bH100\b.*\bPCIe\b", 51.0, 756.0),
    (r"\bH100\b", 67.0, 989.0),
    (r"\bA100\b", 19.5, 312.0),
    (r"\bL4\b", 30.3, 121.0),
    (r"\bV100\b", 15.7, 125.0),
    (r"\bT4\b", 8.1, 65.0),
)


def peak_flops_for_device(device_name: str | None = None, dtype: str | None = None) -> float | None:
    """Peak FLOP/s of a known accelerator, or `None` for an unknown device or a CPU.

    A small table of NVIDIA data-sheet figures (H200, H100 SXM/PCIe, A100, L4, V100, T4): dense
    tensor-core FLOP/s for 16-bit compute dtypes, CUDA-core FP32 FLOP/s for float32.

    Args:
        device_name: Device name as `kp.backend.list_devices()` reports it, or `None` for the
            first accelerator the backend sees. Defaults to `None`.
        dtype: Compute dtype, or `None` for the global mixed-precision policy's compute dtype.
            Defaults to `None`.

    Returns:
        Peak FLOP/s as a float, or `None` when the device is not in the table.

    Example:
        >>> kp.peak_flops_for_device("NVIDIA A100-SXM4-80GB", "bfloat16")
        312000000000000.0
    """
    if device_name is None:
        accelerators = [d for d in _backend.list_devices() if d["kind"] in ("GPU", "TPU")]
        if not accelerators:
            return None
        device_name = str(accelerators[0]["name"])
    if dtype is None:
        dtype = keras.mixed_precision.global_policy().compute_dtype
    sixteen_bit = dtype in ("float16", "bfloat16")
    for pattern, fp32, fp16 in _PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return (fp16 if sixteen_bit else fp32) * 1e12
    return None
