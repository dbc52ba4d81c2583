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
from keras_perf._fit_measure import TORCH_COMPILE_MIN_SECONDS, TORCH_SPE, compile_twin


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
        memory_batch=None,
    ):
        self.change = change
        # The batch size at which its step's peak memory is measured (changes of the batch or
        # of what a step keeps: larger batches, micro-batching, remat); None: not measured.
        self.memory_batch = memory_batch
        # The cost of its warm-up as a multiple of the first trace (a new model, an XLA
        # compile), where a retrace of the train function would underestimate it; else None.
        self.trace_factor = trace_factor
        # Called when the change runs out of memory (or is above `memory_limit_bytes`): the
        # changes to time instead, a list (empty: none).
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
    if ctx.source.kind != "tf.data":  # only tf.data sources hold a pipeline (`source.x`)
        return None
    ds = ctx.source.x
    if type(ds).__name__ == "_PrefetchDataset":
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
    if ctx.source.kind != "tf.data":
        return None
    ds = ctx.source.x
    if not _backend.tf_data_has_stage(ds, "MapDataset"):
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
    if ctx.source.kind != "tf.data":
        return None
    ds = ctx.source.x
    if _backend.tf_data_has_stage(ds, "CacheDataset"):
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


def _mib(n) -> str:
    return f"{n / 2**20:,.1f} MiB"


def memory_changes(ctx, size, notes) -> list:
    """What fits a batch of `size` in less memory: micro-batched, and with remat="full"; in
    the order of `kp.fit_with_oom_retry`'s ladder (remat first for a model with
    BatchNormalization, whose statistics it keeps exact; micro-batching first otherwise),
    so that the exact one is timed first when the budget is short."""
    from keras_perf.oom import batch_dependent

    changes = [microbatch_change(ctx, size, notes), remat_change(ctx, size, notes)]
    if batch_dependent(ctx.twin):
        changes.reverse()
    return [c for c in changes if c is not None]


def _over_limit(ctx, notes) -> list | None:
    """The current batch micro-batched and with remat, where its step is above
    `memory_limit_bytes` (any input: the batches are the user's)."""
    if ctx.current_fits:
        return None
    notes.append(
        f"the step at batch {ctx.batch_size} peaks at {_mib(ctx.step_memory['peak_bytes'])}, "
        f"above memory_limit_bytes ({_mib(ctx.memory_limit)}): micro-batched and with remat at "
        "the same batch instead (kp.find_max_batch_size gives the largest batch of each)."
    )
    return memory_changes(ctx, ctx.batch_size, notes)


def _larger_batch(ctx, notes) -> Change | list | None:
    """Twice the batch size, for arrays with at least 2 such batches; micro-batched and with
    remat instead where memory is the limit (or where the larger batch runs out of memory)."""
    source, B = ctx.source, ctx.batch_size
    if source.kind != "arrays" or source.examples // (2 * B) < 2 or not ctx.current_fits:
        return None
    big = 2 * B
    if not ctx.larger_batch_fits:
        if ctx.memory_limit is not None:
            why = (
                f"step peak {_mib(ctx.step_memory['peak_bytes'])} at batch {B}, "
                f"memory_limit_bytes {_mib(ctx.memory_limit)}"
            )
        else:
            why = f"peak {_mib(ctx.peak_memory_bytes)} of {_mib(ctx.device_bytes)}"
        notes.append(
            f"batch_size={big} not tried as it is: memory is the limit ({why}); micro-batched "
            "and with remat instead."
        )
        return memory_changes(ctx, big, notes)
    return Change(
        f"batch_size={big}",
        f"model.fit(..., batch_size={big})  # changes the optimisation: retune the learning rate",
        source.fit_kwargs(batch_size=big),
        big,
        on_oom=lambda: memory_changes(ctx, big, notes),
        memory_batch=big,
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
        notes.append(
            "steps_per_execution alone not offered: Keras refuses it on the torch backend "
            "(keras-perf's traced step runs it: offered with it)."
        )
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
        if ctx.compile_args.get("run_eagerly"):
            return None
        if ctx.max_seconds < TORCH_COMPILE_MIN_SECONDS:
            notes.append(
                "jit_compile=True (torch.compile) not measured: its first compile can take "
                f"longer than the whole time budget (tried from max_seconds="
                f"{TORCH_COMPILE_MIN_SECONDS} on)."
            )
            return None
        return Change(
            "jit_compile=True (torch.compile)",
            "model.compile(..., jit_compile=True)  # or kp.accelerate(model, x, y)",
            ctx.base_fit_kwargs,
            ctx.batch_size,
            lambda: compile_twin(twin, args, jit_compile=True),
            lambda: compile_twin(twin, args),
            # torch.compile's first compile: many times a plain first step.
            trace_factor=20.0,
        )
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


def _torch_traced_step(ctx, notes) -> Change | None:
    """keras-perf's traced torch train step (`keras_perf.train_step.torch_traced`), where this
    build has it: the same step without Keras' per-layer Python overhead."""
    if keras.backend.backend() != "torch" or ctx.compile_args.get("run_eagerly"):
        return None
    try:
        from keras_perf.train_step import torch_traced
    except ImportError:
        notes.append("keras-perf's traced train step not offered: not available in this build.")
        return None
    twin = ctx.twin
    if torch_traced.traced_step_state(twin).get("active"):
        return None

    def install():
        torch_traced.install_traced_step(twin)
        state = torch_traced.traced_step_state(twin)
        said = f"keras-perf's traced train step fell back to Keras' own: {state.get('reason')}"
        if not state.get("active") and said not in notes:
            notes.append(said)

    changes = [
        Change(
            "keras-perf traced step (torch)",
            "kp.accelerate(model, x, y)  # measures it and installs it where it pays",
            ctx.base_fit_kwargs,
            ctx.batch_size,
            install,
            lambda: torch_traced.remove_traced_step(twin),
            trace_factor=4.0,  # traced once per input signature
        )
    ]
    k = TORCH_SPE[0]
    if ctx.steps >= 2 * k:  # fit's loop and the callbacks once per k steps

        def install_with_spe():
            install()
            twin.steps_per_execution = k

        changes.append(
            Change(
                f"keras-perf traced step + steps_per_execution={k} (torch)",
                "kp.accelerate(model, x, y)  # measures it and applies it where it pays",
                ctx.base_fit_kwargs,
                ctx.batch_size,
                install_with_spe,
                lambda: torch_traced.remove_traced_step(twin),
                trace_factor=4.0,
                steps_multiple=k,
            )
        )
    return changes


# The changes in the order they are offered (and their notes written). Data-side changes touch
# the input or the batch; compile-side ones recompile the twin, which needs a clone of the model.
DATA_CHANGES = (
    _over_limit,
    _pydataset_workers,
    _tf_data_prefetch,
    _tf_data_parallel_map,
    _tf_data_cache,
    _larger_batch,
)
COMPILE_CHANGES = (_steps_per_execution, _jit_compile, _torch_traced_step, _mixed_precision)


def candidates(ctx) -> tuple[list[Change], list[str]]:
    """The changes that apply to this model, data and backend; and notes on those that do not."""
    out, notes = [], []
    for offer in DATA_CHANGES:
        change = offer(ctx, notes)
        if isinstance(change, list):
            out.extend(change)
        elif change is not None:
            out.append(change)
    if not ctx.can_recompile:
        notes.append("compile-side changes not tried: Keras could not clone this model.")
        return out, notes
    for offer in COMPILE_CHANGES:
        change = offer(ctx, notes)
        if isinstance(change, list):
            out.extend(change)
        elif change is not None:
            out.append(change)
    return out, notes


def _stock_or_own(ctx, name, notes):
    """(whether the twin has keras-perf's train step itself, or None when neither it nor a
    `kp.loss_scaled` twin of it can be had), with a note saying why not."""
    from keras_perf.train_step import LossScaleTrainStep

    twin = ctx.twin
    if not ctx.can_recompile:
        notes.append(f"{name} not tried: Keras could not clone this model.")
        return None
    if isinstance(twin, LossScaleTrainStep):
        return True
    if not _backend.is_functional(twin):
        notes.append(
            f"{name} not tried: kp.loss_scaled takes Sequential and Functional models; a "
            "subclassed model gets micro-batching and remat from `class M(kp.LossScaleTrainStep, "
            "keras.Model)`."
        )
        return None
    return False


def _fit_kwargs(ctx, size):
    """`fit` arguments for a batch of `size`: the user's own at the current batch size."""
    return ctx.base_fit_kwargs if size == ctx.batch_size else ctx.source.fit_kwargs(batch_size=size)


def microbatch_change(ctx, big, notes) -> Change | None:
    """A batch of `big` in slices (`kp.loss_scaled(..., microbatches=k)`): at twice the batch,
    the examples/s of the larger batch at about the activation memory of the current one; at
    the current batch, about half its activation memory."""
    from keras_perf.oom import batch_dependent
    from keras_perf.train_step import loss_scaled

    twin, B = ctx.twin, ctx.batch_size
    name = f"batch_size={big}, micro-batched"
    own = _stock_or_own(ctx, name, notes)
    if own is None:
        return None
    current = twin.microbatches if own else 1
    k = 2 * current
    if big < k:
        return None  # fewer examples than slices
    held = {}

    def apply():
        if own:
            twin.microbatches = k
            return twin
        # The twin's layers behind keras-perf's train step, compiled as the twin is, with the
        # twin's optimizer.
        held["model"] = loss_scaled(twin, microbatches=k)
        return held["model"]

    def undo():
        if own:
            twin.microbatches = current
        held.clear()

    fit = f"; model.fit(..., batch_size={big})" if big != B else ""
    if own:
        how = f"model.microbatches = {k}{fit}"
    else:
        how = f"model = kp.loss_scaled(model, microbatches={k}){fit}"
    if big != B:
        how += f"  # slices of {big // k}: about the memory of batch {B}; retune the learning rate"
    else:
        how += f"  # slices of {big // k}: the same update, less activation memory"
    if batch_dependent(twin):
        how += f"; BatchNormalization normalises each slice of {big // k} on its own"
    return Change(
        f"{name} (microbatches={k})",
        how,
        _fit_kwargs(ctx, big),
        big,
        apply,
        undo,
        trace_factor=1.0,  # a new model (or a new micro-batch count): traced anew
        memory_batch=big,
    )


def remat_change(ctx, size, notes) -> Change | None:
    """A batch of `size` kept whole, each layer's activations recomputed in the backward pass
    (`kp.loss_scaled(..., remat="full")`): the same arithmetic, BatchNormalization included,
    for one more forward pass."""
    from keras_perf.train_step import loss_scaled

    twin, B = ctx.twin, ctx.batch_size
    name = f'batch_size={size}, remat="full"'
    own = _stock_or_own(ctx, name, notes)
    if own is None:
        return None
    if own and twin.remat is not None:
        notes.append(f"{name} not tried: the model recomputes already (remat={twin.remat!r}).")
        return None
    held = {}

    def apply():
        if own:
            twin.set_remat("full")
            return twin
        held["model"] = loss_scaled(twin, remat="full")
        return held["model"]

    def undo():
        if own:
            twin.set_remat(None)
        held.clear()

    fit = f"; model.fit(..., batch_size={size})" if size != B else ""
    how = (
        'model.set_remat("full")' if own else 'model = kp.loss_scaled(model, remat="full")'
    ) + fit
    how += "  # activations recomputed in the backward pass: exact, the batch whole"
    if size != B:
        how += "; retune the learning rate"
    return Change(
        name,
        how,
        _fit_kwargs(ctx, size),
        size,
        apply,
        undo,
        trace_factor=1.0,  # a new model (or a new remat setting): traced anew
        memory_batch=size,
    )
