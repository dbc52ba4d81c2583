"""Which groups are pruned, how important each channel is, and which channels go.

- A group is *prunable* when nothing blocks it (model output, a layer needing all channels),
  and it is *selected* by `include`/`exclude` (names of producer layers; one excluded producer
  keeps its whole group).
- Importance of a channel: the norm of its slice of each kernel of the group (producer output
  slices, consumer input slices, depthwise filters) and of the BatchNormalization gamma,
  summed over these weights. `"l2"`: Euclidean norm of each slice; `"l1"`: sum of |w|.
- `scope="layer"`: each group keeps `max(round(n * (1 - s)), 1)` of its n channels.
  `scope="global"`: every channel's importance is divided by the mean importance of its group,
  and the lowest of all groups together go, `round(N * s)` of the N channels in all.
- Floor: a channel is never removed if that left a producer layer with no output channel.
"""

from __future__ import annotations

import numpy as np
from keras import ops

from keras_perf._layer_selection import matches_name
from keras_perf.channel_pruning._graph import ChannelGraph, ChannelGraphError

IMPORTANCE = ("l2", "l1")
#: What `include`/`exclude` items name, for their error message.
NAMES = "names of producer layers"


def resolve(graph: ChannelGraph, include=(), exclude=(), strict: bool = True) -> None:
    """Set each group's `selected`, `why` (why not pruned) and raise for what cannot be followed.

    Raises:
        ValueError: an `include`/`exclude` item naming no producer layer.
        ChannelGraphError: a selected group that reaches something the walk cannot follow.
    """
    producers = [p.layer.name for g in graph.groups for p in g.producers]
    for arg, items in (("include", include), ("exclude", exclude)):
        for item in items:
            if not any(matches_name(item, n) for n in producers):
                raise ValueError(
                    f"`{arg}` item {item!r} names no producer layer (Dense, Conv1D/2D/3D, "
                    f"SeparableConv) of model {graph.model.name!r}. Producers: {producers}."
                )
    blocked = []
    for g in graph.groups:
        g.selected, g.why = True, None
        if include and not any(matches_name(i, n) for i in include for n in g.names):
            g.selected, g.why = False, "not in `include`"
        excluded = [n for n in g.names if any(matches_name(e, n) for e in exclude)]
        if excluded:
            others = [n for n in g.names if n not in excluded]
            coupled = f"; it is coupled with {others}" if others else ""
            g.selected, g.why = False, f"{excluded} excluded{coupled}"
        if g.selected and g.errors:
            blocked.append(g)
        if g.selected and (g.errors or g.reasons):
            g.selected, g.why = False, (g.errors or g.reasons)[0]
    if blocked and strict:
        names = [n for g in blocked for n in g.names]
        what = "; ".join(dict.fromkeys(e for g in blocked for e in g.errors))
        raise ChannelGraphError(
            f"Channel pruning cannot follow the channels of {names} in model "
            f"{graph.model.name!r}: {what}. Pruning through it could give a wrong result. "
            f"Leave these layers unpruned with `exclude={names}`."
        )


def channel_importance(graph: ChannelGraph, groups, importance: str) -> dict:
    """{channel id: importance} over the channels of `groups`."""
    wanted = {g.index for g in groups}
    n = len(graph.parent)
    total = np.zeros(n, dtype=np.float64)
    seen_vars = set()
    for info in graph.infos:
        for w in info.weights:
            if not w.importance or id(w.variable) in seen_vars:
                continue
            seen_vars.add(id(w.variable))
            value = np.asarray(ops.convert_to_numpy(w.variable.value), dtype=np.float64)
            for axis, slots in w.axes.items():
                ok = slots >= 0
                if not ok.any():
                    continue
                moved = np.moveaxis(value, axis, 0).reshape(len(slots), -1)
                per = (moved**2).sum(1) if importance == "l2" else np.abs(moved).sum(1)
                channels = graph.channel_of[slots[ok]]
                acc = np.bincount(channels, weights=per[ok], minlength=n)
                total += np.sqrt(acc) if importance == "l2" else acc
    return {int(c): float(total[c]) for g in graph.groups if g.index in wanted for c in g.channels}


def _producer_counts(graph: ChannelGraph) -> tuple[dict, dict]:
    """channel -> {producer info index: count of its output channels in it}; and totals."""
    per_channel: dict = {}
    alive: dict = {}
    for i, info in enumerate(graph.infos):
        if not info.producer:
            continue
        alive[i] = len(info.out_slots)
        for s in info.out_slots:
            c = int(graph.channel_of[s])
            d = per_channel.setdefault(c, {})
            d[i] = d.get(i, 0) + 1
    return per_channel, alive


def pick(graph: ChannelGraph, candidates: list, count: int, per_channel, alive) -> set:
    """The first `count` of `candidates` (ordered) that keep every producer >= 1 channel."""
    removed = set()
    for c in candidates:
        if len(removed) >= count:
            break
        touched = per_channel.get(c, {})
        if all(alive[i] - k >= 1 for i, k in touched.items()):
            for i, k in touched.items():
                alive[i] -= k
            removed.add(c)
    return removed


def keep_count(n: int, sparsity: float) -> int:
    kept = np.float32(n) * (np.float32(1.0) - np.float32(sparsity))
    return max(int(np.round(kept)), 1)


def choose(graph: ChannelGraph, sparsity: float, importance: str, scope: str) -> set:
    """The channels to remove at `sparsity` from the selected groups."""
    groups = [g for g in graph.groups if g.selected]
    if not groups or sparsity <= 0:
        return set()
    imp = channel_importance(graph, groups, importance)
    per_channel, alive = _producer_counts(graph)
    removed = set()
    if scope == "layer":
        for g in groups:
            n = len(g.channels)
            order = sorted(g.channels.tolist(), key=lambda c: (imp[c], c))
            removed |= pick(graph, order, n - keep_count(n, sparsity), per_channel, alive)
        return removed
    scores = []
    for g in groups:
        mean = float(np.mean([imp[c] for c in g.channels]))
        for c in g.channels.tolist():
            scores.append((imp[c] / mean if mean > 0 else 0.0, g.index, c))
    scores.sort()
    n = len(scores)
    return pick(graph, [c for _, _, c in scores], n - keep_count(n, sparsity), per_channel, alive)


def zero_channels(graph: ChannelGraph, groups=None) -> set:
    """Channels of prunable groups whose every weight slice is exactly zero (already masked).

    Blocked groups never count. The floor holds: a producer keeps at least one channel.
    """
    if groups is None:
        groups = [g for g in graph.groups if not g.errors and not g.reasons]
    wanted = {int(c) for g in groups for c in g.channels}
    if not wanted:
        return set()
    n = len(graph.parent)
    nonzero = np.zeros(n, dtype=bool)
    for info in graph.infos:
        for w in info.weights:
            if (
                info.kind == "bn"
                and w.variable is not getattr(info.layer, "gamma", None)
                and (w.variable is not getattr(info.layer, "beta", None))
            ):
                continue  # moving statistics do not reach the output of a zeroed channel
            value = ops.convert_to_numpy(w.variable.value)
            for axis, slots in w.axes.items():
                ok = slots >= 0
                if not ok.any():
                    continue
                moved = np.moveaxis(value, axis, 0).reshape(len(slots), -1)
                nz = (moved != 0).any(1)
                channels = graph.channel_of[slots[ok]]
                nonzero[channels[nz[ok]]] = True
    candidates = sorted(c for c in wanted if not nonzero[c])
    per_channel, alive = _producer_counts(graph)
    return pick(graph, candidates, len(candidates), per_channel, alive)


def keep_vector(graph: ChannelGraph, slots: np.ndarray, removed: set) -> np.ndarray:
    """Boolean vector along an axis: True where the channel stays."""
    keep = np.ones(len(slots), dtype=bool)
    if removed:
        ok = slots >= 0
        channels = graph.channel_of[slots[ok]]
        keep[ok] = ~np.isin(channels, np.fromiter(removed, dtype=np.int64))
    return keep
