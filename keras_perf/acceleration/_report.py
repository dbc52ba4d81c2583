"""The result of `kp.accelerate`: the measured candidates, the chosen one, a table, JSON."""

from __future__ import annotations

ROW_KEYS = (
    "candidate",
    "settings",
    "examples_per_s",
    "speedup",
    "exact",
    "max_abs_diff",
    "chosen",
    "note",
)


def _plain(v):
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return int(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


class Acceleration:
    """What `kp.accelerate` measured and did.

    Attributes:
        chosen: The settings applied (or, with `apply=False`, that would be), e.g.
            `{"jit_compile": True, "steps_per_execution": 16}`; `{}` when nothing beat the
            model's own settings by more than the noise margin (5 %).
        speedup: Examples/s with `chosen` over those with the model's own settings, from
            fresh alternated rounds of the two after the choice (1.0 when `chosen` is `{}`).
        rows: One dict per candidate, best first: `candidate`, `settings`, `examples_per_s`
            (None: not measured), `speedup`, `exact` (None: not checked), `max_abs_diff`,
            `chosen`, `note` (why it lost, was not applied or not measured).
        applied: Whether `chosen` was set on the model.
        notes: What was not tried and why.
        backend, batch_size, steps: The measuring conditions; `seconds`: the whole call.
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        keys = ("chosen", "speedup", "rows", "applied", "notes", "backend", "batch_size", "steps")
        return {k: _plain(getattr(self, k)) for k in keys + ("seconds",)}

    def __repr__(self) -> str:
        return f"<Acceleration chosen={self.chosen!r} speedup={self.speedup:.2f}>"

    def __str__(self) -> str:
        head = (
            f"kp.accelerate ({self.backend}, batch {self.batch_size}, {self.steps} steps per "
            f"timed epoch): "
        )
        if self.chosen:
            verb = "applied" if self.applied else "would apply (apply=False)"
            head += f"{verb} {self.chosen}: {self.speedup:.2f}x"
        else:
            head += "the model's own settings are the fastest exact ones; nothing changed"
        lines = [head, ""]
        table = [("", "candidate", "examples/s", "speed-up", "exact (max |diff|)", "note")]
        for r in self.rows:
            eps = "-" if r["examples_per_s"] is None else f"{r['examples_per_s']:,.0f}"
            sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            if r["exact"] is None:
                ex = "-"
            else:
                diff = "" if r["max_abs_diff"] is None else f" ({r['max_abs_diff']:.1e})"
                ex = ("yes" if r["exact"] else "NO") + diff
            table.append(("*" if r["chosen"] else "", r["candidate"], eps, sp, ex, r["note"] or ""))
        widths = [max(len(row[i]) for row in table) for i in range(5)]
        for row in table:
            cells = [
                row[i].ljust(widths[i]) if i in (0, 1, 4) else row[i].rjust(widths[i])
                for i in range(5)
            ]
            lines.append("  ".join(cells + [row[5]]).rstrip())
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)
