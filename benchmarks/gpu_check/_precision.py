"""Section 1: mixed precision (float32, mixed_float16, mixed_bfloat16) with our train step."""

from __future__ import annotations

from ._common import (
    _batches,
    _compile,
    _error_text,
    _free_memory,
    _num,
    _row,
    convnet,
    mlp,
    timed_fit,
)
from ._config import DRY_PEAK_FLOPS, MODELS, POLICIES


def section_mixed_precision(ctx, rows: list) -> None:
    import keras

    import keras_perf as kp

    steps = ctx.sizes["steps"]
    for kind in MODELS:
        for policy in POLICIES:
            row_id = f"1/{kind}/{policy}"
            try:
                keras.mixed_precision.set_global_policy(policy)
                if kind == "mlp":
                    s = ctx.sizes["mlp"]
                    base = mlp(s["inputs"], [s["width"]] * s["depth"], s["classes"])
                    hand = 6.0 * base.count_params()
                    label = f"MLP {s['inputs']}-{s['depth']}x{s['width']}-{s['classes']}"
                    hand_how = "6 x params"
                    data = _batches((s["inputs"],), s["classes"], s["batch"])
                else:
                    s = ctx.sizes["convnet"]
                    base, label, hand = convnet(ctx)
                    hand_how = "3 x 2 x 4.1 GMACs" if not ctx.dry else "3 x 2 x MACs by hand"
                    data = _batches((s["image"], s["image"], 3), s["classes"], s["batch"])
                model = _compile(kp.loss_scaled(base))
                compute = keras.mixed_precision.global_policy().compute_dtype
                peak = ctx.peak_flops(compute)
                r = timed_fit(
                    ctx, model, data, steps, peak_flops=DRY_PEAK_FLOPS if ctx.dry else None
                )
                monitor_flops = kp.estimate_flops_per_example(model)
                mfu_hand = hand * r["examples_per_s"] / peak if peak else None
                note = (
                    f"FLOPs/example: monitor {_num(monitor_flops)}, hand {_num(hand)} "
                    f"({hand_how}); peak {_num(peak)} FLOP/s ({compute})"
                )
                if ctx.dry:
                    note += " [nominal]"
                if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
                    note += "; loss scaled"
                rows.append(
                    _row(
                        ctx,
                        row_id,
                        f"{label}, {policy}, batch {s['batch']}",
                        examples_per_s=r["examples_per_s"],
                        step_ms=r["step_ms"],
                        mfu_monitor=r["mfu"],
                        mfu_hand=mfu_hand,
                        note=note,
                        flops_monitor=monitor_flops,
                        flops_hand=hand,
                        peak_flops=peak,
                        batch=s["batch"],
                    )
                )
            except Exception as exc:  # one case failing leaves the others to run
                rows.append(_row(ctx, row_id, f"{kind}, {policy}", error=_error_text(exc)))
            finally:
                base = model = data = None
                _free_memory()
