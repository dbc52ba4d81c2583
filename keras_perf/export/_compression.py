"""`compression_report`: parameters, non-zeros, raw bytes and gzip bytes per layer.

It counts parameters, non-zero parameters, raw bytes and gzip bytes per layer, as the
TensorFlow Model Optimization pruning tutorial measures a pruned model's size. Not here:
TFLite file sizes (`export_tflite`'s report) and pruning's own `sparsity_report`.
"""

from __future__ import annotations

import gzip

import keras
import numpy as np

from keras_perf._utils import check_int, iter_layers


def compression_report(model: keras.Model, compresslevel: int = 9) -> dict:
    """Count parameters, non-zero parameters, raw bytes and gzip bytes, per layer and in total.

    Pruning leaves a weight tensor's size unchanged; what shrinks is how well it compresses.
    The tfmot pruning tutorial measures that by gzipping the saved model; this report gzips
    the raw weight bytes (no file-format overhead), per layer and for the whole model. Every
    weight is counted once (trainable or not, e.g. BatchNorm statistics), under the innermost
    layer that owns it; optimizer state is not part of a model's size and is left out.

    Args:
        model: A built Keras model (or layer).
        compresslevel: gzip level, 1 (fast) to 9 (smallest). Defaults to `9`.

    Returns:
        A dict with `layers`, a list with one dict per layer that owns weights (`name`,
        `class`, `params`, `nonzero`, `sparsity`, `bytes`, `gzip_bytes`), and `total`, the
        same counts for the whole model (`gzip_bytes` of all weights compressed together,
        plus `compression_ratio` = `bytes / gzip_bytes`).

    Raises:
        TypeError: `model` is not a Keras layer or model; `compresslevel` is not an int.
        ValueError: `compresslevel` outside 1-9; the model is not built.

    Example:
        >>> import keras, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> report = kp.compression_report(model)
        >>> report["total"]["params"], report["layers"][0]["class"]
        (27, 'Dense')
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model or layer, got {type(model).__name__}.")
    check_int("compresslevel", compresslevel, minimum=1)
    if compresslevel > 9:
        raise ValueError(f"`compresslevel` must be an integer in [1, 9], got {compresslevel}.")
    if not model.built:
        raise ValueError(
            "`model` is not built, so it has no weights yet: start it with `keras.Input(shape)` "
            "or call it once on a batch before asking for its compression report."
        )

    owner = {}  # id(variable) -> layer; pre-order traversal, so the innermost owner wins.
    variables = {}
    for layer in [model, *iter_layers(model)]:
        for v in layer.weights:
            owner[id(v)] = layer
            variables[id(v)] = v

    rows = {}
    blobs = []
    for vid, v in variables.items():
        layer = owner[vid]
        value = np.asarray(keras.ops.convert_to_numpy(v.value))
        raw = np.ascontiguousarray(value).tobytes()
        row = rows.setdefault(
            id(layer),
            {
                "name": layer.name,
                "class": type(layer).__name__,
                "params": 0,
                "nonzero": 0,
                "bytes": 0,
                "_blobs": [],
            },
        )
        row["params"] += int(value.size)
        row["nonzero"] += int(np.count_nonzero(value))
        row["bytes"] += len(raw)
        row["_blobs"].append(raw)
        blobs.append(raw)

    layers = []
    for row in rows.values():
        data = b"".join(row.pop("_blobs"))
        row["gzip_bytes"] = len(gzip.compress(data, compresslevel=compresslevel, mtime=0))
        row["sparsity"] = _sparsity(row["params"], row["nonzero"])
        layers.append(row)
    params = sum(r["params"] for r in layers)
    nonzero = sum(r["nonzero"] for r in layers)
    raw_bytes = sum(r["bytes"] for r in layers)
    gz = len(gzip.compress(b"".join(blobs), compresslevel=compresslevel, mtime=0))
    total = {
        "params": params,
        "nonzero": nonzero,
        "sparsity": _sparsity(params, nonzero),
        "bytes": raw_bytes,
        "gzip_bytes": gz,
        "compression_ratio": raw_bytes / gz if gz else 1.0,
    }
    return {"layers": layers, "total": total}


def _sparsity(params: int, nonzero: int) -> float:
    return 1.0 - nonzero / params if params else 0.0
