"""The changes `diagnose` tries: each applies to a twin (or a copy of the data) and is timed.

One function per change, listed in `DATA_CHANGES` and `COMPILE_CHANGES` in the order they are
offered: each takes the run's context and a list of notes, and returns the `Change` to time
where it applies (backend, kind of input, current settings), else None, with a note saying
why where that is worth knowing. `candidates` walks the two lists; a new change is one new
function added to one of them. The timing itself lives in `_trial.py`: a warm-up fit (traces
the changed train function), then a fit timed from its start.
"""

from __future__ import annotations

import keras

from keras_perf import backend as _backend
from keras_perf.diagnosis._measure import compile_twin


class Change:
    """One what-if: `apply()` changes the twin or the data, `undo()` puts it back.

    `fit_kwargs` is what to pass to `fit` while the change is applied; `examples_per_step`
    the batch size it trains with (for examples/s).
    """

    def __init__(
        self,
        change,
        how,
        fit_kwargs,
        examples_per_step,
        apply=None,
        undo=None,
        steps_multiple=1,
        retraces=True,
        on_oom=None,
        trace_factor=None,
    ):
        self.change = change
        # The cost of its warm-up as a multiple of the first trace (a new model, an XLA
        # compile), where a retrace of the train function would underestimate it; else None.
        self.trace_factor = trace_factor
        # Called when the change runs out of memory: the change to time instead, or None.
        self.on_oom = on_oom
        self.retraces = retraces  # False: same shapes and train function (data-side changes)
        self.how = how
        self.fit_kwargs = fit_kwargs
        self.examples_per_step = examples_per_step
        self._apply = apply
        self._undo = undo
        self.steps_multiple = steps_multiple

    def apply(self):
        """Apply the change; returns the model to time when it is not the twin itself."""
        if self._apply is not None:
            return self._apply()
        return None

    def undo(self):
        if self._undo is not None:
            self._undo()


# Data side: the input (a copy of it, or its reading) and the batch size.


def _pydataset_workers(ctx, notes) -> Change | None:
    """A PyDataset read by 4 worker threads, where it has fewer."""
    if ctx.source.kind != "PyDataset":
        return None
    ds = ctx.source.x
    workers, multi = ds.workers, ds.use_multiprocessing
    if workers >= 4:
        return None

    def set_workers(ds=ds):
        ds.workers = 4

    def reset_workers(ds=ds, w=workers, m=multi):
        ds.workers, ds.use_multiprocessing = w, m

    return Change(
        "PyDataset workers=4",
        f"{type(ds).__name__}(..., workers=4)  # threads; passed to keras.utils.PyDataset.__init__",
        ctx.base_fit_kwargs,
        ctx.batch_size,
        set_workers,
        reset_workers,
        retraces=False,
    )


def _tf_data_prefetch(ctx, notes) -> Change | None:
    """`prefetch(AUTOTUNE)` last in a tf.data pipeline that does not end with one."""
    ds = ctx.source.x
    if ctx.source.kind != "tf.data" or type(ds).__name__ == "_PrefetchDataset":
        return None
    return Change(
        "tf.data prefetch",
        "dataset = dataset.prefetch(tf.data.AUTOTUNE)  # last in the pipeline",
        {"x": _backend.tf_data_tuned(ds)},
        ctx.batch_size,
        retraces=False,
    )


def _tf_data_parallel_map(ctx, notes) -> Change | None:
    """`num_parallel_calls=AUTOTUNE` for a tf.data pipeline with a map that is not parallel."""
    ds = ctx.source.x
    if ctx.source.kind != "tf.data" or not _backend.tf_data_has_stage(ds, "MapDataset"):
        return None
    return Change(
        "tf.data parallel map",
        "dataset = dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)",
        {"x": _backend.tf_data_tuned(ds, parallel_map=True)},
        ctx.batch_size,
        retraces=False,
    )


def _tf_data_cache(ctx, notes) -> Change | None:
    """`dataset.cache()`, when the pipeline is finite and one pass fits in the time budget.

    Its gain shows from the second pass on, so the cache is filled (one whole pass, untimed)
    before the timed fit. The cache is measured at the end of the pipeline, an upper bound on
    a cache placed before shuffling and random augmentation, where it belongs.
    """
    ds = ctx.source.x
    if ctx.source.kind != "tf.data" or _backend.tf_data_has_stage(ds, "CacheDataset"):
        return None
    batches = int(ds.cardinality())
    if batches <= 0:
        notes.append("tf.data cache not tried: the dataset is infinite or of unknown length.")
        return None
    fill_s = ctx.input_per_batch * batches
    if fill_s > ctx.max_seconds / 4:
        notes.append(
            f"tf.data cache not tried: filling it takes one pass over {batches} batches "
            f"(about {fill_s:.0f} s), more than a quarter of max_seconds."
        )
        return None
    cached = _backend.tf_data_tuned(ds, cache=True)

    def fill(cached=cached):
        for _ in cached:  # one full pass fills tf.data's in-memory cache for later iterators
            pass

    how = "dataset = dataset.cache()  # after the deterministic stages, before shuffle"
    if _backend.tf_data_has_stage(ds, "ShuffleDataset"):
        how += "; measured with the cache last, an upper bound"
    return Change("tf.data cache", how, {"x": cached}, ctx.batch_size, fill, retraces=False)


def _larger_batch(ctx, notes) -> Change | None:
    """Twice the batch size, for arrays with at least 2 such batches; micro-batched instead
    where memory is the limit (or where the larger batch runs out of memory)."""
    source, B = ctx.source, ctx.batch_size
    if source.kind != "arrays" or source.examples // (2 * B) < 2:
        return None
    big = 2 * B
    if not ctx.larger_batch_fits:
        notes.append(
            f"batch_size={big} not tried as it is: memory is the limit (peak "
            f"{ctx.peak_memory_bytes / 2**20:,.0f} MiB of {ctx.device_bytes / 2**20:,.0f} "
            f"MiB); micro-batched instead."
        )
        return microbatch_change(ctx, big, notes)
    return Change(
        f"batch_size={big}",
        f"model.fit(..., batch_size={big})  # changes the optimisation: retune the learning rate",
        source.fit_kwargs(batch_size=big),
        big,
        on_oom=lambda: microbatch_change(ctx, big, notes),
    )


# Compile side: the twin recompiled.


def _compiles_in_graph(ctx) -> bool:
    """TensorFlow or JAX, not run eagerly: where `steps_per_execution` and XLA apply."""
    return keras.backend.backend() in ("tensorflow", "jax") and not ctx.compile_args.get(
        "run_eagerly"
    )


def _steps_per_execution(ctx, notes) -> Change | None:
    """Several steps per call of the train function (32, or fewer for a short measurement)."""
    twin, args, n = ctx.twin, ctx.compile_args, ctx.steps
    if keras.backend.backend() == "torch":
        notes.append("steps_per_execution not offered: Keras refuses it on the torch backend.")
        return None
    if not _compiles_in_graph(ctx):
        return None
    current = int(args.get("steps_per_execution") or 1)
    k = 32 if n >= 64 else max(2, 2 ** ((max(n // 2, 2)).bit_length() - 1))
    if current >= k:
        return None
    return Change(
        f"steps_per_execution={k}",
        f"model.compile(..., steps_per_execution={k})",
        ctx.base_fit_kwargs,
        ctx.batch_size,
        lambda k=k: compile_twin(twin, args, steps_per_execution=k),
        lambda: compile_twin(twin, args),
        steps_multiple=k,
    )


def _jit_compile(ctx, notes) -> Change | None:
    """XLA (`jit_compile=True`) on TensorFlow and JAX, where the twin does not use it yet."""
    twin, args = ctx.twin, ctx.compile_args
    if twin.jit_compile:
        return None
    if keras.backend.backend() == "torch":
        notes.append(
            "jit_compile=True (torch.compile) not measured: its first compile can take longer "
            "than the whole time budget."
        )
        return None
    if not _compiles_in_graph(ctx):
        return None
    return Change(
        "jit_compile=True",
        "model.compile(..., jit_compile=True)",
        ctx.base_fit_kwargs,
        ctx.batch_size,
        lambda: compile_twin(twin, args, jit_compile=True),
        lambda: compile_twin(twin, args),
        # XLA's first compile: 1.6-3.3x the first plain trace of an MLP or small CNN
        # on TensorFlow (CPU), where a plain retrace costs a tenth of it.
        trace_factor=4.0,
    )


def _mixed_precision(ctx, notes) -> Change | None:
    """A float32 twin's half-precision policy: the device rule's on a GPU or TPU; on a CPU
    `mixed_bfloat16` where the step is compute-bound and `kp.precision_report()` (if it has
    run) or the CPU's bfloat16 units say it may pay. Timed on the user's model like every
    change, so a loss shows as one."""
    from keras_perf.mixed_precision import auto_policy
    from keras_perf.precision import cpu_policy_to_try

    twin = ctx.twin
    if not _backend.has_accelerator():
        if ctx.bottleneck != "compute":
            return None  # The step's arithmetic is not what limits this run.
        policy, reason = cpu_policy_to_try()
        if policy is None:
            notes.append(f"mixed precision not offered on this CPU: {reason}.")
            return None
    else:
        policy = auto_policy()  # the device rule: bfloat16 from Ampere on, float16 on 7.x
    if policy == "float32":
        notes.append(
            "mixed precision not offered: this GPU has no float16 tensor cores (compute "
            "capability below 7.0), where float16 does not run faster."
        )
        return None
    if twin.dtype_policy.name != "float32":
        return None
    return Change(
        f"mixed precision ({policy})",
        f"kp.setup_mixed_precision('{policy}')  # before building the model",
        ctx.base_fit_kwargs,
        ctx.batch_size,
        lambda: ctx.use_mixed_twin(policy),
        ctx.drop_mixed_twin,
        # A new model, traced anew (with XLA on TensorFlow where the twin uses it).
        trace_factor=4.0 if keras.backend.backend() == "tensorflow" and twin.jit_compile else 1.0,
    )


# The changes in the order they are offered (and their notes written). Data-side changes touch
# the input or the batch; compile-side ones recompile the twin, which needs a clone of the model.
DATA_CHANGES = (
    _pydataset_workers,
    _tf_data_prefetch,
    _tf_data_parallel_map,
    _tf_data_cache,
    _larger_batch,
)
COMPILE_CHANGES = (_steps_per_execution, _jit_compile, _mixed_precision)


def candidates(ctx) -> tuple[list[Change], list[str]]:
    """The changes that apply to this model, data and backend; and notes on those that do not."""
    out, notes = [], []
    for offer in DATA_CHANGES:
        change = offer(ctx, notes)
        if change is not None:
            out.append(change)
    if not ctx.can_recompile:
        notes.append("compile-side changes not tried: Keras could not clone this model.")
        return out, notes
    for offer in COMPILE_CHANGES:
        change = offer(ctx, notes)
        if change is not None:
            out.append(change)
    return out, notes


def microbatch_change(ctx, big, notes) -> Change | None:
    """A batch of `big` in slices of the current batch (`kp.loss_scaled(..., microbatches=k)`):
    the examples/s of the larger batch at about the activation memory of the current one."""
    from keras_perf.train_step import LossScaleTrainStep, loss_scaled

    twin, B = ctx.twin, ctx.batch_size
    name = f"batch_size={big}, micro-batched"
    if not ctx.can_recompile:
        notes.append(f"{name} not tried: Keras could not clone this model.")
        return None
    current = twin.microbatches if isinstance(twin, LossScaleTrainStep) else 1
    if not isinstance(twin, LossScaleTrainStep) and not _backend.is_functional(twin):
        notes.append(
            f"{name} not tried: kp.loss_scaled takes Sequential and Functional models; a "
            "subclassed model gets micro-batching from `class M(kp.LossScaleTrainStep, "
            "keras.Model)`."
        )
        return None
    k = 2 * current
    held = {}

    def apply():
        if isinstance(twin, LossScaleTrainStep):
            twin.microbatches = k
            return twin
        # The twin's layers behind keras-perf's train step, compiled as the twin is, with the
        # twin's optimizer.
        held["model"] = loss_scaled(twin, microbatches=k)
        return held["model"]

    def undo():
        if isinstance(twin, LossScaleTrainStep):
            twin.microbatches = current
        held.clear()

    if isinstance(twin, LossScaleTrainStep):
        how = f"model.microbatches = {k}; model.fit(..., batch_size={big})"
    else:
        how = f"model = kp.loss_scaled(model, microbatches={k}); model.fit(..., batch_size={big})"
    how += f"  # slices of {big // k}: about the memory of batch {B}; retune the learning rate"
    return Change(
        f"{name} (microbatches={k})",
        how,
        ctx.source.fit_kwargs(batch_size=big),
        big,
        apply,
        undo,
        trace_factor=1.0,  # a new model (or a new micro-batch count): traced anew
    )
