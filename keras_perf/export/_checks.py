"""Checks `export_tflite` makes before converting: the output path and the model's inputs.

`_check_path` refuses a path TFLite's converter could not write; `_model_inputs`,
`_input_count` and `_input_specs` read the model's input signature (`None` specs for a
subclassed model, whose signature is read from the SavedModel on export). The quantization-
aware export (`_qat`) uses them too. Not here: the checks of the
calibration data (`_calibration`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import keras

from keras_perf._utils import check_choice, check_int, iter_layers


def _check_export_arguments(model, path, quantization, quantizations, calibration_samples):
    """The arguments every exporter (TFLite, ONNX) takes, checked before anything is written."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"`path` must be a str or path-like, got {type(path).__name__}.")
    if quantization is not None and not isinstance(quantization, str):
        raise TypeError(
            f"`quantization` must be None or one of {quantizations[1:]}, got "
            f"{type(quantization).__name__}."
        )
    check_choice("quantization", quantization, quantizations)
    check_int("calibration_samples", calibration_samples, minimum=1)


def _check_path(path) -> Path:
    path = Path(path)
    parent = path.parent
    if not parent.exists():
        raise ValueError(f"`path`'s directory {str(parent)!r} does not exist; create it first.")
    if not parent.is_dir():
        raise ValueError(f"`path`'s parent {str(parent)!r} is not a directory.")
    if path.is_dir():
        raise ValueError(f"`path` {str(path)!r} is a directory; give a file name (`m.tflite`).")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".keras_perf_probe_"):
            pass
    except OSError as e:
        raise ValueError(
            f"`path`'s directory {str(parent)!r} is not writable ({type(e).__name__}: {e})."
        ) from None
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"`path` {str(path)!r} exists and is not writable.")
    return path


def _model_inputs(model) -> list:
    try:
        return list(model.inputs or [])
    except (AttributeError, ValueError):
        # A subclassed model called on data has no symbolic inputs but Keras can still
        # derive an input signature from its build shapes.
        return [None]


def _input_count(model) -> int:
    try:
        return len(model.inputs) if model.inputs else 1
    except (AttributeError, ValueError):
        return 1


def _input_specs(model) -> list[tuple] | None:
    """`(name, shape, dtype)` per input in `model.inputs` order; `None` for a subclassed model.

    The names are the ones `model.export` gives the SavedModel signature, so the TFLite
    file's signature too.
    """
    try:
        inputs = list(model.inputs or [])
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    return [(t.name, tuple(t.shape), str(t.dtype)) for t in inputs]


def pack_inputs(model, arrays: list):
    """`arrays` (one per input, in `model.inputs` order) in the structure the model takes:
    a dict for a dict-input model (a list works too, but Keras then warns that the structure
    does not match), one array for one input, else a list."""
    try:
        structure = model.input
    except (AttributeError, ValueError):
        structure = None
    if isinstance(structure, dict):
        return keras.tree.pack_sequence_as(structure, list(arrays))
    return arrays[0] if len(arrays) == 1 else list(arrays)


def _reduced_precision_layers(model) -> list[tuple[str, str]]:
    """`(layer name, policy name)` of every layer that computes below float32."""
    found = []
    for layer in [model, *iter_layers(model)]:
        policy = getattr(layer, "dtype_policy", None)
        compute = getattr(policy, "compute_dtype", "float32")
        if compute in ("float16", "bfloat16") and not isinstance(layer, keras.layers.InputLayer):
            found.append((layer.name, policy.name))
    return found


def refuse_reduced_precision_qat(model, exporter: str) -> None:
    """A `ValueError` for a quantization-aware model that computes in float16/bfloat16.

    Its int8 export reads the learned ranges off a float32 graph; under `mixed_bfloat16` the
    exporters write half-precision casts around the fake-quantized ops, which the converters
    then reject with an error about an op (tf2onnx: a bfloat16 Conv input; TFLite: a `tfl.mul`
    with operands of two types).
    """
    reduced = _reduced_precision_layers(model)
    if reduced:
        names = ", ".join(f"{name!r} ({policy})" for name, policy in reduced[:3])
        raise ValueError(
            f"{exporter} of a quantization-aware model needs it to compute in float32; its "
            f"layers {names} compute in reduced precision. Nothing was written. Build the float "
            "model again under `keras.mixed_precision.set_global_policy('float32')`, make it "
            "quantization-aware the same way (`qat32 = kp.quantize_aware(model32, ...)`), copy "
            "the trained weights (`qat32.set_weights(qat.get_weights())`: the variables are "
            "float32 under mixed precision) and export `qat32`."
        )


# Layers that are the identity at inference and hold a random-seed state variable. Keras' JAX
# SavedModel writes that state back after each call (a uint32 variable TFLite cannot assign).
_INFERENCE_IDENTITY = (
    keras.layers.Dropout,
    keras.layers.SpatialDropout1D,
    keras.layers.SpatialDropout2D,
    keras.layers.SpatialDropout3D,
    keras.layers.GaussianNoise,
    keras.layers.GaussianDropout,
    keras.layers.AlphaDropout,
)


def _seeded(layer) -> bool:
    return isinstance(getattr(layer, "seed_generator", None), keras.random.SeedGenerator)


def export_twin(model, exporter: str, seed_state: bool = True) -> keras.Model:
    """`model` itself, or the inference twin an exporter converts instead.

    Two things in a trained model have no place in a deployed file:

    - Reduced precision. Under `mixed_float16`/`mixed_bfloat16` a layer's variables are
      float32 and only its computation is in half precision; TFLite's builtin kernels and ONNX
      Runtime's CPU kernels have no bfloat16 (and few float16) versions, so the exported model
      computes in float32 (the quantized modes then quantize from it).
    - On JAX, the seed state of Dropout-like layers: Keras' JAX SavedModel assigns it back after
      every call, and TFLite cannot hold the uint32 variable. These layers are the identity at
      inference, so the twin has `Identity` in their place (`seed_state=False` keeps them:
      the ONNX exporters do not write that state).

    The twin is the same Sequential or Functional graph cloned from the layers' configs, given
    the trained weights. A subclassed model cannot be cloned from its config, so it gets a
    `ValueError` saying how to rebuild it.
    """
    from keras_perf._keras_internals import is_functional

    reduced = _reduced_precision_layers(model)
    jax = seed_state and keras.backend.backend() == "jax"
    random = [
        layer.name
        for layer in iter_layers(model)
        if jax and isinstance(layer, _INFERENCE_IDENTITY) and _seeded(layer)
    ]
    if not reduced and not random:
        return _refuse_seed_state(model, exporter) if jax else model
    why = []
    if reduced:
        names = ", ".join(f"{name!r} ({policy})" for name, policy in reduced[:3])
        why.append(f"its layers {names} compute in reduced precision")
    if random:
        why.append(f"its layers {random[:3]} hold a random-seed state (JAX)")
    why = " and ".join(why)
    if not isinstance(model, keras.Sequential) and not is_functional(model):
        raise ValueError(
            f"{exporter} cannot convert this subclassed model as it is: {why}. Build it again "
            "under `keras.mixed_precision.set_global_policy('float32')` (and without the "
            "Dropout-like layers on JAX), call it once on a batch, copy the weights "
            "(`twin.set_weights(model.get_weights())`) and export the twin."
        )

    def clone(layer):
        if jax and isinstance(layer, _INFERENCE_IDENTITY) and _seeded(layer):
            return keras.layers.Identity(name=layer.name, dtype="float32" if reduced else None)
        config = layer.get_config()
        if reduced and "dtype" in config and not isinstance(layer, keras.layers.InputLayer):
            config["dtype"] = "float32"
        return type(layer).from_config(config)

    try:
        twin = keras.models.clone_model(model, clone_function=clone, recursive=True)
        twin.set_weights(model.get_weights())
    except Exception as e:  # A layer whose config does not round-trip: say what was needed.
        raise ValueError(
            f"{exporter} converts an inference copy of this model because {why}, and making "
            f"the copy failed ({type(e).__name__}: {e}). Rebuild the model under "
            "`keras.mixed_precision.set_global_policy('float32')` (without Dropout-like layers "
            "on JAX), load the weights and export that."
        ) from e
    return _refuse_seed_state(twin, exporter) if jax else twin


def _refuse_seed_state(model, exporter: str) -> keras.Model:
    """`model`, or a `ValueError` naming the layers whose seed state is inside another layer."""
    nested = [
        f"{layer.name}/{inner.name}"
        for layer in iter_layers(model)
        for inner in iter_layers(layer)
        if _seeded(inner)
    ]
    if nested:
        raise ValueError(
            f"{exporter} on JAX cannot convert the random-seed state of layers {nested[:3]} "
            "(a layer's own dropout, as in an LSTM or a MultiHeadAttention): Keras' JAX "
            "SavedModel writes it back after every call and TFLite has no uint32 variables. "
            "Export from the TensorFlow backend (save the model as .keras and load it there)."
        )
    return model
