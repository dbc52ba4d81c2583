"""The graph walk: which channels of which layers are one channel, and which layers are coupled.

Every output channel of a producer (Dense, Conv1D/2D/3D, SeparableConv1D/2D) is a *slot*, an
integer. The walk gives each tensor of the Functional graph the slots of its last (channel)
axis, as a NumPy array (`-1`: a channel no producer owns, e.g. of a model input):

- a producer's input slots are its kernel's input rows; its output gets fresh slots;
- BatchNormalization, activations, dropout, pooling, padding... pass the slots through;
- DepthwiseConv repeats each input slot `depth_multiplier` times (channel-last order);
- Add/Subtract/Multiply/Average/Maximum/Minimum unite the slots at each position;
- Concatenate (on the channel axis) concatenates the arrays; Flatten tiles them;
- a Functional or Sequential model used as a layer is walked through (inlined).

Slots united by a merge are one *channel* (union-find); producers whose channels are united,
and the producer's own channels, form one *group*: pruned together, or not at all.

Graph access: a tensor's producer and producing node are read through
`keras_perf._keras_internals` (`producer`, `producing_node`: Keras' private `_keras_history`
and `_inbound_nodes`), then the node's public `input_tensors`/`output_tensors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras
import numpy as np

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend

L = keras.layers

_CONV = (L.Conv1D, L.Conv2D, L.Conv3D)
_DEPTHWISE = (L.DepthwiseConv1D, L.DepthwiseConv2D)
_SEPARABLE = (L.SeparableConv1D, L.SeparableConv2D)
_MERGE = (L.Add, L.Subtract, L.Multiply, L.Average, L.Maximum, L.Minimum)
_POOL = tuple(
    getattr(L, name)
    for name in (
        "MaxPooling1D MaxPooling2D MaxPooling3D AveragePooling1D AveragePooling2D "
        "AveragePooling3D GlobalMaxPooling1D GlobalMaxPooling2D GlobalMaxPooling3D "
        "GlobalAveragePooling1D GlobalAveragePooling2D GlobalAveragePooling3D ZeroPadding1D "
        "ZeroPadding2D ZeroPadding3D Cropping1D Cropping2D Cropping3D UpSampling1D UpSampling2D "
        "UpSampling3D SpatialDropout1D SpatialDropout2D SpatialDropout3D"
    ).split()
    if hasattr(L, name)
)
# Element-wise on every channel (masked channels may become non-zero, e.g. sigmoid(0) = 0.5:
# harmless, since every consumer's input slice of that channel is zero).
_ELEMENTWISE = tuple(
    getattr(L, name)
    for name in (
        "ReLU LeakyReLU ELU Dropout GaussianNoise GaussianDropout AlphaDropout "
        "ActivityRegularization Identity"
    ).split()
    if hasattr(L, name)
)
_MIXING_ACTIVATIONS = ("softmax", "log_softmax")


class ChannelGraphError(ValueError):
    """Channel pruning cannot follow the channels of this model's graph.

    Raised by `kp.ChannelPruningCallback` (at the start of `fit`), `kp.shrink` and
    `kp.channel_report` for a model whose graph is hidden (subclassed, or a Sequential model
    without known inputs), and by the callback for a selected group that reaches what the walk
    cannot follow (Lambda, custom layers, raw `keras.ops`, shared layers, concatenation off
    the channel axis, grouped or channels-first convolutions). The message says the fix.
    A `ValueError` subclass, so `except ValueError` catches it too; bad arguments (an unknown
    `include` name, an uncompiled model) stay plain `ValueError`/`TypeError`.
    """


@dataclass
class WeightAxes:
    """A weight of a followed layer and, per axis, the slots along it."""

    variable: keras.Variable
    axes: dict  # axis (non-negative) -> slot array along it
    importance: bool  # counted in the channel importance (kernels, BN gamma)


@dataclass
class LayerInfo:
    """A followed layer: its kind, slot arrays, and the weights that carry channels."""

    layer: keras.layers.Layer
    kind: str  # "dense" | "conv" | "depthwise" | "separable" | "bn"
    in_slots: np.ndarray
    out_slots: np.ndarray
    out_shape: tuple
    weights: list = field(default_factory=list)

    @property
    def producer(self) -> bool:
        return self.kind in ("dense", "conv", "separable")


@dataclass
class Blocker:
    slots: np.ndarray
    reason: str
    error: bool  # True: the walk cannot follow it (an error unless the group is not pruned)


@dataclass
class OtherLayer:
    """A layer with weights the walk does not change (its channels are all kept)."""

    layer: keras.layers.Layer
    out_shape: tuple


class ChannelGraph:
    """The result of walking a Functional/Sequential model's graph."""

    def __init__(self, model):
        if not isinstance(model, keras.Model) or not _backend.is_functional(model):
            kind = type(model).__name__
            raise ChannelGraphError(
                f"Channel pruning needs a Functional or Sequential model with known inputs; got "
                f"{kind} {getattr(model, 'name', '')!r}. A subclassed model hides its graph, so "
                "which layers consume which channels cannot be known: build the model with the "
                "Functional API (or `keras.Sequential`), or for a Sequential model call it on "
                "data / give it a `keras.Input` first."
            )
        self.model = model
        self.parent: list[int] = []
        self.producer_of: list[int] = []  # slot -> index in self.infos of its producer
        self.infos: list[LayerInfo] = []
        self.others: list[OtherLayer] = []
        self.blockers: list[Blocker] = []
        self.skipped: list[tuple[str, str]] = []  # (layer name, why its channels are kept)
        self._seen_ops: dict[int, int] = {}
        self.input_slots: dict[int, np.ndarray] = {}  # id(model input tensor) -> slots
        inputs = [self._fixed(_last_dim(t)) for t in model.inputs]
        outputs = self._walk(model, inputs)
        for t, arr in zip(keras.tree.flatten(model.outputs), outputs):
            name = keras_internals.producer(t).name
            self._block(arr, f"it reaches the model output of {name!r}, which keeps its width")
        self._make_groups()

    # -- union-find ---------------------------------------------------------------------------
    def _new_slots(self, n: int, info_index: int) -> np.ndarray:
        start = len(self.parent)
        self.parent.extend(range(start, start + n))
        self.producer_of.extend([info_index] * n)
        return np.arange(start, start + n, dtype=np.int64)

    @staticmethod
    def _fixed(n: int) -> np.ndarray:
        return np.full((n,), -1, dtype=np.int64)

    def find(self, s: int) -> int:
        parent = self.parent
        root = s
        while parent[root] != root:
            root = parent[root]
        while parent[s] != root:
            parent[s], s = root, parent[s]
        return root

    def _union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def _block(self, slots, reason: str, error: bool = False) -> None:
        slots = np.asarray(slots)
        slots = slots[slots >= 0]
        if slots.size:
            self.blockers.append(Blocker(np.unique(slots), reason, error))

    # -- walk ---------------------------------------------------------------------------------
    def _walk(self, model, input_arrays) -> list:
        env = {}
        for t, arr in zip(keras.tree.flatten(model.inputs), input_arrays):
            env[id(t)] = arr
            self.input_slots[id(t)] = arr
        for node in _topological_nodes(model, env):
            op = node.operation
            if isinstance(op, L.InputLayer):
                for t in node.output_tensors:
                    env.setdefault(id(t), self._fixed(_last_dim(t)))
                continue
            ins = [env[id(t)] for t in node.input_tensors]
            outs = self._visit(op, node, ins)
            for t, arr in zip(node.output_tensors, outs):
                env[id(t)] = arr
        return [env[id(t)] for t in keras.tree.flatten(model.outputs)]

    def _visit(self, op, node, ins) -> list:
        outs_t = node.output_tensors
        previous = self._seen_ops.setdefault(id(op), id(node))
        if previous != id(node):
            return self._cannot_follow(
                op,
                ins,
                outs_t,
                "is shared (called more than once), so its channels are tied to several inputs",
            )
        if isinstance(op, keras.Model):
            if not _backend.is_functional(op):
                return self._cannot_follow(op, ins, outs_t, "is a subclassed model")
            return self._walk(op, ins)
        if not isinstance(op, keras.layers.Layer):
            return self._cannot_follow(
                op,
                ins,
                outs_t,
                "is a raw `keras.ops` call on a symbolic tensor; wrap it in a built-in layer or",
            )
        if isinstance(op, L.Lambda):
            return self._cannot_follow(op, ins, outs_t, "is a Lambda layer")
        if not type(op).__module__.startswith("keras."):
            if op.weights:
                self.skipped.append((op.name, _why_skipped(op)))
            return self._cannot_follow(op, ins, outs_t, "is a custom layer")
        out_shape = tuple(outs_t[0].shape) if outs_t else ()
        x = ins[0] if ins else None
        channels_last = getattr(op, "data_format", "channels_last") == "channels_last"
        if isinstance(op, (*_CONV, *_DEPTHWISE, *_SEPARABLE, *_POOL, L.Flatten)) and not (
            channels_last
        ):
            if isinstance(op, (*_CONV, *_DEPTHWISE, *_SEPARABLE)):
                raise ChannelGraphError(
                    f"{type(op).__name__} {op.name!r} of model {self.model.name!r} uses "
                    "data_format='channels_first'; channel pruning follows channels-last "
                    "models only. Build the model with data_format='channels_last' (the Keras "
                    "default) to prune it."
                )
            return self._cannot_follow(op, ins, outs_t, "uses data_format='channels_first'")

        if isinstance(op, L.Dense):
            if getattr(op, "lora_enabled", False) or getattr(op, "quantization_mode", None):
                return self._keep(op, ins, outs_t, "is LoRA-enabled or quantized")
            info = self._add_info(op, "dense", x, out_shape)
            info.out_slots = self._new_slots(op.units, len(self.infos) - 1)
            info.weights = [WeightAxes(op.kernel, {0: x, 1: info.out_slots}, True)]
            if op.use_bias:
                info.weights.append(WeightAxes(op.bias, {0: info.out_slots}, False))
            self._check_activation(op, info.out_slots)
            return [info.out_slots]
        if isinstance(op, _CONV):
            if getattr(op, "groups", 1) != 1:
                return self._cannot_follow(op, ins, outs_t, f"is a grouped convolution "
                                           f"(groups={op.groups})")  # fmt: skip
            info = self._add_info(op, "conv", x, out_shape)
            info.out_slots = self._new_slots(op.filters, len(self.infos) - 1)
            rank = len(op.kernel.shape)
            info.weights = [WeightAxes(op.kernel, {rank - 2: x, rank - 1: info.out_slots}, True)]
            if op.use_bias:
                info.weights.append(WeightAxes(op.bias, {0: info.out_slots}, False))
            self._check_activation(op, info.out_slots)
            return [info.out_slots]
        if isinstance(op, _DEPTHWISE):
            info = self._add_info(op, "depthwise", x, out_shape)
            info.out_slots = np.repeat(x, op.depth_multiplier)
            rank = len(op.kernel.shape)
            info.weights = [WeightAxes(op.kernel, {rank - 2: x}, True)]
            if op.use_bias:
                info.weights.append(WeightAxes(op.bias, {0: info.out_slots}, False))
            self._check_activation(op, info.out_slots)
            return [info.out_slots]
        if isinstance(op, _SEPARABLE):
            info = self._add_info(op, "separable", x, out_shape)
            info.out_slots = self._new_slots(op.filters, len(self.infos) - 1)
            rank = len(op.depthwise_kernel.shape)
            mid = np.repeat(x, op.depth_multiplier)
            info.weights = [
                WeightAxes(op.depthwise_kernel, {rank - 2: x}, True),
                WeightAxes(op.pointwise_kernel, {rank - 2: mid, rank - 1: info.out_slots}, True),
            ]
            if op.use_bias:
                info.weights.append(WeightAxes(op.bias, {0: info.out_slots}, False))
            self._check_activation(op, info.out_slots)
            return [info.out_slots]
        if isinstance(op, L.BatchNormalization):
            rank = len(outs_t[0].shape)
            if op.axis not in (-1, rank - 1):
                return self._cannot_follow(op, ins, outs_t, f"normalises axis {op.axis}, not "
                                           "the channel axis")  # fmt: skip
            info = self._add_info(op, "bn", x, out_shape)
            info.out_slots = x
            for name in ("gamma", "beta", "moving_mean", "moving_variance"):
                v = getattr(op, name, None)
                if v is not None:
                    info.weights.append(WeightAxes(v, {0: x}, name == "gamma"))
            return [x]
        if isinstance(op, L.Activation):
            if _activation_name(op.activation) in _MIXING_ACTIVATIONS:
                return self._keep(op, ins, outs_t, "mixes channels (softmax)")
            return [x]
        if isinstance(op, (*_ELEMENTWISE, *_POOL)):
            return self._passthrough_or_other(op, x, outs_t)
        if isinstance(op, _MERGE):
            if len({len(a) for a in ins}) != 1:
                return self._keep(op, ins, outs_t, "broadcasts along the channel axis")
            out = ins[0].copy()
            for other in ins[1:]:
                for i, (a, b) in enumerate(zip(out, other)):
                    if a >= 0 and b >= 0:
                        self._union(int(a), int(b))
                    elif a >= 0 or b >= 0:
                        self._block([max(a, b)], f"{type(op).__name__} {op.name!r} combines it "
                                    "with a channel that cannot be pruned (e.g. of a model input)")  # fmt: skip
                        out[i] = max(a, b)
            return [out]
        if isinstance(op, L.Concatenate):
            rank = len(outs_t[0].shape)
            if op.axis not in (-1, rank - 1):
                return self._cannot_follow(
                    op, ins, outs_t, f"concatenates along axis {op.axis}, not the channel axis"
                )
            return [np.concatenate(ins)]
        if isinstance(op, L.Flatten):
            spatial = tuple(node.input_tensors[0].shape[1:-1])
            if any(d is None for d in spatial):
                return self._cannot_follow(op, ins, outs_t, "flattens an unknown spatial shape")
            return [np.tile(x, int(np.prod(spatial, dtype=np.int64)))]
        return self._keep(op, ins, outs_t, "needs all of its input channels")

    def _add_info(self, op, kind, x, out_shape) -> LayerInfo:
        info = LayerInfo(op, kind, x, x, out_shape)
        self.infos.append(info)
        return info

    def _passthrough_or_other(self, op, x, outs_t):
        if op.weights:  # not expected for these layers; keep whatever it is unchanged
            return self._keep(op, [x], outs_t, "has weights")
        return [x]

    def _check_activation(self, op, slots) -> None:
        if _activation_name(getattr(op, "activation", None)) in _MIXING_ACTIVATIONS:
            self._block(slots, f"{op.name!r} has a softmax activation, which mixes channels")

    def _outputs_fixed(self, op, outs_t) -> list:
        if op.weights:
            self.others.append(OtherLayer(op, tuple(outs_t[0].shape) if outs_t else ()))
        return [self._fixed(_last_dim(t)) for t in outs_t]

    def _keep(self, op, ins, outs_t, why: str) -> list:
        for arr in ins:
            self._block(arr, f"it feeds {type(op).__name__} {op.name!r}, which {why}")
        return self._outputs_fixed(op, outs_t)

    def _cannot_follow(self, op, ins, outs_t, why: str) -> list:
        name = getattr(op, "name", type(op).__name__)
        for arr in ins:
            self._block(arr, f"{type(op).__name__} {name!r} {why}", error=True)
        if isinstance(op, keras.layers.Layer):
            return self._outputs_fixed(op, outs_t)
        return [self._fixed(_last_dim(t)) for t in outs_t]

    # -- groups -------------------------------------------------------------------------------
    def _make_groups(self) -> None:
        n = len(self.parent)
        roots = np.array([self.find(s) for s in range(n)], dtype=np.int64)
        self.channel_of = roots  # slot -> channel id (root slot)
        # Groups: channels united with their producer's other channels.
        gparent = list(range(n))

        def gfind(s):
            while gparent[s] != s:
                gparent[s] = gparent[gparent[s]]
                s = gparent[s]
            return s

        for s in range(n):
            for a, b in ((s, int(roots[s])), (s, self._first_slot_of(s))):
                ra, rb = gfind(a), gfind(b)
                if ra != rb:
                    gparent[max(ra, rb)] = min(ra, rb)
        group_root = np.array([gfind(s) for s in range(n)], dtype=np.int64)
        order = sorted(set(group_root.tolist()))
        index = {r: i for i, r in enumerate(order)}
        self.group_of_slot = np.array([index[r] for r in group_root], dtype=np.int64)
        self.groups = [Group(i) for i in range(len(order))]
        for info in self.infos:
            if info.producer:
                self.groups[self.group_of_slot[info.out_slots[0]]].producers.append(info)
        for g in self.groups:
            slots = np.nonzero(self.group_of_slot == g.index)[0]
            g.channels = np.unique(roots[slots])
        for b in self.blockers:
            for gi in np.unique(self.group_of_slot[b.slots]):
                g = self.groups[gi]
                (g.errors if b.error else g.reasons).append(b.reason)
        for info in self.infos:
            touched = set()
            for w in info.weights:
                for slots in w.axes.values():
                    s = slots[slots >= 0]
                    touched.update(self.group_of_slot[s].tolist())
            for gi in touched:
                self.groups[gi].members.append(info)

    def _first_slot_of(self, s: int) -> int:
        return int(self.infos[self.producer_of[s]].out_slots[0])


@dataclass
class Group:
    """Coupled producers: their channels are pruned together or not at all."""

    index: int
    producers: list = field(default_factory=list)
    members: list = field(default_factory=list)
    channels: np.ndarray = None  # channel ids (root slots)
    reasons: list = field(default_factory=list)  # why it cannot be pruned (fine)
    errors: list = field(default_factory=list)  # what the walk could not follow

    @property
    def names(self) -> list:
        return [p.layer.name for p in self.producers]


def _why_skipped(op) -> str:
    """Why a custom layer with weights keeps its channels (`channel_report`'s "skipped")."""
    if type(op).__module__.startswith("keras_perf.quantization"):
        return (
            "is a quantization-aware layer (kp.quantize_aware): prune the float model, "
            "kp.shrink it, then call kp.quantize_aware on the shrunk model"
        )
    base = next((c.__name__ for c in type(op).__mro__[1:]
                 if c.__module__.startswith("keras.")), "Layer")  # fmt: skip
    return (
        f"is a custom layer (a subclass of {base}, {type(op).__name__}), which the walk does "
        "not follow: its channels are kept; use the built-in layer to prune it"
    )


def _last_dim(t) -> int:
    shape = tuple(t.shape)
    if not shape or shape[-1] is None:
        return 0
    return int(shape[-1])


def _activation_name(fn) -> str:
    return getattr(fn, "__name__", str(fn)) if fn is not None else ""


def _topological_nodes(model, env) -> list:
    """The nodes of `model`'s graph, each after the nodes it depends on."""
    order, done = [], set()
    stack = [(t, False) for t in reversed(keras.tree.flatten(model.outputs))]
    while stack:
        t, expanded = stack.pop()
        if id(t) in env:
            continue
        node = keras_internals.producing_node(t)
        if id(node) in done:
            continue
        if expanded:
            done.add(id(node))
            order.append(node)
            continue
        stack.append((t, True))
        for parent in reversed(node.input_tensors):
            if id(parent) not in env:
                stack.append((parent, False))
    return order
