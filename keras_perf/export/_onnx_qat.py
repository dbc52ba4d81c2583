"""A quantization-aware model in ONNX: its float graph and the ranges it learned.

`float_copy` is the QAT model as the file computes it in float: each quantized kernel layer
becomes its float Keras layer holding the fake-quantized kernel (what the QAT model computes
with), each `ActivationQuantizer` an `Identity`, and a BatchNormalization that follows a kernel
layer is folded into it (as TFLite and ONNX Runtime fold it; per channel, the folded kernel
has the same int8 integers: each channel's scale is multiplied by the same factor). Keras exports that copy on every backend
(torch.onnx rejects the QAT model itself: its narrow weight range (-127, 127) is not one
ONNX's fake-quant export allows).

A QAT model with nested Sequential/Functional models is first `flatten`ed (inlined into one
graph of copies of its layers), so that every quantizer has a tensor of the exported graph.

`learned_ranges` finds which tensors of the exported (pre-processed) graph the quantizers sat
on: the exporters name tensors their own way, so the copy and the graph are both run once on
a probe batch (random, inside the input's learned range; it is not calibration: no range is
taken from it) and each quantizer's tensor is matched by value (channels-last or -first).
Its learned `(min, max)` then goes to that tensor, and to the tensors that carry the same
values reordered (Transpose, Reshape, MaxPool...) or clipped by a Relu the quantizer followed.
ONNX Runtime's `quantize_static` turns the ranges into scales and zero points exactly as
Keras' fake quantization nudges them (`scale = (max - min) / 255`, zero point rounded).
"""

from __future__ import annotations

import keras
import numpy as np

from keras_perf import _keras_internals as keras_internals
from keras_perf._utils import iter_layers
from keras_perf.export import _onnx_graph, _onnx_session
from keras_perf.quantization import (
    QUANTIZED_CLASSES,
    ActivationQuantizer,
    QuantizedKernelMixin,
    check_learned_ranges,
    fake_quant_kernel,
)
from keras_perf.quantization import function_name as _function_name
from keras_perf.quantization import layer_graph as _graph

_FLOAT_CLASSES = {v: k for k, v in QUANTIZED_CLASSES.items()}
_QAT_KEYS = ("weight_bits", "per_channel", "sparsity_mask", "activation_quantizer")


class _Pass(keras.layers.Layer):
    """An identity that takes the arguments of the layer it replaces (`training`, `mask`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs, training=None, mask=None):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape


def _quantizers(model) -> list:
    return [layer for layer in iter_layers(model) if isinstance(layer, ActivationQuantizer)]


def float_copy(qat) -> keras.Model:
    """The QAT model with float layers, fake-quantized kernels and identity quantizers."""
    check_learned_ranges(qat, "The ONNX int8 export")
    qat = flatten(qat)
    folds = _batch_norm_folds(qat)  # BatchNormalization name -> kernel layer
    folded = {id(k) for k in folds.values()}

    def clone(layer):
        if isinstance(layer, ActivationQuantizer) or layer.name in folds:
            return _Pass(name=layer.name)
        config = layer.get_config()
        if isinstance(layer, QuantizedKernelMixin):
            for key in _QAT_KEYS:
                config.pop(key, None)
            if id(layer) in folded:
                config["use_bias"] = True
            return _FLOAT_CLASSES[type(layer)].from_config(config)
        return type(layer).from_config(config)

    copy = keras.models.clone_model(qat, clone_function=clone)
    for old in qat.layers:
        if isinstance(old, (ActivationQuantizer, keras.layers.InputLayer)):
            continue
        new = copy.get_layer(old.name)
        if old.name in folds:
            continue
        if isinstance(old, QuantizedKernelMixin):
            kernel = fake_quant_kernel(old.masked_kernel(), old.weight_bits, old.channel_axes())
            kernel = keras.ops.convert_to_numpy(kernel)
            bias = np.zeros(kernel.shape[-1] if new.bias is None else new.bias.shape, "float32")
            if old.bias is not None:
                bias = keras.ops.convert_to_numpy(old.bias)
            bn = next((qat.get_layer(b) for b, k in folds.items() if k is old), None)
            if bn is not None:
                kernel, bias = _fold(kernel, bias, bn)
            new.kernel.assign(kernel)
            if new.bias is not None:
                new.bias.assign(bias)
        else:
            new.set_weights(old.get_weights())
    return copy


def flatten(model) -> keras.Model:
    """`model` with its nested Sequential/Functional models inlined: one Functional graph of
    fresh copies of the layers (same configs and weights), or `model` itself when nothing is
    nested. The quantizers inside a nested model then have tensors of the outer graph, which
    `learned_ranges` probes; the user's model and its layers are left untouched."""
    nested = [layer for layer in model.layers if isinstance(layer, keras.Model)]
    if not nested:
        return model
    fresh: dict[int, keras.Operation] = {}
    pairs = []
    used: dict[int, int] = {}

    def copy_of(op):
        if id(op) not in fresh:
            new = type(op).from_config(op.get_config())
            fresh[id(op)] = new
            if isinstance(op, keras.layers.Layer):
                pairs.append((op, new))
        return fresh[id(op)]

    def call(op, *args, **kwargs):
        if not isinstance(op, keras.Model):
            return copy_of(op)(*args, **kwargs)
        used[id(op)] = used.get(id(op), 0) + 1
        if used[id(op)] > 1:
            raise ValueError(
                f"export_onnx cannot inline the nested model {op.name!r} of this "
                "quantization-aware model: it is called more than once (its quantizers would "
                "have one range for several tensors). Build the model with one copy of the "
                f"sub-model per call, or export the float model with quantization='dynamic'."
            )
        return run(op, args[0] if len(args) == 1 else list(args))  # training/mask: inference

    def run(graph, inputs):
        if isinstance(graph, keras.Sequential):
            x = inputs
            for layer in graph.layers:
                if not isinstance(layer, keras.layers.InputLayer):
                    x = call(layer, x)
            return x
        return keras_internals.run_through_graph(graph, inputs, call)

    inputs = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name),
        model.inputs[0] if isinstance(model, keras.Sequential) else model.input,
    )
    try:
        flat = keras.Model(inputs, run(model, inputs), name=model.name)
    except ValueError as e:
        if "unique" not in str(e):
            raise
        raise ValueError(
            "export_onnx inlines the nested models of a quantization-aware model, and a layer "
            f"name is then used twice ({e}). Give the layers of the nested models names "
            "unique across the whole model (`name=` when building it), then apply "
            "`quantize_aware` again."
        ) from e
    for old, new in pairs:
        new.set_weights(old.get_weights())
    return flat


def _batch_norm_folds(qat) -> dict:
    """{BatchNormalization name: the Dense/Conv layer (linear activation) it alone follows}."""
    layers, consumers, *_ = _graph(qat)
    folds = {}
    for layer in layers:
        if not isinstance(layer, QuantizedKernelMixin) or isinstance(
            layer, keras.layers.EinsumDense
        ):
            continue
        users = consumers.get(layer.name, [])
        if len(users) != 1 or _function_name(layer.activation) != "linear":
            continue
        bn = qat.get_layer(users[0])
        if not isinstance(bn, keras.layers.BatchNormalization):
            continue
        rank = len(bn.input.shape)
        axis = bn.axis if isinstance(bn.axis, int) else (bn.axis[0] if len(bn.axis) == 1 else None)
        if axis in (-1, rank - 1):  # Channels last, the kernel's last axis.
            folds[bn.name] = layer
    return folds


def _fold(kernel, bias, bn):
    """The kernel and bias of a layer followed by `bn` (in inference), as one layer's."""
    np_ = keras.ops.convert_to_numpy
    factor = 1.0 / np.sqrt(np_(bn.moving_variance) + bn.epsilon)
    if bn.gamma is not None:
        factor = factor * np_(bn.gamma)
    shift = -np_(bn.moving_mean) * factor
    if bn.beta is not None:
        shift = shift + np_(bn.beta)
    shape = kernel.shape[-2:] if kernel.shape[-1] * kernel.shape[-2] == factor.size else None
    if shape is not None and kernel.shape[-1] != factor.size:  # DepthwiseConv2D: in x mult.
        kernel = kernel * factor.reshape(shape)
    else:
        kernel = kernel * factor
    return kernel.astype("float32"), (bias * factor + shift).astype("float32")


def _probe(qat, copy, n: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    by_name = {q.name: q for q in _quantizers(qat)}
    arrays = []
    for t in copy.inputs:
        q = by_name.get(f"{t.name}_quant") or by_name.get("input_quant")
        lo, hi = (float(q.min.numpy()), float(q.max.numpy())) if q is not None else (0.0, 1.0)
        shape = [n] + [d or 1 for d in t.shape[1:]]
        if "float" in str(t.dtype):
            arrays.append(rng.uniform(lo, hi, shape).astype(str(t.dtype)))
        else:
            arrays.append(np.zeros(shape, str(t.dtype)))
    return arrays


def _matches(a: np.ndarray, v: np.ndarray) -> bool:
    """Whether graph tensor `a` holds Keras tensor `v`'s values, channels-last or -first."""
    candidates = [v]
    if v.ndim >= 3:
        candidates.append(np.moveaxis(v, -1, 1))  # The graph runs channels-first there.
    tol = 1e-4 * max(1.0, float(np.abs(v).max()))
    return any(a.shape == c.shape and np.allclose(a, c, rtol=1e-3, atol=tol) for c in candidates)


def learned_ranges(qat, copy, prepared: str) -> dict[str, tuple[float, float]]:
    """{tensor name of the pre-processed float file `prepared`: (min, max) learned by `qat`}."""
    import onnx

    quantizers = _quantizers(qat)
    ranges = {q.name: (float(q.min.numpy()), float(q.max.numpy())) for q in quantizers}
    x = _probe(qat, copy)
    probe = keras.Model(copy.inputs, [copy.get_layer(q.name).output for q in quantizers])
    values = [keras.ops.convert_to_numpy(v) for v in probe(x, training=False)]

    proto = onnx.load(prepared)
    graph = proto.graph
    known = {v.name: v for v in list(graph.value_info) + list(graph.output)}
    initializers = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers]
    tensors = names + [o for n in graph.node for o in n.output if o and o not in names]
    del graph.output[:]
    for name in tensors:
        graph.output.append(
            known.get(name)
            or onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
        )
    sess = _onnx_session.session(proto.SerializeToString(), threads=1)
    feeds = dict(zip(names, x))
    outputs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))

    found: dict[str, tuple[float, float]] = {}
    for q, v in zip(quantizers, values):
        if np.ptp(v) == 0:
            continue  # A constant tensor matches anything; its range comes by propagation.
        for name, a in outputs.items():
            if a.dtype == np.float32 and _matches(a, v):
                found.setdefault(name, ranges[q.name])
    _propagate(graph, found)
    return found


def _propagate(graph, found: dict) -> None:
    """Give the ranges to tensors carrying the same values (reordered, or before a Relu)."""
    changed = True
    while changed:
        changed = False
        for node in graph.node:
            if not node.input or not node.output:
                continue
            x, y = node.input[0], node.output[0]
            if node.op_type in _onnx_graph.SAME_SCALE:
                if x in found and y not in found:
                    found[y], changed = found[x], True
                elif y in found and x not in found:
                    found[x], changed = found[y], True
            elif node.op_type == "Relu" and y in found and x not in found:
                found[x], changed = found[y], True
