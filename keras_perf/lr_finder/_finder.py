"""`find_learning_rate`: the range test run through Keras' own `fit`, the model put back after.

One `fit` call runs the test, one step per epoch (`steps_per_epoch=1`): Keras resets its metrics
at every epoch, so each epoch's logged `loss` is exactly that step's loss (within an epoch the
log is a running mean), and between epochs every backend reads the variables afresh (the JAX
trainer syncs its state there), so a learning rate assigned in `on_epoch_begin` reaches the
next step without a retrace. Keras' data handling, callbacks and train step (ours included:
`kp.loss_scaled`, `DistillationModel`) run unchanged.

The learning rate: an optimizer built with a float holds it in a variable, assigned before each
step; one with a schedule (or a callable) gets a geometric schedule of `iterations` for the
test, and its own object back afterwards (the train step is retraced for the test and the
model's own compiled step put back). Lives elsewhere: the state saved and restored (`_state`),
the curve and the suggestion (`_curve`).
"""

from __future__ import annotations

import collections.abc
import math
import warnings

import keras

from keras_perf import backend as _backend
from keras_perf._inputs import check_fit_data, check_no_ignored_settings
from keras_perf._keras_internals import learning_rate_source
from keras_perf._utils import check_int, check_number, iter_layers, warn
from keras_perf.lr_finder._curve import LRFinderResult, SmoothedLoss, diverged
from keras_perf.lr_finder._state import ModelState

_OUT_OF_DATA = "Your input ran out of data"


def geometric_lrs(min_lr: float, max_lr: float, steps: int) -> list[float]:
    """`steps` learning rates from `min_lr` to `max_lr` (both included), equally spaced in log."""
    ratio = math.log(max_lr / min_lr)
    return [min_lr * math.exp(ratio * k / (steps - 1)) for k in range(steps)]


class _RangeSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`geometric_lrs(...)[iterations - start]`, computed in the compiled step (no host sync)."""

    def __init__(self, min_lr: float, max_lr: float, steps: int, start: int):
        self.min_lr, self.max_lr, self.steps, self.start = min_lr, max_lr, steps, start

    def __call__(self, step):
        ops = keras.ops
        k = ops.clip(ops.cast(step, "float32") - float(self.start), 0.0, self.steps - 1.0)
        rate = math.log(self.max_lr / self.min_lr) / (self.steps - 1)
        return self.min_lr * ops.exp(k * rate)

    def get_config(self):
        return {
            "min_lr": self.min_lr,
            "max_lr": self.max_lr,
            "steps": self.steps,
            "start": self.start,
        }


class _RangeTestCallback(keras.callbacks.Callback):
    """Sets each step's learning rate, records its loss, stops on divergence or at `steps`."""

    # on_train_batch_end only notes that a step ran: it reads neither the model nor the logs,
    # so Keras may keep dispatching steps asynchronously (JAX, torch).
    async_safe = True

    def __init__(self, lrs, smoothing, assign, on_train_begin, one_pass=False):
        super().__init__()
        # An iterator (a generator) is read once: when it ends, Keras starts again from the
        # batches it kept to infer the data's spec, which the test must not train on again.
        self.one_pass = one_pass
        self.planned = lrs
        self.assign = assign  # assign each rate to the optimizer's variable (else: a schedule)
        self.smoothing = SmoothedLoss(smoothing)
        self._on_train_begin = on_train_begin
        self.lrs, self.raw_losses, self.losses = [], [], []
        self.stop_reason = None
        self._lr = None
        self._stepped = False
        self._empty_epochs = 0

    def on_train_begin(self, logs=None):
        self._on_train_begin()  # Keras has built the model, metrics and optimizer by now

    def on_epoch_begin(self, epoch, logs=None):
        optimizer = self.model.optimizer
        if self.assign:
            self._lr = self.planned[len(self.lrs)]
            optimizer.learning_rate = self._lr
        else:  # what the schedule gives at this step's `iterations`
            self._lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        self._stepped = False

    def on_train_batch_end(self, batch, logs=None):
        self._stepped = True

    def on_epoch_end(self, epoch, logs=None):
        if not self._stepped:  # the data ran out: a re-iterable input starts again next epoch
            self._empty_epochs += 1
            if self._empty_epochs >= 2 or self.one_pass:
                self._stop(f"the data ran out after {len(self.lrs)} batches")
            return
        self._empty_epochs = 0
        if "loss" not in (logs or {}):
            raise ValueError(
                "find_learning_rate follows the logged `loss`, but the model's train step "
                f"logs only {sorted(logs or {})}: return the loss under the key 'loss'."
            )
        raw = float(logs["loss"])
        self.lrs.append(self._lr)
        self.raw_losses.append(raw)
        self.losses.append(self.smoothing.update(raw))
        if not math.isfinite(raw):
            self._stop(f"the loss was {raw} at learning rate {self._lr:.3g}")
        elif diverged(self.losses):
            self._stop(
                f"the smoothed loss {self.losses[-1]:.4g} exceeded 4x its lowest value "
                f"{min(self.losses):.4g} at learning rate {self._lr:.3g}"
            )
        elif len(self.lrs) == len(self.planned):
            self.model.stop_training = True

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.model.stop_training = True


def _check_arguments(model, x, min_lr, max_lr, steps, batch_size, smoothing):
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            "`model` is not compiled: call `model.compile(optimizer=..., loss=...)` before "
            "find_learning_rate (it trains with the model's own optimizer and loss)."
        )
    min_lr = check_number("min_lr", min_lr, low=0.0, low_inclusive=False)
    max_lr = check_number("max_lr", max_lr, low=0.0, low_inclusive=False)
    if not math.isfinite(max_lr):
        raise ValueError(f"`max_lr` must be finite, got {max_lr!r}.")
    if min_lr >= max_lr:
        raise ValueError(
            f"`min_lr` must be < `max_lr`, got min_lr={min_lr!r} >= max_lr={max_lr!r}."
        )
    steps = check_int("steps", steps, minimum=5)
    check_int("batch_size", batch_size, minimum=1, allow_none=True)
    smoothing = check_number("smoothing", smoothing, low=0.0, high=1.0, low_inclusive=False)
    if x is None:
        raise ValueError("`x` is None: pass the training data as `model.fit` takes it.")
    return min_lr, max_lr, steps, smoothing


def _build_optimizer(model) -> None:
    """Build the optimizer now if the model is built, so its slots are in the saved state.

    JAX and PyTorch build an unbuilt model, its metrics and its optimizer when `fit` starts,
    before any callback; TensorFlow builds them while tracing the first step, after the state
    is saved. Building the optimizer here is what its first step would do (Keras' own symbolic
    build calls the same `build(model.trainable_variables)`). A model itself unbuilt on
    TensorFlow is refused: its weights would be created, then trained, inside the test.
    """
    model_built = all(layer.built for layer in (model, *iter_layers(model)))
    if not model_built and keras.backend.backend() == "tensorflow":
        raise ValueError(
            "`model` is not built. On the TensorFlow backend Keras creates an unbuilt model's "
            "weights inside the first training step, so the range test could not put them "
            "back: build it first (give it a `keras.Input`, call `model.build(input_shape)` "
            "or call it on a batch)."
        )
    if model_built and not model.optimizer.built:
        with _backend.model_scope(model):  # a tf.distribute model's slots are its strategy's
            model.optimizer.build(model.trainable_variables)


def _innermost(optimizer):
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def fresh_slots(model) -> None:
    """Give the model's optimizer the variable values of a new optimizer of the same
    configuration: slots (momentum, moments, accumulators), `iterations` and gradient
    accumulators as before its first step (Lightning re-creates the optimizer for `lr_find`).

    The optimizer object, its configuration (clipping, weight decay, EMA, accumulation) and the
    compiled step stay; only values change (the caller saved them). A `LossScaleOptimizer`'s own
    scale is kept: it measures the gradients' range, not the past updates. An optimizer that
    cannot be re-created from its config keeps its slots, with a warning.
    """
    optimizer = _innermost(model.optimizer)
    if not optimizer.built:
        return  # nothing to reset: its first step builds fresh slots
    own_lr = learning_rate_source(optimizer)
    try:
        config = optimizer.get_config()
        # The learning rate plays no part in the slots' initial values; a float keeps a
        # schedule or callable (which may not serialise) out of the way.
        config["learning_rate"] = 0.0
        with _backend.model_scope(model):
            fresh = type(optimizer).from_config(config)
            fresh.build(model.trainable_variables)
        fresh_lr = learning_rate_source(fresh)
        own = [v for v in optimizer.variables if v is not own_lr]
        new = [v for v in fresh.variables if v is not fresh_lr]
        if len(own) != len(new) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(own, new, strict=True)
        ):
            raise ValueError(
                f"its variables do not line up ({len(own)} against {len(new)} re-created)"
            )
        values = [keras.ops.convert_to_numpy(v.value) for v in new]
    except Exception as exc:
        warn(
            f"find_learning_rate: could not re-create {type(optimizer).__name__} from its "
            f"config ({type(exc).__name__}: {exc}): the range test starts from the optimizer's "
            "current slots, so momentum left by earlier training may drive the curve.",
            stacklevel=5,
        )
        return
    for variable, value in zip(own, values, strict=True):
        variable.assign(value)


def find_learning_rate(
    model,
    x,
    y=None,
    min_lr: float = 1e-7,
    max_lr: float = 10.0,
    steps: int = 100,
    batch_size: int | None = None,
    smoothing: float = 0.05,
    *,
    sample_weight=None,
    class_weight=None,
    shuffle=True,
) -> LRFinderResult:
    """Run a learning-rate range test on a compiled model, then put the model back as it was.

    Trains `steps` batches with the learning rate rising geometrically from `min_lr` to
    `max_lr` (Smith 2015; fastai's `lr_find`, Lightning's `Tuner.lr_find`), through the
    model's own `fit`, optimizer, loss and train step. The loss is smoothed (an exponential
    moving average with bias correction, weight `smoothing` on each new loss). The run stops
    early once the loss diverges: a non-finite loss, or a smoothed loss above 4 times the
    lowest so far (fastai's and Lightning's rule). The suggestion is the learning rate at the
    steepest descent of the smoothed loss against log(learning rate), leaving out the first
    `steps // 10` points and the last one (Lightning's rule and skips; see docs/lr_finder.md).

    Afterwards the model is as before: weights, optimizer variables and `iterations`, the
    learning rate (the same schedule object, when it is one), metric states, compile settings,
    the compiled train step and the host random generators, so a following `fit` is what it
    would have been without the test (an optimizer never built before is left built, with the
    values its first step would start from). Works with any optimizer whose learning rate is a
    float, a schedule or a callable, with `kp.loss_scaled` and `DistillationModel` models and
    quantization-aware models. Data that runs out before `steps` batches is started again if
    it can be (arrays, `tf.data`, `PyDataset`, `DataLoader`); a generator that ends ends the
    curve, with a warning.

    Args:
        model: A compiled `keras.Model`.
        x: Training data, as `model.fit` takes it: arrays, a `tf.data.Dataset`, a
            `keras.utils.PyDataset`, a generator or a torch `DataLoader`.
        y: Targets, when `x` is arrays. Defaults to `None`.
        min_lr: First learning rate, > 0. Defaults to `1e-7`.
        max_lr: Last learning rate, > `min_lr`. Defaults to `10.0`.
        steps: Number of batches (learning rates) to try, >= 5. Defaults to `100`.
        batch_size: Batch size for array data, as in `fit`. Defaults to `None` (`fit`'s 32).
        smoothing: Weight of each new loss in the moving average, in (0, 1]; 1 is no
            smoothing. Defaults to `0.05`.
        sample_weight: As in `fit`. Defaults to `None`.
        class_weight: As in `fit`. Defaults to `None`.
        shuffle: As in `fit`. Defaults to `True`.

    Returns:
        An `LRFinderResult`: `suggestion`, `lrs`, `losses` (smoothed), `raw_losses`,
        `stop_reason`, and `plot(path)` (needs the `plot` extra).

    Raises:
        TypeError: `model` is not a `keras.Model`, or an argument has the wrong type.
        ValueError: the model is not compiled, `min_lr` or `max_lr` is not positive,
            `min_lr >= max_lr`, `steps < 5`, `smoothing` is outside (0, 1], `x` holds no
            examples or is a dict without one of the model's inputs, or `fit` rejects the data
            (raised before any step, the model untouched).

    Example:
        >>> import numpy as np, keras, keras_perf as kp
        >>> x, y = np.random.rand(256, 8).astype("float32"), np.random.rand(256, 1)
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        >>> model.compile(keras.optimizers.SGD(0.01), "mse")
        >>> f = kp.find_learning_rate(model, x, y, min_lr=1e-4, max_lr=10.0, steps=30)
        >>> f.suggestion is None or 1e-4 <= f.suggestion <= 10.0
        True
    """
    min_lr, max_lr, steps, smoothing = _check_arguments(
        model, x, min_lr, max_lr, steps, batch_size, smoothing
    )
    check_fit_data("find_learning_rate", model, x)
    check_no_ignored_settings("find_learning_rate", model)
    optimizer = model.optimizer
    own_lr = learning_rate_object(optimizer)
    assign = isinstance(own_lr, keras.Variable)
    state = ModelState(model)
    schedule = None if assign else _RangeSchedule(min_lr, max_lr, steps, 0)

    def on_train_begin():
        # Keras has built the model, metrics and optimizer by now: save, then start the test
        # from fresh slots (every value comes back in `state.restore()`).
        state.save_variables()
        fresh_slots(model)
        if schedule is not None:  # read when the step is traced, at the first step after this
            schedule.start = int(keras.ops.convert_to_numpy(optimizer.iterations))

    callback = _RangeTestCallback(
        geometric_lrs(min_lr, max_lr, steps),
        smoothing,
        assign,
        on_train_begin,
        one_pass=isinstance(x, collections.abc.Iterator),
    )
    _build_optimizer(model)
    state.save_attributes()
    try:
        if not assign:
            optimizer.learning_rate = schedule
        if not assign or model.steps_per_execution != 1:
            state.save_train_function()
            model.steps_per_execution = 1  # one step per epoch, one loss per step
            model.train_function = None  # traced again with the test's learning rate
        with warnings.catch_warnings():
            # Keras warns each time data runs out; the callback decides what that means.
            warnings.filterwarnings("ignore", message=_OUT_OF_DATA)
            model.fit(
                x,
                y,
                batch_size=batch_size,
                epochs=2 * steps,  # room for the empty epochs of data that runs out
                steps_per_epoch=1,
                sample_weight=sample_weight,
                class_weight=class_weight,
                shuffle=shuffle,
                callbacks=[callback],
                verbose=0,
            )
    finally:
        if not assign:
            optimizer.learning_rate = own_lr  # the same object, through the public setter
        state.restore()
    result = LRFinderResult(
        callback.lrs,
        callback.raw_losses,
        callback.losses,
        min_lr=min_lr,
        max_lr=max_lr,
        steps=steps,
        smoothing=smoothing,
        stop_reason=callback.stop_reason,
    )
    if callback.stop_reason and callback.stop_reason.startswith("the data ran out"):
        warn(
            f"find_learning_rate: {callback.stop_reason}, before the {steps} steps asked for; "
            "the curve stops there. Pass data that can be iterated again (arrays, tf.data, "
            "PyDataset, DataLoader) or a generator that yields at least `steps` batches.",
            stacklevel=2,
        )
    if result.suggestion is None:
        warn(
            f"find_learning_rate: no suggestion from {len(result.lrs)} points: the smoothed loss "
            "never fell between the skipped ends of the curve. Lower `min_lr` (the loss may "
            "already diverge at the start) or raise `steps`.",
            stacklevel=2,
        )
    return result


def learning_rate_object(optimizer):
    """The learning rate as `optimizer` holds it (a variable, a schedule or a callable); a
    `LossScaleOptimizer` delegates to its `inner_optimizer`."""
    return learning_rate_source(_innermost(optimizer))
