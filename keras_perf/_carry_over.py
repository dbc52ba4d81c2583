"""What a model rebuilt from another one (`kp.quantize_aware`, `kp.shrink`) carries over.

Both transforms rebuild each layer from its config and copy its values. A config does not
hold everything: an adapted `Normalization` derives its mean and variance from its variables
only in `finalize_state()`, an adapted `StringLookup` keeps its vocabulary as an asset. These
helpers move a layer's whole state the way a `.keras` file does.
"""

from __future__ import annotations

import tempfile

import keras


def finalize_state(layer) -> None:
    """Recompute what `layer` derives from its variables after they were assigned (an adapted
    `Normalization`'s mean and variance), as Keras does after loading a file."""
    finalize = getattr(layer, "finalize_state", None)
    if callable(finalize):
        finalize()


def copy_layer_state(old, new) -> None:
    """Give `new` (a layer of `old`'s class, built from its config) all of `old`'s state:
    variables, assets (a lookup layer's vocabulary) and the state derived from them."""
    if hasattr(old, "save_assets") and hasattr(new, "load_assets"):
        with tempfile.TemporaryDirectory() as assets:
            old.save_assets(assets)
            new.load_assets(assets)
    store = {}
    old.save_own_variables(store)
    if store:
        new.load_own_variables(
            {k: keras.ops.convert_to_numpy(getattr(v, "value", v)) for k, v in store.items()}
        )
    finalize_state(new)


def keep_train_step(old, new):
    """`new` with `old`'s keras-perf train step and every one of its settings (the table in
    keras_perf/train_step/_settings.py: `microbatches`, `clipnorm`, the loss-scale settings,
    `traced_step`, `remat` and `remat_threshold`), when `old` has that step; else `new` as it
    is. A `new` that has the step (a `keras.models.clone_model` twin, which is built with
    the defaults) gets the settings in place.

    Raises:
        ValueError: `old.remat` lists layers that `new` cannot recompute (a layer that
            `kp.quantize_aware` gave state); the message says how to go on.
    """
    from keras_perf.train_step import (  # imports a backend
        LossScaleTrainStep,
        apply_settings,
        loss_scaled,
        settings,
    )

    if not isinstance(old, LossScaleTrainStep):
        return new
    values = settings(old)
    try:
        if not isinstance(new, LossScaleTrainStep):
            return loss_scaled(new, **values)
        apply_settings(new, values)
    except ValueError as e:
        raise ValueError(
            f"Model {old.name!r} has remat={old.remat!r}, which the new model cannot keep: {e} "
            'Set `model.remat` to a mode ("full" recomputes every layer without state) or '
            "to None first, and set the new model's `remat` afterwards."
        ) from e
    return new
