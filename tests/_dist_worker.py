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


def stopping_case(scope, slow_worker=False):
    """EarlyStopping and TimeLimit inside `scope`: epochs stopped at, reasons."""
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
                time.sleep(2.0 if slow_worker else 0.0)

        model = kp.loss_scaled(build())  # stock fit fails under MWMS (Keras 3.15)
        limit = kp.TimeLimit(seconds=8.0)
        hist = train(model, x, y, epochs=50, callbacks=[Slow(), limit])
        out["time_limit"] = [limit.stopped_epoch, limit.stop_reason, len(hist.history["loss"])]
    return out


def monitor_case(scope):
    """TrainingMonitor inside `scope`: examples and steps are global, not per replica."""
    import keras_perf as kp

    x, y = data()
    with scope():
        model = kp.loss_scaled(build())
        mon = kp.TrainingMonitor()
        train(model, x, y, epochs=2, callbacks=[mon])
    return {"examples": [h["examples"] for h in mon.history], "steps": [h["steps"] for h in mon.history]}


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
    out["pruning"] = pruning_case(strategy.scope)
    out["monitor"] = monitor_case(strategy.scope)
    out["distill"] = distill_case(strategy.scope)
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
    }


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
    return out


SCENARIOS = {"tf_mirrored": tf_mirrored, "tf_mwms": tf_mwms, "jax_dp": jax_dp}


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]]()
    text = json.dumps(result)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(text)
    print("RESULT " + text, flush=True)
