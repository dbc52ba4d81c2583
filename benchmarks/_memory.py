"""Activation memory of one training step, `microbatches=k` vs 1, measured without a GPU.

On an accelerator the figure to read is the device's peak memory (`bench_train_step.py` does
that where one is present). On a CPU this script measures what each backend can report
exactly, for an MLP 784-1024-1024-10 (Adam, float32) trained with `kp.loss_scaled`:

- TensorFlow: the peak of TensorFlow's own CPU allocator during one call of the compiled
  train function (`tf.config.experimental.get_memory_info("CPU:0")`, which counts only with
  the BFC allocator: this script sets `TF_CPU_ALLOCATOR_USE_BFC=true` before TensorFlow is
  imported, so run it as its own process).
- JAX: the scratch ("temp") buffers XLA assigns to the compiled train step
  (`jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes`): activations,
  gradients, accumulators and optimizer temporaries, as the buffer assigner lays them out.
- PyTorch: the peak of the tensors autograd holds for the backward pass (hooked with
  `torch.autograd.graph.saved_tensors_hooks`, each storage counted once, weights and input
  data excluded): the activations alone.

TensorFlow's peak depends on the order its executor runs independent ops in. With several
inter-op threads (its default) that order follows the machine's load; `--tf-inter-op-threads 1`
runs one op at a time, which repeats within a traced function but still differs from one
trace to the next (MLP at microbatches=4, batch 8192: 32.7-42.6 MB over five new models in
one process, about one slice's activation more or less). So each TensorFlow figure is the
median over `--repeats` new models (3 by default). The other two counts repeat exactly.

The TensorFlow and JAX totals include what does not grow with the batch (the gradients,
and with k > 1 the accumulators), so each is taken at two batch sizes and the activation
memory is read as the growth per example: (M(b2) - M(b1)) / (b2 - b1). The ratio of that
growth at k = 1 and k = 4 is the reported figure; an ideal k-way split gives 4.

Run: `python -m benchmarks._memory [--microbatches 4] [--batches 1024 8192]
[--tf-inter-op-threads N] [--repeats 3]`; prints one JSON object. Every number is a byte
count from the framework, not a timing.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    # Must precede the import of TensorFlow: only the BFC allocator keeps CPU statistics.
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    # oneDNN's kernels keep scratch buffers of their own, which made the peak vary by
    # megabytes from run to run; TensorFlow's Eigen kernels do not.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"

import argparse  # noqa: E402
import json  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_perf as kp  # noqa: E402

from ._harness import compile_sce, mlp  # noqa: E402

WHAT = {
    "tensorflow": "TF CPU allocator peak during one compiled step (BFC)",
    "jax": "XLA temp buffers of the compiled step",
    "torch": "peak of tensors saved for backward",
}


def _model(microbatches: int) -> keras.Model:
    model = mlp([1024, 1024], 784, seed=0, functional=True)
    model = kp.loss_scaled(model, microbatches=microbatches)
    return compile_sce(model, keras.optimizers.Adam(1e-3))


def _data(batch: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 784)).astype("float32")
    return x, rng.integers(0, 10, batch).astype("int32")


def _tensorflow(model, x, y) -> int:
    import tensorflow as tf

    data = (tf.constant(x), tf.constant(y))
    model.train_function(iter([data]))  # traced and warm
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    model.train_function(iter([data]))
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - base


def _jax(model, x, y) -> int:
    import jax

    state = tuple(
        [v.value for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )
    compiled = jax.jit(model.train_step).lower(state, (x, y)).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _torch(model, x, y) -> int:
    import torch

    # The counter kp.find_max_batch_size measures a step with on a CPU.
    from keras_perf.backend.torch import SavedTensorsPeak

    saved = SavedTensorsPeak(v.value.untyped_storage().data_ptr() for v in model.variables)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    return saved.peak


def step_memory(microbatches: int, batch: int, repeats: int = 1) -> int:
    """Bytes the backend's measure gives for one step at this batch size (see the docstring).

    On TensorFlow the median over `repeats` new models (its peak differs between traces); JAX
    and torch count the same bytes every time, so they measure once.
    """
    if keras.backend.backend() == "tensorflow" and repeats > 1:
        return int(np.median([step_memory(microbatches, batch) for _ in range(repeats)]))
    model = _model(microbatches)
    x, y = _data(batch)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # builds weights, optimizer, step
    measure = {"tensorflow": _tensorflow, "jax": _jax, "torch": _torch}[keras.backend.backend()]
    return measure(model, x, y)


def activation_memory(
    microbatches: int = 4, batches: tuple[int, int] = (1024, 8192), repeats: int = 3
) -> dict:
    """Per-example growth of step memory at 1 and `microbatches` slices, and their ratio."""
    b1, b2 = batches
    out = {
        "backend": keras.backend.backend(),
        "what": WHAT[keras.backend.backend()],
        "batches": [b1, b2],
    }
    for k in (1, microbatches):
        m1, m2 = step_memory(k, b1, repeats), step_memory(k, b2, repeats)
        out[f"bytes_k{k}"] = [m1, m2]
        out[f"per_example_k{k}"] = (m2 - m1) / (b2 - b1)
    out["microbatches"] = microbatches
    out["ratio"] = out["per_example_k1"] / out[f"per_example_k{microbatches}"]
    out["total_ratio_at_b2"] = out["bytes_k1"][1] / out[f"bytes_k{microbatches}"][1]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs=2, default=(1024, 8192))
    parser.add_argument(
        "--tf-inter-op-threads",
        type=int,
        default=0,
        help="TensorFlow only: inter-op threads (0: TensorFlow's default, as users run it; "
        "1: one op at a time, so the executor's order no longer follows the machine's load)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="TensorFlow only: new models per figure, the median taken (its peak differs "
        "between traces)",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if keras.backend.backend() == "tensorflow" and args.tf_inter_op_threads:
        import tensorflow as tf

        tf.config.threading.set_inter_op_parallelism_threads(args.tf_inter_op_threads)
    result = activation_memory(args.microbatches, tuple(args.batches), args.repeats)
    if result["backend"] == "tensorflow":
        result["tf_inter_op_threads"] = args.tf_inter_op_threads or "default"
        result["repeats"] = args.repeats
    print(json.dumps(result))


if __name__ == "__main__":
    main()
