"""`channel_report`: channels, parameters and FLOPs of each layer, before and after shrinking."""

from __future__ import annotations

import keras
import numpy as np

from keras_perf._layer_selection import check_selectors
from keras_perf.channel_pruning import _select
from keras_perf.channel_pruning._graph import _CONV, _DEPTHWISE, _SEPARABLE, ChannelGraph


def _spatial(out_shape) -> int | None:
    dims = tuple(out_shape)[1:-1]
    if any(d is None for d in dims):
        return None
    return int(np.prod(dims, dtype=np.int64))


_MAC_KINDS = ("dense", "conv", "depthwise", "separable")


def _macs(kind, kernel_sizes, out_shape) -> int | None:
    if kind not in _MAC_KINDS:
        return 0
    spatial = _spatial(out_shape)
    return None if spatial is None else int(sum(kernel_sizes)) * spatial


def _kind_of(layer) -> str:
    if isinstance(layer, keras.layers.Dense):
        return "dense"
    if isinstance(layer, _SEPARABLE):
        return "separable"
    if isinstance(layer, _DEPTHWISE):
        return "depthwise"
    if isinstance(layer, _CONV):
        return "conv"
    return "other"


def _kernels(layer) -> list:
    names = (
        ("depthwise_kernel", "pointwise_kernel") if _kind_of(layer) == "separable" else ("kernel",)
    )
    return [getattr(layer, n) for n in names if getattr(layer, n, None) is not None]


def channel_report(model, include=None, exclude=None) -> dict:
    """Per layer: output channels, parameters and FLOPs now and after `kp.shrink(model)`.

    The removed channels are those `kp.shrink` removes (all-zero in their whole group). MACs
    count the multiply-accumulates of kernels per example (Dense: `in * units` per output
    position; Conv: `kernel size * in * filters` per output pixel; depthwise and separable
    likewise); FLOPs are `2 * MACs`. Biases, BatchNormalization, activations and merges are
    not counted as FLOPs (they are in the parameters).

    Args:
        model: A built Functional or Sequential model.
        include: As in `kp.ChannelPruningCallback`: report as prunable only the groups of
            these producer layers. Defaults to `None`.
        exclude: As in `kp.ChannelPruningCallback`; the report then says which group an
            excluded producer keeps unpruned. Defaults to `None`.

    Returns:
        `{"layers": [...], "groups": [...], "total": {...}, "skipped": [...]}`. Each layer (every layer with
        weights, nested models walked through): `name`, `class`, `group` (index or None),
        `channels_before`/`channels_after` (output channels), `params_before`/`params_after`,
        `macs_before`/`macs_after`, `flops_before`/`flops_after` (None where a spatial size
        is unknown). Each group: `index`, `producers`, `channels_before`, `channels_after`,
        `prunable`, `reason` (why it is not pruned, or None). `total`: the sums of params,
        MACs and FLOPs. `skipped`: `{"name", "reason"}` of each layer with weights that the
        walk does not follow (a custom layer, a quantization-aware layer): never pruned.

    Raises:
        ChannelGraphError: (a `ValueError`) a subclassed (or not yet built) model, a
            `data_format="channels_first"` convolution.

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    >>> kp.channel_report(model)["total"]["params_before"]
    46
    """
    graph = ChannelGraph(model)
    _select.resolve(
        graph,
        check_selectors("include", include, classes=False, what=_select.NAMES),
        check_selectors("exclude", exclude, classes=False, what=_select.NAMES),
        strict=False,
    )
    removed = _select.zero_channels(graph, [g for g in graph.groups if g.selected])
    rows = []
    for info in graph.infos:
        owned = info.out_slots[info.out_slots >= 0]
        group = int(graph.group_of_slot[owned[0]]) if owned.size else None
        by_var = {id(w.variable): w for w in info.weights}
        before = after = 0
        kernel_ids = {id(k) for k in _kernels(info.layer)}
        k_before, k_after = [], []
        for v in info.layer.weights:
            size = int(np.prod(v.shape, dtype=np.int64))
            w = by_var.get(id(v))
            shape = list(v.shape)
            if w is not None:
                for axis, slots in w.axes.items():
                    shape[axis] = int(_select.keep_vector(graph, slots, removed).sum())
            small = int(np.prod(shape, dtype=np.int64))
            before, after = before + size, after + small
            if id(v) in kernel_ids:
                k_before.append(size)
                k_after.append(small)
        rows.append(
            _row(
                info.layer,
                group,
                len(info.out_slots),
                int(_select.keep_vector(graph, info.out_slots, removed).sum()),
                before,
                after,
                _macs(info.kind, k_before, info.out_shape),
                _macs(info.kind, k_after, info.out_shape),
            )
        )
    for other in graph.others:
        layer = other.layer
        params = int(sum(np.prod(v.shape, dtype=np.int64) for v in layer.weights))
        sizes = [int(np.prod(k.shape, dtype=np.int64)) for k in _kernels(layer)]
        macs = _macs(_kind_of(layer), sizes, other.out_shape)
        width = other.out_shape[-1] if other.out_shape else None
        rows.append(_row(layer, None, width, width, params, params, macs, macs))
    groups = []
    for g in graph.groups:
        n = len(g.channels)
        gone = sum(1 for c in g.channels.tolist() if c in removed)
        groups.append(
            {
                "index": g.index,
                "producers": g.names,
                "channels_before": n,
                "channels_after": n - gone,
                "prunable": g.selected,
                "reason": g.why,
            }
        )
    total = {}
    for key in ("params", "macs", "flops"):
        for when in ("before", "after"):
            values = [r[f"{key}_{when}"] for r in rows]
            total[f"{key}_{when}"] = None if None in values else int(sum(values))
    skipped = [{"name": name, "reason": why} for name, why in graph.skipped]
    return {"layers": rows, "groups": groups, "total": total, "skipped": skipped}


def _row(layer, group, ch_before, ch_after, p_before, p_after, m_before, m_after) -> dict:
    return {
        "name": layer.name,
        "class": type(layer).__name__,
        "group": group,
        "channels_before": ch_before,
        "channels_after": ch_after,
        "params_before": int(p_before),
        "params_after": int(p_after),
        "macs_before": m_before,
        "macs_after": m_after,
        "flops_before": None if m_before is None else 2 * m_before,
        "flops_after": None if m_after is None else 2 * m_after,
    }
