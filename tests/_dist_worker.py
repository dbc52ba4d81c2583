"""Worker process for tests/test_distributed.py (not collected by pytest).

Distributed engines must be configured before the backend initialises (TF logical devices,
XLA's host device count, TF_CONFIG), so every scenario runs in a fresh process:

    python tests/_dist_worker.py SCENARIO [OUT_JSON]

Scenarios: `tf_mirrored` (MirroredStrategy over two logical CPUs), `tf_mwms` (one worker of a
MultiWorkerMirroredStrategy; TF_CONFIG comes from the environment), `jax_dp`
(keras.distribution.DataParallel over two host devices). Each prints `RESULT <json>` as its
last line (and writes it to OUT_JSON if given).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GLOBAL_BATCH = 16
STEPS = 4


def data(n=GLOBAL_BATCH * STEPS, features=8, classes=3, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x[:, :classes].argmax(axis=1)).astype("int32")
    return x, y


def build(seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, dtype="float32"),
        ]
    )


def train(model, x, y, epochs=1, **fit_kwargs):
    import keras

    model.compile(
        keras.optimizers.SGD(0.1, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    hist = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs
    )
    return hist


def max_diff(a, b):
    import numpy as np

    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def train_step_case(scope, microbatches):
    """Weights after training with our step, on one device and inside `scope`."""
    import keras_perf as kp

    x, y = data()
    ref = kp.loss_scaled(build(), microbatches=microbatches)
    train(ref, x, y, epochs=2)
    with scope():
        model = kp.loss_scaled(build(), microbatches=microbatches)
        train(model, x, y, epochs=2)
    return max_diff(ref.get_weights(), model.get_weights())


def overflow_case(scope):
    """Under mixed_float16, one poisoned example on one replica: every replica skips the step."""
    import keras
    import numpy as np

    import keras_perf as kp

    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(n=GLOBAL_BATCH)
    sw = np.ones(len(x), "float32")
    sw[-1] = 1e30  # lands on the last replica's shard
    with scope():
        model = kp.loss_scaled(build(), microbatches=2)
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.build((None, 8))
        model.optimizer.build(model.trainable_variables)
    before = [w.copy() for w in model.get_weights()]
    hist = model.fit(x, y, sample_weight=sw, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    unchanged = max_diff(before, model.get_weights())
    hist2 = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    moved = max_diff(before, model.get_weights())
    keras.mixed_precision.set_global_policy("float32")
    return {
        "skipped": int(hist.history["skipped_steps"][-1]),
        "scale_after_overflow": float(hist.history["loss_scale"][-1]),
        "unchanged": unchanged,
        "skipped_after_clean_step": int(hist2.history["skipped_steps"][-1]),
        "moved_after_clean_step": moved,
    }


def batchnorm_skip_case(scope, microbatches):
    """A BatchNormalization model; one Inf on the last replica's shard: every replica's copy
    of every variable (moving statistics included) is left as it was; returns the largest
    change (NaN counts as a change)."""
    import keras
    import numpy as np

    import keras_perf as kp

    x, y = data(n=GLOBAL_BATCH)
    with scope():
        keras.utils.set_random_seed(0)
        base = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(3),
            ]
        )
        model = kp.loss_scaled(base, microbatches=microbatches)
        model.compile(
            keras.optimizers.Adam(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    before = [_replica_values(v) for v in model.variables]
    bad = x.copy()
    bad[-1, 0] = np.inf  # the last replica's shard (its second slice with microbatches=2)
    hist = model.fit(bad, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    change = 0.0
    for v, old in zip(model.variables, before):
        for a, b in zip(old, _replica_values(v)):
            diff = np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))
            change = max(change, float(np.max(np.where(np.isnan(diff), np.inf, diff))))
    return {"skipped": int(hist.history["skipped_steps"][-1]), "change": change}


def _replica_values(variable):
    """The per-replica copies of a variable (one entry outside tf.distribute)."""
    import keras
    import numpy as np

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        value = getattr(variable, "value", variable)
        if tf.distribute.has_strategy() or isinstance(value, tf.distribute.DistributedValues):
            strategy = tf.distribute.get_strategy()
            return [np.asarray(v) for v in strategy.experimental_local_results(value)]
    return [keras.ops.convert_to_numpy(variable)]


def pruning_case(scope):
    """PruningCallback inside `scope`: sparsity reached, same mask on every replica."""
    import hashlib

    import numpy as np

    import keras_perf as kp

    x, y = data()
    with scope():
        model = kp.loss_scaled(build())  # stock fit fails under MWMS (Keras 3.15)
        cb = kp.PruningCallback(kp.ConstantSparsity(0.5, begin_step=0, frequency=1))
        train(model, x, y, epochs=2, callbacks=[cb])
        kernels = [v for v in model.trainable_variables if "kernel" in v.path]
        out = {"sparsity": [], "replicas_agree": True, "mask_hash": ""}
        digest = hashlib.sha1()
        for v in kernels:
            copies = _replica_values(v)
            masks = [c == 0 for c in copies]
            out["replicas_agree"] &= all(np.array_equal(masks[0], m) for m in masks[1:])
            out["replicas_agree"] &= all(np.array_equal(copies[0], c) for c in copies[1:])
            out["sparsity"].append(float(masks[0].mean()))
            digest.update(masks[0].tobytes())
        out["mask_hash"] = digest.hexdigest()
    return out


def stopping_case(scope, slow_worker=False, epoch_sleep=0.0, seconds=8.0):
    """EarlyStopping and TimeLimit inside `scope`: epochs stopped at, reasons.

    Each epoch sleeps `epoch_sleep` s (2 s on a `slow_worker`); TimeLimit gets `seconds`.
    """
    import time

    import keras

    import keras_perf as kp

    x, y = data()
    out = {}
    with scope():
        model = kp.loss_scaled(build())  # stock fit fails under MWMS (Keras 3.15)
        es = kp.EarlyStopping(monitor="loss", stopping_threshold=10.0, mode="min")
        train(model, x, y, epochs=5, callbacks=[es])
        out["early"] = [es.stopped_epoch, es.best_epoch, es.stop_reason]

        class Slow(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                time.sleep(2.0 if slow_worker else epoch_sleep)

        model = kp.loss_scaled(build())  # stock fit fails under MWMS (Keras 3.15)
        limit = kp.TimeLimit(seconds=seconds)
        hist = train(model, x, y, epochs=50, callbacks=[Slow(), limit])
        out["time_limit"] = [limit.stopped_epoch, limit.stop_reason, len(hist.history["loss"])]
    return out


def early_stopping_parity_case(scope):
    """EarlyStopping(patience, restore_best_weights) on val_loss: one device vs inside `scope`.

    On this data val_loss is lowest at epoch 9 and rises at epochs 10 and 11 (by about 2e-3
    each, far above float32 noise), so patience=2 stops after epoch 11 and restores epoch 9.
    """
    import keras_perf as kp

    x, y = data()
    xv, yv = data(n=32, seed=1)

    def run():
        model = build()
        es = kp.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
        hist = train(model, x, y, epochs=30, callbacks=[es], validation_data=(xv, yv))
        decision = [es.stopped_epoch, es.best_epoch, es.stop_reason, len(hist.history["loss"])]
        return model.get_weights(), decision, hist.history["val_loss"]

    ref_w, ref_decision, ref_val = run()
    with scope():
        w, decision, val = run()
    return {
        "one_device": ref_decision,
        "distributed": decision,
        "weights": max_diff(ref_w, w),
        "val_loss": max(abs(a - b) for a, b in zip(ref_val, val)),
    }


def _oom_above(threshold, from_call=0, replica=None):
    """Identity layer that raises the backend's OOM error once, as in tests/test_oom.py.

    It raises on the first training call with a static batch above `threshold` from the
    `from_call`-th such call on (0-based). Static batches are seen in eager TF steps and while
    jax.jit traces a step. `replica`: count and raise only on that tf.distribute replica.
    """
    import keras

    import keras_perf as kp

    class OOMAbove(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.calls, self.raised, self.sizes, self.raised_at = 0, [], [], None

        def call(self, x, training=False):
            n = x.shape[0]
            if not training or not isinstance(n, int):
                return x
            if replica is not None:
                import tensorflow as tf

                ctx = tf.distribute.get_replica_context()
                if ctx is None or int(ctx.replica_id_in_sync_group) != replica:
                    return x
            index, self.calls = self.calls, self.calls + 1
            self.sizes.append(n)
            if n > threshold and index >= from_call and not self.raised:
                exc = kp.backend.oom_error(f"Out of memory (injected, batch {n}).")
                self.raised.append(exc)
                self.raised_at = len(self.sizes) - 1
                raise exc
            return x

    return OOMAbove()


def oom_case(scope, n, threshold, from_call, replica=None, fit_in_scope=True):
    """kp.fit_with_oom_retry with one injected OOM, compared with a one-device run.

    The reference trains the epochs before the failed one as they were, then the rest with
    the surviving micro-batch count from the start of the failed epoch.
    """
    import keras
    import numpy as np

    import keras_perf as kp

    x, y = data(n=n)
    eager = keras.backend.backend() == "tensorflow"  # the OOM layer needs static shapes

    def make(layer=None):
        dense = build().layers
        model = keras.Sequential(
            [keras.Input((8,)), dense[0]] + ([layer] if layer else []) + dense[1:]
        )
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            run_eagerly=eager and layer is not None,
        )
        return model

    layer = _oom_above(threshold, from_call, replica)
    with scope():
        model = make(layer)
    # Keras binds a TF model to its strategy when it is created: fit outside the scope, as
    # users may, so the micro-batched twin made at the OOM must find the strategy itself.
    with scope() if fit_in_scope else _no_scope():
        hist = kp.fit_with_oom_retry(
            model, x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0
        )
    events = hist.oom_events
    failed = events[0]["epoch"] if events else 2

    ref = make()
    ref_loss = []
    if failed > 0:
        h = ref.fit(x, y, batch_size=GLOBAL_BATCH, epochs=failed, shuffle=False, verbose=0)
        ref_loss += h.history["loss"]
    twin = kp.loss_scaled(ref, microbatches=2)
    h = twin.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=2, initial_epoch=failed, shuffle=False, verbose=0
    )
    ref_loss += h.history["loss"]

    with scope():
        replicas_agree = all(
            all(np.array_equal(c[0], other) for other in c[1:])
            for c in (_replica_values(v) for v in model.weights)
        )
        iterations = int(_replica_values(hist.model.optimizer.iterations)[0])
    return {
        "epochs": hist.epoch,
        "events": [[e["epoch"], e["batch_size"], e["microbatches"]] for e in events],
        "error": events[0]["error"] if events else "",
        "raised": len(layer.raised),
        # Static batches the layer saw after it raised: the retry's micro-batches.
        "sizes_after": [] if layer.raised_at is None else layer.sizes[layer.raised_at + 1 :],
        "microbatches": getattr(hist.model, "microbatches", 1),
        "iterations": [iterations, int(twin.optimizer.iterations)],
        "weights": max_diff(ref.get_weights(), model.get_weights()),
        "loss": max(abs(a - b) / abs(b) for a, b in zip(hist.history["loss"], ref_loss)),
        "replicas_agree": replicas_agree,
    }


def monitor_case(scope):
    """TrainingMonitor inside `scope`: examples and steps are global, not per replica."""
    import keras_perf as kp

    x, y = data()
    with scope():
        model = kp.loss_scaled(build())
        mon = kp.TrainingMonitor()
        train(model, x, y, epochs=2, callbacks=[mon])
    return {
        "examples": [h["examples"] for h in mon.history],
        "steps": [h["steps"] for h in mon.history],
    }


def distill_case(scope):
    """DistillationModel: student weights after 2 epochs, one device vs inside `scope`."""
    import keras

    import keras_perf as kp

    x, y = data()

    def run():
        teacher = build(seed=7)
        student = build(seed=0)
        distiller = kp.DistillationModel(student, teacher, temperature=3.0, alpha=0.7)
        distiller.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            student_loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        distiller.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        return student.get_weights(), teacher.get_weights()

    ref_student, ref_teacher = run()
    with scope():
        student, teacher = run()
    return {
        "student": max_diff(ref_student, student),
        "teacher_unchanged": max_diff(ref_teacher, [w for w in build(seed=7).get_weights()]),
    }


def tf_mirrored():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {"replicas": strategy.num_replicas_in_sync}
    for k in (1, 2):
        out[f"train_step_mb{k}"] = train_step_case(strategy.scope, k)
    out["overflow"] = overflow_case(strategy.scope)
    for k in (1, 2):
        out[f"batchnorm_skip_mb{k}"] = batchnorm_skip_case(strategy.scope, k)
    out["pruning"] = pruning_case(strategy.scope)
    out["monitor"] = monitor_case(strategy.scope)
    out["distill"] = distill_case(strategy.scope)
    # Global batch 16 = 8 per replica; the OOM is raised on replica 1 only, at its 7th step
    # (epoch 1, step 2: two updates of epoch 1 to roll back). 2 micro-batches of 4 fit.
    out["oom"] = oom_case(
        strategy.scope, n=64, threshold=4, from_call=6, replica=1, fit_in_scope=False
    )
    return out


def tf_mwms():
    import tensorflow as tf

    import keras_perf as kp

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = data()
    ref = kp.loss_scaled(build(), microbatches=2)
    train(ref, x, y, epochs=2)
    with strategy.scope():
        model = kp.loss_scaled(build(), microbatches=2)
        train(model, x, y, epochs=2)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    return {
        "replicas": strategy.num_replicas_in_sync,
        "task": task,
        "train_step_mb2": max_diff(ref.get_weights(), model.get_weights()),
        "pruning": pruning_case(strategy.scope),
        "stopping": stopping_case(strategy.scope, slow_worker=task == 1),
        "monitor": monitor_case(strategy.scope),
        "distill": distill_case(strategy.scope),
        "oom_refused": oom_refused_case(strategy),
    }


def oom_refused_case(strategy):
    """kp.fit_with_oom_retry under a multi-worker strategy: a clear error before any step."""
    import keras

    import keras_perf as kp

    x, y = data()
    with strategy.scope():
        model = kp.loss_scaled(build())
        model.compile(
            keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    before = model.get_weights()
    out = {}
    for where in ("in_scope", "model_only"):
        try:
            with strategy.scope() if where == "in_scope" else _no_scope():
                kp.fit_with_oom_retry(model, x, y, batch_size=GLOBAL_BATCH, verbose=0)
            out[where] = ["", ""]
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            out[where] = [type(exc).__name__, str(exc)]
    out["unchanged"] = max_diff(before, model.get_weights())
    return out


def _no_scope():
    import contextlib

    return contextlib.nullcontext()


def jax_dp():
    import contextlib

    import jax
    import keras

    devices = jax.devices()
    dist = keras.distribution.DataParallel(devices=devices)

    @contextlib.contextmanager
    def scope():
        keras.distribution.set_distribution(dist)
        try:
            yield
        finally:
            keras.distribution.set_distribution(None)

    out = {"replicas": len(devices)}
    for k in (1, 2):
        out[f"train_step_mb{k}"] = train_step_case(scope, k)
    out["pruning"] = pruning_case(scope)
    out["monitor"] = monitor_case(scope)
    out["distill"] = distill_case(scope)
    out["stopping"] = stopping_case(scope, epoch_sleep=0.25, seconds=2.0)
    out["early_stopping"] = early_stopping_parity_case(scope)
    # jax.jit traces once per batch shape, on the global batch (SPMD: one program for both
    # devices). 72 examples: 4 batches of 16, then one of 8, traced anew; the OOM is raised in
    # that second trace (epoch 0, after its 4 updates). 2 micro-batches (8, then 4) fit.
    out["oom"] = oom_case(scope, n=72, threshold=4, from_call=1)
    return out


SCENARIOS = {"tf_mirrored": tf_mirrored, "tf_mwms": tf_mwms, "jax_dp": jax_dp}


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]]()
    text = json.dumps(result)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(text)
    print("RESULT " + text, flush=True)
