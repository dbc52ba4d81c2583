"""What a written `.tflite` file says about itself: the stored input order and the report.

`export_tflite` (and the quantization-aware export) store the model's input names, in
`model.inputs` order, in the file's metadata under `METADATA_NAME`; `_stored_input_order`
reads them back (`tflite_predict` uses it), and `_report` is the dict `export_tflite`
returns. Not here: reading and writing the flatbuffer itself (`keras_perf.export._tflite_lib`).
"""

from __future__ import annotations

import json
from pathlib import Path

from keras_perf.export import _tflite_lib as _tflite

METADATA_NAME = "keras_perf"


def _report(path: Path, content: bytes, quantization) -> dict:
    inputs, outputs = _tflite.describe(content)
    for entry in inputs + outputs:
        entry.pop("index")
    return {
        "path": str(path),
        "bytes": len(content),
        "quantization": quantization,
        "input_dtype": inputs[0]["dtype"],
        "output_dtype": outputs[0]["dtype"],
        "input_quantization": inputs[0]["quantization"],
        "output_quantization": outputs[0]["quantization"],
        "inputs": inputs,
        "outputs": outputs,
        "input_order": _stored_input_order(content),
        "select_tf_ops": _tflite.flex_ops(content),
    }


def _stored_input_order(content: bytes) -> list[str] | None:
    raw = _tflite.read_metadata(content, METADATA_NAME)
    if raw is None:
        return None
    try:
        return list(json.loads(raw.decode())["inputs"])
    except (ValueError, KeyError, TypeError):
        return None
