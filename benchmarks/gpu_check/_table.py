"""The rows as one Markdown table: ratios to each row's baseline, a title naming the devices."""

from __future__ import annotations

from ._common import _gib, _num
from ._config import _baseline


def add_ratios(rows: list[dict]) -> None:
    """Each row's figure over its baseline's (see `_baseline`), where both are known."""
    by_key = {(r["backend"], r["id"]): r for r in rows}
    for r in rows:
        spec = _baseline(r["id"])
        r.setdefault("ratio", None)
        if spec is None:
            continue
        base = by_key.get((r["backend"], spec[0]))
        if base and r.get(spec[1]) and base.get(spec[1]):
            r["ratio"] = r[spec[1]] / base[spec[1]]
            r["ratio_of"] = spec[1]
            r["baseline"] = spec[0]
        if base and r.get("peak_memory_bytes") and base.get("peak_memory_bytes"):
            r["memory_ratio"] = base["peak_memory_bytes"] / r["peak_memory_bytes"]


HEAD = [
    "section",
    "backend",
    "case",
    "examples/s",
    "ms/step",
    "vs baseline",
    "peak memory",
    "MFU monitor",
    "MFU hand",
    "note",
]
SECTION_NAMES = {
    1: "1 mixed precision",
    2: "2 micro-batch memory",
    3: "3 OOM recovery",
    4: "4 distill / prune",
    5: "5 diagnose",
    6: "6 remat",
}
RATIO_WORDS = {
    "examples_per_s": "x speed",
    "step_ms": "x time",
    "predicted_over_real": " predicted/real",
}


def table(rows: list[dict]) -> str:
    """The rows as one Markdown table."""
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for r in rows:
        note = ("dry-run; " if r.get("dry_run") else "") + (r.get("note") or "")
        if r.get("error"):
            note = ("dry-run; " if r.get("dry_run") else "") + "ERROR: " + r["error"]
        ratio = r.get("ratio")
        ratio = "-" if ratio is None else f"{ratio:.2f}{RATIO_WORDS[r['ratio_of']]}"
        if r.get("memory_ratio") and r["section"] == 6:
            note = f"peak memory of remat=none / this: {r['memory_ratio']:.2f}; " + note
        mfu = [("-" if r.get(k) is None else f"{r[k]:.1%}") for k in ("mfu_monitor", "mfu_hand")]
        cells = [
            SECTION_NAMES.get(r["section"], str(r["section"])),
            r["backend"],
            r["case"],
            _num(r.get("examples_per_s")),
            _num(r.get("step_ms")),
            ratio,
            _gib(r.get("peak_memory_bytes")),
            *mfu,
            note.strip("; "),
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def title(result: dict) -> str:
    devices = "; ".join(
        f"{b}: {i['device']} ({_gib(i['memory_limit_bytes'])} usable), "
        + ", ".join(f"{k} {v}" for k, v in i["versions"].items())
        for b, i in result["devices"].items()
        if i
    )
    mode = (
        "DRY RUN on the CPU, tiny sizes: every row runs, the figures are not measurements"
        if result["mode"] == "dry-run"
        else "GPU run"
    )
    skipped = ", ".join(result.get("not_installed", []))
    return (
        f"keras-perf GPU check ({mode})\n\nDevice: {devices or 'unknown'}\n\n"
        f"Machine: {result['machine']}\n"
        + (f"\nNot installed, not run: {skipped}\n" if skipped else "")
    )
