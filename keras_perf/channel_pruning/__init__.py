"""Structured (channel) pruning that ends in a physically smaller model.

- `ChannelPruningCallback` (callback.py): masks whole channels during `fit`;
- `shrink` (shrink.py): rebuilds the model without them;
- `channel_report` (report.py): channels, parameters and FLOPs before and after;
- `_graph.py`: the Functional-graph walk that finds coupled layers (groups);
- `_select.py`: selection, importance and which channels go.
"""

from keras_perf.channel_pruning.callback import ChannelPruningCallback
from keras_perf.channel_pruning.report import channel_report
from keras_perf.channel_pruning.shrink import shrink

__all__ = ["ChannelPruningCallback", "channel_report", "shrink"]
