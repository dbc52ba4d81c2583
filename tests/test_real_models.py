"""Every keras-perf piece on the architectures users write, one or two steps each.

The architectures (`tests/models.py`): keras.applications MobileNetV2, ResNet50 and
EfficientNetB0 (both `slow`) at 32x32, a Transformer encoder, a BiLSTM, a dict-in/dict-out Functional model
trained with `loss_weights` and `sample_weight`, and a subclassed model compiled and fitted
without being built first. Each test is one piece on one architecture, on the backend of the
run. Breaks known and being fixed are `xfail(strict=True)` with the break in the reason, so a
fix turns them into failures and whoever fixes one removes its mark (`KNOWN` below).
"""

import inspect
import json

import keras
import numpy as np
import pytest

import keras_perf as kp
from tests.models import ARCHS, IMAGE_SHAPE, SEQ_LEN, VOCAB, compile_model, make_data

# The slow tier (every piece on real architectures, minutes per backend): `.ci/run` runs it on every backend.
pytestmark = pytest.mark.slow

BACKEND = keras.backend.backend()
SLOW = pytest.mark.slow
# The heaviest (piece, architecture) cases beyond the slow architectures (ResNet50,
# EfficientNetB0). None at present.
SLOW_CASES = set()
# Pieces that drive `fit` from callbacks or a train step of their own, whatever the layers:
# on the large architectures (ResNet50, EfficientNetB0; MobileNetV2 too on JAX and PyTorch,
# where it is the largest one run) they repeat what the small architectures and MobileNetV2
# on TensorFlow prove, at 20-46 s a case (CI's TensorFlow slow tier, 2026-11-28). They are
# marked `heavy`: out of `.ci/run`, run by hand with `-m heavy`. The pieces whose code walks
# the layers (micro-batches with BatchNormalization, the OOM ladder's remat rung, pruning and
# its strip, TFLite, the reports) run on every architecture but as said next.
LOOP_PIECES = {"loss_scaled_mb1", "distillation", "monitor", "early_stopping", "time_limit"}
# ResNet50 brings no layer kind that MobileNetV2 and EfficientNetB0 lack but MaxPooling2D
# (Conv2D, BatchNormalization, Add, Activation, ZeroPadding2D, pooling, Dense): in CI it runs
# the reports alone, its layer-walking pieces (micro-batches, the OOM ladder, pruning, TFLite:
# 121 s of CI's TensorFlow test time, 2026-11-28) by hand with `-m heavy`, as do
# EfficientNetB0's micro-batches (51 s: BatchNormalization under micro-batches is
# MobileNetV2's case, Dropout's tests/test_train_step.py's).
REPORTS = {"check_mixed_precision", "compression_report", "flops"}
# On JAX these MobileNetV2 cases compile its step (micro-batched, or again per OOM rung and per
# pruning step's masks) for 24-44 s each (96 s of CI's JAX test time, 2026-11-28); the same
# layer walking runs on MobileNetV2 under TensorFlow and PyTorch (1-19 s there), and the JAX
# train step's micro-batches, ladder and masks on the small architectures. `-m heavy` on JAX.
JAX_COMPILE_HEAVY = {"loss_scaled_mb2", "oom_retry", "pruning"}


def _heavy(key, name, arch):
    if key in LOOP_PIECES and arch.slow:
        return True
    if key in LOOP_PIECES and name == "mobilenet_v2" and BACKEND != "tensorflow":
        return True
    if name == "mobilenet_v2" and BACKEND == "jax" and key in JAX_COMPILE_HEAVY:
        return True
    if name == "resnet50" and key not in REPORTS:
        return True
    return (key, name) == ("loss_scaled_mb2", "efficientnet_b0")


# (piece, architecture) -> (backends where it breaks, the known break). Remove a line when
# its break is fixed: the strict xfail fails as soon as the case passes.
ALL = ("tensorflow", "jax", "torch")
KNOWN = {}  # every break found in this tier is fixed (2026-11); add new ones here


def cases(piece, archs=None, microbatches=None):
    """`pytest.param`s of the architectures for `piece`, with slow and known-break marks.

    With `microbatches`, one case per (architecture, count), the piece named
    `f"{piece}_mb{count}"` in `KNOWN`.
    """
    params = []
    for name, arch in ARCHS.items():
        if archs is not None and name not in archs:
            continue
        for k in microbatches or (None,):
            key = piece if k is None else f"{piece}_mb{k}"
            marks = [SLOW] if arch.slow or (key, name) in SLOW_CASES else []
            if _heavy(key, name, arch):
                marks.append(pytest.mark.heavy)
            known = KNOWN.get((key, name))
            if known is not None and BACKEND in known[0]:
                marks.append(pytest.mark.xfail(strict=True, reason=known[1]))
            values, id_ = ((arch,), name) if k is None else ((arch, k), f"{name}-mb{k}")
            params.append(pytest.param(*values, id=id_, marks=marks))
    return params


def build(arch, seed=0, train_step=False):
    """A fresh model of `arch`, with keras-perf's train step when `train_step`.

    The subclassed model gets it by subclassing the mixin (the documented way; `kp.loss_scaled`
    takes Sequential and Functional models); the others through `kp.loss_scaled`.
    """
    keras.utils.set_random_seed(seed)
    if arch.subclassed:
        bases = (kp.LossScaleTrainStep, keras.Model) if train_step else (keras.Model,)
        return arch.build(bases=bases)
    model = arch.build()
    return kp.loss_scaled(model) if train_step else model


def weights(model):
    return [np.array(w) for w in model.get_weights()]


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b, strict=True))


def fit(model, x, y, sw=None, **kwargs):
    kwargs.setdefault("batch_size", 8)
    kwargs.setdefault("shuffle", False)
    kwargs.setdefault("verbose", 0)
    return model.fit(x, y, sample_weight=sw, **kwargs)


def ensure_built(arch, model, x):
    """Build the subclassed model by calling it, as its first `fit`/`predict` would."""
    if arch.subclassed and not model.built:
        model.predict(x, verbose=0)
    return model


# ---------------------------------------------------------------------------------------------
# kp.loss_scaled
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("arch", "microbatches"), cases("loss_scaled", microbatches=(1, 2)))
def test_loss_scaled_step(arch, microbatches):
    # One step of batch 8 in 1 or 2 slices: finite loss, the step's logs, weights updated.
    x, y, sw = make_data(arch, 8)
    model = build(arch, train_step=True)
    model.microbatches = microbatches
    compile_model(arch, model)
    before = weights(model) if model.built else None
    h = fit(model, x, y, sw)
    assert np.isfinite(h.history["loss"][0])
    assert h.history["skipped_steps"][0] == 0
    assert np.isfinite(h.history["grad_norm"][0]) and h.history["grad_norm"][0] > 0
    assert int(model.optimizer.iterations) == 1
    after = weights(model)
    assert all(np.isfinite(w).all() for w in after)
    if before is not None:
        assert max_diff(before, after) > 0


# BatchNormalization normalises each slice with the slice's own mean and variance (and
# updates its moving statistics once per slice), and Dropout draws other masks per slice, so
# a micro-batched step of such a model is *not* the full-batch step: for MobileNetV2, ResNet50
# and EfficientNetB0 `test_loss_scaled_step[2]` only checks that the step runs. The others
# must give the full-batch update to rounding.
@pytest.mark.parametrize(
    "arch",
    cases("microbatches_match", [n for n, a in ARCHS.items() if a.deterministic_step]),
)
def test_two_microbatches_equal_one_full_batch_step(arch):
    x, y, sw = make_data(arch, 8)
    result = {}
    for k in (1, 2):
        model = build(arch, seed=3, train_step=True)
        model.microbatches = k
        compile_model(arch, model)
        fit(model, x, y, sw)
        result[k] = weights(model)
    start = weights(ensure_built(arch, build(arch, seed=3), x))
    assert max_diff(result[1], start) > 1e-4  # the step moved the weights
    assert max_diff(result[1], result[2]) < 1e-5


# ---------------------------------------------------------------------------------------------
# kp.fit_with_oom_retry
# ---------------------------------------------------------------------------------------------
def inject_oom(model, threshold, on_model=False):
    """Make the model raise the backend's OOM on a training call above `threshold` examples.

    As in tests/test_oom.py: the check is Python in a layer's call, so it needs a static batch
    size (TF: `run_eagerly=True`; JAX raises while jax.jit traces the step; torch is eager),
    and it fires only on training calls, so the calls Keras makes to build the model or its
    metrics (torch on "meta" tensors, JAX under `jax.eval_shape`) do not raise, as no real
    allocator would there. The layer is the first one whose `call` takes `training`, or with
    `on_model` the model itself (a subclassed model: on JAX its `call` runs without a call
    context, so its layers see `training` only when the user's `call` passes it on).
    Returns the raised errors.
    """
    layer = (
        model
        if on_model
        else next(
            x
            for x in model._flatten_layers(include_self=False)
            if "training" in inspect.signature(x.call).parameters
        )
    )
    original, raised = layer.call, []

    def call(*args, **kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        n = keras.tree.flatten(x)[0].shape[0]
        if kwargs.get("training") and isinstance(n, int) and n > threshold:
            raised.append(kp.backend.oom_error(f"Out of memory (injected, batch {n})."))
            raise raised[-1]
        return original(*args, **kwargs)

    layer.call = call
    return raised


@pytest.mark.parametrize("arch", cases("oom_retry"))
def test_fit_with_oom_retry(arch):
    x, y, sw = make_data(arch, 8)
    model = build(arch)
    raised = inject_oom(model, threshold=4, on_model=arch.subclassed)
    compile_model(arch, model, run_eagerly=BACKEND == "tensorflow")
    h = kp.fit_with_oom_retry(
        model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, sample_weight=sw
    )
    # Keras may also call the layer on a concrete batch while building an unbuilt subclassed
    # model (and swallow the error there), so count the events, not the raises.
    assert raised
    # The ladder's first rung keeps training exact: remat for a model with BatchNormalization
    # (it keeps the batch whole, so the injected OOM comes again), micro-batches otherwise. A
    # subclassed model without the train step has the one rung, accumulation.
    rungs = (
        ["remat", "microbatches"] if arch.batchnorm and not arch.subclassed else ["microbatches"]
    )
    events = [(e["epoch"], e["batch_size"], e["microbatches"], e["strategy"]) for e in h.oom_events]
    assert events == [(0, 8, 1, rung) for rung in rungs]
    assert h.epoch == [0]
    assert np.isfinite(h.history["loss"][0])
    trained = weights(model)
    assert all(np.isfinite(w).all() for w in trained)
    # The effective batch is kept: without BatchNorm/Dropout (see above) the run equals a
    # plain one-step fit on the whole batch.
    ref = build(arch)
    compile_model(arch, ref)
    fit(ref, x, y, sw)
    if arch.deterministic_step:
        assert max_diff(trained, weights(ref)) < 1e-5


# ---------------------------------------------------------------------------------------------
# kp.DistillationModel
# ---------------------------------------------------------------------------------------------
def tiny_teacher(arch):
    """A small model with the student's inputs and output width (and output activation)."""
    act = "softmax" if arch.softmax else None
    if arch.inputs == "image":
        inp = keras.Input(IMAGE_SHAPE)
        h = keras.layers.GlobalAveragePooling2D()(inp)
        return keras.Model(inp, keras.layers.Dense(arch.classes, activation=act)(h))
    if arch.inputs == "tokens":
        inp = keras.Input((SEQ_LEN,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 4)(inp))
        return keras.Model(inp, keras.layers.Dense(arch.classes)(h))
    if arch.inputs == "dict":
        inp = {"image": keras.Input((8,), name="image"), "meta": keras.Input((3,), name="meta")}
        h = keras.layers.Concatenate()([inp["image"], inp["meta"]])
        out = {
            "label": keras.layers.Dense(arch.classes, name="label")(h),
            "score": keras.layers.Dense(1, name="score")(h),
        }
        return keras.Model(inp, out)
    inp = keras.Input((10,))
    return keras.Model(inp, keras.layers.Dense(arch.classes)(inp))


@pytest.mark.parametrize("arch", cases("distillation"))
def test_distillation_student(arch):
    x, y, sw = make_data(arch, 8)
    student = build(arch)
    teacher = tiny_teacher(arch)
    teacher_before = weights(teacher)
    if arch.dict_io:
        # Regression: accepted, then a tensor TypeError deep in fit. One output is distilled;
        # a dict-output student is refused at construction, saying what to do instead.
        with pytest.raises(ValueError, match="distils one output"):
            kp.DistillationModel(student, teacher, alpha=0.5)
        return
    distiller = kp.DistillationModel(student, teacher, alpha=0.5, from_logits=not arch.softmax)
    loss = arch.loss()
    distiller.compile(
        keras.optimizers.SGD(0.05),
        student_loss=loss["loss"],
        loss_weights=loss.get("loss_weights"),
    )
    h = fit(distiller, x, y, sw)
    for key in ("loss", "student_loss", "distillation_loss"):
        assert np.isfinite(h.history[key][0]), key
    assert h.history["distillation_loss"][0] > 0
    assert max_diff(weights(teacher), teacher_before) == 0
    student_after = weights(student)
    ref = ensure_built(arch, build(arch), x)
    assert max_diff(student_after, weights(ref)) > 0
    out = distiller.predict(x, verbose=0)
    np.testing.assert_allclose(
        keras.tree.flatten(out)[0], keras.tree.flatten(student.predict(x, verbose=0))[0], atol=1e-6
    )


# ---------------------------------------------------------------------------------------------
# Callbacks: TrainingMonitor, PruningCallback (+ strip_pruning, sparsity_report),
# EarlyStopping, TimeLimit
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", cases("monitor"))
def test_training_monitor(arch, tmp_path):
    x, y, sw = make_data(arch, 16)
    model = compile_model(arch, build(arch))
    mon = kp.TrainingMonitor(log_path=tmp_path / "run.jsonl")
    fit(model, x, y, sw, callbacks=[mon])
    (rec,) = mon.history
    assert (rec["epoch"], rec["steps"], rec["examples"]) == (1, 2, 16)
    assert rec["examples_per_s"] > 0 and rec["step_time_ms_p50"] > 0
    assert np.isfinite(rec["loss"])
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["steps"] == 2
    assert mon.summary()["epochs"] == 1


@pytest.mark.parametrize("arch", cases("pruning"))
def test_pruning_reaches_sparsity_and_strips(arch):
    x, y, sw = make_data(arch, 16)
    model = compile_model(arch, build(arch))
    pruning = kp.PruningCallback(kp.ConstantSparsity(0.5, begin_step=0, frequency=1))
    h = fit(model, x, y, sw, callbacks=[pruning])
    report = kp.sparsity_report(model)
    assert report["weights"]
    for row in report["weights"]:
        # tfmot's rule: keep the max(round(n * (1 - s)), 1) largest magnitudes.
        assert row["nonzero"] <= max(round(row["size"] * 0.5), 1), row
    assert report["total"]["sparsity"] >= 0.49
    assert h.history["sparsity"][-1] == pytest.approx(report["total"]["sparsity"], abs=1e-6)
    before = keras.tree.flatten(model.predict(x, verbose=0))
    kp.strip_pruning(model)
    assert not [v.path for v in model.weights if type(v.constraint).__name__ == "MaskConstraint"]
    assert kp.sparsity_report(model)["total"] == report["total"]
    after = keras.tree.flatten(model.predict(x, verbose=0))
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    fit(model, x, y, sw)  # a plain fit after stripping
    assert kp.sparsity_report(model)["total"]["sparsity"] < report["total"]["sparsity"]


@pytest.mark.parametrize("arch", cases("early_stopping"))
def test_early_stopping_restores_best(arch):
    x, y, sw = make_data(arch, 8)
    xv, yv, _ = make_data(arch, 8, seed=1)
    model = compile_model(arch, build(arch))
    es = kp.EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)
    h = fit(model, x, y, sw, epochs=3, validation_data=(xv, yv), callbacks=[es])
    val = h.history["val_loss"]
    assert h.epoch == [0, 1, 2] and es.stop_reason is None
    assert es.best == pytest.approx(min(val)) and es.best_epoch == int(np.argmin(val))
    restored = model.evaluate(xv, yv, batch_size=8, verbose=0, return_dict=True)["loss"]
    assert restored == pytest.approx(es.best, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("arch", cases("time_limit"))
def test_time_limit_stops(arch):
    x, y, sw = make_data(arch, 8)
    model = compile_model(arch, build(arch))
    limit = kp.TimeLimit(seconds=1e-3)
    h = fit(model, x, y, sw, epochs=3, callbacks=[limit])
    # No second epoch fits in a millisecond: stopped after the first, which always runs.
    assert h.epoch == [0]
    assert limit.stop_reason == "time_limit" and limit.stopped_epoch == 0


# ---------------------------------------------------------------------------------------------
# Export and reports
# ---------------------------------------------------------------------------------------------
@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("arch", cases("tflite"))
def test_export_tflite_matches_predict(arch, tmp_path):
    x, _, _ = make_data(arch, 4)
    model = ensure_built(arch, build(arch), x)
    path = tmp_path / "m.tflite"
    if arch.name == "bilstm":
        # Regression: the converter failed 16 frames deep. The LSTM needs TF ops TFLite lacks:
        # a clear error names the option, which writes the file (run it with the Flex delegate).
        with pytest.raises(ValueError, match="allow_select_tf_ops"):
            kp.export_tflite(model, path)
        report = kp.export_tflite(model, path, allow_select_tf_ops=True)
        assert report["select_tf_ops"] and path.stat().st_size > 0
        return
    kp.export_tflite(model, path)
    if arch.dict_io:
        # What users pass for a multi-input model: a list in the model's input order.
        feed = [x[t.name] for t in model.inputs]
        expected = model.predict(x, verbose=0)
        expected = [expected[name] for name in model.output_names]
    else:
        feed, expected = x, model.predict(x, verbose=0)
    got = kp.tflite_predict(path, feed)
    for g, e in zip(keras.tree.flatten(got), keras.tree.flatten(expected), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", cases("check_mixed_precision"))
def test_check_mixed_precision(arch):
    x, _, _ = make_data(arch, 2)
    # A float32 model has nothing to report.
    assert kp.check_mixed_precision(ensure_built(arch, build(arch), x)) == []
    keras.mixed_precision.set_global_policy("mixed_float16")
    findings = kp.check_mixed_precision(ensure_built(arch, build(arch), x))
    assert all(isinstance(f, str) for f in findings)
    if arch.softmax:  # keras.applications' softmax head computes in float16
        assert any("predictions" in f for f in findings), findings


@pytest.mark.parametrize("arch", cases("compression_report"))
def test_compression_report(arch):
    x, _, _ = make_data(arch, 2)
    model = ensure_built(arch, build(arch), x)
    report = kp.compression_report(model)
    total = report["total"]
    assert total["params"] == model.count_params()
    assert sum(r["params"] for r in report["layers"]) == total["params"]
    assert total["nonzero"] == sum(int(np.count_nonzero(w)) for w in model.get_weights())
    assert total["bytes"] == sum(w.nbytes for w in model.get_weights())
    assert 0 < total["gzip_bytes"] <= total["bytes"] * 1.01


def _dense_flops(model):
    """3 x 2 x multiply-adds of the Dense layers of a model whose Dense layers see vectors."""
    return 6.0 * sum(
        int(np.prod(layer.kernel.shape))
        for layer in model.layers
        if isinstance(layer, keras.layers.Dense)
    )


@pytest.mark.parametrize("arch", cases("flops"))
def test_estimate_flops_per_example(arch):
    x, _, _ = make_data(arch, 2)
    model = ensure_built(arch, build(arch), x)
    flops = kp.estimate_flops_per_example(model)
    if arch.recurrent or arch.attention or arch.subclassed:
        # Documented: unknown (None), never a silent under-count.
        assert flops is None
    elif arch.dict_io:
        assert flops == _dense_flops(model)
    else:
        # A CNN: each kernel is applied at least once and at most at every input position.
        kernels = 6.0 * sum(
            int(np.prod(v.shape)) for v in model.trainable_weights if "kernel" in v.path
        )
        assert kernels <= flops <= kernels * IMAGE_SHAPE[0] * IMAGE_SHAPE[1]
