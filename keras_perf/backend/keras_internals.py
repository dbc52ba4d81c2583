"""The one place keras-perf reads or writes private Keras attributes (checked on Keras 3.15).

Keras has no public API for these; every other module calls the functions here, so a Keras
change breaks one small module (and the tests on every backend), not the whole package.
Each function names the private attribute it touches and why it is needed.
"""

from __future__ import annotations

import contextlib

# Keras keeps masks beside tensors; this is its reader (no public equivalent).
from keras.src.backend.common.masking import get_keras_mask

__all__ = [
    "accumulated_gradients",
    "added_losses",
    "aggregate_additional_loss",
    "callback_model",
    "compiled_loss",
    "direct_sublayers",
    "get_keras_mask",
    "input_structure",
    "loss_terms_replaced",
    "loss_tracker",
    "metric_direction",
    "optimizer_iterations",
    "output_structure",
    "learning_rate_source",
    "set_learning_rate_source",
    "set_initial_epoch",
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


def input_structure(model, default=None):
    """The nested (dict, list) input structure of a Functional model (`_inputs_struct`)."""
    return getattr(model, "_inputs_struct", default)


def output_structure(model, default=None):
    """The nested output structure of a Functional model (`_outputs_struct`)."""
    return getattr(model, "_outputs_struct", default)


def set_initial_epoch(model, epoch: int) -> None:
    """Set the epoch `fit` starts from: `_initial_epoch`, the attribute `BackupAndRestore` sets
    for this (`fit` reads it after `on_train_begin`; 0 means fit's `initial_epoch`)."""
    model._initial_epoch = epoch


# -- layers --------------------------------------------------------------------------------
def direct_sublayers(layer) -> list:
    """Sub-layers Keras tracks on any layer (`_layers`; `layers` is public on models only)."""
    sub = getattr(layer, "_layers", None)
    return getattr(layer, "layers", []) if sub is None else sub


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
    """The schedule or variable behind `learning_rate` (`_learning_rate`)."""
    return optimizer._learning_rate


def set_learning_rate_source(optimizer, value) -> None:
    """Replace the schedule behind `learning_rate` without building a variable for it."""
    optimizer._learning_rate = value
