"""The changes `diagnose` tries: each applies to a twin (or a copy of the data) and is timed.

A candidate is offered only where it applies (backend, kind of input, current settings); each
returns a `fit` set-up to time, or a reason it was not measured. The timing itself lives in
`_core.py`: a warm-up fit (traces the changed train function), then a fit timed from its start.
"""

from __future__ import annotations

import keras

from keras_perf import backend as _backend


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


def _cache_change(ctx, ds, out, notes) -> None:
    """`dataset.cache()`, when the pipeline is finite and one pass fits in the time budget.

    Its gain shows from the second pass on, so the cache is filled (one whole pass, untimed)
    before the timed fit. The cache is measured at the end of the pipeline, an upper bound on
    a cache placed before shuffling and random augmentation, where it belongs.
    """
    import tensorflow as tf

    from keras_perf.backend import tensorflow as _tf

    if _tf.has_stage(ds, "CacheDataset"):
        return
    batches = int(ds.cardinality())
    if batches <= 0:
        notes.append("tf.data cache not tried: the dataset is infinite or of unknown length.")
        return
    fill_s = ctx.input_per_batch * batches
    if fill_s > ctx.max_seconds / 4:
        notes.append(
            f"tf.data cache not tried: filling it takes one pass over {batches} batches "
            f"(about {fill_s:.0f} s), more than a quarter of max_seconds."
        )
        return
    cached = ds.cache().prefetch(tf.data.AUTOTUNE)

    def fill(cached=cached):
        for _ in cached:  # one full pass fills tf.data's in-memory cache for later iterators
            pass

    how = "dataset = dataset.cache()  # after the deterministic stages, before shuffle"
    if _tf.has_stage(ds, "ShuffleDataset"):
        how += "; measured with the cache last, an upper bound"
    out.append(Change("tf.data cache", how, {"x": cached}, ctx.batch_size, fill, retraces=False))


def candidates(ctx) -> tuple[list[Change], list[str]]:
    """The changes that apply to this model, data and backend; and notes on those that do not."""
    from keras_perf.diagnosis._measure import compile_twin

    out, notes = [], []
    backend = keras.backend.backend()
    source, twin, args, B = ctx.source, ctx.twin, ctx.compile_args, ctx.batch_size
    base = ctx.base_fit_kwargs
    n = ctx.steps

    # -- data side ----------------------------------------------------------------------
    if source.kind == "PyDataset":
        ds = source.x
        workers, multi = ds.workers, ds.use_multiprocessing
        if workers < 4:

            def set_workers(ds=ds):
                ds.workers = 4

            def reset_workers(ds=ds, w=workers, m=multi):
                ds.workers, ds.use_multiprocessing = w, m

            out.append(
                Change(
                    "PyDataset workers=4",
                    f"{type(ds).__name__}(..., workers=4)  # threads; passed to "
                    "keras.utils.PyDataset.__init__",
                    base,
                    B,
                    set_workers,
                    reset_workers,
                    retraces=False,
                )
            )
    if source.kind == "tf.data":
        import tensorflow as tf

        from keras_perf.backend import tensorflow as _tf

        ds = source.x
        if type(ds).__name__ != "_PrefetchDataset":
            out.append(
                Change(
                    "tf.data prefetch",
                    "dataset = dataset.prefetch(tf.data.AUTOTUNE)  # last in the pipeline",
                    {"x": ds.prefetch(tf.data.AUTOTUNE)},
                    B,
                    retraces=False,
                )
            )
        if _tf.has_stage(ds, "MapDataset"):  # a map that is not parallel
            options = tf.data.Options()
            options.experimental_optimization.map_parallelization = True
            out.append(
                Change(
                    "tf.data parallel map",
                    "dataset = dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)",
                    {"x": ds.with_options(options).prefetch(tf.data.AUTOTUNE)},
                    B,
                    retraces=False,
                )
            )
    if source.kind == "tf.data":
        _cache_change(ctx, source.x, out, notes)
    if source.kind == "arrays" and source.examples // (2 * B) >= 2:
        big = 2 * B
        larger = Change(
            f"batch_size={big}",
            f"model.fit(..., batch_size={big})  # changes the optimisation: retune the "
            "learning rate",
            source.fit_kwargs(batch_size=big),
            big,
            on_oom=lambda: microbatch_change(ctx, big, notes),
        )
        if ctx.larger_batch_fits:
            out.append(larger)
        else:
            notes.append(
                f"batch_size={big} not tried as it is: memory is the limit (peak "
                f"{ctx.peak_memory_bytes / 2**20:,.0f} MiB of {ctx.device_bytes / 2**20:,.0f} "
                f"MiB); micro-batched instead."
            )
            micro = microbatch_change(ctx, big, notes)
            if micro is not None:
                out.append(micro)

    # -- compile side ---------------------------------------------------------------------
    if not ctx.can_recompile:
        notes.append("compile-side changes not tried: Keras could not clone this model.")
        return out, notes
    if backend in ("tensorflow", "jax") and not args.get("run_eagerly"):
        current = int(args.get("steps_per_execution") or 1)
        k = 32 if n >= 64 else max(2, 2 ** ((max(n // 2, 2)).bit_length() - 1))
        if current < k:
            out.append(
                Change(
                    f"steps_per_execution={k}",
                    f"model.compile(..., steps_per_execution={k})",
                    base,
                    B,
                    lambda k=k: compile_twin(twin, args, steps_per_execution=k),
                    lambda: compile_twin(twin, args),
                    steps_multiple=k,
                )
            )
    elif backend == "torch":
        notes.append("steps_per_execution not offered: Keras refuses it on the torch backend.")
    if backend in ("tensorflow", "jax") and not twin.jit_compile and not args.get("run_eagerly"):
        out.append(
            Change(
                "jit_compile=True",
                "model.compile(..., jit_compile=True)",
                base,
                B,
                lambda: compile_twin(twin, args, jit_compile=True),
                lambda: compile_twin(twin, args),
                # XLA's first compile: 1.6-3.3x the first plain trace of an MLP or small CNN
                # on TensorFlow (CPU), where a plain retrace costs a tenth of it.
                trace_factor=4.0,
            )
        )
    elif backend == "torch" and not twin.jit_compile:
        notes.append(
            "jit_compile=True (torch.compile) not measured: its first compile can take longer "
            "than the whole time budget."
        )
    if _backend.has_accelerator():
        from keras_perf.mixed_precision import auto_policy

        policy = auto_policy()  # float16 on GPUs with tensor cores, bfloat16 on TPUs
        if policy == "float32":
            notes.append(
                "mixed precision not offered: this GPU has no float16 tensor cores (compute "
                "capability below 7.0), where float16 does not run faster."
            )
        elif twin.dtype_policy.name == "float32":
            out.append(
                Change(
                    f"mixed precision ({policy})",
                    f"kp.setup_mixed_precision('{policy}')  # before building the model",
                    base,
                    B,
                    lambda: ctx.use_mixed_twin(policy),
                    ctx.drop_mixed_twin,
                    # A new model, traced anew (with XLA on TensorFlow where the twin uses it).
                    trace_factor=4.0 if backend == "tensorflow" and twin.jit_compile else 1.0,
                )
            )
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
