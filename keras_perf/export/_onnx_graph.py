"""The ONNX graph itself (`onnx` imported lazily): the reads and rewrites `export_onnx` makes on
the proto, and the checks of a quantized (QDQ) file. Checked with onnx 1.23, tf2onnx 1.17,
jax2onnx 0.17, onnxscript 0.7.

What stays hand-written, and why:

- `rewrite_pooling`: jax2onnx writes a `MaxPooling` as a MaxPool over 4 "spatial" axes of a
  6-D tensor (batch and channels included), which ONNX Runtime refuses ("Unsupported pooling
  size"); it becomes the ordinary 2-D (or 1-D/3-D) MaxPool between two Transposes.
- `fold_conv_bias`: PyTorch and JAX exports add a `Conv`'s bias after the Transpose back to
  channels-last, which leaves a tensor (the convolution before its bias) that no Keras layer
  computes and so has no learned range; the bias goes into the `Conv` (exact).
"""

from __future__ import annotations

import numpy as np

WEIGHT_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
# Ops whose output is the input, reordered or subsampled: its quantization is the input's.
SAME_SCALE = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "MaxPool", "Identity")


def _const(proto, name):
    for init in proto.graph.initializer:
        if init.name == name:
            from onnx import numpy_helper

            return numpy_helper.to_array(init)
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            from onnx import numpy_helper

            return numpy_helper.to_array(node.attribute[0].t)
    return None


def _attrs(node) -> dict:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def rewrite_pooling(proto) -> bool:
    """Unsqueeze, Unsqueeze, 6-D MaxPool, Squeeze (jax2onnx) -> Transpose, MaxPool, Transpose."""
    import onnx

    nodes = list(proto.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    changed = False
    for pool in nodes:
        if pool.op_type != "MaxPool" or len(_attrs(pool).get("kernel_shape", ())) < 3:
            continue
        inner = producer.get(pool.input[0])
        outer = inner is not None and producer.get(inner.input[0])
        users = [n for n in nodes if pool.output[0] in n.input]
        if not (
            outer
            and inner.op_type == outer.op_type == "Unsqueeze"
            and len(users) == 1
            and users[0].op_type == "Squeeze"
        ):
            raise ValueError(_POOL_ERROR.format(node=pool.name))
        squeeze = users[0]
        a = _attrs(pool)
        kernel, strides = (
            list(a["kernel_shape"]),
            list(a.get("strides", [1] * len(a["kernel_shape"]))),
        )
        rank = len(kernel)
        pads = list(a.get("pads", [0] * 2 * rank))
        trivial = [
            kernel[i] == 1 and strides[i] == 1 and pads[i] == pads[i + rank] == 0
            for i in range(rank)
        ]
        if set(a) - {"kernel_shape", "strides", "pads"} or not trivial[0]:
            raise ValueError(_POOL_ERROR.format(node=pool.name))
        channel = rank - 1 if trivial[rank - 1] else 1 if trivial[1] else None
        if channel is None:
            raise ValueError(_POOL_ERROR.format(node=pool.name))
        spatial = [i for i in range(1, rank) if i != channel]
        to_first = [0, channel, *spatial]
        back = [to_first.index(i) for i in range(rank)]
        x, y = outer.input[0], squeeze.output[0]
        t_in, pooled = f"{pool.name}_nchw_in", f"{pool.name}_nchw_out"
        new = [
            onnx.helper.make_node(
                "Transpose", [x], [t_in], perm=to_first, name=f"{pool.name}_to_first"
            ),
            onnx.helper.make_node(
                "MaxPool",
                [t_in],
                [pooled],
                name=pool.name,
                kernel_shape=[kernel[i] for i in spatial],
                strides=[strides[i] for i in spatial],
                pads=[pads[i] for i in spatial] + [pads[i + rank] for i in spatial],
            ),
            onnx.helper.make_node("Transpose", [pooled], [y], perm=back, name=f"{pool.name}_back"),
        ]
        index = list(proto.graph.node).index(outer)
        for old in (outer, inner, pool, squeeze):
            proto.graph.node.remove(old)
        for k, node in enumerate(new):
            proto.graph.node.insert(index + k, node)
        changed = True
    return changed


_POOL_ERROR = (
    "jax2onnx wrote the pooling node {node!r} in a form ONNX Runtime cannot run and keras-perf "
    "does not know how to rewrite; export this model on the TensorFlow or PyTorch backend."
)


def fold_conv_bias(proto) -> bool:
    """Conv (no bias) -> Transpose -> Add(constant per channel) becomes Conv(bias) -> Transpose."""
    import onnx
    from onnx import numpy_helper

    nodes = list(proto.graph.node)
    users: dict[str, list] = {}
    for n in nodes:
        for i in n.input:
            users.setdefault(i, []).append(n)
    changed = False
    for conv in nodes:
        if conv.op_type != "Conv" or len(conv.input) > 2:
            continue
        (transpose,) = users.get(conv.output[0], [None])[:1] or [None]
        if transpose is None or len(users[conv.output[0]]) != 1 or transpose.op_type != "Transpose":
            continue
        add_users = users.get(transpose.output[0], [])
        if len(add_users) != 1 or add_users[0].op_type != "Add":
            continue
        add = add_users[0]
        other = add.input[1] if add.input[0] == transpose.output[0] else add.input[0]
        bias = _const(proto, other)
        perm = list(_attrs(transpose)["perm"])
        channels = _const(proto, conv.input[1])
        if bias is None or channels is None:
            continue
        c = channels.shape[0]
        # The bias must vary along the channel axis only (where perm put axis 1).
        axis = perm.index(1)
        if bias.size != c or (bias.ndim and bias.shape[axis - len(perm) + bias.ndim] != c):
            continue
        name = f"{conv.name}_bias"
        proto.graph.initializer.append(
            numpy_helper.from_array(bias.reshape(-1).astype(np.float32), name)
        )
        conv.input.append(name)
        # The Add goes: the Transpose now writes the Add's output tensor.
        transpose.output[0] = add.output[0]
        proto.graph.node.remove(add)
        changed = True
    if changed:
        onnx.checker.check_model(proto)
    return changed


def float_ops(proto) -> list[str]:
    """Names of the weight ops (Conv, MatMul, Gemm with a constant weight) of a QDQ file that
    would run in float: an input, the weight or the output not (de)quantized."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    initializers = {i.name for i in proto.graph.initializer}
    bad = []
    for n in proto.graph.node:
        if n.op_type not in WEIGHT_OPS or len(n.input) < 2:
            continue
        w = producer.get(n.input[1])
        is_weight = n.input[1] in initializers or (
            w is not None and w.op_type == "DequantizeLinear" and w.input[0] in initializers
        )
        if not is_weight:
            continue
        x = producer.get(n.input[0])
        outs = consumers.get(n.output[0], [])
        ok = (
            w is not None
            and w.op_type == "DequantizeLinear"
            and x is not None
            and x.op_type == "DequantizeLinear"
            and outs
            and all(u.op_type == "QuantizeLinear" for u in outs)
        )
        if not ok:
            bad.append(n.name or n.output[0])
    return bad


def quantization_params(proto) -> dict[str, tuple]:
    """{quantized tensor name: (scale array, zero point array)} of a QDQ file's QuantizeLinear
    nodes (activations; weights are stored already quantized)."""
    out = {}
    for n in proto.graph.node:
        if n.op_type == "QuantizeLinear":
            scale, zero = _const(proto, n.input[1]), _const(proto, n.input[2])
            out[n.input[0]] = (scale, zero)
    return out
