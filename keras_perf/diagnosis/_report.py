"""The result of `kp.diagnose`: numbers, a table for people, JSON and a plot."""

from __future__ import annotations

from keras_perf import _imports
from keras_perf.backend import MEASURES as _MEASURES

VERDICTS = {
    "input": "the step waits for data: make the input faster or overlap it with the step",
    "host": "per-step overhead (Python, dispatch, callbacks, the optimizer's launches) "
    "dominates: do more work per step",
    "compute": "the arithmetic of the step dominates: less work per example or faster math",
}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _bar(share: float, width: int = 20) -> str:
    full = int(round(share * width))
    return "#" * full + "." * (width - full)


class Diagnosis:
    """What `kp.diagnose` measured.

    Attributes:
        bottleneck: `"input"`, `"host"` or `"compute"`: the largest share.
        shares: `{"input", "host", "compute"}`, fractions of one training step; they sum to 1.
        examples_per_s: Training throughput with the user's own data and settings.
        what_if: Measured changes, best first: dicts with `change`, `speedup` (x the current
            examples/s), `how` (the line to change), `examples_per_s` and `peak_bytes` (the
            peak memory of its step, measured as `step_memory` is, for the changes of the
            batch, micro-batching and remat where memory can be the limit: on an
            accelerator, or with `memory_limit_bytes`; else `None`).
        peak_memory_bytes: Peak accelerator memory where the backend reports it, else `None`.
        step_memory: The peak memory of one training step at the batch size, measured by
            `kp.backend.step_memory`: `{"peak_bytes", "measure", "batch_size"}` (`measure` a
            key of `kp.oom.MEASURES`), or `None` where this backend cannot measure it here
            (TensorFlow's CPU allocator without `TF_CPU_ALLOCATOR_USE_BFC=true`; a note says).
        memory_limit_bytes: The cap passed to `diagnose`, or `None`.
        seconds_per_step: The measured times behind the shares (`together`, `input_alone`,
            `step_alone`, `input`, `host`, `compute`).
        notes: What was not tried and why, one-pass inputs, where the optimizer goes.
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        """Everything above as plain JSON-serialisable values."""

        def plain(v):
            if isinstance(v, dict):
                return {str(k): plain(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if isinstance(v, float):
                return float(v)
            if v is None or isinstance(v, (str, bool, int)):
                return v
            return float(v)

        return plain(dict(self.__dict__))

    def __repr__(self) -> str:
        shares = ", ".join(f"{k}={v:.2f}" for k, v in self.shares.items())
        return (
            f"Diagnosis(bottleneck={self.bottleneck!r}, {shares}, "
            f"examples_per_s={self.examples_per_s:.1f}, what_if={len(self.what_if)} changes)"
        )

    def __str__(self) -> str:
        s = self.seconds_per_step
        lines = [
            f"keras-perf diagnose ({self.backend}, {self.input_kind}, batch {self.batch_size}): "
            f"{self.examples_per_s:,.0f} examples/s, {1e3 * s['together']:.2f} ms/step",
        ]
        for key in ("input", "host", "compute"):
            lines.append(
                f"  {key:<8} {_bar(self.shares[key])} {100 * self.shares[key]:5.1f}%  "
                f"{1e3 * s[key]:.2f} ms"
            )
        lines.append(f"bottleneck: {self.bottleneck} -- {VERDICTS[self.bottleneck]}")
        if self.what_if:
            lines.append("what if (measured with fit, best first):")
            width = max(len(w["change"]) for w in self.what_if)
            peaks = [w.get("peak_bytes") for w in self.what_if]
            for w, peak in zip(self.what_if, peaks):
                gain = "" if w["speedup"] > 1.05 else "  (no gain)"
                memory = ""
                if any(p is not None for p in peaks):
                    memory = f"{'peak ' + _mib(peak):>18}  " if peak is not None else " " * 20
                lines.append(
                    f"  {w['speedup']:5.2f}x  {w['change']:<{width}}  {memory}{w['how']}{gain}"
                )
        step = getattr(self, "step_memory", None)
        if step is not None:
            lines.append(
                f"peak step memory: {_mib(step['peak_bytes'])} at batch {step['batch_size']} "
                f"({_MEASURES.get(step['measure'], step['measure'])})"
            )
        limit = getattr(self, "memory_limit_bytes", None)
        if limit is not None:
            lines.append(f"memory limit: {_mib(limit)} (memory_limit_bytes)")
        if self.peak_memory_bytes is not None:
            lines.append(f"peak accelerator memory: {self.peak_memory_bytes / 2**20:,.0f} MiB")
        lines.append(
            f"measured in {self.seconds:.1f} s (first trace {self.trace_seconds:.1f} s, "
            f"budget {self.max_seconds:g} s)"
        )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Draw the time split and the what-if speed-ups into an image file at `path`.

        Args:
            path: Output file; its extension picks the format (`.png`, `.svg`, `.pdf`).

        Returns:
            `path`.
        """
        _imports.require("matplotlib", "Diagnosis.plot")
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
        left = 0.0
        colors = {"input": "tab:orange", "host": "tab:purple", "compute": "tab:blue"}
        for key in ("input", "host", "compute"):
            ax1.barh([0], [self.shares[key]], left=left, color=colors[key], label=key)
            left += self.shares[key]
        ax1.set_xlim(0, 1)
        ax1.set_yticks([])
        ax1.set_xlabel("share of one training step")
        ax1.set_title(f"bottleneck: {self.bottleneck}")
        ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3)
        if self.what_if:
            names = [w["change"] for w in self.what_if][::-1]
            ax2.barh(names, [w["speedup"] for w in self.what_if][::-1], color="tab:green")
            ax2.axvline(1.0, color="black", linewidth=0.8)
            ax2.set_xlabel("measured speed-up (x examples/s)")
        else:
            ax2.text(0.5, 0.5, "no what-ifs measured", ha="center", va="center")
            ax2.set_axis_off()
        ax2.set_title("what if")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path
