"""Timing pieces for `diagnose` and `accelerate`: the twin model (also under another dtype
policy), timed `fit` calls (one, the fastest of several, or several alternated), peak memory,
and global random state.

Shared, so on the top level rather than in either package: both measure candidates the same
way on a twin of the user's model, and `accelerate` sits beside `diagnose`, not above it. Not
on the ground floor: it reads memory and timings through `keras_perf.backend`.

Everything is measured with real `fit` calls on a twin of the user's model (same layers,
weights and compile settings; its own optimizer and metric objects), so the user's model and
its next `fit` are untouched. A fit is timed from its start, after an untimed warm-up fit that
traces the train function, and stopped at a deadline by a callback.
"""

from __future__ import annotations

import random
import time
import warnings

import keras
import numpy as np

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf._carry_over import keep_train_step
from keras_perf._utils import host_copy

# torch.compile (Keras' `jit_compile=True`, inductor under keras-perf's traced step) is
# measured only with a budget of at least this many seconds: its first compile takes tens of
# seconds to minutes on a CPU.
TORCH_COMPILE_MIN_SECONDS = 30
# `steps_per_execution` tried with keras-perf's traced step on torch (Keras refuses it alone;
# the installed traced step runs it), the first that divides an epoch's steps.
TORCH_SPE = (4, 3, 2)

COMPILE_KEYS = (
    "optimizer",
    "loss",
    "loss_weights",
    "metrics",
    "weighted_metrics",
    "run_eagerly",
    "steps_per_execution",
    "jit_compile",
)


def compile_args(model) -> dict:
    """The arguments `model.compile` was called with (Keras keeps them to save the model),
    with the model's own `run_eagerly`, `jit_compile` and (but on torch, where a value above 1
    comes only with keras-perf's installed traced step: `make_twin` sets it with that step)
    `steps_per_execution`."""
    stored = keras_internals.compile_config(model)
    config = dict(getattr(stored, "config", {}) or {})
    keys = ("run_eagerly", "steps_per_execution", "jit_compile")
    if keras.backend.backend() == "torch":
        keys = ("run_eagerly", "jit_compile")
    for key in keys:
        config[key] = getattr(model, key, config.get(key))
    config.setdefault("optimizer", model.optimizer)
    return config


def _fresh(obj):
    """A new object of the same class and config (optimizers, metrics: they carry state)."""
    if isinstance(obj, (keras.optimizers.Optimizer, keras.metrics.Metric)):
        return type(obj).from_config(obj.get_config())
    if isinstance(obj, dict):
        return {k: _fresh(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fresh(v) for v in obj)
    return obj


def clone(model, **kwargs):
    """`keras.models.clone_model(model, **kwargs)`, also for a model compiled with a loss or
    metric Keras cannot deserialize (a plain function, a lambda): Keras' clone compiles the
    copy from the model's serialized compile config, which fails on those, so the model is
    cloned as if uncompiled and the caller compiles the copy with the objects themselves
    (`compile_twin`)."""
    try:
        return keras.models.clone_model(model, **kwargs)
    except Exception:
        if not getattr(model, "compiled", False):
            raise
    model.compiled = False  # for the clone only: Keras' Trainer attribute, put back below
    try:
        return keras.models.clone_model(model, **kwargs)
    finally:
        model.compiled = True


def unbuilt_start(model, x_batch):
    """For a model not built yet (a Sequential without an `Input`, a subclassed model never
    called): `(x_batch, weights)`, the weights of a clone built on `x_batch`, for every twin
    to start from (`make_twin(model, start)`); None for a built model, or one Keras cannot
    clone. Without it each twin would draw weights of its own at its first fit, and twins
    that start apart cannot be compared for exactness."""
    if getattr(model, "built", True):
        return None
    with _backend.model_scope(model):
        try:
            built = clone(model)
            built(x_batch)
        except Exception:  # noqa: BLE001 - what Keras cannot clone is said by make_twin
            return None
        return x_batch, built.get_weights()


def start_weights(model, twin, start) -> None:
    """`model`'s weights on `twin`; `start`'s (built on its batch first) for a model not
    built yet."""
    if start is None:
        twin.set_weights(model.get_weights())
    else:
        twin(start[0])
        twin.set_weights(start[1])


def make_twin(model, start=None):
    """A compiled twin of `model` with its weights and its keras-perf train-step settings
    (`microbatches`, `remat`, ...: `keras.models.clone_model` builds the step with the
    defaults), or None when Keras cannot clone it. `start` (from `unbuilt_start`): the twin
    of a model not built yet is built on its batch and given its weights."""
    args = compile_args(model)
    with _backend.model_scope(model):
        try:
            twin = clone(model)
        except Exception:  # subclassed without get_config, custom layers, ...
            return None
        try:
            start_weights(model, twin, start)
        except ValueError:
            return None
        twin = keep_train_step(model, twin)
        compile_twin(twin, args)
        _keep_installed_step(model, twin)
    return twin


def _keep_installed_step(model, twin) -> None:
    """keras-perf's traced torch step, where it is installed on `model` (as `kp.accelerate`
    applies it), installed on `twin` too with `model`'s `steps_per_execution`, which on torch
    runs only with that step (`compile_args` leaves it out there): the twin trains as the
    model does."""
    if keras.backend.backend() != "torch":
        return
    from keras_perf.train_step import installed_traced_step

    mode = installed_traced_step(model)
    if mode is False:
        return
    from keras_perf.train_step.torch_traced import install_traced_step

    install_traced_step(twin, inductor=mode == "inductor")
    twin.steps_per_execution = model.steps_per_execution


def policy_twin(model, policy, start=None):
    """A twin of `model` whose layers run under the dtype `policy`, with its weights (or
    `start`'s, as `make_twin`) and its keras-perf train-step settings (not compiled). Raises
    whatever Keras raises when it cannot clone the model."""
    previous = keras.mixed_precision.global_policy()
    try:
        keras.mixed_precision.set_global_policy(policy)

        def clone_layer(layer):
            config = layer.get_config()
            if "dtype" in config:
                config["dtype"] = policy
            return type(layer).from_config(config)

        with _backend.model_scope(model):
            twin = clone(model, clone_function=clone_layer)
            start_weights(model, twin, start)
            twin = keep_train_step(model, twin)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    return twin


def compile_twin(twin, args, **changes) -> None:
    kwargs = {k: _fresh(args[k]) for k in COMPILE_KEYS if k in args}
    optimizer = getattr(twin, "optimizer", None)  # none on a clone made uncompiled (`clone`)
    if isinstance(optimizer, keras.optimizers.Optimizer) and "optimizer" not in changes:
        kwargs["optimizer"] = optimizer  # a recompile keeps the twin's built optimizer
    kwargs.update(changes)
    twin.compile(**kwargs)


class Snapshot:
    """Values of every variable of a model, its optimizer and metrics, to put back later."""

    def __init__(self, model):
        seen, self.pairs = set(), []
        optimizer = getattr(model, "optimizer", None)
        extra = list(optimizer.variables) if optimizer is not None else []
        for v in list(model.variables) + extra + list(model.metrics_variables):
            if id(v) not in seen:
                seen.add(id(v))
                self.pairs.append((v, host_copy(v)))
        self.attrs = {k: getattr(model, k, None) for k in ("history", "stop_training")}
        self.model = model

    def restore(self):
        for v, value in self.pairs:
            v.assign(value)
        for k, value in self.attrs.items():
            setattr(self.model, k, value)


class RandomState:
    """Python's, NumPy's and the framework's (torch's; TensorFlow's op seeds) global random
    state: fit and clone_model draw from them."""

    def __init__(self):
        self.py = random.getstate()
        self.np = np.random.get_state()
        self.framework = _backend.global_rng_state()  # None on JAX

    def restore(self):
        random.setstate(self.py)
        np.random.set_state(self.np)
        if self.framework is not None:
            _backend.set_global_rng_state(self.framework)


class _Clock(keras.callbacks.Callback):
    """Times a fit from its first batch's start to its last batch's end, and stops it at `deadline`.

    Async-safe (keeps Keras' async dispatch on JAX and torch); at the last step it reads the
    loss, which waits for the device to finish, before reading the clock.
    """

    def __init__(self, model, steps, deadline):
        super().__init__()
        self.async_safe = True
        self._target = model  # not self.model: reading it syncs the state on JAX
        self.planned = steps
        self.deadline = deadline
        self.steps = 0
        self.times: list[float] = []
        self.marks: list[int] = []  # steps done at each time
        self.first_begin = None
        self.end = None
        self.late = False
        self.train_end = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_begin is None:
            self.first_begin = time.perf_counter()

    def on_train_end(self, logs=None):
        self.train_end = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps = batch + 1
        now = time.perf_counter()
        late = self.deadline is not None and now > self.deadline
        if self.steps >= self.planned or late:
            loss = (logs or {}).get("loss")
            if loss is not None:
                np.asarray(keras.ops.convert_to_numpy(loss))  # waits for the step to finish
            now = time.perf_counter()
            self.end = now
            if late:
                self.late = True
                self._target.stop_training = True
        self.times.append(now)
        self.marks.append(self.steps)


def fit_steps(model, steps, deadline=None, setup=None, **fit_kwargs):
    """Run `fit` for up to `steps` steps (stopped at `deadline`).

    Returns `(seconds, steps_done, clock)`: `seconds` from the first batch's start (after `fit`
    has made its data iterator and started any workers, which then still have to deliver the
    first batch) to the end of the last step, so that the one-off set-up and wrap-up of a `fit`
    call do not count against a few dozen steps. With `setup` (seconds), the time runs from the
    start of `fit` less `setup` instead: for a change to the input (workers, prefetch) that would
    otherwise queue batches for free between its start and the first batch.
    """
    clock = _Clock(model, steps, deadline)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ran out of data.*")
        warnings.filterwarnings("ignore", message=".*`shuffle=True` was passed.*")
        t0 = time.perf_counter()
        model.fit(**fit_kwargs, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[clock])
        seconds = time.perf_counter() - t0
    clock.start = t0
    clock.setup = None if clock.first_begin is None else clock.first_begin - t0
    if keras.backend.backend() == "jax" and clock.train_end is not None:
        # JAX's fit hands async callbacks the logs a step late: the loss read at the last
        # step does not wait for it. The end of training (state synced back) does.
        clock.end = clock.train_end
    if clock.end is not None and setup is not None:
        seconds = max(clock.end - t0 - setup, 1e-9)
    elif clock.first_begin is not None and clock.end is not None:
        seconds = clock.end - clock.first_begin
    return seconds, max(clock.steps, 1), clock


def repeat_fits(
    model, n, slice_end, deadline, max_repeats=7, setups=None, setup=None, **fit_kwargs
):
    """Fastest seconds per step over `n`-step fits repeated until `slice_end` (3 to 7 times).

    A fit of a few dozen small steps lasts milliseconds, where one lost time slice on a busy
    machine doubles it: as `timeit` does, the fastest of several repeats is the estimate least
    disturbed by other work on the machine.
    """
    per_step, done = [], n
    for _ in range(max_repeats):
        seconds, done, clock = fit_steps(model, n, deadline, setup, **fit_kwargs)
        per_step.append(seconds / done)
        if setups is not None and clock.setup is not None:
            setups.append(clock.setup)
        if clock.late:  # stopped at the deadline: the later measurements take fewer steps
            return min(per_step), done
        if time.perf_counter() > slice_end and len(per_step) >= 3:
            break
    return min(per_step), n


def alternate_fits(model, runs, slice_end, deadline, max_rounds=7):
    """Fastest seconds per step of each of `runs` (`(steps, fit_kwargs)` pairs), from fits of
    each in turn, round after round until `slice_end` (3 to `max_rounds` rounds)."""
    per_step = [[] for _ in runs]
    for _ in range(max_rounds):
        for times, (n, kw) in zip(per_step, runs):
            seconds, done, clock = fit_steps(model, n, deadline, **kw)
            times.append(seconds / done)
            if clock.late:  # stopped at the deadline
                return [min(t) if t else times[-1] for t in per_step]
        if time.perf_counter() > slice_end and len(per_step[0]) >= 3:
            break
    return [min(t) for t in per_step]


def steady(clock, skip=1):
    """Seconds per step after the first `skip` batches (the trace), from the batch-end times."""
    times, marks = clock.times, clock.marks
    if len(times) > skip + 1:
        return (times[-1] - times[skip]) / (marks[-1] - marks[skip])
    return (times[-1] - clock.start) / max(clock.steps, 1)


class _EpochClock(keras.callbacks.Callback):
    """Notes when the first epoch of a fit starts; stops the fit at `deadline`."""

    def __init__(self, model, deadline):
        super().__init__()
        self.async_safe = True  # as fit runs without it (no sync after every step on JAX)
        self._target = model  # not self.model: reading it syncs the state on JAX
        self.deadline = deadline
        self.begin = None
        self.epochs = 0
        self.late = False

    def on_epoch_begin(self, epoch, logs=None):
        if self.begin is None:
            self.begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.late = True
            self._target.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


def epoch_seconds(model, deadline, epochs=3, fits=1, **fit_kwargs) -> float | None:
    """Seconds per epoch: the median over `fits` fits of `epochs` epochs each of the mean, from
    the fit's first epoch's start to its return. That is every step and each epoch's own work
    (a new data iterator and the teardown of the last one, workers started and stopped, the
    epoch's callbacks), not the fit call's one-off set-up, which a long training pays once.
    None when the deadline cuts a fit short.

    The teardown counts because it can cost as much as the steps: on TensorFlow, deleting a
    tf.data iterator can wait up to 0.6 s for tf.data's autotuner (seen for iterators that lived
    about 0.5-1.3 s; Keras builds such a pipeline for arrays), at random.
    """
    means = []
    for _ in range(fits):
        clock = _EpochClock(model, deadline)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*`shuffle=True` was passed.*")
            model.fit(**fit_kwargs, epochs=epochs, verbose=0, callbacks=[clock])
        end = time.perf_counter()
        if clock.late or clock.begin is None or clock.epochs < epochs:
            return None
        means.append((end - clock.begin) / epochs)
    return float(np.median(means))


def peak_memory() -> int | None:
    stats = _backend.memory_stats()
    return None if stats is None else stats.get("peak_bytes")


def step_peak(model, batch) -> dict:
    """The peak memory of one training step of `model` on `batch` (`(x, y, sample_weight)`),
    as `kp.backend.step_memory` measures it: `{"peak_bytes", "measure"}`.

    TensorFlow and torch run the step (the model's variables move on by one step); JAX
    compiles it and reads XLA's memory analysis. A model not trained yet (a new
    `kp.loss_scaled` twin) is built first, shapes only, as `fit` would build it.
    """
    x, y, sample_weight = batch
    with _backend.model_scope(model):
        keras_internals.symbolic_build(
            model, keras.tree.map_structure(lambda t: None if t is None else t[:1], batch)
        )
    result = _backend.step_memory(
        model, batch, lambda: model.train_on_batch(x, y, sample_weight=sample_weight)
    )
    return {"peak_bytes": int(result["bytes"]), "measure": result["measure"]}
