"""Pruning: step time while masks are being updated, against plain fit and against tfmot.

Claims (docs/BENCHMARKS.md):
1. `fit` with `kp.PruningCallback` in its active phase (masks recomputed every `frequency`
   steps) vs plain `fit` of the same architecture: target <= 1.10x.
2. The same against tensorflow-model-optimization's `prune_low_magnitude` + `UpdatePruningStep`
   on the same architecture under legacy tf_keras: ours / tfmot, target <= 0.77 (ours >= 1.3x
   faster). tfmot needs tf_keras, which runs on TensorFlow whatever KERAS_BACKEND says, so this
   row runs on every backend: ours on the Keras 3 backend picked, tfmot on tf_keras, in one
   process. On the TensorFlow backend two reference rows split the ratio into the framework
   loops (Keras 3 vs tf_keras) and tfmot's own cost, which bound what any callback can reach.
3. gzip size of the 80 %-sparse model's weights vs the dense model's (tfmot's tutorial: 3x).

Claim 1 is read per step: the callback's per-batch hook plus one call of the compiled train
function, against the plain model's train function, alternated step by step (1000 steps each,
10 mask updates; the updates' time is measured apart and spread over the steps). Otherwise each
timed unit is one epoch of `fit` on digits-sized data (1437 x 64 features, MLP 64-512-512-10,
batch 32: 45 steps), alternated A B B A. Run:

    KERAS_BACKEND=tensorflow python -m benchmarks.bench_pruning [--quick] [--json out.json]
"""

from __future__ import annotations

import contextlib
import gzip
import os
import tempfile
import warnings

import keras
import numpy as np

import keras_perf as kp
from keras_perf.data import load_digits_split

from ._harness import abba, compile_sce, finish, interleaved, mlp, one_step, parse_args, row

HIDDEN = 512
BATCH = 32


def data():
    """Digits in scikit-learn's order (not shuffled): train 1437, test 360."""
    (x, y), (xt, yt) = load_digits_split(seed=None, sizes=(1437,))
    return x, y, xt, yt


@contextlib.contextmanager
def active_phase():
    """Silence the callback's "schedule will not reach its target" warning, on purpose.

    The timed fits benchmark the active pruning phase: `end_step=100_000` lies far beyond
    them so that the masks are recomputed all along, and the final sparsity is never meant
    to be reached. The warning says exactly that, so it is expected here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="PruningCallback: the schedule will not reach its target",
            category=kp.KerasPerfWarning,
        )
        yield


def keras3_model():
    return mlp([HIDDEN, HIDDEN], optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"])


def tf_keras_model():
    """The same MLP under legacy tf_keras (uncompiled: see `tf_keras_compile`)."""
    import tf_keras

    return mlp([HIDDEN, HIDDEN], keras_module=tf_keras)


def tf_keras_compile(model):
    """Compile a tf_keras model as `keras3_model` compiles its Keras 3 twin."""
    import tf_keras

    return compile_sce(model, tf_keras.optimizers.Adam(1e-3), ["accuracy"], keras_module=tf_keras)


def tfmot_model(schedule_args):
    import tensorflow_model_optimization as tfmot

    schedule = tfmot.sparsity.keras.PolynomialDecay(**schedule_args)
    pruned = tfmot.sparsity.keras.prune_low_magnitude(tf_keras_model(), pruning_schedule=schedule)
    return tf_keras_compile(pruned), tfmot.sparsity.keras.UpdatePruningStep()


def per_step(x, y, schedule_args, steps: int) -> dict:
    """What the callback adds per batch, without fit's loop: single steps alternated.

    Ours: the callback's per-batch hook, then one call of the compiled train function (which
    applies the mask constraints). A mask update (every `frequency` steps) is one slow step
    that a per-block median would hide, so its time is measured apart and spread over the
    steps: ratio = median step ratio + (update time per step) / (plain step time).
    """
    import time

    plain, pruned = keras3_model(), keras3_model()
    callback = kp.PruningCallback(kp.PolynomialDecay(**schedule_args))
    plain.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, verbose=0)
    with active_phase():
        pruned.fit(
            x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, verbose=0, callbacks=[callback]
        )
        # Enter the callback's training state again, as fit does at the start of an epoch.
        callback.set_model(pruned)
        callback.on_train_begin()
        callback.on_epoch_begin(0)
    spent = {"wall": 0.0, "cpu": 0.0, "n": 0}
    update = callback._update

    def timed_update(*a, **k):
        w, c = time.perf_counter(), time.process_time()
        update(*a, **k)
        spent["wall"] += time.perf_counter() - w
        spent["cpu"] += time.process_time() - c
        spent["n"] += 1

    callback._update = timed_update
    xb, yb = x[:BATCH], y[:BATCH]
    step_plain, step_pruned = one_step(plain, xb, yb), one_step(pruned, xb, yb)

    def step_ours():
        callback.on_train_batch_begin(0)
        return step_pruned()

    for _ in range(3):
        step_plain(), step_pruned()
    res = interleaved(step_plain, step_ours, steps)
    callback.on_train_end()
    extra = spent["wall"] * 1e3 / steps / res["step_ms"]
    extra_cpu = spent["cpu"] * 1e3 / steps / max(res["step_cpu_ms"], 1e-9)
    res["wall_ratio"] += extra
    res["cpu_ratio"] += extra_cpu
    res["wall_spread"] = tuple(v + extra for v in res["wall_spread"])
    res["cpu_spread"] = tuple(v + extra_cpu for v in res["cpu_spread"])
    res["note"] = (
        f"{res['step_ms']:.2f} ms/step plain (wall), {steps} steps each; {spent['n']} mask "
        f"updates, {1e3 * spent['wall'] / max(spent['n'], 1):.1f} ms each, "
        f"+{extra:.3f} wall, +{extra_cpu:.3f} CPU spread over the steps"
    )
    return res


def gzip_bytes(model) -> int:
    """gzip size of the model's weights alone (as tfmot's tutorial: no optimizer state)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "weights.npz")
        np.savez(path, *model.get_weights())
        with open(path, "rb") as f:
            return len(gzip.compress(f.read(), compresslevel=9))


def main():
    args = parse_args(__doc__.splitlines()[0])
    x, y, xt, yt = data()
    if args.smoke:  # CI: 8 steps per epoch instead of 45, one of each fit
        x, y = x[: 8 * BATCH], y[: 8 * BATCH]
    repeats = 1 if args.quick else 5
    # Active phase for the whole run: end_step far away, masks recomputed every 100 steps.
    schedule_args = dict(
        initial_sparsity=0.0, final_sparsity=0.8, begin_step=0, end_step=100_000, frequency=100
    )
    rows = []

    plain = keras3_model()
    pruned = keras3_model()
    callback = kp.PruningCallback(kp.PolynomialDecay(**schedule_args))

    def fit_plain():
        plain.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

    updates = []

    def fit_pruned():
        with active_phase():
            pruned.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[callback])
        updates.append(len(callback.history))

    fit_plain()  # warm-up: compile both steps
    fit_pruned()
    result = abba(fit_plain, fit_pruned, repeats=repeats)
    n_fits, n_updates = len(updates), sum(updates)
    rows.append(
        row(
            "PruningCallback fit (active phase) / plain fit, whole epochs",
            result,
            "(info)",
            note=f"MLP 64-{HIDDEN}-{HIDDEN}-10, 45 steps/epoch, {n_updates} mask updates in {n_fits} pruned epochs",
        )
    )

    steps = 8 if args.smoke else 200 if args.quick else 1000
    result = per_step(x, y, schedule_args, steps)
    rows.append(
        row(
            "PruningCallback step / plain step, per step (active phase)",
            result,
            "<= 1.10",
            note=result["note"],
        )
    )

    # tfmot runs on tf_keras (TensorFlow) whichever Keras 3 backend runs ours.
    theirs, update_step = tfmot_model(schedule_args)

    def fit_tfmot():
        theirs.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[update_step])

    fit_tfmot()
    result = abba(fit_tfmot, fit_pruned, repeats=repeats)
    rows.append(
        row(
            f"PruningCallback fit (Keras 3, {keras.backend.backend()}) / tfmot "
            "prune_low_magnitude fit (tf_keras)",
            result,
            "<= 0.77",
            note="same MLP, schedule and data; tfmot wraps layers, ours is a callback",
        )
    )
    if keras.backend.backend() == "tensorflow":
        legacy = tf_keras_compile(tf_keras_model())

        def fit_legacy():
            legacy.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

        fit_legacy()
        loop = abba(fit_legacy, fit_plain, repeats=repeats)
        rows.append(
            row(
                "(reference) plain Keras 3 fit / plain tf_keras fit",
                loop,
                "-",
                note="framework loop difference inside the row above",
            )
        )
        # tfmot's whole pruning cost over its own loop. Ours runs on Keras 3's loop and costs at
        # least plain Keras 3 fit, so ours / tfmot >= (Keras 3 / tf_keras) / (tfmot / tf_keras).
        cost = abba(fit_legacy, fit_tfmot, repeats=repeats)
        bound = loop["cpu_ratio"] / cost["cpu_ratio"]
        rows.append(
            row(
                "(reference) tfmot fit / plain tf_keras fit",
                cost,
                "-",
                note=(
                    "tfmot's own pruning overhead; lowest ours/tfmot reachable with a "
                    f"zero-cost callback on Keras 3 (CPU): {bound:.3f}"
                ),
            )
        )

    # Size: dense vs 80 % sparse (stripped), same architecture and training budget.
    epochs = 1 if args.smoke else 2 if args.quick else 8
    dense = keras3_model()
    dense.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    sparse = keras3_model()
    steps = epochs * 45
    sparse_cb = kp.PruningCallback(
        kp.PolynomialDecay(0.0, 0.8, 0, int(steps * 0.6) // 10 * 10, frequency=10)
    )
    sparse.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[sparse_cb])
    kp.strip_pruning(sparse)
    dense_acc = dense.evaluate(xt, yt, verbose=0)[1]
    sparse_acc = sparse.evaluate(xt, yt, verbose=0)[1]
    dense_size, sparse_size = gzip_bytes(dense), gzip_bytes(sparse)
    ratio = sparse_size / dense_size
    rows.append(
        row(
            "gzip(weights) 80 %-sparse / dense",
            {"wall_ratio": ratio, "cpu_ratio": None, "repeats": 1},
            "<= 0.33",
            note=(
                f"{sparse_size} / {dense_size} bytes ({1 / ratio:.2f}x smaller); "
                f"sparsity {kp.sparsity_report(sparse)['total']['sparsity']:.3f}; "
                f"test acc dense {dense_acc:.4f} sparse {sparse_acc:.4f} ({epochs} epochs)"
            ),
        )
    )
    finish(rows, args)


if __name__ == "__main__":
    main()
