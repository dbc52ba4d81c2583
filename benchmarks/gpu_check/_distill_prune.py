"""Section 4: per-step cost of `kp.DistillationModel` and `kp.PruningCallback`."""

from __future__ import annotations

from ._common import _batches, _sce, mlp, timed_row


def section_distill_prune(ctx, rows: list) -> None:
    import keras

    import keras_perf as kp

    steps = ctx.sizes["steps"]
    d = ctx.sizes["distill"]
    data = _batches((d["inputs"],), 10, d["batch"])
    student_shape = f"MLP {d['inputs']}-{'-'.join(map(str, d['student']))}-10"
    teacher_shape = f"{d['inputs']}-{'-'.join(map(str, d['teacher']))}-10"

    def per_step(row_id, case, data, make, note=""):
        def build():
            model, callbacks, extra = make()
            return model, callbacks, lambda m: (note + extra(m)).strip("; ")

        timed_row(ctx, rows, row_id, case, build, data, steps)

    def plain_student():
        s = mlp(d["inputs"], d["student"], 10, name="student")
        s.compile(keras.optimizers.Adam(1e-3), _sce())
        return s, [], lambda m: ""

    def distiller():
        teacher = mlp(d["inputs"], d["teacher"], 10, name="teacher")
        student = mlp(d["inputs"], d["student"], 10, name="student")
        model = kp.DistillationModel(student, teacher, temperature=3.0, alpha=0.7)
        model.compile(optimizer=keras.optimizers.Adam(1e-3))
        return model, [], lambda m: ""

    per_step(
        "4/distillation/plain_student",
        f"plain fit of the student {student_shape}, batch {d['batch']}",
        data,
        plain_student,
    )
    per_step(
        "4/distillation/DistillationModel",
        f"DistillationModel, teacher {teacher_shape}, batch {d['batch']}",
        data,
        distiller,
        note="includes the frozen teacher's forward pass",
    )

    p = ctx.sizes["prune"]
    data = _batches((p["inputs"],), 10, p["batch"])
    shape = f"MLP {p['inputs']}-{'-'.join(map(str, p['widths']))}-10, batch {p['batch']}"

    def plain():
        model = mlp(p["inputs"], p["widths"], 10)
        model.compile(keras.optimizers.Adam(1e-3), _sce())
        return model, [], lambda m: ""

    def pruned():
        model = mlp(p["inputs"], p["widths"], 10)
        model.compile(keras.optimizers.Adam(1e-3), _sce())
        cb = kp.PruningCallback(kp.ConstantSparsity(0.8, begin_step=0, frequency=p["frequency"]))
        return model, [cb], lambda m: f"; sparsity reached {cb.sparsity:.2f}"

    per_step("4/pruning/plain", f"plain fit, {shape}", data, plain)
    per_step(
        "4/pruning/PruningCallback",
        f"PruningCallback, {shape}",
        data,
        pruned,
        note=f"ConstantSparsity 0.8, masks updated every {p['frequency']} steps",
    )
