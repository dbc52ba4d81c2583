"""Claims: DistillationModel costs what a hand-written step costs; offline targets save time.

Measured on the backend picked by KERAS_BACKEND (TensorFlow and JAX; the hand-written
baseline is a compiled step, so PyTorch runs claim 2 only), in one process, ABBA, median:

1. `DistillationModel`'s compiled train step (the function `fit` calls per batch) vs a
   hand-written minimal compiled step (`tf.function` / `jax.jit`) doing the same math —
   frozen teacher forward, T²·KL of the softened outputs + (1 − alpha)·cross-entropy, Adam
   update — single steps alternated step by step (300 each), median per block, median over
   blocks. Target <= 1.05x. Student MLP 784-512-512-10, teacher 784-1024-1024-1024-10 (about
   4× the student's FLOPs), batch 256, float32. Also shown, without a target: one epoch of
   `DistillationModel.fit` vs the hand-written step looped over the same pre-cut batches,
   which adds `fit`'s own loop (data adapter, callbacks, per-step dispatch; 32 steps per
   epoch in the full run, 4 with --quick).
2. Offline (`teacher=None`, targets from `kp.precompute_teacher_logits`) vs online
   distillation, one epoch each, same models. Target: offline >= 1.5x faster (ratio <= 0.67).
3. No target, splitting claim 1: `DistillationModel.fit` vs `fit` of a plain `keras.Model`
   doing the same math in `compute_loss` (the stock Keras train step): what our train step
   adds, apart from what `fit` itself costs over a bare loop.

Run: `python -m benchmarks.bench_distillation [--quick] [--json out.json]`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

import keras_perf as kp

from . import _harness

T, ALPHA, BATCH = 3.0, 0.7, 256


def mlp(widths, name):
    return _harness.mlp(widths, 784, name=name)


def hand_loss(t_logits, s_logits, y):
    log_t = ops.log_softmax(t_logits / T, axis=-1)
    log_s = ops.log_softmax(s_logits / T, axis=-1)
    kl = ops.mean(ops.sum(ops.exp(log_t) * (log_t - log_s), axis=-1)) * T**2
    ce = ops.mean(keras.losses.sparse_categorical_crossentropy(y, s_logits, from_logits=True))
    return ALPHA * kl + (1 - ALPHA) * ce


class StockStepKD(keras.Model):
    """The same distillation math in `compute_loss` of a plain `keras.Model`: stock Keras
    train step, none of ours. Timed against `DistillationModel` to split the gap to the
    hand-written step into what `fit` costs and what our train step adds."""

    def __init__(self, student, teacher, **kwargs):
        super().__init__(**kwargs)
        self.student, self.teacher = student, teacher

    def call(self, x, training=False):
        return self.student(x, training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        t = ops.stop_gradient(self.teacher(x, training=False))
        return hand_loss(t, y_pred, y)


def hand_epoch_tf(student, teacher, batches):
    import tensorflow as tf

    opt = keras.optimizers.Adam(1e-3)
    opt.build(student.trainable_variables)

    @tf.function
    def step(x, y):
        t = tf.stop_gradient(teacher(x, training=False))
        with tf.GradientTape() as tape:
            loss = hand_loss(t, student(x, training=True), y)
        grads = tape.gradient(loss, student.trainable_variables)
        opt.apply(grads, student.trainable_variables)
        return loss

    def epoch():
        for x, y in batches:
            loss = step(x, y)
        return float(loss)

    def one():
        return float(step(*batches[0]))

    return epoch, one


def hand_epoch_jax(student, teacher, batches):
    import jax

    opt = keras.optimizers.Adam(1e-3)
    opt.build(student.trainable_variables)
    t_vars = [v.value for v in teacher.non_trainable_variables]

    def loss_fn(tv, ntv, x, y, t):
        s, ntv = student.stateless_call(tv, ntv, x, training=True)
        return hand_loss(t, s, y), ntv

    @jax.jit
    def step(tv, ntv, ov, x, y):
        t, _ = teacher.stateless_call([], t_vars, x, training=False)
        t = jax.lax.stop_gradient(t)
        (loss, ntv), grads = jax.value_and_grad(loss_fn, has_aux=True)(tv, ntv, x, y, t)
        tv, ov = opt.stateless_apply(ov, grads, tv)
        return loss, tv, ntv, ov

    state = [
        [v.value for v in student.trainable_variables],
        [v.value for v in student.non_trainable_variables],
        [v.value for v in opt.variables],
    ]

    def epoch():
        tv, ntv, ov = state
        for x, y in batches:
            loss, tv, ntv, ov = step(tv, ntv, ov, x, y)
        state[:] = [tv, ntv, ov]
        return float(loss)

    def one():
        loss, *state[:] = step(*state, *batches[0])
        return float(loss)

    return epoch, one


def main():
    args = _harness.parse_args(__doc__.splitlines()[0])
    backend = keras.backend.backend()
    n = 512 if args.smoke else 1024 if args.quick else 8192  # --smoke (CI): 2 batches, once
    repeats = 1 if args.smoke else 2 if args.quick else 3
    rng = np.random.default_rng(0)
    x = rng.random((n, 784), dtype=np.float32)
    y = rng.integers(0, 10, n).astype("int32")
    keras.utils.set_random_seed(0)
    teacher = mlp([1024, 1024, 1024], "teacher")
    teacher.trainable = False
    rows = []

    def fit_epoch(model, target):
        return lambda: model.fit(x, target, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    online = kp.DistillationModel(
        mlp([512, 512], "student_online"), teacher, temperature=T, alpha=ALPHA
    )
    online.compile(keras.optimizers.Adam(1e-3))
    run_online = fit_epoch(online, y)
    run_online()

    if backend in ("tensorflow", "jax"):
        student = mlp([512, 512], "student_hand")
        batches = [
            (ops.convert_to_tensor(x[i : i + BATCH]), ops.convert_to_tensor(y[i : i + BATCH]))
            for i in range(0, n, BATCH)
        ]
        hand, hand_one = (hand_epoch_tf if backend == "tensorflow" else hand_epoch_jax)(
            student, teacher, batches
        )
        hand()
        ours_one = _harness.one_step(online, x[:BATCH], y[:BATCH])
        for _ in range(5):
            hand_one(), ours_one()
        steps = 16 if args.quick else 300
        res = _harness.interleaved(hand_one, ours_one, steps)
        rows.append(
            _harness.row(
                "DistillationModel step / hand-written compiled step, per step",
                res,
                "<= 1.05",
                note=f"{res['step_ms']:.1f} ms/step (hand, wall), {steps} steps each",
            )
        )
        res = _harness.abba(hand, run_online, repeats=repeats)
        rows.append(
            _harness.row(
                "DistillationModel.fit epoch / hand-written loop of the step",
                res,
                "(info)",
                note=f"n={n}, batch {BATCH}; includes fit's own loop",
            )
        )

    stock = StockStepKD(mlp([512, 512], "student_stock"), teacher)
    stock.compile(keras.optimizers.Adam(1e-3))
    run_stock = fit_epoch(stock, y)
    run_stock()
    res = _harness.abba(run_stock, run_online, repeats=repeats)
    rows.append(
        _harness.row(
            "(split) DistillationModel.fit / same math in a stock-step fit",
            res,
            "-",
            note="what our train step adds; the rest of the gap is fit itself",
        )
    )

    logits = kp.precompute_teacher_logits(teacher, x, batch_size=BATCH)
    offline = kp.DistillationModel(
        mlp([512, 512], "student_offline"), None, temperature=T, alpha=ALPHA
    )
    offline.compile(keras.optimizers.Adam(1e-3))
    run_offline = fit_epoch(offline, (y, logits))
    run_offline()
    res = _harness.abba(run_online, run_offline, repeats=repeats)
    rows.append(
        _harness.row(
            "offline epoch / online epoch (teacher ~4x student)",
            res,
            "<= 0.67",
            note=f"n={n}; precompute once: not counted",
        )
    )
    _harness.finish(rows, args)


if __name__ == "__main__":
    main()
