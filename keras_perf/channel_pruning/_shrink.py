"""`shrink`: rebuild a channel-pruned model without its removed channels."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from keras_perf import _keras_internals as keras_internals
from keras_perf._carry_over import copy_layer_state, finalize_state, keep_train_step
from keras_perf.channel_pruning import _select
from keras_perf.channel_pruning._graph import ChannelGraph, ChannelGraphError


def _sliced(graph, w, removed) -> np.ndarray:
    value = ops.convert_to_numpy(w.variable.value)
    for axis, slots in w.axes.items():
        keep = np.nonzero(_select.keep_vector(graph, slots, removed))[0]
        value = np.take(value, keep, axis=axis)
    return value


def analyse(model):
    """(graph, removed channels) of `model`: the all-zero channels of the groups it can prune."""
    graph = ChannelGraph(model)
    return graph, _select.zero_channels(graph)


def shrink(model):
    """A new, physically smaller model without the channels that channel pruning removed.

    A channel is removed when every weight carrying it in its group is exactly zero (the
    producer's kernel slice and bias, BatchNormalization gamma and beta, depthwise filters,
    the consumers' input slices): what `kp.ChannelPruningCallback` leaves. Each shrunk layer
    is rebuilt from its config with fewer `units`/`filters` and keeps its name; the weights of
    the kept channels are copied. The result is a plain Functional (or Sequential) model,
    nested models included, whose outputs equal the masked model's (up to float rounding),
    and which saves as `.keras` and exports to TFLite without keras-perf.

    Args:
        model: A built Functional or Sequential model, usually trained with
            `kp.ChannelPruningCallback`. An unpruned model gives a same-size copy.

    Returns:
        A new `keras.Model` of the same kind. The original model is not changed.

    Raises:
        ChannelGraphError: (a `ValueError`) a subclassed (or not yet built) model, a
            quantization-aware model (shrink the float model before `kp.quantize_aware`).

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="hidden"),
    ...                           keras.layers.Dense(2)])
    >>> kernel, bias = model.layers[0].get_weights()
    >>> kernel[:, :3] = 0; bias[:3] = 0        # as the callback's masks leave them
    >>> model.layers[0].set_weights([kernel, bias])
    >>> kernel, bias = model.layers[1].get_weights()
    >>> kernel[:3] = 0                          # the consumer's input rows too
    >>> model.layers[1].set_weights([kernel, bias])
    >>> kp.shrink(model).get_layer("hidden").units
    1
    """
    graph, removed = analyse(model)
    quantized = [name for name, why in graph.skipped if "quantization-aware" in why]
    if quantized:
        raise ChannelGraphError(
            f"kp.shrink cannot remove channels of the quantization-aware layers {quantized} of "
            f"model {model.name!r}. Shrink before quantizing: prune the float model, "
            "`small = kp.shrink(model)`, then `kp.quantize_aware(small)`."
        )
    infos = {id(info.layer): info for info in graph.infos}
    pairs = []

    def new_inputs(m):
        def one(t):
            shape = list(t.shape)
            slots = graph.input_slots.get(id(t))
            if slots is not None and shape:
                shape[-1] = int(_select.keep_vector(graph, slots, removed).sum())
            name = keras_internals.producer(t).name  # the input keeps its name
            return keras.Input(batch_shape=tuple(shape), dtype=t.dtype, name=name)

        return keras.tree.map_structure(
            one, m.inputs if isinstance(m, keras.Sequential) else m.input
        )

    def clone(layer):
        if isinstance(layer, keras.Model):  # a nested model: rebuilt for its new input width
            new = keras.models.clone_model(
                layer, input_tensors=new_inputs(layer), clone_function=clone
            )
            pairs.append((layer, new))
            return new
        if isinstance(layer, keras.layers.Lambda):
            return layer  # no weights; from_config would refuse a Python lambda (safe mode)
        if not isinstance(layer, keras.layers.Layer):
            # A raw `keras.ops` call on a symbolic tensor (`ops.arange`, `x + y`): an
            # operation without weights, rebuilt from its config as Keras' own cloning does.
            return layer.__class__.from_config(layer.get_config())
        config = layer.get_config()
        info = infos.get(id(layer))
        if info is not None and info.producer:
            kept = int(_select.keep_vector(graph, info.out_slots, removed).sum())
            config["units" if info.kind == "dense" else "filters"] = kept
        new = layer.__class__.from_config(config)
        pairs.append((layer, new))
        return new

    inputs = None if isinstance(model, keras.Sequential) else new_inputs(model)
    small = keras.models.clone_model(model, input_tensors=inputs, clone_function=clone)
    for old, new in pairs:
        if isinstance(old, keras.Model):
            continue  # its layers are copied one by one
        info = infos.get(id(old))
        if info is None:  # not shrunk: all of its state (an adapted Normalization's too)
            copy_layer_state(old, new)
            continue
        by_var = {id(w.variable): w for w in info.weights}
        values = []
        for v in old.weights:
            w = by_var.get(id(v))
            values.append(
                ops.convert_to_numpy(v.value) if w is None else _sliced(graph, w, removed)
            )
        if values:
            new.set_weights(values)
            finalize_state(new)
    return keep_train_step(model, small)
