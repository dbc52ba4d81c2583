"""Structured (channel) pruning that ends in a physically smaller model.

Public names: `ChannelPruningCallback`, `shrink`, `channel_report` and `ChannelGraphError`.

The parts:

- `_callback`: `ChannelPruningCallback`, which masks whole channels during `fit` (its
  schedule stepping is pruning's, `keras_perf.pruning._base`);
- `_shrink`: `shrink`, which rebuilds the model without them;
- `_report`: `channel_report`: channels, parameters and FLOPs before and after;
- `_graph`: the Functional-graph walk that finds coupled layers (groups), and
  `ChannelGraphError`, raised for a graph it cannot follow;
- `_select`: selection, importance and which channels go (the `include`/`exclude` rules are
  `keras_perf._layer_selection`).
"""

from keras_perf.channel_pruning._callback import ChannelPruningCallback
from keras_perf.channel_pruning._graph import ChannelGraphError
from keras_perf.channel_pruning._report import channel_report
from keras_perf.channel_pruning._shrink import shrink

__all__ = ["ChannelGraphError", "ChannelPruningCallback", "channel_report", "shrink"]
