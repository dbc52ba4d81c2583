"""How out-of-memory errors and the attempts are written in events and messages.

Lives here: `_error_text` (an error's first line, as in `history.oom_events`) and `_tried`
(the attempts, for the give-up message). Not here: recognising an OOM (`kp.backend.is_oom`).
"""

from __future__ import annotations

import math
import re


def _error_text(exc: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # Keras bolds the message in a terminal
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Exception encountered when calling"):
        lines = lines[1:]  # Keras' note on which layer raised; the error's own text follows
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 300 else text[:297] + "..."


def _tried(events, batch_size) -> str:
    parts = []
    for e in events:
        size = "?" if batch_size is None else math.ceil(batch_size / e["microbatches"])
        parts.append(
            f"epoch {e['epoch']}: batch {e['batch_size']} in {e['microbatches']} micro-batch(es) of {size}"
        )
    return "; ".join(parts)
