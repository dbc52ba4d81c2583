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
    """`new` with `old`'s keras-perf train step and its settings (`microbatches`, `clipnorm`,
    `remat` and `remat_threshold`, `traced_step`, the loss-scale settings), when `old` has that step; else
    `new` as it is.

    Raises:
        ValueError: `old.remat` lists layers that `new` cannot recompute (a layer that
            `kp.quantize_aware` gave state); the message says how to go on.
    """
    from keras_perf.train_step import LossScaleTrainStep, loss_scaled  # imports a backend

    if not isinstance(old, LossScaleTrainStep):
        return new
    settings = {
        "microbatches": old.microbatches,
        "clipnorm": old.clipnorm,
        "initial_scale": old.initial_scale,
        "dynamic_growth_steps": old.dynamic_growth_steps,
        "traced_step": old.traced_step,
    }
    remat = (old.remat, old.remat_threshold)
    try:
        if not isinstance(new, LossScaleTrainStep):
            return loss_scaled(new, **settings, remat=remat[0], remat_threshold=remat[1])
        new.set_remat(*remat)
    except ValueError as e:
        raise ValueError(
            f"Model {old.name!r} has remat={old.remat!r}, which the new model cannot keep: {e} "
            'Set `model.remat` to a mode ("full" recomputes every layer without state) or '
            "to None first, and set the new model's `remat` afterwards."
        ) from e
    for name, value in settings.items():
        setattr(new, name, value)
    return new
