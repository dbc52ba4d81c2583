"""`ChannelPruningCallback`: mask whole channels during `fit`, following a pruning schedule."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from keras_perf._layer_selection import check_selectors
from keras_perf._masks import MaskConstraint
from keras_perf._utils import check_choice, check_int
from keras_perf.channel_pruning import _select
from keras_perf.channel_pruning._graph import ChannelGraph, ChannelGraphError
from keras_perf.pruning import MaskingCallback, PruningSchedule


class _ChannelMask(MaskConstraint):
    """Pruning's mask constraint (`w -> mask * original(w)`), as its own type so that channel
    masks and magnitude-pruning masks are told apart on one model."""


def _mask_array(graph, w, removed) -> np.ndarray:
    shape = tuple(int(d) for d in w.variable.shape)
    mask = np.ones(shape, dtype="float32")
    for axis, slots in w.axes.items():
        keep = _select.keep_vector(graph, slots, removed).astype("float32")
        view = [1] * len(shape)
        view[axis] = shape[axis]
        mask = mask * keep.reshape(view)
    return mask


@keras.saving.register_keras_serializable(package="keras_perf")
class ChannelPruningCallback(MaskingCallback):
    """Structured pruning: remove whole output channels, following a pruning schedule.

    At the start of `fit` the Functional (or Sequential) graph is walked to find which layers
    share channels: a producer (Dense, Conv1D/2D/3D, SeparableConv1D/2D), the
    BatchNormalization and depthwise filters that follow it, the input slices of the layers
    that consume it, and producers tied to it by a residual `Add`/`Multiply`/`Subtract` or a
    `Concatenate` form one *group*. At each step the schedule names, the least important
    channels of each group are masked: the producer's kernel slice and bias, the BN gamma and
    beta (so the channel's output is exactly 0), the depthwise filters and every consumer's
    input slice. The masks are the weights' constraints, applied by the optimizer after every
    update, so the model trains as usual. `kp.shrink(model)` then removes the masked channels.

    Groups that reach a model output, or a layer needing all of its channels (softmax,
    LayerNormalization, Reshape, ...), are not pruned; `kp.channel_report` says why. What the
    walk cannot follow (Lambda, custom layers, raw `keras.ops`, shared layers, concatenation
    off the channel axis, grouped or channels-first convolutions) is an error at the start of
    `fit`, unless the producers reaching it are excluded.

    Args:
        schedule: `kp.PolynomialDecay` or `kp.ConstantSparsity` (or any
            `kp.PruningSchedule`): when to recompute the masks and the fraction of channels
            to remove in each group.
        importance: `"l2"` (norm of each channel's weights in every member of its group,
            summed over the members) or `"l1"` (sum of absolute values). Defaults to `"l2"`.
        scope: `"layer"` (each group loses the schedule's fraction of its channels) or
            `"global"` (channels of all groups ranked together by importance divided by their
            group's mean importance). Defaults to `"layer"`.
        include: Prune only the groups of these producer layers (names or regexes).
            Defaults to `None` (every group that can be pruned).
        exclude: Never prune the groups of these producer layers; one excluded producer
            keeps its whole group. Defaults to `None`.
        verbose: 1 prints a line at each mask update. Defaults to `0`.

    Attributes:
        sparsity: The share of the prunable channels removed: during `fit` the schedule's
            last update; after it, read from the model's weights (a restore of the best
            weights by `EarlyStopping` shows). `removed`: those channels.
        history: One entry per mask update (`step`, `target_sparsity`, `sparsity`).

    Raises:
        TypeError: a schedule that is not a `kp.PruningSchedule`, bad include/exclude items.
        ValueError: bad `importance` or `scope`; at the start of `fit`: an uncompiled model,
            an include/exclude name that is no producer.
        ChannelGraphError: (a `ValueError`) at the start of `fit`: a subclassed model, or a
            group reaching what the walk cannot follow (the message names it and the
            `exclude` to pass).

    Example:

    >>> model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
    ...                           keras.layers.Dense(4)])
    >>> model.compile("adam", "mse")
    >>> cb = kp.ChannelPruningCallback(kp.ConstantSparsity(0.5, begin_step=0, frequency=10))
    >>> _ = model.fit(np.random.rand(64, 16), np.random.rand(64, 4), callbacks=[cb], verbose=0)
    >>> kp.shrink(model).layers[0].units
    16
    """

    def __init__(
        self,
        schedule,
        importance: str = "l2",
        scope: str = "layer",
        include=None,
        exclude=None,
        verbose: int = 0,
    ):
        super().__init__()
        if not isinstance(schedule, PruningSchedule):
            raise TypeError(
                "`schedule` must be a kp.PolynomialDecay, kp.ConstantSparsity or another "
                f"kp.PruningSchedule; got {schedule!r}."
            )
        self.schedule = schedule
        self.importance = check_choice("importance", importance, _select.IMPORTANCE)
        self.scope = check_choice("scope", scope, ("layer", "global"))
        self.include = check_selectors("include", include, classes=False, what=_select.NAMES)
        self.exclude = check_selectors("exclude", exclude, classes=False, what=_select.NAMES)
        self.verbose = check_int("verbose", verbose, minimum=0)
        self.graph: ChannelGraph | None = None
        self._removed: set = set()
        self._sparsity = 0.0
        self.history: list[dict] = []
        self._masks: list = []  # (WeightAxes, mask variable)
        self._ready = False

    # -- what the model holds ----------------------------------------------------------------
    def _after_fit(self) -> bool:
        return self.graph is not None and not self._ready

    @property
    def removed(self) -> set:
        """The removed (all-zero) channels of the prunable groups. During `fit`, the masks'
        channels; after it, read from the weights the model holds, so that a callback that
        put other weights back at the end of `fit` (`EarlyStopping(restore_best_weights=True)`,
        in either order) is reflected."""
        if self._after_fit():
            return _select.zero_channels(self.graph, [g for g in self.graph.groups if g.selected])
        return self._removed

    @removed.setter
    def removed(self, value) -> None:
        self._removed = set(value)

    @property
    def sparsity(self) -> float:
        """The share of the prunable channels removed: during `fit`, what the schedule's last
        update masked; after it, what the model's weights hold (see `removed`)."""
        if self._after_fit():
            return self._share(len(self.removed))
        return self._sparsity

    @sparsity.setter
    def sparsity(self, value) -> None:
        self._sparsity = float(value)

    def _share(self, removed: int) -> float:
        total = sum(len(g.channels) for g in self.graph.groups if g.selected)
        return removed / total if total else 0.0

    def get_config(self) -> dict:
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "importance": self.importance,
            "scope": self.scope,
            "include": [i if isinstance(i, str) else i.pattern for i in self.include] or None,
            "exclude": [i if isinstance(i, str) else i.pattern for i in self.exclude] or None,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config: dict):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)

    # -- hooks --------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self.model  # on JAX this attaches the latest state to the variables
        if getattr(model, "optimizer", None) is None:
            raise ValueError(
                "ChannelPruningCallback needs a compiled model (it counts optimizer steps)."
            )
        # The walk runs now, so that what it cannot follow is an error before any step.
        self.graph = ChannelGraph(model)
        _select.resolve(self.graph, self.include, self.exclude)
        if self.graph.skipped and not any(g.selected for g in self.graph.groups):
            what = "; ".join(f"{name!r} {why}" for name, why in self.graph.skipped)
            raise ChannelGraphError(
                f"ChannelPruningCallback has no channel to prune in model {model.name!r}: {what}."
            )
        self._read_steps_per_execution(model)
        self.history = []
        self._ready = False

    def on_epoch_begin(self, epoch, logs=None):
        if self._ready:
            # The step again at every epoch, as PruningCallback reads it: an epoch that
            # `kp.fit_with_oom_retry` runs again starts from the step it first started at.
            self._read_step(self.model)
            return
        # The step and the zero channels are read at the first epoch, after every callback's
        # `on_train_begin`: a `BackupAndRestore` listed after this callback has restored the
        # weights and the optimizer's step by then.
        model = self.model
        selected = [g for g in self.graph.groups if g.selected]
        # Resuming (or a second fit): channels already all-zero stay masked.
        self._removed = _select.zero_channels(self.graph, selected)
        self._install(model, selected)
        self._read_step(model)
        self._update_sparsity()
        self._ready = True

    def _install(self, model, selected) -> None:
        wanted = {int(c) for g in selected for c in g.channels}
        self._masks, changed, seen = [], False, set()
        for info in self.graph.infos:
            for w in info.weights:
                v = w.variable
                if not v.trainable or id(v) in seen:
                    continue
                channels = {
                    int(c)
                    for slots in w.axes.values()
                    for c in self.graph.channel_of[slots[slots >= 0]]
                }
                if not channels & wanted:
                    continue
                seen.add(id(v))
                current = v.constraint
                if isinstance(current, _ChannelMask):
                    mask = current.mask
                    mask.assign(_mask_array(self.graph, w, self._removed))
                else:
                    mask = keras.Variable(
                        _mask_array(self.graph, w, self._removed), dtype=v.dtype,
                        trainable=False, autocast=False, name="channel_mask",
                    )  # fmt: skip
                    v.constraint = _ChannelMask(mask, current)
                    changed = True
                self._masks.append((w, mask))
        self._carry_masks(model)
        self._refresh_train_step(model, masks_changed=False, constraints_changed=changed)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["channel_sparsity"] = self._sparsity

    def on_train_end(self, logs=None):
        if self.graph is None or not self._ready:
            return
        model = self.model
        if getattr(model.optimizer, "use_ema", False):
            self._apply()  # weight EMA has overwritten the weights after the last step
        self._release_masks(model)
        self._uninstall(model)
        self._ready = False

    def _uninstall(self, model) -> None:
        """Take the masks off the weights' constraints: after `fit` the model is plain.

        A callback restoring the best weights (`EarlyStopping(restore_best_weights=True)`)
        then leaves exactly those weights, whatever the order of the callbacks, and a next
        `fit` trains every channel unless it is given a `ChannelPruningCallback` again (which
        keeps the all-zero channels masked).
        """
        for w, mask in self._masks:
            v = w.variable
            outer, current = None, v.constraint
            while current is not None and not (
                isinstance(current, _ChannelMask) and current.mask is mask
            ):
                outer, current = current, getattr(current, "original", None)
            if current is None:
                continue
            if outer is None:
                v.constraint = current.original
            else:
                outer.original = current.original
        self._masks = []
        self._refresh_train_step(model, masks_changed=False, constraints_changed=True)

    def _mask_variables(self) -> list:
        return [m for _, m in self._masks]

    # -- masks --------------------------------------------------------------------------------
    def _apply(self) -> None:
        for w, mask in self._masks:
            v = w.variable
            v.assign(ops.multiply(v.value, ops.cast(mask.value, v.dtype)))

    def _update(self, step: int, sparsity: float) -> None:
        model = self.model  # on JAX this attaches the latest state to the variables
        self._removed = _select.choose(self.graph, sparsity, self.importance, self.scope)
        for w, mask in self._masks:
            mask.assign(_mask_array(self.graph, w, self._removed))
        self._apply()
        self._update_sparsity()
        self.history.append({"step": step, "target_sparsity": sparsity,
                             "sparsity": self._sparsity})  # fmt: skip
        self._refresh_train_step(model, masks_changed=True, constraints_changed=False)
        if self.verbose:
            print(
                f"ChannelPruningCallback: step {step}: target sparsity {sparsity:.4f}, "
                f"removed {len(self._removed)} channels ({self._sparsity:.4f} of the prunable)"
            )

    def _update_sparsity(self) -> None:
        self._sparsity = self._share(len(self._removed))


__all__ = ["ChannelPruningCallback"]
