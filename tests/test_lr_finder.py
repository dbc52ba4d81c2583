"""kp.find_learning_rate: the range test's curve, its suggestion, and the model put back after it.

Ground truth: linear least squares with plain SGD diverges above 2/λmax of the loss's Hessian,
so the suggestion must land below it (and not absurdly far below). The suggestion rule is
checked against Lightning's `suggestion()` test cases, ported; the promise that the model is
untouched is checked variable by variable, and by a following `fit` giving the same weights.
"""

import math
import sys
import warnings

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf import KerasPerfWarning
from keras_perf.lr_finder import LRFinderResult, steepest_descent
from keras_perf.lr_finder._curve import SmoothedLoss, diverged
from keras_perf.lr_finder._finder import _RangeTestCallback, geometric_lrs, learning_rate_object

BACKEND = keras.backend.backend()
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n=128, d=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype("float32"), rng.integers(0, classes, n)


def _mlp(d=8, classes=3, dropout=False):
    layers = [keras.Input((d,)), keras.layers.Dense(16, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(0.2, seed=1))
    return keras.Sequential([*layers, keras.layers.Dense(classes)])


def _compiled(optimizer="adam", **kwargs):
    model = _mlp(**kwargs)
    model.compile(optimizer, SCE, metrics=["accuracy"])
    return model


def _state(model):
    """Every value a `fit` can change: variables (seeds included), optimizer, metrics."""
    variables = model.variables + model.optimizer.variables + model.metrics_variables
    return [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in variables]


def _assert_same_state(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


# --- the curve: smoothing, divergence, suggestion (no training) -------------------------------


def test_smoothing_is_a_bias_corrected_moving_average():
    s = SmoothedLoss(0.05)
    losses = [2.0, 1.0, 4.0, 3.0]
    got = [s.update(v) for v in losses]
    avg, want = 0.0, []
    for n, v in enumerate(losses, start=1):
        avg = 0.95 * avg + 0.05 * v
        want.append(avg / (1 - 0.95**n))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[0] == pytest.approx(
        2.0, rel=1e-12
    )  # bias correction: the first point is the first loss, not 0.05 of it
    assert [SmoothedLoss(1.0).update(v) for v in (5.0, 7.0)] == [5.0, 7.0]  # 1: no smoothing


def test_divergence_rule():
    assert not diverged([1.0])
    assert not diverged([1.0, 0.5, 2.0])  # exactly 4x the best is not yet divergence
    assert diverged([1.0, 0.5, 2.01])
    assert diverged([1.0, float("nan")])
    assert diverged([float("inf")])


def test_geometric_learning_rates():
    lrs = geometric_lrs(1e-4, 1.0, 5)
    np.testing.assert_allclose(lrs, [1e-4, 1e-3, 1e-2, 1e-1, 1.0], rtol=1e-12)


# Lightning's `test_suggestion_not_enough_finite_points` cases (skip_begin, skip_end, losses,
# no suggestion expected), on learning rates 1, 2, 3, ... as there.
NAN, INF = float("nan"), float("inf")
MIXED = [NAN, NAN, 0, INF, 1, 2, 3, INF, 2, NAN, 1]


@pytest.mark.parametrize(
    "skip_begin, skip_end, losses, none_expected",
    [
        (0, 0, [], True),
        (10, 1, [], True),
        (0, 2, [0, 1, 2], True),
        (0, 1, [2, 1, 0], False),
        (1, 1, [2, 1, 0], True),
        (1, 1, [3, 2, 1, 0], False),
        (0, 1, MIXED, False),
        (4, 1, MIXED, False),
    ],
)
def test_suggestion_needs_two_finite_points_lightning_cases(
    skip_begin, skip_end, losses, none_expected
):
    # Lightning's cases use rising losses ([0, 1, 2]); ours also refuses a loss that never
    # falls, so the cases that must give a suggestion fall where Lightning's rise.
    lrs = np.arange(1, len(losses) + 1, dtype=float)
    index = steepest_descent(lrs, losses, skip_begin, skip_end)
    assert (index is None) == none_expected


def test_suggestion_ignores_non_finite_values_lightning_case():
    lrs = geometric_lrs(1e-6, 1.0, 50)
    losses = list(np.cos(np.linspace(0, np.pi, 50)) + 2)
    before = steepest_descent(lrs, losses)
    losses[-1] = NAN  # Lightning: a NaN last loss changes nothing
    assert steepest_descent(lrs, losses) == before
    losses[25] = INF
    index = steepest_descent(lrs, losses)
    assert index is not None and math.isfinite(losses[index])


def test_suggestion_is_the_steepest_descent_against_log_lr():
    # Lightning's `test_gradient_correctness` (sin on 0..2π, steepest descent at π), with the
    # sine taken of log(lr) over a geometric grid: the steepest descent is at log(lr) = π.
    lrs = np.exp(np.linspace(0, 2 * np.pi, 1000))
    index = steepest_descent(lrs, np.sin(np.log(lrs)), skip_begin=2, skip_end=2)
    assert abs(math.log(lrs[index]) - math.pi) < 1e-2


def _lightning(losses, up_to_lowest=True):
    """pytorch_lightning's suggestion(): np.gradient(losses[10:-1]).argmin() + 10; ours looks
    only up to the lowest of those losses (everywhere where the lowest is the first)."""
    kept = np.asarray(losses)[10:-1]
    slopes = np.gradient(kept)
    if up_to_lowest and kept.argmin() > 0:
        slopes = slopes[: int(kept.argmin()) + 1]
    return int(slopes.argmin()) + 10


def test_on_a_geometric_grid_the_rule_is_lightning_s_index_rule():
    rng = np.random.default_rng(0)
    lrs = geometric_lrs(1e-7, 10.0, 100)
    same = 0
    for _ in range(20):
        losses = np.cumsum(rng.normal(size=100))
        assert steepest_descent(lrs, losses, 10, 1) == _lightning(losses)
        same += _lightning(losses) == _lightning(losses, up_to_lowest=False)
    assert 0 < same < 20  # random walks: both sides of the difference are exercised


def test_a_descent_after_the_lowest_loss_is_not_suggested():
    """The run stops at 4x the lowest loss; below that, a loss that blew up can fall back
    steeply (digits on torch, seed 1: 1.5, up to 5.2, down to 5.0 at lr 3.3, which Lightning's
    rule suggests and which trains to 10 % accuracy). The suggestion is the steepest descent
    before the lowest loss."""
    lrs = geometric_lrs(1e-7, 10.0, 100)
    losses = np.concatenate(
        [
            np.linspace(2.4, 1.5, 60),  # the descent, 0.015 a step
            np.linspace(1.5, 5.2, 25)[1:],  # the divergence, not 4x the lowest
            np.linspace(5.2, 4.0, 6)[1:],  # falling back: 0.24 a step
            np.full(11, 4.0),
        ]
    )
    assert len(losses) == 100
    index = steepest_descent(lrs, losses, 10, 1)
    assert 10 <= index <= 59 and _lightning(losses, up_to_lowest=False) > 80
    r = LRFinderResult(lrs, losses, losses, min_lr=1e-7, max_lr=10.0, steps=100, smoothing=1.0,
                       stop_reason=None)  # fmt: skip
    assert r.suggestion == lrs[index] < 1e-1


def test_result_suggest_and_repr():
    lrs = geometric_lrs(1e-5, 1.0, 20)
    losses = list(1.0 / (1.0 + np.exp(np.linspace(-6, 6, 20))))  # falls fastest mid-way
    r = LRFinderResult(
        lrs, losses, losses, min_lr=1e-5, max_lr=1.0, steps=20, smoothing=1.0, stop_reason=None
    )
    assert r.suggestion_index in (9, 10)
    assert r.suggestion == lrs[r.suggestion_index]
    assert r.suggest(skip_begin=12) == lrs[12]  # past the steepest point: the first kept one
    assert f"suggestion={r.suggestion:.3g}" in repr(r) and "20 of 20 steps" in repr(r)


# --- bad input: a clear error before any step ------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"min_lr": 1.0, "max_lr": 1.0}, ValueError, "`min_lr` must be < `max_lr`"),
        ({"min_lr": 0.5, "max_lr": 0.1}, ValueError, "`min_lr` must be < `max_lr`"),
        ({"min_lr": 0.0}, ValueError, "`min_lr` must be in"),
        ({"min_lr": -1e-3}, ValueError, "`min_lr` must be in"),
        ({"max_lr": -1.0}, ValueError, "`max_lr` must be in"),
        ({"max_lr": float("inf")}, ValueError, "`max_lr` must be finite"),
        ({"steps": 4}, ValueError, "`steps` must be an integer >= 5"),
        ({"steps": 10.0}, TypeError, "`steps` must be an integer"),
        ({"smoothing": 0.0}, ValueError, "`smoothing` must be in"),
        ({"smoothing": 1.5}, ValueError, "`smoothing` must be in"),
        ({"batch_size": 0}, ValueError, "`batch_size` must be an integer >= 1"),
        ({"min_lr": "1e-3"}, TypeError, "`min_lr` must be a number"),
    ],
)
def test_bad_arguments_are_refused_before_any_step(kwargs, error, match):
    x, y = _data()
    model = _compiled()
    before = _state(model)
    with pytest.raises(error, match=match):
        kp.find_learning_rate(model, x, y, **kwargs)
    _assert_same_state(before, _state(model))


def test_an_uncompiled_model_or_no_model_is_refused():
    x, y = _data()
    with pytest.raises(ValueError, match="not compiled: call `model.compile"):
        kp.find_learning_rate(_mlp(), x, y)
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        kp.find_learning_rate("model", x, y)
    with pytest.raises(ValueError, match="`x` is None"):
        kp.find_learning_rate(_compiled(), None)


def _two_inputs(structure="dict"):
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b} if structure == "dict" else [a, b], out)
    model.compile("sgd", "mse")
    return model


def test_no_examples_or_a_missing_input_is_named_before_any_step():
    """Regression (issue 41, item 9): 0 examples raised `ZeroDivisionError` from Keras' array
    adapter; a dict `x` without one of the model's inputs failed inside the traced step."""
    model = _compiled()
    before = _state(model)
    with pytest.raises(ValueError, match=r"find_learning_rate: `x` holds no examples"):
        kp.find_learning_rate(model, np.zeros((0, 8), "float32"), np.zeros(0))
    _assert_same_state(before, _state(model))
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(64, 4)), "b": rng.normal(size=(64, 3))}
    y = rng.normal(size=(64, 1))
    for structure in ("dict", "list"):
        model = _two_inputs(structure)
        with pytest.raises(
            ValueError, match=r"`x` is a dict without the model's input\(s\) \['b'\]"
        ):
            kp.find_learning_rate(model, {"a": x["a"]}, y)
        assert int(model.optimizer.iterations) == 0
    with pytest.raises(ValueError, match=r"`x` is a list of 1 arrays, but the model has 2"):
        kp.find_learning_rate(_two_inputs("list"), [x["a"]], y)
    if BACKEND == "tensorflow":  # a dataset of dicts: read from its element spec
        import tensorflow as tf

        ds = tf.data.Dataset.from_tensor_slices(({"a": x["a"]}, y)).batch(8)
        with pytest.raises(ValueError, match=r"without the model's input\(s\) \['b'\]"):
            kp.find_learning_rate(_two_inputs(), ds)
        with pytest.raises(ValueError, match="the tf.data dataset `x` is empty"):
            kp.find_learning_rate(_two_inputs(), ds.take(0))
    with warnings.catch_warnings():  # 5 steps may give no suggestion: not the point
        warnings.simplefilter("ignore", KerasPerfWarning)
        f = kp.find_learning_rate(_two_inputs(), x, y, max_lr=1e-2, steps=5)  # both: it runs
    assert len(f.lrs) == 5


def test_remat_set_on_a_plain_model_is_refused_with_the_fix():
    """Regression (issue 41, item 10): `model.remat = "full"` on a plain Keras model is an
    attribute Keras never reads; it was silently ignored."""
    x, y = _data()
    model = _compiled()
    model.remat = "full"
    with pytest.raises(ValueError, match=r"kp.loss_scaled\(model, remat='full'\)"):
        kp.find_learning_rate(model, x, y)
    assert int(model.optimizer.iterations) == 0
    wrapped = kp.loss_scaled(_mlp(), remat="full")  # the fix: keras-perf's train step reads it
    wrapped.compile("adam", SCE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KerasPerfWarning)
        f = kp.find_learning_rate(wrapped, x, y, steps=5)
    assert len(f.lrs) == 5


def test_data_fit_rejects_is_refused_before_any_step_model_untouched():
    x, y = _data()
    model = _compiled()
    model.fit(x, y, epochs=1, verbose=0)  # built, metrics holding values
    before = _state(model)
    lr = model.optimizer.learning_rate
    with pytest.raises(ValueError):
        kp.find_learning_rate(model, "not data", y)
    with pytest.raises(ValueError):  # fit's own check: `y` with a dataset
        kp.find_learning_rate(model, _Batches(x, y), y)
    _assert_same_state(before, _state(model))
    assert model.optimizer.learning_rate is lr


# --- ground truth: least squares, plain SGD --------------------------------------------------


@pytest.mark.parametrize("schedule", [False, True], ids=["float_lr", "schedule"])
def test_least_squares_suggestion_is_below_the_stability_limit(schedule):
    rng = np.random.default_rng(0)
    n, d = 128, 8
    x = rng.normal(size=(n, d)).astype("float32") * np.linspace(0.5, 2.0, d).astype("float32")
    y = x @ rng.normal(size=(d, 1)).astype("float32") + 0.1 * rng.normal(size=(n, 1))
    # loss = mean((xw - y)^2): Hessian 2 xᵀx / n; full-batch SGD diverges above 2 / λmax.
    limit = 2.0 / np.linalg.eigvalsh(2.0 * x.T.astype("float64") @ x / n).max()
    model = keras.Sequential(
        [keras.Input((d,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    lr = keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.5) if schedule else 0.01
    model.compile(keras.optimizers.SGD(lr), "mse")
    f = kp.find_learning_rate(
        model, x, y.astype("float32"), min_lr=1e-4, max_lr=10.0, steps=40, batch_size=n
    )
    assert 0.02 * limit <= f.suggestion <= limit, (f.suggestion / limit, f)
    # The curve: geometric learning rates from min_lr, the loss falling, then diverging.
    np.testing.assert_allclose(f.lrs, geometric_lrs(1e-4, 10.0, 40)[: len(f.lrs)], rtol=1e-5)
    assert f.stop_reason is not None and "exceeded 4x" in f.stop_reason
    assert f.lrs[-1] > limit and f.losses[-1] > 4 * min(f.losses)
    assert min(f.losses) < 0.5 * f.losses[0]


def _ill_conditioned(n=256, d=8, seed=0):
    """Least squares with feature scales 1 to 30: 2 / λmax of the loss's Hessian is its limit."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, d)) * np.logspace(0, 1.5, d)).astype("float32")
    y = (x @ rng.normal(size=(d, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    limit = 2.0 / np.linalg.eigvalsh(2.0 * x.T.astype("float64") @ x / n).max()
    return x, y, limit


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda lr: keras.optimizers.SGD(lr, momentum=0.9),
        lambda lr: keras.optimizers.Adam(lr),
        lambda lr: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(lr, 8, 0.9)),
    ],
    ids=["sgd_momentum", "adam", "adam_schedule"],
)
def test_stale_momentum_does_not_drive_the_curve(make_optimizer):
    """Regression (issue 41, item 7): after an epoch of SGD(momentum=0.9) on an ill-conditioned
    least squares, the range test started from the trained momentum, diverged from its first
    step at 1e-6 and gave no suggestion. It now runs with the optimizer's configuration and
    fresh slots and `iterations` (Lightning re-creates the optimizer for `lr_find`): the curve is
    that of the same weights under a newly compiled optimizer, and everything comes back."""
    x, y, limit = _ill_conditioned()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(make_optimizer(float(1.5 * limit)), "mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    before = _state(model)
    args = dict(min_lr=1e-6, max_lr=1.0, steps=60, batch_size=len(x))
    f = kp.find_learning_rate(model, x, y, **args)
    _assert_same_state(before, _state(model))  # the trained slots and iterations are back
    assert int(model.optimizer.iterations) == 8

    twin = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    twin.set_weights(model.get_weights())
    twin.compile(make_optimizer(float(1.5 * limit)), "mse")
    g = kp.find_learning_rate(twin, x, y, **args)
    np.testing.assert_allclose(f.raw_losses, g.raw_losses, rtol=1e-4)
    assert f.suggestion == pytest.approx(g.suggestion, rel=1e-6)
    assert len(f.lrs) > 20
    if "SGD" in type(model.optimizer).__name__:
        assert 0.02 * limit <= f.suggestion <= limit, (f.suggestion / limit, f)


# --- the model is put back -------------------------------------------------------------------


def test_every_variable_metric_and_attribute_is_put_back():
    x, y = _data()
    model = _compiled(dropout=True)
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    before = _state(model)
    lr_variable = model.optimizer.variables[1]
    compile_config = model.get_compile_config()
    train_function = model.train_function
    metrics = {k: float(v) for k, v in model.get_metrics_result().items()}
    f = kp.find_learning_rate(model, x, y, batch_size=32, steps=12)
    assert len(f.lrs) == 12 or f.stop_reason
    _assert_same_state(before, _state(model))  # weights, seeds, slots, iterations, lr, metrics
    assert int(model.optimizer.iterations) == 4
    assert model.optimizer.variables[1] is lr_variable
    assert float(model.optimizer.learning_rate) == pytest.approx(0.001)
    assert model.get_compile_config() == compile_config
    assert model.train_function is train_function and model.history is history
    assert {k: float(v) for k, v in model.get_metrics_result().items()} == metrics
    assert not model.stop_training


def test_a_schedule_comes_back_as_the_same_object():
    x, y = _data()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9)
    model = _compiled(keras.optimizers.Adam(schedule))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    before = _state(model)
    f = kp.find_learning_rate(model, x, y, batch_size=32, min_lr=1e-5, max_lr=1.0, steps=8)
    assert learning_rate_object(model.optimizer) is schedule
    _assert_same_state(before, _state(model))
    # During the test the schedule was ours: the recorded rates are the geometric ones.
    np.testing.assert_allclose(f.lrs, geometric_lrs(1e-5, 1.0, 8)[: len(f.lrs)], rtol=1e-5)


@pytest.mark.parametrize("schedule", [False, True], ids=["adam_float", "adam_exponential_decay"])
def test_a_following_fit_is_what_it_would_have_been(schedule):
    x, y = _data()

    def run(find):
        keras.utils.set_random_seed(7)
        lr = keras.optimizers.schedules.ExponentialDecay(0.01, 5, 0.9) if schedule else 0.01
        model = _compiled(keras.optimizers.Adam(lr), dropout=True)
        # A model never fit (optimizer and metrics unbuilt): Keras' first fit draws one
        # shuffle more than later ones (it builds the metrics from a first batch), so the
        # first fit keeps the batch order; the second shuffles.
        for shuffle in (False, True):
            keras.utils.set_random_seed(99)
            if find:
                with warnings.catch_warnings():  # 6 steps may give no suggestion: not the point
                    warnings.simplefilter("ignore", KerasPerfWarning)
                    kp.find_learning_rate(model, x, y, batch_size=32, steps=6, shuffle=shuffle)
            model.fit(x, y, batch_size=32, epochs=1, shuffle=shuffle, verbose=0)
        return [v.numpy() for v in model.weights + model.optimizer.variables]

    for a, b in zip(run(find=False), run(find=True), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF builds models inside the first step")
def test_an_unbuilt_model_is_refused_on_tensorflow():
    model = keras.Sequential([keras.layers.Dense(3)])
    model.compile("adam", SCE)
    x, y = _data()
    with pytest.raises(ValueError, match="`model` is not built"):
        kp.find_learning_rate(model, x, y)
    assert not model.built


@pytest.mark.skipif(BACKEND == "tensorflow", reason="TF refuses an unbuilt model")
def test_an_unbuilt_model_comes_back_with_its_initial_weights():
    x, y = _data()
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.layers.Dense(3)])
    model.compile("adam", SCE)
    kp.find_learning_rate(model, x, y, steps=6)
    keras.utils.set_random_seed(3)
    twin = keras.Sequential([keras.layers.Dense(3)])
    twin.build((None, 8))
    for a, b in zip(model.get_weights(), twin.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0


# --- stopping --------------------------------------------------------------------------------


def _driven_callback(steps=10, smoothing=1.0):
    model = _compiled(keras.optimizers.SGD(0.1))
    cb = _RangeTestCallback(geometric_lrs(1e-3, 1.0, steps), smoothing, True, lambda: None)
    cb.set_model(model)
    model.stop_training = False
    return model, cb


def _step(cb, epoch, logs, stepped=True):
    cb.on_epoch_begin(epoch)
    if stepped:
        cb.on_train_batch_end(0)
    cb.on_epoch_end(epoch, logs)


def test_a_non_finite_loss_stops_the_test():
    model, cb = _driven_callback()
    _step(cb, 0, {"loss": 2.0})
    assert float(model.optimizer.learning_rate) == pytest.approx(1e-3)
    _step(cb, 1, {"loss": float("nan")})
    assert model.stop_training and "the loss was nan" in cb.stop_reason
    assert len(cb.lrs) == 2 and math.isnan(cb.raw_losses[-1])


def test_data_that_runs_out_twice_in_a_row_stops_the_test():
    model, cb = _driven_callback()
    _step(cb, 0, {"loss": 2.0})
    _step(cb, 1, {}, stepped=False)  # a pass ended: a re-iterable input restarts
    assert not model.stop_training
    _step(cb, 2, {"loss": 1.5})
    _step(cb, 3, {}, stepped=False)
    _step(cb, 4, {}, stepped=False)
    assert model.stop_training and cb.stop_reason == "the data ran out after 2 batches"


def test_a_train_step_without_a_loss_log_is_named():
    _, cb = _driven_callback()
    with pytest.raises(ValueError, match=r"logs only \['total'\]"):
        _step(cb, 0, {"total": 1.0})


# --- data kinds and our pieces ---------------------------------------------------------------


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch=32):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]


def _inputs(kind, x, y):
    if kind == "pydataset":
        return (_Batches(x, y),)
    if kind == "tf.data":
        tf = pytest.importorskip("tensorflow")
        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(32),)
    if kind == "dataloader":
        torch = pytest.importorskip("torch")
        data = torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y))
        return (torch.utils.data.DataLoader(data, batch_size=32, shuffle=True),)
    return x, y


@pytest.mark.parametrize("kind", ["arrays", "pydataset", "tf.data", "dataloader"])
def test_data_kinds_are_cycled_to_the_steps_asked_for(kind):
    if kind == "dataloader" and BACKEND != "torch":
        pytest.skip("a torch DataLoader is data for the torch backend")
    x, y = _data(n=64)  # 2 batches of 32
    model = _compiled()
    model.fit(x, y, epochs=1, steps_per_epoch=1, verbose=0)
    before = _state(model)
    f = kp.find_learning_rate(model, *_inputs(kind, x, y), max_lr=1e-2, steps=5)
    assert len(f.lrs) == 5 and f.stop_reason is None  # 2 batches a pass: cycled twice
    _assert_same_state(before, _state(model))


def test_a_generator_that_runs_out_ends_the_curve_with_a_warning():
    x, y = _data(n=96)

    def batches():
        for i in range(3):
            yield x[32 * i : 32 * (i + 1)], y[32 * i : 32 * (i + 1)]

    model = _compiled()
    with pytest.warns(KerasPerfWarning) as record:
        f = kp.find_learning_rate(model, batches(), max_lr=1e-2, steps=50, shuffle=False)
    messages = [str(w.message) for w in record if w.category is KerasPerfWarning]
    assert "the data ran out after 3 batches" in messages[0]
    assert "no suggestion from 3 points" in messages[1]  # 50 // 10 = 5 points skipped
    assert len(f.lrs) == 3 and f.stop_reason == "the data ran out after 3 batches"


def _loss_scaled_bf16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = kp.loss_scaled(_mlp(), microbatches=2)
    model.compile("adam", SCE)
    return model


def _loss_scaled_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = kp.loss_scaled(_mlp())
    model.compile("adam", SCE)  # wrapped in a LossScaleOptimizer
    return model


def _distiller():
    model = kp.DistillationModel(_mlp(), _mlp(), temperature=3.0, alpha=0.7)
    model.compile(optimizer="adam")
    return model


def _qat():
    model = kp.quantize_aware(_mlp())
    model.compile("adam", SCE)
    return model


@pytest.mark.parametrize(
    "make", [_loss_scaled_bf16, _loss_scaled_float16, _distiller, _qat], ids=lambda f: f.__name__
)
def test_our_pieces_run_and_come_back_untouched(make):
    x, y = _data()
    model = make()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    before = _state(model)
    f = kp.find_learning_rate(model, x, y, batch_size=32, max_lr=1.0, steps=8)
    assert len(f.lrs) >= 2 and all(isinstance(v, float) for v in f.raw_losses)
    assert math.isfinite(f.raw_losses[0])
    _assert_same_state(before, _state(model))


@pytest.mark.skipif(BACKEND == "torch", reason="Keras refuses steps_per_execution > 1 on torch")
def test_steps_per_execution_is_one_during_the_test_and_restored():
    x, y = _data()
    losses = {}
    for spe in (1, 4):
        keras.utils.set_random_seed(5)
        model = _mlp()
        model.compile("adam", SCE, steps_per_execution=spe)
        f = kp.find_learning_rate(model, x, y, batch_size=16, max_lr=1e-1, steps=8, shuffle=False)
        assert model.steps_per_execution == spe
        assert (model.train_function is None) == (spe == 4)  # made for the test: dropped
        losses[spe] = f.raw_losses
    # One step per learning rate: the same losses as with one step per execution.
    assert len(losses[4]) == 8
    np.testing.assert_allclose(losses[4], losses[1], rtol=1e-5)


# --- the plot --------------------------------------------------------------------------------


def _small_result():
    lrs = geometric_lrs(1e-5, 1.0, 20)
    losses = list(1.0 / (1.0 + np.exp(np.linspace(-6, 6, 20))))
    return LRFinderResult(
        lrs, losses, losses, min_lr=1e-5, max_lr=1.0, steps=20, smoothing=1.0, stop_reason=None
    )


def test_plot_draws_a_log_axis_and_marks_the_suggestion(tmp_path):
    pytest.importorskip("matplotlib")
    r = _small_result()
    fig = r.plot(tmp_path / "lr.png")
    assert (tmp_path / "lr.png").stat().st_size > 1000
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    marker = [line for line in ax.lines if line.get_label().startswith("suggestion")]
    assert len(marker) == 1 and marker[0].get_xdata()[0] == r.suggestion


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"keras-perf\[plot\]"):
        _small_result().plot("never.png")


# --- measured on real data (slow) ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_digits_suggestion_trains_well(digits, seed):
    (x, y), (x_test, y_test) = digits

    def model(lr):
        keras.utils.set_random_seed(seed)
        m = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
        )
        m.compile(keras.optimizers.Adam(lr), SCE, metrics=["accuracy"])
        return m

    f = kp.find_learning_rate(model(1e-3), x, y, batch_size=32)
    # Lightning's rule (pytorch_lightning's suggestion(), skips 10 and 1) on the same losses,
    # up to the lowest (on torch, seed 1, Lightning's own pick, 3.3, trains to 10 %).
    assert f.suggestion == f.lrs[_lightning(f.losses)]
    accuracy = {}
    for lr in (f.suggestion, f.suggestion / 100):
        m = model(lr)
        m.fit(x, y, batch_size=32, epochs=5, verbose=0)
        accuracy[lr] = m.evaluate(x_test, y_test, verbose=0)[1]
    assert accuracy[f.suggestion] >= 0.90, (f, accuracy)
    assert accuracy[f.suggestion] > accuracy[f.suggestion / 100], (f, accuracy)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
def test_under_a_mirrored_strategy_the_test_runs_and_leaves_the_model_as_it_was():
    """A model built under a tf.distribute strategy: its optimizer is built in the strategy's
    scope (outside it, Keras raises 'Need to be inside "with strategy.scope()"'), the curve has
    a loss per learning rate, and every variable, sync-on-read metric ones included, is put
    back."""
    import tensorflow as tf

    x, y = _data(256)
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        model = _compiled()
    variables = model.variables + model.metrics_variables
    before = [np.array(v.numpy(), copy=True) for v in variables]
    r = kp.find_learning_rate(model, x, y, batch_size=32, steps=30)
    assert len(r.lrs) == len(r.losses) >= 10 and all(math.isfinite(v) for v in r.losses[:10])
    for v, a in zip(variables, before):
        np.testing.assert_array_equal(np.array(v.numpy()), a, err_msg=v.path)
    assert model.optimizer.built and int(model.optimizer.iterations.numpy()) == 0
