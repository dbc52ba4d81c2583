"""Claim: keras-perf's train step costs no more than stock Keras `fit`, and micro-batching is cheap.

Measured, on the backend picked by KERAS_BACKEND, in one process, alternated (per step or ABBA), median:

1. `loss_scaled(model)` vs the same architecture under stock Keras (float32 policy), for an
   MLP 784-1024-1024-10 and a small CNN, batch 128. Target <= 1.03x, read on single steps:
   the compiled train function `fit` calls per batch, ours and stock alternated step by step
   (400 steps each; 200 for the CNN), median step time per block of 50, median over blocks.
   Also shown, without a target: whole epochs of `fit` ABBA (64 steps, 5 repeats), where
   fit's own loop is shared and machine noise of a few percent is not resolved.
2. `microbatches=4` vs `microbatches=1` of our step on the MLP, batch 512 (slices of 128 rows,
   the regime micro-batching is for: a batch too big for memory), per step as in 1 (160
   steps each), and on the small CNN at batch 512 (60 steps each), whose activations outweigh
   its weights. Target <= 1.25x on CPU.
   Also at batch 2048 (slices of 512 rows, 40 steps each), same target: there a fixed cost per
   slice, such as eager torch's Python, is spread over more rows.
   Also shown, without a target: batch 128 (slices of 32 rows), where CPU matrix products
   lose efficiency on thin slices; for scale, stock `fit` on 4x smaller batches costs
   about 2.6x per epoch on the same machine (it also runs 4x the optimizer updates).
0. Noise floor, no target: stock against an identical second stock model (A/A), per step
   and per epoch. On a shared CPU its spread shows how far apart two runs of the same work
   land; a claim whose ratio sits inside it is not resolved by this machine.
3. Activation memory, `microbatches=4` vs 1. Target >= 2x lower. On a GPU/TPU: peak device
   memory of one training step on an activation-heavy MLP (batch 1024, 4 x 4096 hidden). On
   a CPU: benchmarks/_memory.py in its own process, which reads each backend's own byte
   counts (TF allocator peak, XLA temp buffers, tensors saved for backward) at batches 1024
   and 8192 and reports the ratio of their growth per example (a count, not a timing); on
   TF the median over 3 new models (one under `--quick`), and in a full run also with one
   inter-op thread, where its peak no longer follows the machine's load.
4. The bare-framework floor, no target: the same MLP written as a hand-written training step
   on the backend itself (benchmarks/_floors.py: `tf.function`, `jax.jit`, torch eager, Adam),
   timed the same way. (a) with vs without the non-finite check (global gradient norm, update
   only if finite), batch 128: what that check costs on the framework alone, against claim 1's
   MLP; (b) 4 accumulated slices vs 1 batch of 512: what gradient accumulation costs on the
   framework alone, against claim 2. Then, for the rows the framework under Keras decides:
   (c) JAX: the small CNN in bare JAX, 4 slices in `lax.scan` (and unrolled) vs 1 batch of
   512, against claim 2's CNN row (XLA:CPU and convolution gradients in loop bodies,
   jax-ml/jax#12868); (d) torch: gradient accumulation written by hand around the same
   Keras model, 4 slices vs 1 at batch 512, against claim 2's MLP row.

Run: `python -m benchmarks.bench_train_step [--quick | --smoke] [--json out.json]`.
"""

from __future__ import annotations

import keras
import numpy as np

import keras_perf as kp
from keras_perf import backend as kb

from . import (
    _floors,
    _harness,
)


def mlp(width: int = 1024, depth: int = 2, inputs: int = 784) -> keras.Model:
    return _harness.mlp([width] * depth, inputs, functional=True)


def cnn() -> keras.Model:
    inp = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(16, 3, activation="relu")(inp)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(32, 3, activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


def compiled(model: keras.Model) -> keras.Model:
    return _harness.compile_sce(model, keras.optimizers.Adam(1e-3))


def epoch(model, x, y, batch_size):
    return lambda: model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)


def pair(build, same):
    """Stock model and ours (or a second stock model) with the same initial weights."""
    keras.utils.set_random_seed(0)
    stock = compiled(build())
    keras.utils.set_random_seed(0)
    ours = compiled(build()) if same else kp.loss_scaled(compiled(build()))
    return stock, ours


def overhead(name, build, x, y, batch_size, repeats, same=False):
    """Whole epochs of fit, ABBA: the step plus fit's own loop, which both share."""
    stock, ours = pair(build, same)
    a, b = epoch(stock, x, y, batch_size), epoch(ours, x, y, batch_size)
    a(), b()  # compile both before timing
    res = _harness.abba(a, b, repeats)
    if same:
        return _harness.row(
            f"(noise floor) stock fit vs identical stock fit, epochs ({name})", res, "-"
        )
    return _harness.row(f"train step vs stock fit, whole epochs ({name})", res, "(info)")


def per_step(baseline, candidate, x, y, batch_size, steps):
    """Single compiled train steps (the functions fit calls), alternated step by step."""
    for model in (baseline, candidate):
        model.fit(x[: 2 * batch_size], y[: 2 * batch_size], batch_size=batch_size, verbose=0)
    a = _harness.one_step(baseline, x[:batch_size], y[:batch_size])
    b = _harness.one_step(candidate, x[:batch_size], y[:batch_size])
    for _ in range(3):
        a(), b()
    return _harness.interleaved(a, b, steps)


def step_overhead(name, build, x, y, batch_size, steps, same=False):
    res = per_step(*pair(build, same), x, y, batch_size, steps)
    note = f"{res['step_ms']:.1f} ms/step (stock, wall), {steps} steps each"
    if same:
        return _harness.row(
            f"(noise floor) stock step vs identical stock step ({name})", res, "-", note=note
        )
    return _harness.row(f"train step vs stock step, per step ({name})", res, "<= 1.03", note=note)


def microbatch_cost(x, y, batch_size, steps, target="<= 1.25", build=mlp, name="MLP"):
    """Single compiled steps of microbatches=4 vs 1, alternated step by step."""
    keras.utils.set_random_seed(0)
    one = kp.loss_scaled(compiled(build()))
    keras.utils.set_random_seed(0)
    four = kp.loss_scaled(compiled(build()), microbatches=4)
    res = per_step(one, four, x, y, batch_size, steps)
    note = f"{res['step_ms']:.1f} ms/step (microbatches=1, wall), {steps} steps each"
    return _harness.row(
        f"microbatches=4 vs 1 step time ({name}, batch {batch_size})", res, target, note=note
    )


def floor_rows(x, y, steps: int) -> list[dict]:
    """Hand-written steps on the bare backend: the cost of the same extra work without Keras."""
    n = len(x)
    plain = _floors.raw_step(x[:128], y[:128])
    checked = _floors.raw_step(x[:128], y[:128], check=True)
    res = _harness.interleaved(plain, checked, steps)
    rows = [
        _harness.row(
            "(floor) hand-written step + non-finite check vs hand-written step (MLP, batch 128)",
            res,
            "-",
            note=f"{res['step_ms']:.1f} ms/step unchecked; read against the MLP row's <= 1.03",
        )
    ]
    if n >= 512:
        one = _floors.raw_step(x[:512], y[:512])
        four = _floors.raw_step(x[:512], y[:512], slices=4)
        res = _harness.interleaved(one, four, max(steps * 2 // 5, 8))
        rows.append(
            _harness.row(
                "(floor) hand-written 4 accumulated slices vs 1 batch (MLP, batch 512)",
                res,
                "-",
                note=f"{res['step_ms']:.1f} ms/step one batch; read against microbatches' <= 1.25",
            )
        )
    return rows


def framework_rows(x, y, x_img, steps: int) -> list[dict]:
    """Floors for the rows whose ratio the framework under Keras sets (see the module docstring)."""
    backend = keras.backend.backend()
    rows = []
    if backend == "jax" and len(x_img) >= 512:
        one = _floors.raw_cnn_step(x_img[:512], y[:512])
        for loop in ("scan", "unrolled"):
            four = _floors.raw_cnn_step(x_img[:512], y[:512], slices=4, loop=loop)
            res = _harness.interleaved(one, four, steps)
            rows.append(
                _harness.row(
                    f"(floor) bare-JAX CNN, 4 slices ({loop}) vs 1 batch (batch 512)",
                    res,
                    "-",
                    note=f"{res['step_ms']:.1f} ms/step one batch; read against the CNN "
                    "microbatches row",
                )
            )
    if backend == "torch" and len(x) >= 512:
        models = []
        for slices in (1, 4):
            keras.utils.set_random_seed(0)
            model = compiled(mlp())
            model.fit(x[:512], y[:512], batch_size=512, verbose=0)
            models.append(_floors.keras_loop_step(model, x[:512], y[:512], slices))
        res = _harness.interleaved(*models, steps)
        rows.append(
            _harness.row(
                "(floor) accumulation by hand through Keras on torch, 4 slices vs 1 (MLP, batch 512)",
                res,
                "-",
                note=f"{res['step_ms']:.1f} ms/step one batch; read against the MLP microbatches row",
            )
        )
    return rows


def peak_memory(microbatches: int) -> int | None:
    keras.utils.set_random_seed(0)
    model = kp.loss_scaled(compiled(mlp(4096, 4, 4096)), microbatches=microbatches)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 4096)).astype("float32")
    y = rng.integers(0, 10, 1024)
    model.fit(x, y, batch_size=1024, epochs=1, verbose=0)  # compile, allocate weights
    kb.clear_memory()
    kb.reset_peak_memory()
    base = kb.memory_stats()
    model.fit(x, y, batch_size=1024, epochs=1, verbose=0)
    stats = kb.memory_stats()
    if not stats or stats.get("peak_bytes") is None:
        return None
    return stats["peak_bytes"] - (base or {}).get("current_bytes", 0)


def cpu_activation_memory(*extra: str, target: str = ">= 2", batches=("1024", "8192")) -> dict:
    """Row for claim 3 on a CPU, from benchmarks._memory run as its own process (at `batches`:
    also under --quick, byte counts cost seconds, not minutes; --smoke counts at 512 and
    2048)."""
    import json
    import subprocess

    cmd, env = _harness.module_command(f"{__package__}._memory")
    out = subprocess.run(
        [*cmd, "--batches", *batches, *extra],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    res = json.loads(out.strip().splitlines()[-1])
    k1, k4 = res["per_example_k1"], res["per_example_k4"]
    threads = {"default": ", TF's default inter-op threads", 1: ", one inter-op thread"}.get(
        res.get("tf_inter_op_threads"), ""
    )
    return _harness.row(
        f"activation memory per example, microbatches=1 / 4 (CPU: {res['what']}{threads})",
        {"wall_ratio": res["ratio"], "cpu_ratio": None, "repeats": 1},
        target,
        note=(
            f"{k1:,.0f} vs {k4:,.0f} bytes per example; whole step at batch {batches[1]}: "
            f"{res['total_ratio_at_b2']:.2f}x lower (ratio in wall column)"
        ),
    )


def main() -> None:
    args = _harness.parse_args(__doc__.splitlines()[0])
    n = 512 if args.quick else 8192
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, n)
    x_flat = rng.normal(size=(n, 784)).astype("float32")
    x_img = x_flat.reshape(n, 28, 28, 1)
    # --smoke (CI): 4 interleaved steps of each pair (2 of the micro-batched ones), the memory
    # count at batches 512 and 2048: the same rows, figures that prove nothing.
    steps = 4 if args.smoke else 16 if args.quick else 400
    rows = [] if args.quick else [step_overhead("MLP", mlp, x_flat, y, 128, steps, same=True)]
    rows += [
        step_overhead("MLP 784-1024-1024-10", mlp, x_flat, y, 128, steps),
        step_overhead("small CNN", cnn, x_img, y, 128, steps // 2 if steps > 16 else steps),
    ]
    if not args.quick:
        rows += [
            overhead("MLP", mlp, x_flat, y, 128, 5, same=True),
            overhead("MLP 784-1024-1024-10", mlp, x_flat, y, 128, 5),
            overhead("small CNN", cnn, x_img, y, 128, 5),
        ]
    micro_steps = 2 if args.smoke else 8 if args.quick else 160
    rows.append(microbatch_cost(x_flat, y, 512, micro_steps))
    # The activation-heavy case micro-batching is for: the CNN's activations outweigh its
    # weights, so slicing adds little weight-gradient work (on JAX it shows the cost of the
    # loop that keeps one slice alive at a time; see docs/BENCHMARKS.md).
    rows.append(microbatch_cost(x_img, y, 512, min(micro_steps, 60), build=cnn, name="small CNN"))
    if not args.quick:
        # Slices of 512 rows: the fixed cost per slice (Python on eager torch) is spread wider.
        rows.append(microbatch_cost(x_flat, y, 2048, 40))
        rows.append(microbatch_cost(x_flat, y, 128, 200, target="(info)"))
    rows += floor_rows(x_flat, y, steps)
    if not args.quick:
        rows += framework_rows(x_flat, y, x_img, 40 if keras.backend.backend() == "jax" else 160)
    if not kb.has_accelerator():
        # --quick: one trace per TF figure (a smoke run; three cost about 45 s more).
        rows.append(
            cpu_activation_memory(
                *(("--repeats", "1") if args.quick else ()),
                **({"batches": ("512", "2048")} if args.smoke else {}),
            )
        )
        if keras.backend.backend() == "tensorflow" and not args.quick:
            # The same with one op at a time: TensorFlow's peak then no longer follows the load.
            rows.append(cpu_activation_memory("--tf-inter-op-threads", "1", target="(info)"))
    else:
        p1, p4 = peak_memory(1), peak_memory(4)
        if p1 and p4:
            res = {"wall_ratio": p1 / p4, "cpu_ratio": None, "repeats": 1}
            rows.append(
                _harness.row(
                    "peak step memory, microbatches=1 / 4 (GPU)",
                    res,
                    ">= 2",
                    note=f"{p1 / 2**20:.0f} MiB vs {p4 / 2**20:.0f} MiB (ratio in wall column)",
                )
            )
    _harness.finish(rows, args)


if __name__ == "__main__":
    main()
