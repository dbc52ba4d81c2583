"""ONNX Runtime's CPU sessions (`onnxruntime` imported lazily), which `export_onnx` (its check
that a file loads), `onnx_predict`, `inference_report` and the QAT ranges' probe run. Checked
with onnxruntime 1.32.

`int8_kernels_saturate` / `saturating_int8_weights`: on an x86-64 CPU without VNNI, ONNX
Runtime's fused uint8 x int8 kernels add pairs of products in 16 bits (VPMADDUBSW), which
saturates when weights use the full int8 range (ORT's quantization docs; measured here on an
AVX2-only AMD EPYC: a digits CNN's int8 file agreed with the float file on 93 % of argmaxes
fused, 99.7 % unfused). `export_onnx` writes "int8" files with 7-bit weights by default
(ORT's `reduce_range`), and a session on such a CPU runs a full-range file unfused.
"""

from __future__ import annotations

import os

import numpy as np


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
