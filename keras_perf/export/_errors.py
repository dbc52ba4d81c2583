"""What a failed TFLite conversion turns into: a `ValueError` naming the model's layers at fault.

TensorFlow's converter reports in MLIR diagnostics, many lines of `loc(callsite(...))` per op;
`converter_summary` keeps the distinct error texts alone. `graph_layers` and `describe_layers`
name the layers of a model's graph in a message. `select_tf_ops_error` is the error of a model
whose ops (an LSTM's loop) TFLite's builtin ops cannot express, shared by the float and
post-training export (`_convert`) and the quantization-aware one (`_qat`).
"""

from __future__ import annotations

import keras

# Layers whose loop TFLite's builtin ops cannot express with a free batch size.
RECURRENT = (keras.layers.RNN, keras.layers.Bidirectional)


def graph_layers(model) -> list:
    """The layers of `model`'s graph, nested models entered (not listed themselves)."""
    found = []
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            found.extend(graph_layers(layer))
        else:
            found.append(layer)
    return found


def describe_layers(layers) -> str:
    """`"MultiHeadAttention 'mha'; LayerNormalization 'ln1', 'ln2'"`: names by class."""
    by_class: dict[str, list[str]] = {}
    for layer in layers:
        by_class.setdefault(type(layer).__name__, []).append(repr(layer.name))
    return "; ".join(f"{cls} {', '.join(names)}" for cls, names in by_class.items())


def converter_summary(text: str, n: int = 2) -> str:
    """The first `n` distinct error texts of a converter message, without their `loc(...)`
    source locations (or its last `n` lines when it has no `error:` line), indented."""
    found: list[str] = []
    for line in text.splitlines():
        if "error:" not in line:
            continue
        message = line.split("error:", 1)[1].strip()
        if message.startswith("loc("):  # loc(callsite(fused[...] at ...)): the text
            depth = 0
            for i, char in enumerate(message):
                depth += (char == "(") - (char == ")")
                if depth == 0 and char == ")":
                    message = message[i + 1 :].lstrip(": ").strip()
                    break
        if message and message not in found:
            found.append(message)
    if not found:
        found = [line.strip() for line in text.strip().splitlines() if line.strip()][-n:]
    return "\n".join(f"  {m[:300]}" for m in found[:n])


def select_tf_ops_error(error: Exception, model, quantized: bool = False) -> ValueError:
    """The `ValueError` for a conversion that needs TensorFlow ops (`allow_select_tf_ops`)."""
    loops = [layer for layer in graph_layers(model) if isinstance(layer, RECURRENT)]
    what = (
        f"the loop of {describe_layers(loops)}"
        if loops
        else "some ops of this model (e.g. the loop of an LSTM/GRU with a free batch size)"
    )
    kept = " (they compute in float; the rest of the file stays int8)" if quantized else ""
    return ValueError(
        f"TFLite's builtin ops cannot express {what}, so nothing was written; the converter "
        f"said:\n{converter_summary(str(error))}\nPass `allow_select_tf_ops=True` to keep "
        f"those ops as TensorFlow ops{kept}; the file then needs an interpreter linked with the "
        "Flex delegate (Android: `org.tensorflow:tensorflow-lite-select-tf-ops`)."
    )
