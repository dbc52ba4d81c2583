"""`quantize_aware`: clone a Sequential/Functional model with fake-quantized kernels and
learned activation ranges, placed where TFLite's int8 kernels have them.

Placement (what TFLite fuses, see docs/quantization.md): one quantizer on each float model
input; none between a kernel layer (Dense/Conv...), a BatchNormalization folded into it and a
ReLU/ReLU6 fused into it; one after the fused block; none on layers that keep their input's
scale (Flatten, Reshape, MaxPooling, Dropout...); none before a Concatenate, one after it; one
after every other layer.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_perf._carry_over import copy_layer_state, keep_train_step
from keras_perf._layer_selection import check_selectors, matches_layer
from keras_perf._masks import MaskConstraint
from keras_perf._utils import check_bool, check_number
from keras_perf.quantization._layers import QUANTIZED_CLASSES, QuantizedKernelMixin
from keras_perf.quantization._quantizers import (
    ACTIVATION_BITS,
    WEIGHT_BITS,
    ActivationQuantizer,
    check_bits,
)

_PASS_THROUGH = tuple(
    getattr(keras.layers, n)
    for n in (
        "Dropout",
        "SpatialDropout1D",
        "SpatialDropout2D",
        "SpatialDropout3D",
        "AlphaDropout",
        "GaussianDropout",
        "GaussianNoise",
        "ActivityRegularization",
        "Identity",
        "Flatten",
        "Reshape",
        "Permute",
        "RepeatVector",
        "MaxPooling1D",
        "MaxPooling2D",
        "MaxPooling3D",
        "GlobalMaxPooling1D",
        "GlobalMaxPooling2D",
        "GlobalMaxPooling3D",
        "ZeroPadding1D",
        "ZeroPadding2D",
        "ZeroPadding3D",
        "Cropping1D",
        "Cropping2D",
        "Cropping3D",
        "UpSampling1D",
        "UpSampling2D",
        "UpSampling3D",
    )
    if hasattr(keras.layers, n)
)
_FUSED_ACTIVATIONS = ("linear", "relu", "relu6")


def quantize_aware(
    model,
    weight_bits: int = 8,
    activation_bits: int = 8,
    per_channel: bool = True,
    include=None,
    exclude=None,
    *,
    ema_decay: float = 0.999,
    preserve_sparsity: bool = True,
):
    """Make a quantization-aware-training copy of a model (as tfmot's `quantize_model`).

    The copy has the same layers, names and weights, with the kernels of `Dense`,
    `EinsumDense`, `Conv1D/2D/3D`, `DepthwiseConv2D` and `Conv2DTranspose` fake-quantized
    (symmetric, narrow integer range, per output channel by default) and fake-quantizers with
    learned ranges on the model's input and on the activations, placed as TFLite's int8
    kernels quantize them.
    Train it with plain `compile`/`fit`; `kp.export_tflite(qat, path, "int8")` then writes an
    int8 file from the learned ranges, without calibration data. The float model is left
    untouched.

    Args:
        model: A built Sequential or Functional model (nested models are quantized too).
        weight_bits: Bits of the kernels' integer range, 2-8. Defaults to `8`.
        activation_bits: Bits of the activations' range, 2-8 or 16. Defaults to `8`.
        per_channel: One scale per output channel of a kernel (TFLite's int8 scheme) rather
            than one per tensor. Defaults to `True`.
        include: Quantize only the kernels of these layers: layer names, regexes (fully
            matching a name) or layer classes. Activations are quantized everywhere, so the
            int8 file has a range for every tensor. Defaults to `None` (every supported layer).
        exclude: Leave these layers' kernels in float (same forms). Defaults to `None`.
        ema_decay: Weight of the old range in the activation ranges' moving average; the
            first training batch sets the range. Defaults to `0.999` (tfmot's).
        preserve_sparsity: A pruned kernel keeps its zeros: the layer computes with
            `kernel * mask`, so those weights get no gradient and stay 0. A kernel counts as
            pruned when it carries keras-perf's pruning mask (`kp.PruningCallback`,
            `kp.prune_low_magnitude`, `kp.ChannelPruningCallback`), or when at least 10 % of
            its entries, and not all, are exactly 0 (a stripped or reloaded pruned model);
            other zeros (an all-zero initialisation, a stray 0) train. Defaults to `True`.

    Returns:
        A new, uncompiled `keras.Model` (Sequential for a Sequential model).

    Raises:
        TypeError: `model` is not a Keras model; a bad argument type.
        ValueError: a subclassed or unbuilt model; bits out of range; nothing to quantize; an
            `include` item that matches no quantizable layer.

    Example:
        >>> import keras, keras_perf as kp
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        >>> qat = kp.quantize_aware(model)
        >>> [type(layer).__name__ for layer in qat.layers]
        ['ActivationQuantizer', 'QuantizedDense', 'ActivationQuantizer']
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    weight_bits = check_bits("weight_bits", weight_bits, WEIGHT_BITS)
    activation_bits = check_bits("activation_bits", activation_bits, ACTIVATION_BITS)
    check_bool("per_channel", per_channel)
    check_bool("preserve_sparsity", preserve_sparsity)
    ema_decay = check_number("ema_decay", ema_decay, low=0.0, high=1.0, high_inclusive=False)
    include = check_selectors("include", include)
    exclude = check_selectors("exclude", exclude)
    _check_graph(model, "model")
    if not model.built or not model.inputs:
        raise ValueError(
            "`model` is not built: start it with `keras.Input(shape)` (or call it on a batch) "
            "before `quantize_aware`."
        )
    candidates = [layer for layer in _leaves(model) if type(layer) in QUANTIZED_CLASSES]
    if not candidates:
        names = sorted(c.__name__ for c in QUANTIZED_CLASSES)
        raise ValueError(
            f"`model` has nothing to quantize: quantize_aware quantizes the kernels of "
            f"{', '.join(names)} layers, and this model has none."
        )
    for item in include:
        if not any(matches_layer(item, layer) for layer in candidates):
            raise ValueError(
                f"`include` item {item!r} matches no quantizable layer; the model's are: "
                f"{', '.join(layer.name for layer in candidates)}."
            )
    selected = {
        id(layer)
        for layer in candidates
        if (not include or any(matches_layer(i, layer) for i in include))
        and not any(matches_layer(i, layer) for i in exclude)
    }
    if not selected:
        raise ValueError(
            "`exclude` leaves nothing to quantize: every quantizable layer "
            f"({', '.join(layer.name for layer in candidates)}) is excluded."
        )
    settings = {
        "weight_bits": weight_bits,
        "activation_bits": activation_bits,
        "per_channel": per_channel,
        "ema_decay": ema_decay,
        "preserve_sparsity": preserve_sparsity,
        "selected": selected,
    }
    pairs = []
    new = _quantize_graph(model, settings, pairs, quantize_inputs=True)
    for old, copy in pairs:
        _copy_weights(old, copy)
    return keep_train_step(model, new)


def _check_graph(model, what):
    if isinstance(model, keras.Sequential):
        return
    try:
        config = model.get_config()
    except Exception:  # NotImplementedError for a subclassed model without get_config.
        config = None
    if not (isinstance(config, dict) and "layers" in config and "input_layers" in config):
        raise ValueError(
            f"`{what}` is a subclassed model ({type(model).__name__}): quantize_aware needs "
            "the layer graph of a Sequential or Functional model to place the quantizers. "
            "Build the model with the functional API (`keras.Model(inputs, outputs)`), or "
            "apply quantize_aware to the Sequential/Functional parts it is made of."
        )


def _leaves(model):
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            _check_graph(layer, f"model's nested layer {layer.name!r}")
            yield from _leaves(layer)
        else:
            yield layer


def _history(obj, found):
    if isinstance(obj, dict):
        if obj.get("class_name") == "__keras_tensor__":
            found.append(obj["config"]["keras_history"][0])
            return
        for v in obj.values():
            _history(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _history(v, found)


def layer_graph(model):
    """(layers in order, name -> list of consumer names (one per edge), output names, names
    of the layers called more than once). Functional "layers" include raw `keras.ops` calls
    on symbolic tensors (e.g. `ops.ones_like(x)`), which are operations but not layers."""
    if isinstance(model, keras.Sequential):
        layers = [x for x in model.layers if not isinstance(x, keras.layers.InputLayer)]
        consumers = {a.name: [b.name] for a, b in zip(layers, layers[1:])}
        return layers, consumers, {layers[-1].name}, set()
    layers = [x for x in model.operations if not isinstance(x, keras.layers.InputLayer)]
    config = model.get_config()
    consumers = {}
    shared = set()
    for entry in config["layers"]:
        producers = []
        _history(entry.get("inbound_nodes", []), producers)
        for p in producers:
            consumers.setdefault(p, []).append(entry["name"])
        if len(entry.get("inbound_nodes", [])) > 1:
            shared.add(entry["name"])
    outputs = []
    _history_names(config["output_layers"], outputs)
    return layers, consumers, set(outputs), shared


def _history_names(obj, found):
    if isinstance(obj, (list, tuple)) and len(obj) == 3 and isinstance(obj[0], str):
        found.append(obj[0])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _history_names(v, found)
    elif isinstance(obj, dict):
        for v in obj.values():
            _history_names(v, found)


def _activation_name(layer) -> str | None:
    """'linear'/'relu'/'relu6'/... for a layer that only applies an activation, else None."""
    if isinstance(layer, keras.layers.ReLU):
        c = layer.get_config()
        if c.get("negative_slope", 0) or c.get("threshold", 0):
            return "leaky"
        return {None: "relu", 6.0: "relu6"}.get(c.get("max_value"), "clipped")
    if isinstance(layer, keras.layers.Activation):
        return function_name(layer.activation)
    return None


def function_name(fn) -> str:
    """The serialized name of an activation function ("linear" for None, "custom" when Keras
    cannot name it): how quantization and the ONNX QAT export decide what fuses."""
    if fn is None:
        return "linear"
    name = keras.activations.serialize(fn)
    if isinstance(name, dict):
        name = name.get("config", "custom")
    return name if isinstance(name, str) else "custom"


def _is_kernel_layer(layer) -> bool:
    return isinstance(layer, tuple(QUANTIZED_CLASSES))


def _split_activation(layer) -> bool:
    """A kernel layer whose activation TFLite does not fuse (softmax, tanh...): its output
    before the activation is a tensor of its own in the int8 file and needs a range."""
    return _is_kernel_layer(layer) and function_name(layer.activation) not in _FUSED_ACTIVATIONS


def _plan(model):
    """name -> whether the layer's output gets a quantizer; name -> its block's end."""
    layers, consumers, outputs, shared = layer_graph(model)
    by_name = {layer.name: layer for layer in layers}

    def linear_kernel(layer):
        return _is_kernel_layer(layer) and (
            _split_activation(layer) or function_name(layer.activation) == "linear"
        )

    def fused(producer, consumer) -> bool:
        if isinstance(consumer, keras.layers.BatchNormalization):
            return linear_kernel(producer)
        if _activation_name(consumer) in ("relu", "relu6"):
            return linear_kernel(producer) or isinstance(
                producer, (keras.layers.BatchNormalization, keras.layers.Add)
            )
        return False

    quantize = {}
    for layer in layers:
        users = consumers.get(layer.name, [])
        if isinstance(layer, keras.Model) or isinstance(layer, _PASS_THROUGH):
            q = False
        elif layer.name in outputs or not users:
            q = True
        elif _split_activation(layer):
            q = True
        elif all(isinstance(by_name[u], keras.layers.Concatenate) for u in users):
            q = False
        elif layer.name in shared:
            q = True  # a quantizer after each call: no fusion planned for a shared layer
        elif len(users) == 1 and fused(layer, by_name[users[0]]):
            q = False
        else:
            q = True
        quantize[layer.name] = q

    def block_end(name):
        seen = set()
        while not quantize[name] and name not in seen:
            seen.add(name)
            users = set(consumers.get(name, []))
            if len(users) != 1:
                return None
            name = users.pop()
        return name if quantize.get(name) else None

    ends = {layer.name: block_end(layer.name) for layer in layers if _is_kernel_layer(layer)}
    return quantize, ends


def _quantizer(settings, name):
    return ActivationQuantizer(
        settings["activation_bits"], ema_decay=settings["ema_decay"], name=name
    )


def _quant_name(layer_name, split=False):
    return f"{layer_name}_activation_quant" if split else f"{layer_name}_quant"


def _clone(layer, settings, pairs, end, split):
    if isinstance(layer, keras.Model):
        return _quantize_graph(layer, settings, pairs, quantize_inputs=False)
    if not isinstance(layer, keras.layers.Layer):  # a raw keras.ops call: rebuilt, no state
        return type(layer).from_config(layer.get_config())
    config = layer.get_config()
    cls = type(layer)
    if id(layer) in settings["selected"]:
        config.update(
            weight_bits=settings["weight_bits"],
            per_channel=settings["per_channel"],
            sparsity_mask=bool(settings["preserve_sparsity"] and _pruned(layer.kernel)),
            activation_quantizer=(
                _quant_name(layer.name, True) if split else (end and _quant_name(end))
            ),
        )
        cls = QUANTIZED_CLASSES[cls]
    if split:
        config["activation"] = "linear"
    new = cls.from_config(config)
    pairs.append((layer, new))
    return new


# Share of exact zeros from which a kernel without a pruning mask counts as pruned (a pruned
# model after `kp.strip_pruning` or save/load); below it, zeros are taken as accidental.
_PRUNED_ZEROS = 0.1


def _pruned(kernel) -> bool:
    """Whether a kernel's exact zeros are pruning's, to keep at 0: it carries a pruning mask
    (`kp.PruningCallback`, `kp.prune_low_magnitude`, `kp.ChannelPruningCallback`), or at least
    `_PRUNED_ZEROS` of it and not all of it is zero (an all-zero kernel is an initialisation)."""
    zeros = float(np.mean(keras.ops.convert_to_numpy(kernel) == 0))
    if zeros == 0.0:
        return False
    return isinstance(kernel.constraint, MaskConstraint) or _PRUNED_ZEROS <= zeros < 1.0


def _quantize_graph(model, settings, pairs, quantize_inputs):
    quantize, ends = _plan(model)
    act_layers = {}
    calls = {}

    def after(old_name, new_layer, out, split_from=None):
        # A shared layer's second call gets quantizers of its own: `<name>_quant_1`...
        n = calls[old_name] = calls.get(old_name, -1) + 1
        suffix = f"_{n}" if n else ""
        if not (isinstance(out, keras.KerasTensor) and _is_float(out)):
            return out  # integer ids, masks...: nothing to quantize (nor several outputs)
        if split_from is not None:
            out = _quantizer(settings, _quant_name(old_name, True) + suffix)(out)
            activation = keras.layers.Activation(split_from, name=f"{old_name}_activation{suffix}")
            out = activation(out)
        if quantize[old_name]:
            out = _quantizer(settings, _quant_name(old_name) + suffix)(out)
        return out

    if isinstance(model, keras.Sequential):
        inp = model.inputs[0]
        new_layers = [keras.Input(batch_shape=inp.shape, dtype=inp.dtype, name=inp.name)]
        if quantize_inputs and _is_float(inp):
            new_layers.append(_quantizer(settings, "input_quant"))
        for layer in model.layers:
            if isinstance(layer, keras.layers.InputLayer):
                continue
            split = _split_activation(layer)
            new_layers.append(_clone(layer, settings, pairs, ends.get(layer.name), split))
            if split:
                new_layers.append(_quantizer(settings, _quant_name(layer.name, True)))
                new_layers.append(
                    keras.layers.Activation(layer.activation, name=f"{layer.name}_activation")
                )
            if quantize.get(layer.name) and _float_output(layer):
                new_layers.append(_quantizer(settings, _quant_name(layer.name)))
        return keras.Sequential(new_layers, name=model.name)

    new_inputs = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name), model.input
    )
    quantized_inputs = {}
    if quantize_inputs:
        for t in keras.tree.flatten(new_inputs):
            if _is_float(t):
                quantized_inputs[id(t)] = _quantizer(settings, _quant_name(t.name))(t)

    def call_function(layer, *args, **kwargs):
        swap = lambda t: quantized_inputs.get(id(t), t)  # noqa: E731
        args = keras.tree.map_structure(swap, args)
        kwargs = keras.tree.map_structure(swap, kwargs)
        out = layer(*args, **kwargs)
        split = act_layers.get(layer.name)
        return after(layer.name, layer, out, split)

    def clone_function(layer):
        split = _split_activation(layer)
        if split:
            act_layers[layer.name] = layer.activation
        return _clone(layer, settings, pairs, ends.get(layer.name), split)

    return keras.models.clone_model(
        model,
        input_tensors=new_inputs,
        clone_function=clone_function,
        call_function=call_function,
    )


def _is_float(t) -> bool:
    return "float" in str(t.dtype)


def _float_output(layer) -> bool:
    try:
        return _is_float(layer.output)
    except (AttributeError, ValueError):  # also called in another model: no single output
        return True


def _copy_weights(old, new):
    """Assign `old`'s weights to the same-named weights of `new` (its extra ones, a kernel
    mask, are set from the kernel's zeros); a layer kept as it was gets all of its state."""
    if isinstance(old, keras.Model):
        return
    if not isinstance(new, QuantizedKernelMixin):
        copy_layer_state(old, new)  # e.g. an adapted Normalization's statistics
        return
    by_name = {}
    for v in new.weights:
        by_name.setdefault(v.name, []).append(v)
    for v in old.weights:
        by_name[v.name].pop(0).assign(keras.ops.convert_to_numpy(v.value))
    if isinstance(new, QuantizedKernelMixin) and new.kernel_mask is not None:
        mask = keras.ops.convert_to_numpy(old.kernel) != 0
        new.kernel_mask.assign(mask.astype(new.kernel_mask.dtype))
