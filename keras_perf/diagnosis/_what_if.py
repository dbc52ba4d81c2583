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
    ):
        self.change = change
        self.retraces = retraces  # False: same shapes and train function (data-side changes)
        self.how = how
        self.fit_kwargs = fit_kwargs
        self.examples_per_step = examples_per_step
        self._apply = apply
        self._undo = undo
        self.steps_multiple = steps_multiple

    def apply(self):
        if self._apply is not None:
            self._apply()

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
    if source.kind == "arrays" and ctx.larger_batch_fits:
        big = 2 * B
        if source.examples // big >= 2:
            out.append(
                Change(
                    f"batch_size={big}",
                    f"model.fit(..., batch_size={big})  # changes the optimisation: retune the "
                    "learning rate",
                    source.fit_kwargs(batch_size=big),
                    big,
                )
            )
    elif source.kind == "arrays":
        notes.append(
            f"batch_size={2 * B} not tried: memory is the limit (peak "
            f"{ctx.peak_memory_bytes} bytes); kp.fit_with_oom_retry micro-batches a batch "
            "that does not fit."
        )

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
            )
        )
    elif backend == "torch" and not twin.jit_compile:
        notes.append(
            "jit_compile=True (torch.compile) not measured: its first compile can take longer "
            "than the whole time budget."
        )
    if _backend.has_accelerator():
        policy = "mixed_bfloat16" if backend == "jax" else "mixed_float16"
        if twin.dtype_policy.name == "float32":
            out.append(
                Change(
                    f"mixed precision ({policy})",
                    f"kp.setup_mixed_precision('{policy}')  # before building the model",
                    base,
                    B,
                    lambda: ctx.use_mixed_twin(policy),
                    ctx.drop_mixed_twin,
                )
            )
    return out, notes
