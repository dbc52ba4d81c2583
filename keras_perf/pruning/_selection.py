"""Which weights are pruned: the prunable kinds, and what `include`/`exclude` select of them.

The selector rules themselves (names, regexes, classes) are `keras_perf._layer_selection`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras

from keras_perf._layer_selection import matches_layer, matches_path
from keras_perf._utils import iter_layers

# Layer class -> (weight names, axis along which an m-by-n block runs: the input dimension).
# Looked up by isinstance, so subclasses of these layers are pruned too.
_CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
_CONV_T = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)
_SEP = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
_RNN_CELLS = (keras.layers.SimpleRNNCell, keras.layers.LSTMCell, keras.layers.GRUCell)

#: What is pruned, per layer kind, and the axis of the m-by-n blocks (the input dimension).
PRUNABLE = (
    (keras.layers.Dense, ("kernel",), 0),  # kernel (in, out): blocks along `in`
    (_CONV, ("kernel",), -2),  # (*spatial, in, out): blocks along `in`
    (_CONV_T, ("kernel",), -1),  # (*spatial, out, in): blocks along `in`
    (_SEP, ("pointwise_kernel",), -2),  # (1.., in, out): blocks along `in`
    (keras.layers.Embedding, ("embeddings",), -1),  # (vocab, dim): blocks along `dim`
    (_RNN_CELLS, ("kernel", "recurrent_kernel"), 0),  # (in|units, gates*units)
    (keras.layers.EinsumDense, ("kernel",), None),  # last contracted axis, from the equation
)


@dataclass
class _Target:
    layer: keras.layers.Layer
    variable: keras.Variable
    axis: int
    mask: keras.Variable | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        return self.variable.path


def _einsum_input_axis(layer) -> int:
    # "abc,cde->abde": the kernel axes also found in the input are contracted (the input
    # dimensions); m-by-n blocks run along the last of them.
    try:
        inputs, _ = layer.equation.split("->")
        x_spec, k_spec = inputs.split(",")
        shared = [i for i, c in enumerate(k_spec) if c in x_spec]
        return shared[-1] if shared else 0
    except (AttributeError, ValueError):
        return 0


def _own_variables(layer) -> list:
    nested = {id(v) for sub in iter_layers(layer) for v in sub.weights}
    return [v for v in layer.weights if id(v) not in nested]


def _prunable_in(layer) -> list[_Target]:
    for classes, names, axis in PRUNABLE:
        if isinstance(layer, classes):
            if axis is None:
                axis = _einsum_input_axis(layer)
            return [
                _Target(layer, v, axis)
                for v in _own_variables(layer)
                if v.name in names and v.trainable and layer.trainable
            ]
    return []


def _all_prunable(model) -> list[_Target]:
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built; call it on data (or `model.build(shape)`) "
            "before pruning, so its weights exist."
        )
    targets, seen = [], set()
    for layer in [model, *iter_layers(model)]:
        for t in _prunable_in(layer):
            if id(t.variable) not in seen:
                seen.add(id(t.variable))
                targets.append(t)
    return targets


def _describe(targets) -> str:
    return ", ".join(f"{t.layer.name} ({type(t.layer).__name__}: {t.path})" for t in targets)


def _select(model, include=(), exclude=()) -> list[_Target]:
    """The prunable weights of `model`, filtered by `include`/`exclude` (layer or any parent)."""
    targets = _all_prunable(model)
    if not targets:
        raise ValueError(
            f"Model {model.name!r} has no prunable weights. Pruned are the kernels of Dense, "
            "EinsumDense (MultiHeadAttention), Conv*, Conv*Transpose, the pointwise kernels of "
            "SeparableConv*, Embedding embeddings and RNN cell kernels; never biases, "
            "normalisation or non-trainable weights."
        )
    layers = [model, *iter_layers(model)]

    def covered(item) -> set:
        """ids of the target variables selected by `item` (matching layer or an ancestor)."""
        ids = set()
        for layer in layers:
            if matches_layer(item, layer):
                for sub in [layer, *iter_layers(layer)]:
                    ids.update(id(t.variable) for t in _prunable_in(sub))
            else:
                ids.update(
                    id(t.variable) for t in _prunable_in(layer) if matches_path(item, t.path)
                )
        return ids & {id(t.variable) for t in targets}

    if include:
        chosen = set()
        for item in include:
            ids = covered(item)
            if not ids:
                raise ValueError(
                    f"`include` item {item!r} matches no prunable weight of model "
                    f"{model.name!r}. Prunable layers: {_describe(targets)}."
                )
            chosen |= ids
        targets = [t for t in targets if id(t.variable) in chosen]
    for item in exclude:
        ids = covered(item)
        if not ids:
            raise ValueError(
                f"`exclude` item {item!r} matches no prunable weight of model "
                f"{model.name!r}. Prunable layers: {_describe(_all_prunable(model))}."
            )
        targets = [t for t in targets if id(t.variable) not in ids]
    if not targets:
        raise ValueError(
            f"`exclude` leaves no weight to prune in model {model.name!r}. "
            f"Prunable layers: {_describe(_all_prunable(model))}."
        )
    return targets


def _relative_path(model, target) -> str:
    """The weight's path without the model-name prefix (a reloaded model may be renamed)."""
    prefix = f"{model.name}/"
    path = target.path
    return path[len(prefix) :] if model is not None and path.startswith(prefix) else path
