"""ONNX export and ONNX Runtime, used by `keras_perf.export`'s `export_onnx` and `onnx_predict`.

The graph comes from Keras' own `model.export(path, format="onnx")` (tf2onnx on TensorFlow,
jax2onnx on JAX, `torch.onnx` with onnxscript on PyTorch); quantization from ONNX Runtime's
tools (`quant_pre_process`, `quantize_static`, `quantize_dynamic`, the float16 converter).
Like `keras_perf.export._tflite_lib`, this module serves every backend and imports its packages
lazily, inside each function. Checked with Keras 3.15.1, onnx 1.23, onnxruntime 1.32,
tf2onnx 1.17, jax2onnx 0.17, onnxscript 0.7.

What stays hand-written, and why:

- `_rewrite_pooling`: jax2onnx writes a `MaxPooling` as a MaxPool over 4 "spatial" axes of a
  6-D tensor (batch and channels included), which ONNX Runtime refuses ("Unsupported pooling
  size"); it becomes the ordinary 2-D (or 1-D/3-D) MaxPool between two Transposes.
- `_fold_conv_bias`: PyTorch and JAX exports add a `Conv`'s bias after the Transpose back to
  channels-last, which leaves a tensor (the convolution before its bias) that no Keras layer
  computes and so has no learned range; the bias goes into the `Conv` (exact).
- `int8_kernels_saturate` / `saturating_int8_weights`: on an x86-64 CPU without VNNI, ONNX
  Runtime's fused uint8 x int8 kernels add pairs of products in 16 bits (VPMADDUBSW), which
  saturates when weights use the full int8 range (ORT's quantization docs; measured here on an
  AVX2-only AMD EPYC: a digits CNN's int8 file agreed with the float file on 93 % of argmaxes
  fused, 99.7 % unfused). `export_onnx` writes "int8" files with 7-bit weights by default
  (ORT's `reduce_range`), and a session on such a CPU runs a full-range file unfused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings

import numpy as np

from keras_perf._imports import require

EXTRA = "onnx"
# What Keras' `model.export(format="onnx")` needs on each backend.
EXPORTERS = {"tensorflow": "tf2onnx", "jax": "jax2onnx", "torch": "onnxscript"}
WEIGHT_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
# Ops whose output is the input, reordered or subsampled: its quantization is the input's.
_SAME_SCALE = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "MaxPool", "Identity")


def require_onnx(feature: str, backend: str | None = None) -> None:
    """ImportError naming the `onnx` extra when a package `feature` needs is missing."""
    for module in ("onnx", "onnxruntime"):
        require(module, feature, extra=EXTRA)
    if backend in EXPORTERS:
        require(EXPORTERS[backend], feature, extra="onnx-jax" if backend == "jax" else EXTRA)


@contextlib.contextmanager
def quiet_logs():
    """Hide the exporters' and ORT quantization's INFO/WARNING lines (not errors)."""
    import onnxruntime as ort

    loggers = [logging.getLogger(n) for n in ("", "tf2onnx", "tensorflow", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, logging.ERROR))
    ort.set_default_logger_severity(3)
    try:
        with warnings.catch_warnings():
            # torch.onnx's tracer on Keras' shape arithmetic ("Converting a tensor to a Python
            # integer..."): Keras' shapes are static here, the trace is right.
            warnings.filterwarnings("ignore", message="Converting a tensor to a Python")
            # torch.onnx's notice that Keras' call (the TorchScript exporter) will go.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
            warnings.filterwarnings("ignore", message="You are using the legacy TorchScript")
            yield
    finally:
        ort.set_default_logger_severity(2)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_float(model, path: str) -> None:
    """Keras' own ONNX export of `model` to `path`, made loadable by ONNX Runtime."""
    import keras
    import onnx

    exporter = EXPORTERS.get(keras.backend.backend(), "Keras")
    try:
        with quiet_logs(), _constant_statistics(model):
            model.export(str(path), format="onnx", verbose=False)
    except ImportError:
        raise
    except Exception as e:
        raise ValueError(
            f"Keras' ONNX export ({exporter}) cannot convert this model: {type(e).__name__}: "
            f"{_first_line(e)}. Replace the layer or op it names, or export on another Keras "
            "backend."
        ) from e
    proto = onnx.load(str(path))
    _refuse_extra_inputs(proto, model, exporter)
    if _rewrite_pooling(proto):
        onnx.save(proto, str(path))
    try:
        session(str(path))
    except Exception as e:  # tf2onnx writes an op it cannot convert as it is.
        raise ValueError(
            f"Keras' ONNX export ({exporter}) wrote a graph ONNX Runtime cannot load: "
            f"{_first_line(e)}. Replace the layer or op it names, or export on another Keras "
            "backend."
        ) from e


@contextlib.contextmanager
def _constant_statistics(model):
    """On TensorFlow, a `Normalization`'s mean and variance as numpy arrays while Keras exports.

    After `adapt` (or given to the constructor), Keras' `Normalization` holds its statistics as
    eager tensors, not variables; the traced function captures them and tf2onnx writes each
    capture as a required graph input (`.../Sub/y:0`, `.../Sqrt/x:0`), so the file cannot run
    on the model's inputs alone. As numpy arrays they are traced as constants instead. The
    layers get their tensors back afterwards. (JAX and PyTorch export them as constants.)
    """
    import keras

    from keras_perf._utils import iter_layers

    swapped = []
    if keras.backend.backend() == "tensorflow":
        for layer in iter_layers(model):
            if isinstance(layer, keras.layers.Normalization) and layer.mean is not None:
                swapped.append((layer, layer.mean, layer.variance))
                layer.mean = keras.ops.convert_to_numpy(layer.mean)
                layer.variance = keras.ops.convert_to_numpy(layer.variance)
    try:
        yield
    finally:
        for layer, mean, variance in swapped:
            layer.mean, layer.variance = mean, variance


def _refuse_extra_inputs(proto, model, exporter: str) -> None:
    """A `ValueError` when the exported graph needs inputs the model does not have.

    A tensor the traced function captured instead of reading from a variable (a layer's
    constant held as an eager tensor) becomes a graph input on TensorFlow: such a file cannot
    run on the model's inputs alone, and ORT's int8 calibration fails on it.
    """
    initializers = {i.name for i in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in initializers]
    wanted = len(model.inputs)
    if len(names) <= wanted:
        return
    own = {t.name for t in model.inputs}
    extra = [n for n in names if n not in own] or names[wanted:]
    raise ValueError(
        f"Keras' ONNX export ({exporter}) wrote a graph that needs {len(extra)} input(s) the "
        f"model does not have ({', '.join(extra[:4])}): a layer holds a constant as a "
        "tensor rather than a variable (as Keras' `Normalization` does), and the exporter "
        "made it an input. Nothing was written. Hold the constant in a variable "
        "(`self.add_weight(..., trainable=False)`) or in the layer's config, or export on "
        "another Keras backend."
    )


def _first_line(e: Exception) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


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


def _rewrite_pooling(proto) -> bool:
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


def _fold_conv_bias(proto) -> bool:
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


_UUID_DATA = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\.data")


def pre_process(src: str, dst: str) -> None:
    """ORT's `quant_pre_process` (shape inference and graph optimization), then the bias fold."""
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    before = set(os.listdir("."))
    try:
        with quiet_logs():
            quant_pre_process(src, dst)
    except ImportError:
        raise
    except Exception:
        # ORT's symbolic shape inference gives up on some graphs (a Transformer's attention
        # reshapes: a bare Exception from tf2onnx's graph, a TypeError from jax2onnx's) and
        # may leave its partial model in the working directory: remove what it wrote there,
        # and pre-process without it (ONNX's own shape inference still runs).
        for name in set(os.listdir(".")) - before:
            if name.startswith("sym_shape_infer_temp") or _UUID_DATA.fullmatch(name):
                os.remove(name)  # the model, and its weights (onnx names them <uuid>.data)
        with quiet_logs():
            quant_pre_process(src, dst, skip_symbolic_shape=True)
    proto = onnx.load(dst)
    if _fold_conv_bias(proto):
        onnx.save(proto, dst)


def int8_kernels_saturate() -> bool:
    """Whether ONNX Runtime's fused uint8 x int8 kernels can saturate on this CPU: x86-64
    without a VNNI instruction (`avx512_vnni`, `avx_vnni`, `amx_int8`), where MLAS adds pairs of
    products in 16 bits. False where /proc/cpuinfo cannot be read (not Linux) and on other CPUs.
    """
    from keras_perf._cpu import VNNI_FLAGS, cpu_info, is_x86

    _, flags = cpu_info()
    return bool(flags) and is_x86() and not any(f in flags for f in VNNI_FLAGS)


def saturating_int8_weights(proto) -> bool:
    """Whether a QDQ file has int8 weights beyond 7 bits (|q| > 64), which ORT's fused u8s8
    kernels can saturate on a CPU without VNNI (`int8_kernels_saturate`)."""
    import onnx
    from onnx import numpy_helper

    dequantized = {n.input[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    for init in proto.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            continue  # Not loaded (a file over 2 GB): not read here.
        if init.name in dequantized and init.data_type == onnx.TensorProto.INT8:
            if np.abs(numpy_helper.to_array(init).astype(np.int16)).max(initial=0) > 64:
                return True
    return False


def quantize(
    src: str,
    dst: str,
    mode: str,
    reader=None,
    ranges: dict | None = None,
    cache=None,
    reduce_range: bool = False,
):
    """ORT's quantization of the (pre-processed, for int8) float file `src` into `dst`.

    `mode`: `"float16"`, `"dynamic"` (int8 weights, `quantize_dynamic`) or `"int8"`
    (`quantize_static`, QDQ, per-channel int8 weights, uint8 activations), calibrated by
    `reader` or, with `ranges` ({tensor name: (min, max)}, learned by a QAT model), from
    those ranges written as ORT's calibration cache (ORT's `TensorsData`), so no data runs.
    `reduce_range`: weights in [-64, 64] (7 bits), which no CPU's int8 kernels saturate.
    """
    from onnxruntime import quantization as q

    with quiet_logs():
        if mode == "float16":
            import onnx
            from onnxruntime.transformers.float16 import convert_float_to_float16

            onnx.save(convert_float_to_float16(onnx.load(src), keep_io_types=True), dst)
        elif mode == "dynamic":
            q.quantize_dynamic(src, dst, weight_type=q.QuantType.QInt8, reduce_range=reduce_range)
        else:
            extra = {}
            if ranges is not None:
                from onnxruntime.quantization.calibrate import (
                    CalibrationMethod,
                    TensorsData,
                    save_tensors_data,
                )

                data = {k: (np.float32(lo), np.float32(hi)) for k, (lo, hi) in ranges.items()}
                save_tensors_data(TensorsData(CalibrationMethod.MinMax, data), cache)
            try:
                q.quantize_static(
                    src,
                    dst,
                    reader,
                    quant_format=q.QuantFormat.QDQ,
                    per_channel=True,
                    activation_type=q.QuantType.QUInt8,
                    weight_type=q.QuantType.QInt8,
                    calibration_cache_path=cache,
                    reduce_range=reduce_range,
                    extra_options=extra,
                )
            except (ImportError, ValueError):
                raise
            except Exception as e:  # e.g. its bare `assert` on a scale ("scale issue")
                raise ValueError(
                    "ONNX Runtime's int8 quantization failed on this model's graph "
                    f"({type(e).__name__}: {_first_line(e) or 'no message'}). Nothing was "
                    "written: use quantization='dynamic' (int8 weights, no calibration), or "
                    "export on another Keras backend (graphs differ by exporter)."
                ) from e


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


def session(path, threads: int | None = None):
    """An ONNX Runtime CPU session; `threads` intra-op threads with spinning off.

    On a CPU whose fused int8 kernels saturate (`int8_kernels_saturate`), a file with
    full-range int8 weights runs with ORT's basic optimizations only: each QDQ group stays
    DequantizeLinear + the float op, which computes what the file says (slower, not wrong).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if int8_kernels_saturate():
        import onnx

        proto = (
            onnx.load_from_string(path)
            if isinstance(path, bytes)
            else onnx.load(str(path), load_external_data=False)
        )
        if saturating_int8_weights(proto):
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    if threads is not None:
        options.intra_op_num_threads = int(threads)
        options.inter_op_num_threads = 1
    # Idle threads that spin steal the CPU from whatever runs next (FACTS: ONNX).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(
        str(path) if isinstance(path, (str, os.PathLike)) else path,
        options,
        providers=["CPUExecutionProvider"],
    )


def run(sess, feeds: dict[str, np.ndarray], batch_size: int | None) -> list[np.ndarray]:
    """Outputs of `sess` on `feeds` ({input name: array}), `batch_size` examples per call."""
    n = len(next(iter(feeds.values())))
    step = n if batch_size is None else batch_size
    parts = [
        sess.run(None, {k: v[i : i + step] for k, v in feeds.items()}) for i in range(0, n, step)
    ]
    return [np.concatenate([p[k] for p in parts], axis=0) for k in range(len(parts[0]))]
