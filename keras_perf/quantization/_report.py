"""`quantization_report`: bits and ranges of every quantized layer of a QAT model."""

from __future__ import annotations

import keras
import numpy as np

from keras_perf._utils import iter_layers
from keras_perf.quantization._layers import QuantizedKernelMixin
from keras_perf.quantization._quantizers import ActivationQuantizer


class QuantizationReport(list):
    """A list of per-layer dicts that prints as a table."""

    def __str__(self):
        head = ("name", "w_bits", "a_bits", "per_ch", "weight_range", "activation_range")
        rows = [head]
        for r in self:
            rows.append(
                (
                    r["name"],
                    str(r["weight_bits"] or "-"),
                    str(r["activation_bits"] or "-"),
                    "yes" if r["per_channel"] else "no",
                    _fmt(r["weight_range"]),
                    _fmt(r["activation_range"]),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython / notebooks show the table.
        p.text(str(self))


def _fmt(r):
    return "-" if r is None else f"({r[0]:.4g}, {r[1]:.4g})"


def quantization_report(model) -> QuantizationReport:
    """Bits and ranges of every quantized layer of a model made by `kp.quantize_aware`.

    Args:
        model: A quantization-aware model (from `kp.quantize_aware`, possibly trained, saved
            and loaded).

    Returns:
        A list (printing as a table) with one dict per quantized kernel layer, then one per
        other activation quantizer (the model's inputs, after Add, Concatenate...): `name`, `weight_bits`, `activation_bits`, `per_channel`,
        `weight_range` (the kernel's quantization range, `(-max|w|, max|w|)` over its
        channels) and `activation_range` (the learned `(min, max)` of the activation
        quantizer after the layer's fused block, `None` if it has none). Rows of activation
        quantizers alone have `weight_bits`/`weight_range` `None`.

    Raises:
        TypeError: `model` is not a Keras model.
        ValueError: `model` has no quantized layer.

    Example:
        >>> import keras, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> report = kp.quantization_report(kp.quantize_aware(model))
        >>> report[0]["name"], report[0]["weight_bits"]
        ('dense', 8)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    layers = list(iter_layers(model))
    quantizers = {q.name: q for q in layers if isinstance(q, ActivationQuantizer)}
    rows = QuantizationReport()
    targets = set()
    for layer in layers:
        if not isinstance(layer, QuantizedKernelMixin):
            continue
        k = np.abs(keras.ops.convert_to_numpy(layer.masked_kernel()))
        m = float(k.max()) if k.size else 0.0
        q = quantizers.get(layer.activation_quantizer or "")
        if q is not None:
            targets.add(q.name)
        rows.append(
            {
                "name": layer.name,
                "weight_bits": layer.weight_bits,
                "activation_bits": None if q is None else q.num_bits,
                "per_channel": layer.per_channel,
                "weight_range": (-m, m),
                "activation_range": None if q is None else _range(q),
            }
        )
    if not rows and not quantizers:
        raise ValueError("`model` has no quantized layer: make it with `kp.quantize_aware(model)`.")
    for q in quantizers.values():
        if q.name not in targets:
            rows.append(
                {
                    "name": q.name,
                    "weight_bits": None,
                    "activation_bits": q.num_bits,
                    "per_channel": False,
                    "weight_range": None,
                    "activation_range": _range(q),
                }
            )
    return rows


def _range(q):
    return (float(keras.ops.convert_to_numpy(q.min)), float(keras.ops.convert_to_numpy(q.max)))
