"""The one place keras-perf reads or writes private Keras attributes (checked on Keras 3.15).

Keras has no public API for these; every other module calls the functions here, so a Keras
change breaks one small module (and the tests on every backend), not the whole package.
Each function names the private attribute it touches and why it is needed; the private
`keras.src` imports are here too, each with the Keras versions it was checked on.

Backend-neutral and on the ground floor of the package: it imports Keras only, never
`keras_perf.backend` or anything above it (tests/test_imports.py checks that, and that no other
module imports `keras.src` or reads `_keras_history`/`_inbound_nodes`/`_outbound_nodes`). It
stays here rather than in `keras_perf/backend/` (decided for issue 42): `backend/` holds what
differs per Keras backend, and nothing here does but one function, which is for the traced
torch step alone (`torch_spatial_transposes_as_views`: it imports Keras' torch module when it
is called, never at import); the ground floor (`_utils`) and the shared train step
(`train_step/_base.py`), which must not reach `backend/`, read it.
"""

from __future__ import annotations

import contextlib

import keras

# Keras builds layers symbolically with this (no graph ops, no metric updates); checked on
# Keras 3.8-3.15.
from keras.src.backend import compute_output_spec

# Keras keeps masks beside tensors; this is its reader (no public equivalent).
from keras.src.backend.common.masking import get_keras_mask

# Keras casts float variables to a layer's compute dtype inside its call through this scope;
# a call recomputed in the backward pass (remat on torch) runs after it has closed, so the
# train step re-enters one with the same dtype. Checked on Keras 3.15.
from keras.src.backend.common.variables import AutocastScope, get_autocast_scope

# Keras divides the loss by the replica count under tf.distribute and tracks the undivided
# value (its helpers for both, used by its TensorFlow trainer); checked on Keras 3.8-3.15.
from keras.src.losses.loss import scale_loss_for_distribution, unscale_loss_for_distribution

__all__ = [
    "accumulated_gradients",
    "added_losses",
    "aggregate_additional_loss",
    "autocast_dtype",
    "autocast_scope",
    "master_value",
    "callback_model",
    "compiled_loss",
    "compute_output_spec",
    "direct_sublayers",
    "examples_seen",
    "get_keras_mask",
    "held_values",
    "inbound_output_shapes",
    "input_structure",
    "is_functional",
    "learning_rate_source",
    "loss_terms_replaced",
    "loss_tracker",
    "metric_direction",
    "optimizer_iterations",
    "output_structure",
    "producer",
    "producing_node",
    "run_through_graph",
    "scale_loss_for_distribution",
    "set_initial_epoch",
    "set_learning_rate_source",
    "symbolic_build",
    "torch_spatial_transposes_as_views",
    "unscale_loss_for_distribution",
]


# -- models --------------------------------------------------------------------------------
def compiled_loss(model):
    """The model's `CompileLoss` (`_compile_loss`), or None before `compile`."""
    return getattr(model, "_compile_loss", None)


def loss_tracker(model):
    """The `Mean` Keras' train and test steps track the loss in (`_loss_tracker`), or None."""
    return getattr(model, "_loss_tracker", None)


def aggregate_additional_loss(model, loss):
    """One `model.losses` entry as Keras' `compute_loss` adds it (`_aggregate_additional_loss`:
    cast and, under tf.distribute, divided by the replica count)."""
    return model._aggregate_additional_loss(loss)


def examples_seen(model) -> int | None:
    """Examples Keras' built-in loss tracker has counted since the model's metrics were reset.

    Keras' own `train_step`/`test_step` (every backend) update `model._loss_tracker`, a
    `keras.metrics.Mean`, with `sample_weight` = the leading dimension of the batch's first
    input, so its `count` is the number of examples seen this epoch, a short last batch and
    `steps_per_execution > 1` included. `fit` resets it at each epoch start and `evaluate`
    resets it at its start (after `on_test_begin`). Private attribute, present since Keras 3.0,
    checked with Keras 3.15. Reading it syncs the device: call it per epoch, never per batch.

    Returns:
        The count as an int, or None when the model has no such tracker or it counted nothing
        (a custom `train_step` that does not update it).
    """
    count = getattr(loss_tracker(model), "count", None)
    if count is None:
        return None
    # float() of the 0-d backend tensor: on TF, convert_to_numpy of a variable warns under NumPy 2.
    raw = getattr(count, "value", count)
    if hasattr(raw, "read_value"):
        # tf.distribute: a sync-on-read variable; reading it outside the replicas sums them.
        raw = raw.read_value()
    value = float(raw)
    return int(round(value)) if value > 0 else None


def is_functional(model) -> bool:
    """Whether `model` is a Functional model (Sequential models with an input count too)."""
    # Private import: Keras exports no public Functional class (checked on Keras 3.8-3.15).
    from keras.src.models.functional import Functional

    return isinstance(model, Functional) or (
        isinstance(model, keras.Sequential) and bool(getattr(model, "inputs", None))
    )


def input_structure(model, default=None):
    """The nested (dict, list) input structure of a Functional model (`_inputs_struct`)."""
    return getattr(model, "_inputs_struct", default)


def output_structure(model, default=None):
    """The nested output structure of a Functional model (`_outputs_struct`)."""
    return getattr(model, "_outputs_struct", default)


def run_through_graph(model, inputs, call_fn):
    """A Functional model's graph run on `inputs`, each operation called through
    `call_fn(op, *args, **kwargs)` (`Functional._run_through_graph`, what its `call` uses): the
    way to rebuild a graph with other layers in place of its own. Checked on Keras 3.15."""
    return model._run_through_graph(inputs, call_fn=call_fn)


def symbolic_build(model, data_batch) -> None:
    """Build the model, its compiled loss and metrics and its optimizer without a step.

    What `fit` and `train_on_batch` do first (`Trainer._symbolic_build`, checked on Keras
    3.8-3.15): shapes only, no variable changes a value. Needed before a train step is
    compiled outside `fit` (XLA's memory analysis) or its state is copied.
    """
    model._symbolic_build(data_batch=data_batch)


def set_initial_epoch(model, epoch: int | None) -> None:
    """Set the epoch `fit` starts from: `_initial_epoch`, the attribute `BackupAndRestore` sets
    for this (`fit` reads it after `on_train_begin`; 0 or None means fit's `initial_epoch`).
    Keras never clears it: a later `fit` of the same model starts there too, unless it is
    set back to None."""
    model._initial_epoch = epoch


# -- Functional graphs ---------------------------------------------------------------------
def producer(tensor):
    """The operation (a layer, or a raw `keras.ops` call) that produced a symbolic tensor of a
    Functional graph (`KerasTensor._keras_history.operation`), or None for a tensor without
    one. Checked on Keras 3.8-3.15."""
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation


def producing_node(tensor):
    """The graph `Node` that produced a symbolic tensor: its operation's inbound node at the
    index `_keras_history` records (`Operation._inbound_nodes`); read its public
    `input_tensors`/`output_tensors`. Checked on Keras 3.8-3.15."""
    op, node_index, _ = tensor._keras_history
    return op._inbound_nodes[node_index]


def consumers(layer) -> list:
    """The operations that take `layer`'s outputs in a Functional graph (each outbound node's
    `operation`, `Operation._outbound_nodes`). Checked on Keras 3.8-3.15."""
    nodes = getattr(layer, "_outbound_nodes", None) or []
    return [n.operation for n in nodes if getattr(n, "operation", None) is not None]


# -- layers --------------------------------------------------------------------------------
def direct_sublayers(layer) -> list:
    """Sub-layers Keras tracks on any layer (`_layers`; `layers` is public on models only)."""
    sub = getattr(layer, "_layers", None)
    return getattr(layer, "layers", []) if sub is None else sub


def inbound_output_shapes(layer) -> list:
    """Shapes of `layer`'s outputs at each of its calls in a model's graph (`_inbound_nodes`)."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    return [t.shape for node in nodes for t in keras.tree.flatten(node.output_tensors)]


def autocast_dtype():
    """The dtype float variables are cast to inside the current layer call, or None."""
    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


def autocast_scope(dtype):
    """A context casting float variables to `dtype` as a layer call does (None: nothing)."""
    return contextlib.nullcontext() if dtype is None else AutocastScope(dtype)


def master_value(variable):
    """`variable`'s own value, in its own dtype, also inside a layer call that casts float
    variables to a mixed-precision compute dtype (Keras: `AutocastScope(None)` casts nothing).
    `.value` is read inside the scope (`convert_to_tensor` on TensorFlow returns the Keras
    variable itself, cast when read later); on TensorFlow it is a `tf.Variable`, read into a
    tensor by `ops.copy` (`tf.identity`), as some Keras ops want a tensor."""
    with AutocastScope(None):
        value = variable.value
    return keras.ops.copy(value) if keras.backend.backend() == "tensorflow" else value


def held_values(variables) -> list:
    """The tensors `variables` hold, read as `.value` reads them outside any stateless or
    autocast scope. `.value` checks those scopes and the device on every read (17 us for an
    MLP's 22 variables on torch here, 2.5 % of its traced step); the traced step reads them
    once per step, outside every scope, from `_value`."""
    return [v.value if v._value is None else v._value for v in variables]


def added_losses(layer) -> bool:
    """Whether `layer` holds losses added with `add_loss()` (`_losses`, `_loss_ids`)."""
    return bool(getattr(layer, "_losses", None) or getattr(layer, "_loss_ids", None))


# -- compiled loss -------------------------------------------------------------------------
@contextlib.contextmanager
def loss_terms_replaced(compile_loss, make_term, make_tracker):
    """While inside, `compile_loss` computes each term with `make_term(index, loss)` and tracks
    each per-output loss with `make_tracker(metric)` (`_flat_losses`, `_metrics`: its terms
    as (path, loss, weight, name) and their trackers). Yields the original terms."""
    terms, metrics = compile_loss._flat_losses, compile_loss._metrics
    compile_loss._flat_losses = [
        (path, make_term(j, loss), weight, name)
        for j, (path, loss, weight, name) in enumerate(terms)
    ]
    compile_loss._metrics = [make_tracker(m) for m in metrics]
    try:
        yield terms
    finally:
        compile_loss._flat_losses, compile_loss._metrics = terms, metrics


# -- metrics and callbacks -----------------------------------------------------------------
def metric_direction(metric):
    """`"up"`/`"down"` as a metric declares it for "auto" monitoring (`_direction`), or None."""
    return getattr(metric, "_direction", None)


def callback_model(callback):
    """The callback's model without the sync the `model` property does on JAX (`_model`)."""
    return callback._model


# -- optimizers ----------------------------------------------------------------------------
def optimizer_iterations(optimizer):
    """The raw batch counter behind `iterations` (`_iterations`: counts accumulated batches)."""
    return optimizer._iterations


def accumulated_gradients(optimizer) -> list:
    """The gradient accumulators of `gradient_accumulation_steps` (`_accumulated_gradients`)."""
    return [a for a in (getattr(optimizer, "_accumulated_gradients", None) or []) if a is not None]


def learning_rate_source(optimizer):
    """The schedule, callable or variable behind `learning_rate` (`_learning_rate`).

    Keras' public `optimizer.learning_rate` returns the value of a schedule, not the schedule,
    and its setter untracks the variable when anything but a number is assigned, so the object a
    user passed can be read back (and put back) only here.
    """
    return optimizer._learning_rate


def set_learning_rate_source(optimizer, value) -> None:
    """Replace the schedule behind `learning_rate` without building a variable for it."""
    optimizer._learning_rate = value


def compile_config(model):
    """The compile configuration Keras keeps for saving (`Trainer._compile_config`, since Keras
    3.0; a new object at every `compile`), or None for a model never compiled. The arguments
    `compile` was called with (`.config`) and, by identity, whether the model was compiled
    again."""
    return getattr(model, "_compile_config", None)


def set_keras_seed(seed) -> None:
    """The Keras part of `keras.utils.set_random_seed(seed)` (Keras 3.8-3.15: the global seed
    in `global_state` and the global `SeedGenerator` dropped, to be made again from it), for
    `backend.set_random_seed`, which seeds the rest itself."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)


@contextlib.contextmanager
def torch_spatial_transposes_as_views():
    """Within it, Keras' torch backend hands convolutions and poolings a channels-first view of
    a channels-last image instead of a channels-first copy (`keras.src.backend.torch.nn.
    _transpose_spatial_inputs`, which adds `.contiguous()`; checked on Keras 3.15).

    Why: a Keras image is channels-last, torch's convolutions and poolings take channels-first
    shapes. Keras copies each image to channels-first memory, its convolution then copies it
    back to channels-last memory (`_maybe_convert_to_channels_last`), and its poolings run
    torch's channels-first kernels: on this project's CPU a 2x2 max pooling of 64x26x26x16 takes
    2.7 ms channels-first against 0.25 ms on the same image in channels-last memory, and a ReLU's
    gradient between the two layouts 2.9 ms against 0.26. A view costs nothing, and every op
    then reads the memory as it lies; the values are the same ops' values (the convolutions run
    in channels-last memory either way). Keras copies so that a `view` of the result works; a
    step traced with `make_fx` under this scope fails to trace where one does not, and the
    caller traces again without it. Used only while keras-perf traces a train step (one
    thread); yields False where this Keras has no such function (nothing is changed).
    """
    from keras.src.backend.torch import nn as torch_nn  # imports torch: called on torch only

    original = getattr(torch_nn, "_transpose_spatial_inputs", None)
    if original is None:
        yield False
        return

    def as_view(inputs):
        if inputs.ndim not in (3, 4, 5):
            return original(inputs)  # Keras' own error
        return inputs.permute(0, inputs.ndim - 1, *range(1, inputs.ndim - 1))

    torch_nn._transpose_spatial_inputs = as_view
    try:
        yield True
    finally:
        torch_nn._transpose_spatial_inputs = original
