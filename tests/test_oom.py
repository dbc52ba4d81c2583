"""kp.fit_with_oom_retry / kp.find_max_microbatch with out-of-memory injected on CPU.

CPU training never runs out of memory, so `OOMAbove` raises the backend's own OOM exception
(`kp.backend.oom_error`: TF `ResourceExhaustedError`, XLA `JaxRuntimeError` with status
RESOURCE_EXHAUSTED, `torch.OutOfMemoryError`) when a training call sees more examples than a
threshold, as an allocator would. The check is Python code in `call`, so on TensorFlow the
models are compiled with `run_eagerly=True` (Keras runs the same train step without
tf.function, whose traced batch size is unknown); torch is eager anyway. On JAX the layer
raises while jax.jit traces the step, where slice sizes are static. A Python exception raised
from a host callback (tf.py_function, jax io_callback) reaches the caller re-wrapped as a
different error (UnknownError / INTERNAL), so that route would not test the real exception
types. One JAX test uses it anyway, for a failure inside the running compiled step at a chosen
step, after XLA donated the state buffers (XLA reports INTERNAL with the callback's
RESOURCE_EXHAUSTED text inside, which the shim's text check accepts).
"""

import functools
import sys

import keras
import numpy as np
import pytest

import keras_perf as kp
from tests import models

BACKEND = keras.backend.backend()
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# run_eagerly on TF, where the traced batch size is unknown; on JAX size-only injection runs
# compiled (the layer raises while jax.jit traces the step); torch is eager anyway.
EAGER = BACKEND == "tensorflow"


class OOMAbove(keras.layers.Layer):
    """Identity layer that raises the backend's OOM error on a training call above `threshold`.

    Only calls with a static batch size count (eager steps; jax.jit traces). The n-th such
    call (0-based) raises if `n >= from_call` and at most `max_raises` times; `error` replaces
    the OOM error by another exception (to check that it propagates).
    """

    def __init__(self, threshold=None, from_call=0, max_raises=None, error=None, **kwargs):
        super().__init__(**kwargs)
        self.threshold, self.from_call, self.max_raises, self.error = (
            threshold,
            from_call,
            max_raises,
            error,
        )
        self.calls, self.raised, self.sizes = 0, [], []

    def call(self, x, training=False):
        n = x.shape[0]
        if training and isinstance(n, int) and self.threshold is not None:
            index, self.calls = self.calls, self.calls + 1
            self.sizes.append(n)
            armed = self.max_raises is None or len(self.raised) < self.max_raises
            if n > self.threshold and index >= self.from_call and armed:
                exc = self.error or kp.backend.oom_error(
                    f"Out of memory while trying to allocate {n * 1000} bytes (injected, batch {n})."
                )
                self.raised.append(exc)
                raise exc
        return x


def _model(seed=0, **oom):
    keras.utils.set_random_seed(seed)
    layer = OOMAbove(**oom)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), layer, keras.layers.Dense(3)]
    )
    return model, layer


def _compile(model, eager=EAGER):
    model.compile(keras.optimizers.Adam(0.01), SCE, run_eagerly=eager)
    return model


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def _max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.train_begin, self.train_end, self.epochs_ended = 0, 0, []

    def on_train_begin(self, logs=None):
        self.train_begin += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epochs_ended.append(epoch)

    def on_train_end(self, logs=None):
        self.train_end += 1


# Eager on TF; torch is eager anyway. On JAX, eager micro-batched steps are slow (lax.scan
# compiles at each eager step), so JAX's mid-epoch case is the compiled host-callback test
# at the end of this file (test_jax_failure_inside_compiled_step_with_donated_buffers).
@pytest.mark.backends("tensorflow", "torch")
@pytest.mark.parametrize("kind", ["stock", "mixin"])
def test_mid_epoch_oom_recovers_exactly(kind):
    # 48 examples, batch 16: 3 steps per epoch. The 6th step (epoch 1, step 2) runs out of
    # memory after two Adam updates of epoch 1 were applied: they must be rolled back. The
    # last epoch fails, so that few eager micro-batched steps run (slow on JAX).
    x, y = _data(n=48)
    model, layer = _model(threshold=8, from_call=5)
    if kind == "mixin":
        model = kp.loss_scaled(model)
    _compile(model, eager=True)
    rec = Recorder()
    early = keras.callbacks.EarlyStopping(monitor="loss", patience=5)
    h = kp.fit_with_oom_retry(
        model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[rec, early]
    )

    # Reference: epoch 0 in batches of 16, epoch 1 with the surviving 2 x 8 from its start.
    ref, _ = _model()
    _compile(ref, eager=False)
    h0 = ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    twin = kp.loss_scaled(ref, microbatches=2)
    h1 = twin.fit(x, y, batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=0)

    assert _max_diff(model, ref) < 1e-5
    np.testing.assert_allclose(
        h.history["loss"], h0.history["loss"] + h1.history["loss"], rtol=1e-5
    )
    assert h.epoch == [0, 1]
    assert len(layer.raised) == 1
    assert [(e["epoch"], e["batch_size"], e["microbatches"]) for e in h.oom_events] == [(1, 16, 1)]
    assert type(layer.raised[0]).__name__ in h.oom_events[0]["error"]
    assert "batch 16" in h.oom_events[0]["error"]
    assert int(ref.optimizer.iterations) == int(h.model.optimizer.iterations) == 6
    assert (rec.train_begin, rec.train_end, rec.epochs_ended) == (1, 1, [0, 1])
    assert h.model.microbatches == 2
    if kind == "mixin":
        assert h.model is model
    else:
        assert not isinstance(model, kp.LossScaleTrainStep)  # the user's model is unchanged
        assert h.model.layers[-1] is model.layers[-1]  # ... and shares its layers with the twin


def test_no_oom_equals_plain_fit():
    x, y = _data(n=40)
    model, _ = _model(threshold=1000)
    _compile(model, eager=False)
    h = kp.fit_with_oom_retry(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ref, _ = _model()
    _compile(ref, eager=False)
    h_ref = ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert _max_diff(model, ref) == 0.0
    assert h.history["loss"] == h_ref.history["loss"]
    assert h.oom_events == [] and h.model is model


def test_repeated_ooms_double_until_it_fits_and_validation_runs_once_per_epoch():
    x, y = _data(n=32)
    model, layer = _model(threshold=4)  # 16 -> 8 -> 4 fits
    _compile(model)
    h = kp.fit_with_oom_retry(
        model,
        x,
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(x[:8], y[:8]),
        strategies=("microbatches",),  # the doubling alone (the ladder: the tests below)
    )
    assert [e["microbatches"] for e in h.oom_events] == [1, 2]
    assert {e["epoch"] for e in h.oom_events} == {0}
    assert len(h.history["val_loss"]) == 2 and len(h.history["loss"]) == 2
    assert h.model.microbatches == 4 and max(layer.sizes[len(layer.raised) :]) <= 4


@pytest.mark.backends("jax", "torch")
def test_compiled_step_oom_recovers():
    # Compiled: on JAX the layer raises while jax.jit traces the step (static slice size),
    # i.e. from the same train-function call a real XLA allocation failure comes from.
    x, y = _data(n=32)
    model, _ = _model(threshold=8)
    _compile(model, eager=False)
    h = kp.fit_with_oom_retry(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ref = kp.loss_scaled(_model()[0], microbatches=2)
    _compile(ref, eager=False)
    ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert [(e["epoch"], e["microbatches"]) for e in h.oom_events] == [(0, 1)]
    assert _max_diff(model, ref) < 1e-5


def test_gives_up_below_min_batch_size():
    x, y = _data(n=16)
    model, _ = _model(threshold=0)  # nothing fits
    _compile(model)
    with pytest.raises(
        RuntimeError, match=r"min_batch_size=4.*Tried: epoch 0: batch 16 in 1"
    ) as info:
        kp.fit_with_oom_retry(model, x, y, batch_size=16, min_batch_size=4, verbose=0)
    assert "micro-batch(es) of 4" in str(info.value)  # 16, 8, 4 tried; 2 would be below 4
    assert kp.backend.is_oom(info.value)  # the last OOM error is its cause


def test_gives_up_after_max_retries():
    x, y = _data(n=16)
    model, layer = _model(threshold=0)
    _compile(model)
    before = model.get_weights()
    with pytest.raises(RuntimeError, match=r"max_retries=1 recoveries were used up"):
        kp.fit_with_oom_retry(model, x, y, batch_size=16, max_retries=1, verbose=0)
    assert len(layer.raised) == 2
    # The model is left as the failed epoch found it, usable (on JAX too, where the failed
    # call can leave variables without values).
    for w, w0 in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, w0)
    layer.threshold = None
    assert np.isfinite(model.evaluate(x, y, verbose=0))


def test_non_oom_exception_propagates_unchanged():
    x, y = _data(n=16)
    boom = ValueError("boom: not a memory problem")
    model, _ = _model(threshold=0, error=boom)
    _compile(model)
    with pytest.raises(ValueError, match="boom") as info:
        kp.fit_with_oom_retry(model, x, y, batch_size=16, verbose=0)
    plain, _ = _model(threshold=0, error=boom)
    _compile(plain)
    with pytest.raises(ValueError) as plain_info:
        plain.fit(x, y, batch_size=16, verbose=0)
    # The same exception plain fit raises (Keras adds the layer's name to the text), no retry.
    assert type(info.value) is type(plain_info.value) and str(info.value) == str(plain_info.value)
    assert model.layers[1].calls == 1


class Net(keras.Model):
    """A subclassed stock model (no keras-perf train step) with an OOM-injecting layer."""

    def __init__(self, seed=0, **oom):
        super().__init__()
        keras.utils.set_random_seed(seed)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.oom = OOMAbove(**oom)
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.oom(self.hidden(x), training=training))


def _schedule_compile(model, eager):
    # Halves every 2 updates: a schedule read at the count of accumulated batches (Keras'
    # own behaviour under gradient_accumulation_steps) would decay twice as fast.
    lr = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=2, decay_rate=0.5)
    model.compile(keras.optimizers.Adam(lr), SCE, run_eagerly=eager)
    return model


@pytest.mark.parametrize("lr", ["constant", "schedule"])
def test_subclassed_stock_model_recovers_with_smaller_batches_and_accumulation(lr):
    # 64 examples, batch 16: 4 steps per epoch. Call 5 (epoch 1, step 1) runs out of memory
    # after one update of epoch 1: the epoch restarts from its snapshot with batches of 8,
    # two accumulated per update, which is the same update as one batch of 16.
    compile_ = _compile if lr == "constant" else _schedule_compile
    x, y = _data(n=64)
    model = compile_(Net(threshold=8, from_call=5), eager=True)
    model.fit(x[:16], y[:16], batch_size=16, epochs=0, verbose=0)  # builds the optimizer
    optimizer = model.optimizer
    rec = Recorder()
    h = kp.fit_with_oom_retry(
        model, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[rec]
    )

    ref = compile_(Net(), eager=False)
    h_ref = ref.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert _max_diff(model, ref) < 1e-5
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)
    assert [(e["epoch"], e["batch_size"], e["microbatches"]) for e in h.oom_events] == [(1, 16, 1)]
    assert model.oom.sizes[5:] == [16] + [8] * 16  # the failed call, then two epochs of 8 x 8
    assert rec.epochs_ended == [0, 1, 2] and rec.train_begin == rec.train_end == 1
    # The user's optimizer is back, with the state of 12 updates and no accumulators left.
    assert model.optimizer is optimizer and not optimizer.gradient_accumulation_steps
    assert int(optimizer.iterations) == int(ref.optimizer.iterations) == 12
    assert len(optimizer.variables) == len(ref.optimizer.variables)
    for a, b in zip(optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), atol=1e-5
        )
    # Training goes on with the original batch, as before the OOM (the injection disarmed).
    model.oom.threshold = None
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert _max_diff(model, ref) < 1e-5


def test_accumulation_gives_up_when_the_batch_does_not_split_evenly():
    x, y = _data(n=24)
    model = _compile(Net(threshold=2), eager=True)
    with pytest.raises(
        RuntimeError, match=r"batch_size=12 cannot be cut into 8 equal batches"
    ) as info:
        kp.fit_with_oom_retry(model, x, y, batch_size=12, verbose=0)
    assert "batch 12 in 4 micro-batch(es) of 3" in str(info.value)  # 12, then 2 x 6, then 4 x 3
    assert not model.optimizer.gradient_accumulation_steps


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, i):
        sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[sl], self.y[sl]


@pytest.mark.parametrize("case", ["pydataset", "loss_scale_optimizer"])
def test_subclassed_stock_model_that_cannot_recover_says_how_to_fix(case):
    x, y = _data(n=16)
    model = Net(threshold=0)
    if case == "pydataset":
        model.compile(keras.optimizers.Adam(0.01), SCE, run_eagerly=EAGER)
        data, match = {"x": Batches(x, y, 8)}, r"cannot be re-batched"
    else:
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
        model.compile(optimizer, SCE, run_eagerly=EAGER)
        data, match = {"x": x, "y": y, "batch_size": 16}, r"LossScaleOptimizer"
    with pytest.raises(RuntimeError, match=match) as info:
        kp.fit_with_oom_retry(model, verbose=0, **data)
    assert "kp.LossScaleTrainStep, keras.Model" in str(info.value)


@pytest.mark.backends("tensorflow")
def test_tf_data_input_recovers_by_micro_batching():
    import tensorflow as tf

    x, y = _data(n=48)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    model, _ = _model(threshold=8, from_call=4)  # epoch 1, step 1
    _compile(model, eager=True)
    h = kp.fit_with_oom_retry(model, ds, epochs=2, verbose=0)
    ref, _ = _model()
    _compile(ref, eager=False)
    ref.fit(ds, epochs=1, verbose=0)
    kp.loss_scaled(ref, microbatches=2).fit(ds, epochs=2, initial_epoch=1, verbose=0)
    assert [(e["epoch"], e["batch_size"], e["microbatches"]) for e in h.oom_events] == [(1, 16, 1)]
    assert _max_diff(model, ref) < 1e-5 and h.epoch == [0, 1]


def test_find_max_microbatch_probes_and_restores():
    x, y = _data(n=32)
    model, layer = _model(threshold=5)
    _compile(model)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # optimizer built, state non-trivial
    before = [w.copy() for w in model.get_weights()]
    iterations = int(model.optimizer.iterations)
    assert kp.find_max_microbatch(model, x, y, batch_size=16) == 4
    assert len(layer.raised) == 2  # 16 and 8 failed
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert int(model.optimizer.iterations) == iterations


def test_find_max_microbatch_gives_up():
    x, y = _data(n=4)
    model, _ = _model(threshold=0)
    _compile(model)
    with pytest.raises(RuntimeError, match="even micro-batches of one example"):
        kp.find_max_microbatch(model, x, y, batch_size=4)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"batch_size": 0}, ValueError, "`batch_size` must be an integer >= 1"),
        ({"batch_size": 2.5}, TypeError, "`batch_size` must be an integer"),
        ({"epochs": 0}, ValueError, "`epochs` must be an integer >= 1"),
        ({"min_batch_size": 0}, ValueError, "`min_batch_size` must be an integer >= 1"),
        ({"max_retries": -1}, ValueError, "`max_retries` must be an integer >= 0"),
        ({"initial_epoch": -1}, ValueError, "`initial_epoch` must be an integer >= 0"),
        ({"callbacks": keras.callbacks.CallbackList([])}, TypeError, "list of callbacks"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    model, _ = _model()
    _compile(model)
    with pytest.raises(error, match=match):
        kp.fit_with_oom_retry(model, np.zeros((4, 6)), np.zeros(4), **kwargs)


def test_plain_model_with_remat_attribute_is_refused():
    # Issue 41 item 10: Keras' own step ignores `model.remat`; say so instead of training.
    model, _ = _model()
    _compile(model)
    model.remat = "full"
    with pytest.raises(ValueError, match=r"kp.fit_with_oom_retry: `model.remat` is set"):
        kp.fit_with_oom_retry(model, np.zeros((4, 6)), np.zeros(4))


def test_model_checks():
    with pytest.raises(TypeError, match="must be a keras.Model"):
        kp.fit_with_oom_retry("model", np.zeros((4, 6)))
    model, _ = _model()
    with pytest.raises(ValueError, match="is not compiled"):
        kp.fit_with_oom_retry(model, np.zeros((4, 6)), np.zeros(4))
    with pytest.raises(ValueError, match="is not compiled"):
        kp.find_max_microbatch(model, np.zeros((4, 6)), np.zeros(4))
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1"):
        kp.find_max_microbatch(model, np.zeros((4, 6)), np.zeros(4), batch_size=0)


@pytest.mark.parametrize("message", ["boom", "RESOURCE_EXHAUSTED: x", "out of memory"])
def test_oom_error_is_recognised(message):
    assert kp.backend.is_oom(kp.backend.oom_error(message))
    assert not kp.backend.is_oom(ValueError(message))
    assert not kp.backend.is_oom(RuntimeError("boom"))


@pytest.mark.backends("jax")
def test_jax_failure_inside_compiled_step_with_donated_buffers():
    # A failure while the jitted step runs (its input buffers are donated), mid-epoch. The OOM
    # is raised from a host callback, which XLA reports as INTERNAL with the callback's
    # RESOURCE_EXHAUSTED text inside: the runtime path of a real failure, not its exact status.
    import jax

    class HostOOM(keras.layers.Layer):
        def __init__(self, fail_at):
            super().__init__()
            self.fail_at, self.count = fail_at, 0

        def _check(self):
            self.count += 1
            if self.count == self.fail_at:
                raise kp.backend.oom_error(
                    "Out of memory while trying to allocate 1.0GiB (injected)."
                )
            return np.float32(0.0)

        def call(self, x, training=False):
            if not training or x.shape[0] is None or x.shape[0] <= 8:
                return x
            z = jax.experimental.io_callback(
                self._check, jax.ShapeDtypeStruct((), "float32"), ordered=True
            )
            return x + z

    def build(fail_at):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="tanh"),
                HostOOM(fail_at),
                keras.layers.Dense(3),
            ]
        )
        return _compile(model, eager=False)

    x, y = _data(n=48)
    model = build(fail_at=5)  # epoch 1, step 1
    h = kp.fit_with_oom_retry(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ref = build(fail_at=0)
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    kp.loss_scaled(ref, microbatches=2).fit(
        x, y, batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=0
    )
    assert [(e["epoch"], e["microbatches"]) for e in h.oom_events] == [(1, 1)]
    assert _max_diff(model, ref) < 1e-5 and h.epoch == [0, 1]


# -- every input kind: the retried epoch sees what the failed attempt saw -------------------
class _HostOOM(keras.layers.Layer):
    """JAX: raises the OOM from a host callback at the `fail_at`-th step (1-based) above 8."""

    def __init__(self, fail_at, **kwargs):
        super().__init__(**kwargs)
        self.fail_at, self.count = fail_at, 0

    def _check(self):
        self.count += 1
        if self.count == self.fail_at:
            raise kp.backend.oom_error("Out of memory while trying to allocate 1.0GiB (injected).")
        return np.float32(0.0)

    def call(self, x, training=False):
        import jax

        if not training or x.shape[0] is None or x.shape[0] <= 8:
            return x
        z = jax.experimental.io_callback(
            self._check, jax.ShapeDtypeStruct((), "float32"), ordered=True
        )
        return x + z


def _failing_at(step, loss=SCE):
    """A model whose training step `step` (0-based, batches above 8) runs out of memory once.

    TF runs eagerly (Python layer), torch is eager anyway; JAX runs compiled with a host
    callback (the real failure path, after donated buffers). `step=None`: never fails.
    """
    keras.utils.set_random_seed(0)
    if step is None:
        layer = OOMAbove()
    elif BACKEND == "jax":
        layer = _HostOOM(fail_at=step + 1)
    else:
        layer = OOMAbove(threshold=8, from_call=step, max_raises=1)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), layer, keras.layers.Dense(3)]
    )
    model.compile(keras.optimizers.Adam(0.01), loss, run_eagerly=EAGER and step is not None)
    return model


def _batches_in_order(x, y, batch, total):
    for i in range(total):
        j = i % (len(x) // batch)
        yield x[j * batch : (j + 1) * batch], y[j * batch : (j + 1) * batch]


def _input(kind, x, y):
    """(fit arguments, epochs) for 48 examples in batches of 16: 3 epochs of 3 steps."""
    if kind == "arrays_shuffled":
        return {"x": x, "y": y, "batch_size": 16, "shuffle": True}
    if kind == "generator":  # finite: exactly the 9 batches the 3 epochs take
        return {"x": _batches_in_order(x, y, 16, 9), "steps_per_epoch": 3}
    if kind == "generator_offset":  # epochs start at different points of a 3-batch cycle
        return {"x": _batches_in_order(x, y, 16, 10**6), "steps_per_epoch": 2}
    if kind == "pydataset_shuffled":
        return {"x": Batches(x, y, 16), "shuffle": True}
    if kind == "tf_data":
        import tensorflow as tf

        return {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(16)}
    if kind == "dataloader_shuffled":
        import torch

        data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return {"x": torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)}
    raise AssertionError(kind)


INPUT_KINDS = [
    "arrays_shuffled",
    "generator",
    "generator_offset",
    "pydataset_shuffled",
    "tf_data",
    "dataloader_shuffled",
]


@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_mid_epoch_oom_replays_the_failed_epoch_for_every_input_kind(kind):
    # Regression: a generator's retry took fresh batches (fewer updates than epochs x steps),
    # and shuffled inputs drew a new order for the retried epoch.
    import random

    if kind == "arrays_shuffled" and BACKEND == "tensorflow":
        pytest.skip("TF shuffles arrays with tf.random ops, which cannot be rewound (docs)")
    if kind == "dataloader_shuffled":
        pytest.importorskip("torch")
    x, y = _data(n=48)

    def run(model, fit):
        random.seed(0), np.random.seed(0)
        if "torch" in sys.modules:
            sys.modules["torch"].manual_seed(0)
        args = _input(kind, x, y)
        return fit(model, epochs=3, verbose=0, **args)

    model = _failing_at(step=4)  # epoch 1 (epoch 2 for 2-step epochs), after 1-2 updates
    h = run(model, kp.fit_with_oom_retry)
    ref = _failing_at(step=None)
    h_ref = run(ref, keras.Model.fit)
    assert len(h.oom_events) == 1 and h.epoch == [0, 1, 2]
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations)
    assert int(ref.optimizer.iterations) == (6 if kind == "generator_offset" else 9)
    assert _max_diff(model, ref) < 1e-5
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)


def test_generator_epoch_too_large_to_keep_gives_up_clearly(monkeypatch):
    monkeypatch.setattr(kp.oom._state, "_REPLAY_LIMIT_BYTES", 100)  # fewer bytes than one batch
    x, y = _data(n=48)
    model = _failing_at(step=4)
    with pytest.raises(
        RuntimeError, match=r"generator given as `x` cannot be replayed: .* than 100 bytes"
    ):
        kp.fit_with_oom_retry(
            model, _batches_in_order(x, y, 16, 9), steps_per_epoch=3, epochs=3, verbose=0
        )


def test_validation_generator_is_refused_before_training():
    x, y = _data(n=16)
    model, layer = _model(threshold=1000)
    _compile(model)
    val = _batches_in_order(x, y, 8, 2)
    with pytest.raises(ValueError, match=r"`validation_data` is a generator.*PyDataset"):
        kp.fit_with_oom_retry(model, x, y, batch_size=8, validation_data=val, verbose=0)
    assert layer.calls == 0 and int(model.optimizer.iterations) == 0


def test_min_batch_size_above_batch_size_is_refused_before_training():
    x, y = _data(n=16)
    model, layer = _model(threshold=1000)
    _compile(model)
    with pytest.raises(ValueError, match=r"`min_batch_size` \(32\) must be at most the batch"):
        kp.fit_with_oom_retry(model, x, y, batch_size=16, min_batch_size=32, verbose=0)
    assert layer.calls == 0


# -- loss reductions: the update of the full batch, or a refusal ------------------------------
def _sce(reduction):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
def test_accumulation_route_keeps_the_full_batch_update_or_refuses(reduction, weighted):
    # Regression: under reduction="sum" the accumulating optimizer averaged two half-batch
    # sums, i.e. half the update, silently.
    x, y = _data(n=64)
    w = np.linspace(0.2, 2.0, 64).astype("float32") if weighted else None
    model = Net(threshold=8, from_call=5)
    model.compile(keras.optimizers.Adam(0.01), _sce(reduction), run_eagerly=True)
    kwargs = dict(batch_size=16, epochs=2, shuffle=False, verbose=0, sample_weight=w)
    exact = reduction == "sum_over_batch_size" or (
        reduction == "mean_with_sample_weight" and not weighted
    )
    if not exact:
        with pytest.raises(RuntimeError, match=f'reduction="{reduction}"'):
            kp.fit_with_oom_retry(model, x, y, **kwargs)
        return
    kp.fit_with_oom_retry(model, x, y, **kwargs)
    ref = Net()
    ref.compile(keras.optimizers.Adam(0.01), _sce(reduction))
    ref.fit(x, y, **kwargs)
    assert [e["microbatches"] for e in model.history.oom_events] == [1]
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations) == 8
    assert _max_diff(model, ref) < 1e-5


@pytest.mark.parametrize("weighted", [False, True])
def test_micro_batched_route_keeps_the_full_batch_update_under_sum_reduction(weighted):
    x, y = _data(n=48)
    w = np.linspace(0.2, 2.0, 48).astype("float32") if weighted else None
    model = _failing_at(step=4, loss=_sce("sum"))
    kwargs = dict(batch_size=16, epochs=3, shuffle=False, verbose=0, sample_weight=w)
    h = kp.fit_with_oom_retry(model, x, y, **kwargs)
    ref = _failing_at(step=None, loss=_sce("sum"))
    ref.fit(x, y, **kwargs)
    assert len(h.oom_events) == 1
    assert _max_diff(model, ref) < 1e-5


@pytest.mark.parametrize("kind", ["tf_data", "tf_data_unbatched", "pydataset", "dataloader"])
def test_find_max_microbatch_reads_the_first_batches_of_a_dataset(kind):
    # Regression: a tf.data input raised "'_BatchDataset' object is not subscriptable".
    x, y = _data(n=32)
    if kind.startswith("tf_data"):
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x, y))
        data = data if kind == "tf_data_unbatched" else data.batch(8)  # 2 batches make 16
    elif kind == "pydataset":
        data = Batches(x, y, 8)
    else:
        torch = pytest.importorskip("torch")
        tensors = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        data = torch.utils.data.DataLoader(tensors, batch_size=8)
    model, layer = _model(threshold=5)
    _compile(model)
    before = [w.copy() for w in model.get_weights()]
    assert kp.find_max_microbatch(model, data, batch_size=16) == 4
    assert layer.sizes[:3] == [16, 8, 4]  # 16 examples, then halved twice
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_find_max_microbatch_refuses_generators_and_short_data():
    x, y = _data(n=16)
    model, layer = _model(threshold=5)
    _compile(model)
    with pytest.raises(TypeError, match=r"`x` is a generator or iterator"):
        kp.find_max_microbatch(model, _batches_in_order(x, y, 8, 2), batch_size=16)
    with pytest.raises(ValueError, match=r"holds 16 examples, fewer than batch_size=32"):
        kp.find_max_microbatch(model, Batches(x, y, 8), batch_size=32)
    assert layer.calls == 0


# -- the ladder: remat and micro-batches, in the order that keeps training exact ----------
class OOMUnless(keras.callbacks.Callback):
    """Raises the backend's OOM error at a step unless `fits(remat, microbatches)` of the
    model being fitted; from the `from_step`-th step of the run on (0-based, all epochs)."""

    def __init__(self, fits, from_step=0):
        super().__init__()
        self.fits, self.from_step, self.steps, self.seen = fits, from_step, 0, []

    def on_train_batch_begin(self, batch, logs=None):
        setting = (getattr(self.model, "remat", None), getattr(self.model, "microbatches", 1))
        self.seen.append(setting)
        step, self.steps = self.steps, self.steps + 1
        if step >= self.from_step and not self.fits(*setting):
            raise kp.backend.oom_error("Out of memory while trying to allocate 1GiB (injected).")

    def on_epoch_begin(self, epoch, logs=None):
        self.steps = max(self.steps, 3 * epoch)  # 3 steps per epoch: a retry restarts the count


def _bn_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="gelu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
        ]
    )


def _mlp(seed=0):
    return models.mlp([8], 6, 3, activation="gelu", seed=seed)


def _qat_mlp(seed=0):
    return kp.quantize_aware(_mlp(seed))


@pytest.mark.parametrize(
    "build, order",
    [
        (_bn_model, ["remat", "microbatches", "remat+microbatches", "remat+microbatches"]),
        pytest.param(
            _qat_mlp,
            ["remat", "microbatches", "remat+microbatches", "remat+microbatches"],
            marks=pytest.mark.slow,  # ~4 s of CPU on TF: the default tier must not grow
        ),
        (_mlp, ["microbatches", "remat", "remat+microbatches", "remat+microbatches"]),
    ],
    ids=["batchnorm", "qat", "mlp"],
)
def test_ladder_order_depends_on_batch_dependent_layers(build, order):
    # Regression (qat): a QAT model got micro-batches first, which move its activation ranges
    # once per slice towards the slice's min and max (weights 0.004-0.009 off the run
    # without OOM after 3 epochs); remat keeps the batch whole.
    x, y = _data(n=48)
    model = _compile(build(), eager=False)
    oom = OOMUnless(lambda remat, k: remat == "full" and k >= 4)
    h = kp.fit_with_oom_retry(model, x, y, batch_size=16, verbose=0, callbacks=[oom])
    assert [e["strategy"] for e in h.oom_events] == order
    assert [e["microbatches"] for e in h.oom_events] == (
        [1, 2, 1, 2] if build is _mlp else [1, 1, 2, 2]
    )
    assert (h.model.remat, h.model.microbatches) == ("full", 4)


def test_ladder_strategies_chosen_and_ordered():
    x, y = _data(n=48)
    model = _compile(_mlp(), eager=False)
    oom = OOMUnless(lambda remat, k: remat == "full")
    h = kp.fit_with_oom_retry(
        model, x, y, batch_size=16, verbose=0, callbacks=[oom], strategies=("remat",)
    )
    assert [e["strategy"] for e in h.oom_events] == ["remat"]
    assert (h.model.remat, h.model.microbatches) == ("full", 1)
    # Only remat, and it is not enough: the run gives up saying so.
    model = _compile(_mlp(), eager=False)
    never = OOMUnless(lambda remat, k: False)
    with pytest.raises(RuntimeError, match="every rung of `strategies` was tried"):
        kp.fit_with_oom_retry(
            model, x, y, batch_size=16, verbose=0, callbacks=[never], strategies=["remat"]
        )
    # Micro-batches only: doubling, never remat.
    model = _compile(_bn_model(), eager=False)
    oom = OOMUnless(lambda remat, k: k >= 4)
    h = kp.fit_with_oom_retry(
        model, x, y, batch_size=16, verbose=0, callbacks=[oom], strategies=("microbatches",)
    )
    assert [e["strategy"] for e in h.oom_events] == ["microbatches", "microbatches"]
    assert (h.model.remat, h.model.microbatches) == (None, 4)


@pytest.mark.parametrize(
    "strategies", ["remat", [], ["remat", "remat"], ["quantize"], ("microbatches", 2)]
)
def test_bad_strategies_refused_before_training(strategies):
    model = _compile(_mlp(), eager=False)
    oom = OOMUnless(lambda remat, k: True)
    with pytest.raises(ValueError, match="`strategies`"):
        kp.fit_with_oom_retry(
            model, *_data(n=16), batch_size=16, verbose=0, callbacks=[oom], strategies=strategies
        )
    assert oom.seen == []


def test_remat_rung_recovers_exactly_mid_epoch():
    # BatchNormalization: remat first. The OOM comes at the 2nd step of epoch 1, after one
    # update of that epoch was applied (rolled back); the retried epoch runs with remat.
    x, y = _data(n=48)
    model = _compile(_bn_model(), eager=False)
    oom = OOMUnless(lambda remat, k: remat == "full", from_step=4)
    h = kp.fit_with_oom_retry(
        model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[oom]
    )
    assert [(e["epoch"], e["strategy"]) for e in h.oom_events] == [(1, "remat")]
    ref = _compile(_bn_model(), eager=False)
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    twin = kp.loss_scaled(ref, remat="full")
    twin.fit(x, y, batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    # Weights, Adam slots and the moving statistics.
    assert _max_diff(model, ref) < 1e-6
    assert int(h.model.optimizer.iterations) == int(twin.optimizer.iterations) == 6


# The two regressions below take 2-4 s of CPU each on TF (three and one fits): slow tier, on
# every backend (tests/test_pairs_of_pieces.py covers them with the other pieces, on TF).
@pytest.mark.slow
def test_resumed_run_retrying_a_later_epoch_trains_each_epoch_once(tmp_path):
    # Regression: `BackupAndRestore` sets the epoch a resumed fit starts at on the model; Keras
    # never clears it and `fit` prefers it to `initial_epoch`, so the retry of epoch 2 of a
    # model with the train step started at epoch 1 again (history.epoch [1, 1, 2], 12 steps).
    x, y = _data(n=48)

    def build():
        return _compile(kp.loss_scaled(_mlp()), eager=False)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    backup = str(tmp_path / "backup")
    fit = dict(batch_size=16, epochs=3, shuffle=False, verbose=0)
    with pytest.raises(RuntimeError, match="interrupted"):
        build().fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()], **fit)
    model = build()
    oom = OOMUnless(lambda remat, k: k >= 2, from_step=7)  # epoch 2, step 1
    h = kp.fit_with_oom_retry(
        model, x, y, callbacks=[keras.callbacks.BackupAndRestore(backup), oom], **fit
    )
    assert [e["epoch"] for e in h.oom_events] == [2] and h.epoch == [1, 2]
    ref = build()
    ref.fit(x, y, **fit)
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations) == 9
    assert _max_diff(model, ref) < 1e-5


@pytest.mark.slow
def test_pruned_stock_model_restored_to_its_best_epoch_keeps_the_last_masks():
    # Regression: after an OOM a stock model goes on as a `kp.loss_scaled` twin, whose
    # `set_weights` did not mask with the latest pruning masks: EarlyStopping restored the
    # best epoch's weights (pruned at 42 %) and the model ended less pruned than logged (60 %).
    x, y = _data(n=48)
    model = _compile(_mlp(), eager=False)
    pruning = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.6, 0, 6, frequency=2))
    # The logged sparsity, lowest first: the best epoch is the first, pruned less than the last.
    es = kp.EarlyStopping("sparsity", mode="min", patience=5, restore_best_weights=True)
    oom = OOMUnless(lambda remat, k: k >= 2, from_step=4)  # epoch 1, step 1
    h = kp.fit_with_oom_retry(
        model, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
        callbacks=[pruning, es, oom],
    )  # fmt: skip
    assert len(h.oom_events) == 1 and h.model is not model and es.best_epoch == 0
    kernels = [np.array(w) for w in model.trainable_weights if len(w.shape) == 2]
    zeros = sum(int(np.sum(k == 0)) for k in kernels) / sum(k.size for k in kernels)
    assert h.history["sparsity"] == pytest.approx([0.42, 0.6, 0.6], abs=0.02)
    assert zeros == pytest.approx(h.history["sparsity"][-1], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("oom_epoch", [0, 1])
@pytest.mark.parametrize("pruning", ["magnitude", "channel"])
def test_retried_epoch_starts_from_the_pruning_state_it_first_started_from(pruning, oom_epoch):
    # Regressions: the pruning masks (variables outside the model) were not part of the
    # epoch's snapshot, so a retried epoch trained under the masks its failed attempt had
    # reached (0.015 off); and ChannelPruningCallback read the step at the first epoch only,
    # so a retried epoch 0 ran the schedule ahead by the failed steps (0.47 off).
    # 4 steps per epoch, mask updates at steps 1, 3, 5, 7, 9: each epoch starts without one
    # and the OOM comes after its two. Remat, the rung here, is exact to the bit.
    x, y = _data(n=64)

    def run(fit, callbacks=(), remat=None):
        model = _mlp()
        if remat is not None:
            model = kp.loss_scaled(model, remat=remat)
        _compile(model, eager=False)
        if pruning == "magnitude":
            cb = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.6, 1, 9, frequency=2))
        else:
            cb = kp.ChannelPruningCallback(kp.PolynomialDecay(0.0, 0.5, 1, 9, frequency=2))
        fit(model, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
            callbacks=[cb, *callbacks])  # fmt: skip
        return model, cb

    oom = OOMUnless(lambda remat, k: remat == "full", from_step=4 * oom_epoch + 3)
    model, cb = run(
        functools.partial(kp.fit_with_oom_retry, strategies=("remat",)), callbacks=[oom]
    )
    ref, ref_cb = run(keras.Model.fit, remat="full")
    assert [e["epoch"] for e in model.history.oom_events] == [oom_epoch]
    assert _max_diff(model, ref) < 1e-6
    assert cb.sparsity == ref_cb.sparsity > 0.4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sequential", "sequential_pydataset", "subclassed"])
def test_oom_after_updates_of_the_first_epoch_rolls_back_what_the_first_step_built(kind):
    # Regression (TensorFlow): the optimizer's slots, and an unbuilt model's weights, are made
    # in the first traced step, after the first epoch's snapshot; an epoch 0 retried after two
    # updates went on from the failed attempt's Adam slots (0.025 off the run without OOM) and
    # a subclassed model's weights too (0.04 off). They are built before the run now.
    x, y = _data(n=48)
    if kind == "subclassed":  # the accumulation rung: two batches of 8 per update
        model = _compile(Net(threshold=8, from_call=2), eager=True)
        h = kp.fit_with_oom_retry(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        ref = _compile(Net(), eager=False)
    else:
        data = {"x": Batches(x, y, 16)} if kind.endswith("pydataset") else {"x": x, "y": y}
        model = _compile(_mlp(), eager=False)
        oom = OOMUnless(lambda remat, k: k >= 2, from_step=2)
        h = kp.fit_with_oom_retry(model, **data, batch_size=16 if "y" in data else None,
                                  epochs=2, shuffle=False, verbose=0, callbacks=[oom])  # fmt: skip
        ref = _compile(kp.loss_scaled(_mlp(), microbatches=2), eager=False)
    ref.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert [e["epoch"] for e in h.oom_events] == [0]
    assert int(model.optimizer.iterations) == int(ref.optimizer.iterations) == 6
    assert _max_diff(model, ref) < 1e-5


class MixinNet(kp.LossScaleTrainStep, keras.Model):
    def __init__(self):
        super().__init__()
        keras.utils.set_random_seed(0)
        self.hidden, self.out = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_unbuilt_model_fed_a_dataset_gives_up_when_its_first_epoch_cannot_be_rolled_back():
    # TensorFlow builds it in the first step, and a dataset is not read ahead to build it
    # before (that could draw a shuffle): after updates, nothing to roll back to.
    x, y = _data(n=48)
    model = _compile(MixinNet(), eager=False)
    oom = OOMUnless(lambda remat, k: k >= 2, from_step=2)
    with pytest.raises(RuntimeError, match=r"were made in the failed epoch's first step.*"
                       r"call it on a batch of data"):  # fmt: skip
        kp.fit_with_oom_retry(model, Batches(x, y, 16), verbose=0, callbacks=[oom])
    # An OOM in the first step, before any update, is retried: the variables hold their
    # initial values.
    model = _compile(MixinNet(), eager=False)
    oom = OOMUnless(lambda remat, k: k >= 2)
    h = kp.fit_with_oom_retry(model, Batches(x, y, 16), verbose=0, callbacks=[oom])
    assert [e["epoch"] for e in h.oom_events] == [0] and int(model.optimizer.iterations) == 3


# -- the model and the monitor after a recovery (issue 41, items 4 and 5) ------------------
def _usable_after_recovery(model, x, y, history):
    """What a plain `fit` leaves: metric states of the last epoch; evaluate, the LR range
    test and another fit run."""
    result = model.get_metrics_result()
    assert float(result["accuracy"]) == pytest.approx(history.history["accuracy"][-1])
    assert np.isfinite(model.evaluate(x, y, verbose=0)).all()
    assert kp.find_learning_rate(model, x, y, steps=8, batch_size=16).lrs
    assert np.isfinite(model.fit(x, y, batch_size=16, verbose=0).history["loss"]).all()


def test_monitor_keeps_its_measure_and_model_is_usable_after_a_recovery():
    # Regression (issue 41, item 4): after the recovery the monitor measured the user's model,
    # which no longer trains (the twin does): epochs 2-3 logged the process's peak RSS
    # (1.1 GB, `host_peak_rss`) where epoch 1 logged the step's count (32 KB).
    x, y = _data(n=48)
    model = _mlp()
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"])
    oom = OOMUnless(lambda remat, k: k >= 2, from_step=3)  # epoch 2's first step
    mon = kp.TrainingMonitor()
    h = kp.fit_with_oom_retry(
        model, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[oom, mon]
    )
    assert [(e["epoch"], e["strategy"]) for e in h.oom_events] == [(1, "microbatches")]
    measures = [r["memory_measure"] for r in mon.history]
    if BACKEND != "tensorflow" and not kp.backend.has_accelerator():
        assert (
            measures
            == [{"jax": "xla_memory_analysis", "torch": "torch_saved_tensors"}[BACKEND]] * 3
        )
        peaks = [r["peak_memory_bytes"] for r in mon.history]
        assert max(peaks) < 2**20  # the step's count of a 6-8-3 MLP, not the process
    assert len(set(measures)) == 1
    _usable_after_recovery(model, x, y, h)


@pytest.mark.backends("jax")
def test_metrics_have_values_after_a_failure_inside_the_compiled_step():
    # Regression (issue 41, item 5): Keras' JAX trainer takes the metric variables' values
    # into the compiled step (purged, then donated); after the failed fit the user's model,
    # which the twin replaced, kept metric variables without values and
    # `kp.find_learning_rate` next raised a TypeError (or "Array has been deleted").
    x, y = _data(n=48)
    keras.utils.set_random_seed(0)
    layer = _HostOOM(fail_at=5)  # epoch 1, step 1
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), layer, keras.layers.Dense(3)]
    )
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"])
    h = kp.fit_with_oom_retry(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert [e["epoch"] for e in h.oom_events] == [1]
    layer.fail_at = -1
    _usable_after_recovery(model, x, y, h)
