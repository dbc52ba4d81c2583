"""`MaxBatchSizeReport`: what `kp.find_max_batch_size` found, one row per setting.

A read-only mapping that prints as a table, like `kp.precision_report()`'s report;
`MEASURES`, the memory measures a row can name (the table of `keras_perf.backend`, where they
are minted). Not here: the search (`_batch_size`).
"""

from __future__ import annotations

from keras_perf._utils import ReadOnlyReport
from keras_perf.backend import MEASURES

__all__ = ["MEASURES", "MaxBatchSizeReport"]


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.3f}" if n < 1e8 else f"{n / 1e6:,.0f}"


class MaxBatchSizeReport(ReadOnlyReport):
    """What `kp.find_max_batch_size` found: setting name -> row; prints as a table.

    Each row: `setting`, `remat` and `microbatches` (the train step's settings),
    `batch_size` (the largest batch that fitted, 0 if none did), `peak_bytes` (the measured
    peak at that batch, None where not measured), `measure` (the measure's name, a key of
    `kp.oom.MEASURES`, or None), `limited_by` (`"max_batch_size"`, `"memory_limit"` or
    `"out_of_memory"`: what stopped the search) and `tries` (every try in order:
    `batch_size`, `fits`, `peak_bytes`, `reason` (None, `"memory_limit"` or `"out_of_memory"`)
    and `error` (the out-of-memory error's text, else None)).
    Attributes: `backend`, `device`, `memory_limit_bytes`, `max_batch_size` (the largest
    batch searched).
    """

    def __init__(self, rows: dict, backend: str, device: str, memory_limit_bytes, max_batch_size):
        self._data = dict(rows)
        self.backend, self.device = backend, device
        self.memory_limit_bytes, self.max_batch_size = memory_limit_bytes, max_batch_size

    def to_dict(self) -> dict:
        """A JSON-serialisable copy of the report (the rows under `"settings"`)."""
        return {
            "backend": self.backend,
            "device": self.device,
            "memory_limit_bytes": self.memory_limit_bytes,
            "max_batch_size": self.max_batch_size,
            "settings": {
                name: {**row, "tries": [dict(t) for t in row["tries"]]}
                for name, row in self._data.items()
            },
        }

    def __str__(self) -> str:
        limit = self.memory_limit_bytes
        cap = "no memory limit" if limit is None else f"memory limit {_megabytes(limit)} MB"
        lines = [
            f"max batch size ({self.backend}, {self.device}; {cap}; at most {self.max_batch_size})",
            f"{'setting':<24}{'batch':>7}{'peak MB':>10}{'tries':>7}  {'limited by':<16}measure",
        ]
        for name, row in self._data.items():
            label = name if not row["microbatches"] > 1 else f"{name} ({row['microbatches']})"
            peak = "-" if row["peak_bytes"] is None else _megabytes(row["peak_bytes"])
            lines.append(
                f"{label:<24}{row['batch_size']:>7}{peak:>10}{len(row['tries']):>7}  "
                f"{row['limited_by']:<16}{row['measure'] or '-'}"
            )
        return "\n".join(lines)

    __repr__ = __str__
