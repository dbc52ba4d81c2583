"""ONNX Runtime's quantization of a float ONNX file (`onnxruntime` imported lazily): the
pre-processing of an `"int8"` export (`quant_pre_process`, then the bias fold), the
calibration reader of its data, and `quantize` (`quantize_static`, `quantize_dynamic`, the
float16 converter). Checked with onnxruntime 1.32.
"""

from __future__ import annotations

import os
import re

import numpy as np

from keras_perf.export import _onnx_graph
from keras_perf.export._onnx_export import first_line, quiet_logs


class CalibrationReader:
    """ONNX Runtime's `CalibrationDataReader`: the checked calibration arrays, 32 at a time."""

    def __init__(self, arrays, names):
        self.arrays, self.names, self.start = arrays, names, 0

    def get_next(self):
        n = len(self.arrays[0])
        if self.start >= n:
            return None
        s = slice(self.start, self.start + 32)
        self.start += 32
        return {name: a[s] for name, a in zip(self.names, self.arrays)}


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
    if _onnx_graph.fold_conv_bias(proto):
        onnx.save(proto, dst)


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
                    f"({type(e).__name__}: {first_line(e) or 'no message'}). Nothing was "
                    "written: use quantization='dynamic' (int8 weights, no calibration), or "
                    "export on another Keras backend (graphs differ by exporter)."
                ) from e
