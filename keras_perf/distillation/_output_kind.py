"""Logits or probabilities: read from the output layer's config, checked against `from_logits`.

`_output_kind` follows a Functional or Sequential model's output back through pass-through
layers (`Reshape`, `Flatten`, `Dropout`, ...) and nested models to the layer that decides:
a softmax or sigmoid activation means probabilities, an affine layer (`Dense`, `Conv`) with a
linear activation means logits; anything else (a `Lambda`, a custom layer, a subclassed
model) is not told. `_check_from_logits` raises when the config contradicts `from_logits`.
Not here: the other model checks (`_checks`).
"""

from __future__ import annotations

import keras

# Layers that pass values through unchanged (up to shape) at inference: the output's nature
# (logits or probabilities) is the one of the layer before them.
_PASSTHROUGH = (
    keras.layers.Reshape,
    keras.layers.Flatten,
    keras.layers.Dropout,
    keras.layers.Identity,
    keras.layers.Permute,
    keras.layers.GaussianNoise,
    keras.layers.GaussianDropout,
    keras.layers.AlphaDropout,
    keras.layers.ActivityRegularization,
)
# Layers whose output is an affine function of their input when `activation` is linear.
_AFFINE = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
)


def _activation_name(layer) -> str | None:
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    fn = getattr(layer, "activation", None)
    if fn is None:
        return None
    try:
        name = keras.activations.serialize(fn)
    except (ValueError, TypeError):
        return None
    return name if isinstance(name, str) else None


def _producer(model, tensor):
    """The layer of `model` whose (single) output is `tensor`, or None."""
    for layer in getattr(model, "layers", None) or ():
        try:
            if layer.output is tensor:
                return layer
        except (AttributeError, ValueError, RuntimeError):  # unbuilt or called several times
            continue
    return None


def _output_kind(model, depth: int = 0) -> tuple[str | None, str | None]:
    """("probabilities" | "logits" | None, layer description) from the output layer's config.

    `None` when it cannot be told for certain (subclassed or unbuilt models, custom or
    Lambda layers, several outputs).
    """
    try:
        outputs = model.outputs
    except (AttributeError, ValueError, RuntimeError):
        return None, None
    if not outputs or len(outputs) != 1 or depth > 8:
        return None, None
    layer = _producer(model, outputs[0])
    while layer is not None:
        if isinstance(layer, keras.Model):
            return _output_kind(layer, depth + 1)
        name = _activation_name(layer)
        where = f"layer '{layer.name}' ({type(layer).__name__}"
        where += ")" if isinstance(layer, keras.layers.Softmax) else f", activation {name!r})"
        if name in ("softmax", "sigmoid"):
            return "probabilities", where
        if name == "linear" and isinstance(layer, _AFFINE):
            return "logits", where
        if name == "log_softmax":
            return "logits", where
        if isinstance(layer, _PASSTHROUGH) or (
            isinstance(layer, keras.layers.Activation) and name == "linear"
        ):
            try:
                layer = _producer(model, layer.input)
            except (AttributeError, ValueError, RuntimeError):
                return None, None
            continue
        return None, None
    return None, None


def _check_from_logits(model, role: str, from_logits: bool) -> None:
    """Raise when the output layer's config contradicts `from_logits`."""
    kind, where = _output_kind(model)
    if kind == "probabilities" and from_logits:
        raise ValueError(
            f"The {role} '{model.name}' outputs probabilities: its output {where} ends in a "
            "probability activation, but `from_logits=True` treats outputs as logits, so the "
            "soft targets would be softened twice (wrong targets, no error). Pass "
            "`from_logits=False` (both models then output probabilities), or build the model "
            "without the final softmax (e.g. `keras.applications.*(classifier_activation="
            "None)`) for logits."
        )
    if kind == "logits" and not from_logits:
        raise ValueError(
            f"The {role} '{model.name}' outputs logits: its output {where} has no probability "
            "activation, but `from_logits=False` treats outputs as probabilities. Pass "
            "`from_logits=True` (both models then output logits), or end the model in a "
            "softmax."
        )
