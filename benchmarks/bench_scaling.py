"""Scaling note: steps/s of keras-perf's train step on 1 vs 2 devices (no target).

On this project's CI machines the two "devices" are logical CPU devices (TensorFlow
`MirroredStrategy` over two logical CPUs) or XLA host devices (JAX `keras.distribution.
DataParallel` with `--xla_force_host_platform_device_count=2`) sharing the same cores: a
correctness vehicle, not a speed-up. The figure shows what the strategy machinery costs there;
on a machine with two accelerators the same script measures real scaling.

Measured: one epoch of `fit` of `kp.loss_scaled(MLP 784-512-512-10)` (Adam, float32, global
batch 256, the same global batch on 1 and 2 devices), ABBA, median. The devices must be
configured before the backend starts, so the measurement runs in a child process.
PyTorch: Keras has no data-parallel `fit` on that backend; no rows.

Run: `python -m benchmarks.bench_scaling [--quick | --smoke] [--json out.json]`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from . import _harness

BATCH = 256


def child(backend: str, quick: bool, smoke: bool = False) -> list[dict]:
    """Runs in a fresh process whose devices are configured before the backend starts."""
    import contextlib

    import keras
    import numpy as np

    import keras_perf as kp

    if backend == "tensorflow":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
        )
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        two_devices = strategy.scope
        fitting_on_two = contextlib.nullcontext  # the model keeps its strategy
        label = "MirroredStrategy, 2 logical CPU devices"
    else:
        import jax

        dist = keras.distribution.DataParallel(devices=jax.devices()[:2])

        @contextlib.contextmanager
        def two_devices():
            keras.distribution.set_distribution(dist)
            try:
                yield
            finally:
                keras.distribution.set_distribution(None)

        fitting_on_two = two_devices
        label = f"DataParallel, {len(jax.devices())} XLA host devices"

    n = 2 * BATCH if smoke else 1024 if quick else 8192  # --smoke (CI): 2 steps per epoch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 784)).astype("float32")
    y = rng.integers(0, 10, n)

    def build():
        model = kp.loss_scaled(_harness.mlp([512, 512], 784, seed=0, functional=True))
        return _harness.compile_sce(model, keras.optimizers.Adam(1e-3))

    one = build()
    with two_devices():
        two = build()

    def epoch_one():
        one.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    def epoch_two():
        with fitting_on_two():
            two.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    epoch_one(), epoch_two()  # compile both
    times: dict[str, list[float]] = {"one": [], "two": []}

    def timed(key, fn):
        def run():
            times[key].append(_harness.timed(fn)[0])

        return run

    res = _harness.abba(timed("one", epoch_one), timed("two", epoch_two), 1 if quick else 5)
    steps = -(-n // BATCH)
    sps_one = steps / sorted(times["one"])[len(times["one"]) // 2]
    sps_two = steps / sorted(times["two"])[len(times["two"]) // 2]
    return [
        _harness.row(
            f"epoch time, 2 devices / 1 device ({label})",
            res,
            "(info)",
            backend=backend,
            note=(
                f"steps/s: 1 device {sps_one:.1f}, 2 devices {sps_two:.1f}; global batch {BATCH}, "
                f"{steps} steps/epoch; devices share the CPU cores: no speed-up expected"
            ),
        )
    ]


def main() -> None:
    if "--child" in sys.argv:
        backend, quick = sys.argv[sys.argv.index("--child") + 1], "--quick" in sys.argv
        print("ROWS " + json.dumps(child(backend, quick, "--smoke" in sys.argv)))
        return
    args = _harness.parse_args(__doc__.splitlines()[0])
    import keras

    backend = keras.backend.backend()
    rows: list[dict] = []
    if backend in ("tensorflow", "jax"):
        cmd, env = _harness.module_command(__spec__.name, dict(os.environ, KERAS_BACKEND=backend))
        if backend == "jax":
            flags = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
            env["XLA_FLAGS"] = flags.strip()
        cmd += ["--child", backend]
        proc = subprocess.run(
            cmd + (["--quick"] if args.quick else []) + (["--smoke"] if args.smoke else []),
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"scaling child process failed:\n{proc.stderr[-3000:]}")
        rows = json.loads(lines[-1][len("ROWS ") :])
    else:
        print(f"{backend}: Keras has no data-parallel fit on this backend; nothing measured.")
    _harness.finish(rows, args)


if __name__ == "__main__":
    main()
