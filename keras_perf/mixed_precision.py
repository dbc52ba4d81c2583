"""Choosing a mixed-precision policy and checking a model against it."""

from __future__ import annotations

import keras

from keras_perf import _keras_internals as keras_internals
from keras_perf._utils import check_choice, iter_layers
from keras_perf.precision import auto_policy, precision_report, slower_than_float32

__all__ = ["setup_mixed_precision", "check_mixed_precision", "auto_policy"]

POLICIES = ("auto", "mixed_float16", "mixed_bfloat16", "float32")
_HALF = ("float16", "bfloat16")


def setup_mixed_precision(policy: str = "auto") -> str:
    """Set Keras' global dtype policy and return its name.

    `"auto"` picks the policy `kp.precision_report()` measured fastest here:

    - on GPUs and TPUs, by device: `"mixed_bfloat16"` when every visible GPU is a CUDA GPU of
      compute capability >= 8.0 (Ampere and newer: bfloat16 tensor cores at float16's rate, and
      no loss scaling; on an H100 a matmul-bound MLP trained 3.97x as fast as float32 in
      bfloat16 and 3.14x in loss-scaled float16 on torch, 1.73x and 1.78x on JAX);
      `"mixed_float16"` on compute capability 7.x (Volta, Turing: float16 tensor cores only);
      `"mixed_bfloat16"` on TPU, whose matrix units compute in bfloat16; `"float32"` on older
      GPUs;
    - on a CPU, by measurement: `"mixed_bfloat16"` when a Keras training step of a small Dense
      and a small Conv model both run >= 1.3x as fast in it as in float32 (CPUs with AMX or
      AVX-512 BF16 units on TensorFlow: 1.6x measured, whole `fit` epochs 1.8-2.6x), else
      `"float32"` (JAX, whose XLA CPU backend has no fast bfloat16 path, 0.6-0.9x on kernels;
      torch, whose bfloat16 kernels are fast but whose Keras training steps are not).
      float16 is never picked on a CPU: it measured 0.7-0.95x float32 on all three backends.

    Under a mixed policy keep the model's last layer in float32
    (`Dense(..., dtype="float32")`): `kp.check_mixed_precision(model)` reports it otherwise.

    Args:
        policy: `"auto"`, `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`.
            Defaults to `"auto"`.

    Returns:
        The name of the policy now in force.

    Raises:
        ValueError: `policy` is not one of the accepted names.

    Example:
        >>> import keras_perf as kp
        >>> kp.setup_mixed_precision("float32")
        'float32'
    """
    if not isinstance(policy, str):
        raise TypeError(f"`policy` must be a string, one of {POLICIES}; got {policy!r}.")
    check_choice("policy", policy, POLICIES)
    name = precision_report()["policy"] if policy == "auto" else policy
    keras.mixed_precision.set_global_policy(name)
    return name


def _output_layers(model) -> list:
    outputs = getattr(model, "outputs", None)
    layers = []
    if outputs:
        for t in outputs:
            op = keras_internals.producer(t)
            if isinstance(op, keras.layers.Layer):
                layers.append(op)
    if not layers and getattr(model, "layers", None):
        layers.append(model.layers[-1])
    return layers


def _activation_name(layer) -> str | None:
    act = getattr(layer, "activation", None)
    if act is None:
        return None
    return getattr(act, "__name__", str(act))


def check_mixed_precision(model: keras.Model) -> list[str]:
    """Look for mixed-precision mistakes in `model`; return readable findings.

    Checks:

    - an output layer computing in float16/bfloat16 (a softmax or sigmoid in half precision
      saturates and its probabilities lose precision: keep the last layer in float32);
    - a layer whose dtype policy computes in float16 while the global policy is float32 (it
      gets no loss scaling, so its small gradients underflow);
    - a model with a custom `train_step` compiled under `mixed_float16` with an optimizer that
      is not a `LossScaleOptimizer` (gradients underflow), unless the model uses
      `kp.LossScaleTrainStep`, which scales the loss itself;
    - a policy that `kp.precision_report()` measured slower than float32 on this backend and
      device (e.g. `mixed_float16` on a CPU, `mixed_bfloat16` on JAX's CPU backend); this
      measures once per process (a few seconds) when the policy is not float32.

    Args:
        model: A built Keras model.

    Returns:
        A list of findings, each one sentence naming the layer and the fix. Empty when
        nothing is wrong.

    Raises:
        TypeError: `model` is not a Keras layer or model.

    Example:
        >>> import keras, keras_perf as kp
        >>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        >>> kp.check_mixed_precision(m)
        []
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model, got {type(model).__name__}.")
    findings = []
    global_policy = keras.mixed_precision.global_policy().name
    model_policy = getattr(model.dtype_policy, "name", global_policy)

    for layer in _output_layers(model):
        compute = layer.dtype_policy.compute_dtype
        if compute in _HALF:
            act = _activation_name(layer)
            what = f"a {act} " if act in ("softmax", "sigmoid") else ""
            findings.append(
                f"Output layer '{layer.name}' computes {what}in {compute}: half-precision "
                "outputs lose precision and saturate. Give it dtype='float32' "
                f"(e.g. keras.layers.Dense(..., dtype='float32')) or add "
                "keras.layers.Activation('linear', dtype='float32') after it."
            )

    if global_policy == "float32":
        for layer in iter_layers(model):
            if layer.dtype_policy.compute_dtype == "float16":
                findings.append(
                    f"Layer '{layer.name}' computes in float16 while the global policy is "
                    "float32: no loss scaling is applied to it, so its gradients can underflow. "
                    "Use kp.setup_mixed_precision('mixed_float16') or give it dtype='float32'."
                )

    uses_fp16 = "mixed_float16" in (global_policy, model_policy)
    optimizer = getattr(model, "optimizer", None)
    if uses_fp16 and optimizer is not None:
        custom_step = type(model).train_step is not keras.Model.train_step
        ours = getattr(type(model), "_keras_perf_scales_loss", False)
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        if custom_step and not ours and not scaled:
            findings.append(
                f"Model '{model.name}' has a custom train_step under mixed_float16 but its "
                f"optimizer ({type(optimizer).__name__}) is not loss-scaled: float16 gradients "
                "will underflow. Wrap it in keras.optimizers.LossScaleOptimizer and call "
                "optimizer.scale_loss(loss), or subclass kp.LossScaleTrainStep."
            )

    for policy in dict.fromkeys((global_policy, model_policy)):
        slower = slower_than_float32(policy)
        if slower:
            findings.append(
                f"{slower}. Use kp.setup_mixed_precision('auto'), which picks "
                f"'{precision_report()['policy']}' here."
            )
    return findings
