"""The demo's levers, one function each, each measured against its own baseline on the same
data and seeds, appending its rows to `demo.levers`."""

from __future__ import annotations

import time

import keras
import numpy as np

from keras_perf.demo._common import (
    BATCH,
    SEED,
    accuracy,
    copy_of,
    latency_ms,
    lever,
    mlp,
    say,
    sce,
)

TEACHER = [256, 256]  # 84k parameters: the over-parameterised network
STUDENT = [32]  # 2.4k parameters


def train_teacher(demo, bar):
    """The wide teacher on every training label: the loss-scaled step under the device's
    policy, `TrainingMonitor`, `EarlyStopping` with the best weights restored."""
    import keras_perf as kp

    t0 = time.perf_counter()
    teacher = kp.loss_scaled(mlp(TEACHER, "teacher", SEED))
    teacher.compile(keras.optimizers.Adam(2e-3), sce(), metrics=["accuracy"])
    stop = kp.EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)
    mon = kp.TrainingMonitor(log_path=str(demo.out / "teacher.jsonl"))
    epochs = demo.settings.teacher_epochs
    (x, y), val = demo.train, demo.val
    teacher.fit(x, y, batch_size=BATCH, epochs=epochs, validation_data=val, verbose=0,
                callbacks=[mon, stop, bar("[teacher] 64-256-256-10 on every label", epochs)])  # fmt: skip
    mon.plot(str(demo.out / "teacher.png"))
    demo.files += ["teacher.jsonl", "teacher.png"]
    summary = mon.summary()
    demo.stages["teacher"] = {**summary, "stop_reason": stop.stop_reason}
    rate = summary.get("median_examples_per_s")
    demo.add_model("teacher", teacher, accuracy(teacher, *demo.test),
                   time.perf_counter() - t0, None if rate is None else round(float(rate), 1))  # fmt: skip
    return teacher


def _fit_rate(model, x, y, epochs: int) -> float:
    """Median examples/s of `epochs` epochs of `model.fit` (after one warm-up epoch)."""
    import keras_perf as kp

    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    mon = kp.TrainingMonitor()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[mon])
    return float(mon.summary()["median_examples_per_s"])


def training_speed(demo) -> None:
    """Plain `fit` vs `fit` after `kp.accelerate` on the same model (the teacher's shape)."""
    import keras_perf as kp

    s, (x, y) = demo.settings, demo.train
    say(demo, "\n[training speed] plain fit, then fit after kp.accelerate ...")
    model = mlp(TEACHER, "speed", SEED)
    model.compile(keras.optimizers.Adam(1e-3), sce())
    plain = _fit_rate(model, x, y, s.speed_epochs)
    name, unit = "training speed: kp.accelerate", "examples/s"
    accelerate = getattr(kp, "accelerate", None)
    if accelerate is None:
        demo.levers.append(lever(name, plain, None, unit,
                                 note="kp.accelerate not available in this build"))  # fmt: skip
        return
    try:
        r = accelerate(model, x, y, batch_size=BATCH, max_seconds=s.accelerate_seconds)
    except Exception as e:  # another branch's API: the demo goes on and says what happened
        demo.levers.append(lever(name, plain, None, unit,
                                 note=f"kp.accelerate failed: {type(e).__name__}: {e}"))  # fmt: skip
        return
    chosen = [row for row in getattr(r, "rows", []) if row.get("chosen")]
    exact = all(row.get("exact", True) for row in chosen)
    faster = _fit_rate(model, x, y, s.speed_epochs) if r.chosen else plain
    demo.stages["accelerate"] = r.to_dict() if hasattr(r, "to_dict") else {}
    note = f"chosen {r.chosen or 'nothing'} ({'exact' if exact else 'NOT exact'} weights), "
    note += f"accelerate's own measure x{float(r.speedup):.2f}"
    demo.levers.append(lever(name, plain, faster, unit, note=note,
                             why_not="no candidate beat fit's own settings on this model"))  # fmt: skip


def memory(demo) -> None:
    """One training step's peak with `remat="full"` and with 4 micro-batches vs neither, as
    `kp.backend.step_memory` measures it (the measure the monitor and diagnose use), at the
    same loss."""
    import keras_perf as kp
    from keras_perf import backend as _backend

    size = demo.settings.memory_batch
    say(demo, f"\n[memory] one step at batch {size}: plain, remat='full', 4 micro-batches ...")
    why = _backend.step_memory_unavailable()
    x, y = demo.train[0][:size], demo.train[1][:size]
    settings = {"none": {}, "remat full": {"remat": "full"}, "4 micro-batches": {"microbatches": 4}}
    measured = {}
    for label, kwargs in settings.items():
        model = kp.loss_scaled(mlp(TEACHER, "memory", SEED), **kwargs)
        model.compile(keras.optimizers.SGD(0.01), sce())
        loss = float(model.train_on_batch(x, y, return_dict=True)["loss"])  # builds all; its loss
        peak = None
        if why is None:
            result = _backend.step_memory(model, (x, y, None),
                                          lambda m=model: m.train_on_batch(x, y))  # fmt: skip
            peak, demo.stages["memory_measure"] = result["bytes"] / 2**20, result["measure"]
        measured[label] = (peak, loss)
    base_peak, base_loss = measured.pop("none")
    for label, (peak, loss) in measured.items():
        note = why or (
            f"{demo.stages['memory_measure']}, loss {loss:.4f} vs {base_loss:.4f} "
            f"(|diff| {abs(loss - base_loss):.1e})"
        )
        demo.levers.append(lever(f"memory: {label}", base_peak, peak, "MiB per step",
            higher_is_better=False, note=note,
            why_not="recomputing a 3-layer MLP's activations needs buffers of its own that "
                    "outweigh what it saves; remat pays on deep networks"
                    if label.startswith("remat") else
                    "the step's activations are small beside the weights at this size"))  # fmt: skip


def distillation(demo) -> None:
    """The student on a small labelled share alone vs the same student (same seed) distilled,
    label-free, on every training input from a teacher trained on that same share."""
    import keras_perf as kp

    s, (x, y) = demo.settings, demo.train
    n = int(round(len(x) * s.label_share))
    say(demo, f"\n[distillation] {n} labelled examples ({s.label_share:.0%}), "
              f"{len(s.seeds)} seed(s) ...")  # fmt: skip
    xs, ys = x[:n], y[:n]  # the split is shuffled already
    teacher = mlp(TEACHER, "share_teacher", SEED + 100)
    teacher.compile(keras.optimizers.Adam(2e-3), sce())
    teacher.fit(xs, ys, batch_size=32, epochs=s.share_epochs, verbose=0)
    t_acc = accuracy(teacher, *demo.test)
    alone, distilled = [], []
    for seed in s.seeds:
        a = mlp(STUDENT, "student_alone", seed)
        a.compile(keras.optimizers.Adam(2e-3), sce())
        a.fit(xs, ys, batch_size=32, epochs=s.share_epochs, verbose=0)
        alone.append(accuracy(a, *demo.test) * 100)
        student = mlp(STUDENT, "student_distilled", seed)
        d = kp.DistillationModel(student, teacher, temperature=3.0, alpha=1.0)
        d.compile(optimizer=keras.optimizers.Adam(2e-3))
        d.fit(x, batch_size=BATCH, epochs=s.distill_epochs, verbose=0)  # no labels
        distilled.append(accuracy(student, *demo.test) * 100)
        if seed == s.seeds[0]:
            demo.add_model(f"student alone ({n} labels)", a, alone[-1] / 100)
            demo.add_model("student distilled", student, distilled[-1] / 100)
    diffs = np.subtract(distilled, alone)
    note = (f"{len(s.seeds)} seeds, gain min {diffs.min():+.1f} / max {diffs.max():+.1f}; "
            f"teacher trained on the same {n} labels ({t_acc:.1%}), distilled on all "
            f"{len(x)} inputs without their labels")  # fmt: skip
    demo.stages["distillation"] = {"labelled": n, "alone": alone, "distilled": distilled,
                                   "teacher_accuracy": t_acc}  # fmt: skip
    demo.levers.append(lever(f"distillation, {s.label_share:.0%} labels", float(np.mean(alone)),
        float(np.mean(distilled)), "test accuracy %", points=True, note=note,
        why_not="the student alone already matches what the teacher knows"))  # fmt: skip


def _fine_tune(model, demo, callback, epochs):
    model.compile(keras.optimizers.Adam(5e-4), sce())
    (x, y) = demo.train
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[callback])


def _schedule(demo, final):
    import keras_perf as kp

    steps = demo.settings.prune_epochs * int(np.ceil(len(demo.train[0]) / BATCH))
    frequency = max(1, steps // 20)
    end = max(1, int(steps * 0.6) // frequency) * frequency  # on the grid: `final` is reached
    return kp.PolynomialDecay(initial_sparsity=0.0, final_sparsity=final, begin_step=0,
                              end_step=end, frequency=frequency)  # fmt: skip


def pruning(demo, teacher) -> None:
    """The teacher pruned to 85 % sparsity while fine-tuning vs unpruned (accuracy and gzip
    size), and channel pruning + `kp.shrink` (parameters, inference latency)."""
    import keras_perf as kp

    s, test = demo.settings, demo.test
    say(demo, "\n[pruning] the teacher to 85 % sparsity; channel pruning + shrink ...")
    base_acc = accuracy(teacher, *test) * 100
    base = kp.compression_report(teacher)["total"]
    pruned = copy_of(teacher, "teacher_pruned")
    _fine_tune(pruned, demo, kp.PruningCallback(_schedule(demo, 0.85)), s.prune_epochs)
    pruned = kp.strip_pruning(pruned)
    acc = accuracy(pruned, *test) * 100
    rep = kp.compression_report(pruned)["total"]
    sparsity = 1 - rep["nonzero"] / rep["params"]
    demo.add_model("teacher pruned 85%", pruned, acc / 100)
    demo.levers.append(lever("pruning 85%: accuracy", base_acc, acc, "test accuracy %",
        points=True, tolerance=1.0,
        note=f"{sparsity:.0%} of all weights zero; the aim: at most 1 point lost",
        why_not="more than 1 point lost: fine-tuning too short for this sparsity"))  # fmt: skip
    demo.levers.append(lever("pruning 85%: size", base["gzip_bytes"] / 1024,
                             rep["gzip_bytes"] / 1024, "KiB (gzip)", higher_is_better=False,
                             note="the zeros compress; the dense file is the same size"))  # fmt: skip

    channels = copy_of(teacher, "teacher_channels")
    _fine_tune(channels, demo, kp.ChannelPruningCallback(_schedule(demo, 0.75)), s.prune_epochs)
    small = kp.shrink(channels)
    small_acc = accuracy(small, *test) * 100
    demo.add_model("teacher channel-pruned, shrunk", small, small_acc / 100)
    demo.levers.append(lever("channel pruning + shrink: params", teacher.count_params(),
        small.count_params(), "parameters", higher_is_better=False,
        note=f"75% of hidden channels gone; accuracy {base_acc:.1f} -> {small_acc:.1f} %"))  # fmt: skip
    xb = test[0][:BATCH]
    lat = [latency_ms(m, xb, s.repeats * 3) for m in (teacher, small)]
    demo.levers.append(lever("channel pruning + shrink: latency", lat[0], lat[1],
        f"ms, predict batch {BATCH}", higher_is_better=False, note="Keras predict_on_batch, median",
        why_not="a call this small is overhead-bound; the saved FLOPs do not show"))  # fmt: skip


def deployment(demo, model) -> None:
    """`kp.inference_report` on the teacher: Keras `predict` vs TFLite/ONNX float and int8,
    at batch 1 and 64; per batch size the fastest float and the fastest int8 file."""
    import keras_perf as kp
    from keras_perf.export import available_formats

    formats = available_formats(model)
    say(demo, f"\n[deployment] {', '.join(formats)} at batch 1 and {BATCH} ...")
    report = kp.inference_report(model, demo.test[0], demo.test[1], batch_sizes=(1, BATCH),
                                 formats=formats, repeats=demo.settings.repeats,
                                 representative_data=demo.train[0][:200])  # fmt: skip
    demo.inference = [{k: v for k, v in r.items() if not hasattr(v, "shape")} for r in report.rows]
    if demo.verbose:
        print(report, flush=True)
    for b in (1, BATCH):
        rows = {r["format"]: r for r in report.rows if r["batch_size"] == b}
        floats = [rows[f] for f in ("tflite", "onnx") if f in rows]
        ints = [rows[f] for f in ("tflite-int8", "onnx-int8") if f in rows]
        best = min(floats, key=lambda r: r["latency_ms_p50"], default=None)
        if best is not None:  # the exported float file vs Keras predict
            demo.levers.append(lever(f"deploy: float file vs Keras, batch {b}",
                rows["keras"]["latency_ms_p50"], best["latency_ms_p50"], f"ms, batch {b}",
                higher_is_better=False, note=_file_note(best),
                why_not="Keras' own call is as fast as the exported file here"))  # fmt: skip
        for q in ints:  # int8 vs the float file of the same runtime
            f = rows[q["format"].replace("-int8", "")]
            demo.levers.append(lever(f"deploy: {q['format']} vs float, batch {b}",
                f["latency_ms_p50"], q["latency_ms_p50"], f"ms, batch {b}",
                higher_is_better=False, note=_file_note(q),
                why_not=("a call's fixed cost dominates this 84k-parameter MLP at batch 1"
                         if b == 1 else "this CPU's int8 kernels are no faster than its float "
                         "ones for these matrix sizes")))  # fmt: skip


def _file_note(row) -> str:
    return f"{row['format']}, agreement {row['agreement']:.3f}, {row['bytes'] / 1024:.0f} KiB"


def learning_rate(demo) -> None:
    """`kp.find_learning_rate`'s suggestion vs Adam's default 1e-3: test accuracy after the
    same epochs from the same initial weights."""
    import keras_perf as kp

    s, (x, y) = demo.settings, demo.train
    say(demo, f"\n[learning rate] range test, then {s.lr_epochs} epochs at 1e-3 and at it ...")
    probe = mlp(STUDENT, "lr_probe", SEED)
    probe.compile(keras.optimizers.Adam(1e-3), sce())
    found = kp.find_learning_rate(probe, x, y, batch_size=BATCH, steps=s.lr_steps)
    found.plot(str(demo.out / "lr.png"))
    demo.files.append("lr.png")
    result = {}
    for lr in (1e-3, float(found.suggestion)):
        model = mlp(STUDENT, "lr", SEED)
        model.compile(keras.optimizers.Adam(lr), sce())
        model.fit(x, y, batch_size=BATCH, epochs=s.lr_epochs, verbose=0)
        result[lr] = accuracy(model, *demo.test) * 100
    base, with_ = result.values() if len(result) == 2 else (result[1e-3], result[1e-3])
    demo.levers.append(lever(f"learning rate: range test, {s.lr_epochs} epochs", base, with_,
        "test accuracy %", points=True,
        note=f"suggested {found.suggestion:.2g} vs Adam's default 1e-3",
        why_not="Adam's default already suits this model"))  # fmt: skip
