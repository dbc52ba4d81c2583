"""kp.find_max_batch_size: the largest batch per train-step setting, by trying.

On a CPU nothing runs out of memory, so the searches here run with a memory cap, against the
peak each backend measures in process (torch: tensors saved for backward plus variables,
gradients and batch; JAX: XLA's memory analysis; TensorFlow: its BFC allocator, which needs
`TF_CPU_ALLOCATOR_USE_BFC=true` before TensorFlow is imported, so that case runs in a child
process), or with an accelerator faked and `OOMAbove` (tests/test_oom.py) raising the
backend's own out-of-memory error above a batch size.

The cap is calibrated on the model itself: the measured peak of the plain step at 256
examples. The test model, a narrow deep gelu MLP, has its memory in activations, which is
what remat and micro-batches shrink.
"""

import json
import os

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf.oom._batch_size import _best, _search
from tests import models
from tests._child import tensorflow_with_bfc
from tests.test_oom import OOMAbove

BACKEND = keras.backend.backend()
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TF steps with OOMAbove run eagerly, where the batch size is static (tests/test_oom.py).
EAGER = BACKEND == "tensorflow"


def _data(n, features=16, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, features)).astype("float32"), rng.integers(0, classes, n)


def _mlp():
    model = models.mlp([64] * 4, 16, 4, activation="gelu", seed=0)
    model.compile(keras.optimizers.Adam(1e-3), SCE)
    return model


def check_memory_cap_rows():
    """The cap search on the MLP: checked here, returned for the caller to print."""
    model = _mlp()
    x, y = _data(1024)
    calibration = kp.find_max_batch_size(
        model, x[:256], y[:256], "plain", memory_limit_bytes=10**12, start_batch_size=256
    )
    cap = calibration["plain"]["peak_bytes"]
    report = kp.find_max_batch_size(model, x, y, memory_limit_bytes=cap, start_batch_size=256)
    assert list(report) == ["plain", "remat", "microbatches"]
    for name, row in report.items():
        tried = {t["batch_size"]: t for t in row["tries"]}
        assert len(tried) == len(row["tries"])  # no size tried twice
        best = row["batch_size"]
        # Every try was judged by its measured peak against the cap.
        assert all(t["fits"] == (t["peak_bytes"] <= cap) for t in row["tries"]), name
        assert row["peak_bytes"] == tried[best]["peak_bytes"] <= cap
        assert row["measure"] in kp.oom.MEASURES
        # Micro-batched rows try multiples of the micro-batch count.
        step = row["microbatches"]
        assert all(t["batch_size"] % step == 0 for t in row["tries"])
        if best < 1024:  # the next size up was tried and measured above the cap
            assert tried[best + step]["peak_bytes"] > cap
            assert tried[best + step]["reason"] == row["limited_by"] == "memory_limit"
        else:
            assert row["limited_by"] == "max_batch_size"
    plain, remat, sliced = (report[s]["batch_size"] for s in ("plain", "remat", "microbatches"))
    assert 128 < plain < 512  # the calibration batch, give or take TensorFlow's noise
    assert remat > 1.3 * plain and sliced > 2 * plain, (plain, remat, sliced)
    assert (report["remat"]["remat"], report["microbatches"]["microbatches"]) == ("full", 4)
    json.dumps(report.to_dict())
    text = str(report)
    assert "microbatches (4)" in text and str(remat) in text
    return report


@pytest.mark.backends("jax", "torch")
def test_memory_cap_rows():
    report = check_memory_cap_rows()
    # Deterministic measures: the calibration batch is the plain answer exactly.
    assert report["plain"]["batch_size"] == 256


@pytest.mark.slow  # a child process with the BFC allocator
@pytest.mark.backends("tensorflow")
def test_memory_cap_rows_tensorflow_with_bfc_allocator():
    # The BFC allocator must be chosen before TensorFlow is imported: a child process, which
    # also runs the docstring example (tests/test_doctests.py cannot, in this process).
    code = (
        "import doctest, json\n"
        "import keras_perf.oom._batch_size as module\n"
        "from tests.test_find_max_batch_size import check_memory_cap_rows\n"
        "report = check_memory_cap_rows()\n"
        "flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE\n"
        "result = doctest.testmod(module, optionflags=flags)\n"
        "print(json.dumps({'rows': {k: v['batch_size'] for k, v in report.items()},\n"
        "                  'doctest': [result.failed, result.attempted]}))\n"
    )
    result = tensorflow_with_bfc(code)
    assert result["doctest"][0] == 0 and result["doctest"][1] >= 5, result


@pytest.mark.backends("tensorflow")
def test_tensorflow_cpu_without_bfc_allocator_is_refused_before_any_step(monkeypatch):
    if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("true", "1"):
        pytest.skip("this process runs TensorFlow's BFC allocator")
    _no_steps(monkeypatch)
    model = _mlp()
    with pytest.raises(ValueError, match="TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow"):
        kp.find_max_batch_size(model, *_data(64), memory_limit_bytes=10**9)


# -- an accelerator faked: tries fail by out-of-memory ---------------------------------------
def _oom_model(threshold, *layers, microbatches=None):
    keras.utils.set_random_seed(0)
    layer = OOMAbove(threshold=threshold)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), *layers, layer]
        + [keras.layers.Dense(3)]
    )
    if microbatches is not None:  # a model that has keras-perf's train step itself
        model = kp.loss_scaled(model, microbatches=microbatches, remat="activations")
    model.compile(keras.optimizers.Adam(0.01), SCE, metrics=["accuracy"], run_eagerly=EAGER)
    return model, layer


# JAX compiles each fitting size (a micro-batched step slowly): its micro-batched case is the
# cap test above.
@pytest.mark.parametrize(
    "setting, expected",
    [
        ("plain", 13),
        pytest.param("microbatches", 52, marks=pytest.mark.backends("tensorflow", "torch")),
    ],
)
def test_out_of_memory_above_a_batch_size_gives_exactly_that_size(monkeypatch, setting, expected):
    monkeypatch.setattr(kp.backend, "has_accelerator", lambda: True)
    model, layer = _oom_model(threshold=13)
    x, y = _data(64, features=6, classes=3)
    report = kp.find_max_batch_size(model, x, y, settings=setting, start_batch_size=8)
    row = report[setting]
    # 4 slices of ceil(b / 4) examples each: 52 is the largest batch whose slices have 13.
    assert (row["batch_size"], row["limited_by"]) == (expected, "out_of_memory")
    tried = {t["batch_size"]: t for t in row["tries"]}
    above = tried[expected + row["microbatches"]]  # the micro-batched row tries multiples of 4
    assert tried[expected]["fits"] and above["reason"] == "out_of_memory"
    assert "injected" in above["error"]
    assert layer.raised and all(
        "injected, batch 1" in str(e) and int(str(e).split("batch ")[1][:-2]) > 13
        for e in layer.raised
    )
    assert report.memory_limit_bytes is None
    # Measured where the measure works in this process (TensorFlow's CPU allocator needs BFC).
    measured = kp.backend.step_memory_unavailable() is None
    assert (row["peak_bytes"] is not None) == (row["measure"] is not None) == measured


def _state(model):
    optimizer = model.optimizer
    return {
        # model.variables: weights, BatchNormalization's statistics, Dropout's seed state
        "variables": [np.array(keras.ops.convert_to_numpy(v)) for v in model.variables],
        "optimizer": [np.array(keras.ops.convert_to_numpy(v)) for v in optimizer.variables],
        "iterations": int(keras.ops.convert_to_numpy(optimizer.iterations)),
        "metrics": [np.array(keras.ops.convert_to_numpy(v)) for v in model.metrics_variables],
        "settings": (
            getattr(model, "remat", None),
            getattr(model, "remat_threshold", None),
            getattr(model, "microbatches", None),
        ),
    }


# Stock: the user's model beside the twin that shares its layers and optimizer; mixin: the
# model steps itself, its settings changed per row. One setting each (JAX compiles each size).
@pytest.mark.parametrize(
    "kind, setting, threshold", [("stock", "plain", 8), ("mixin", "remat+microbatches", 2)]
)
def test_model_untouched(monkeypatch, kind, setting, threshold):
    monkeypatch.setattr(kp.backend, "has_accelerator", lambda: True)
    model, layer = _oom_model(
        threshold,
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.3),
        microbatches=2 if kind == "mixin" else None,
    )
    x, y = _data(32, features=6, classes=3)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # optimizer, BN and metrics not fresh
    before = _state(model)
    assert before["iterations"] == 8 and any(np.any(m != 0) for m in before["metrics"])
    report = kp.find_max_batch_size(
        model, x, y, settings=setting, start_batch_size=8, max_batch_size=16
    )
    # 8 examples fit; 16 and below down to 9 (plain) or 12 (4 slices) ran out of memory.
    assert report[setting]["batch_size"] == 8 and len(layer.raised) >= 2
    after = _state(model)
    for key in ("variables", "optimizer", "metrics"):
        assert len(before[key]) == len(after[key])
        assert all(np.array_equal(a, b) for a, b in zip(before[key], after[key])), key
    assert after["iterations"] == before["iterations"]
    assert after["settings"] == before["settings"]


# -- the search alone -----------------------------------------------------------------------
def _attempt(fits=None, peak=None, limit=None):
    def attempt(size):
        p = None if peak is None else peak(size)
        return {
            "batch_size": size,
            "fits": fits(size) if peak is None else p <= limit,
            "peak_bytes": p,
        }

    return attempt


@pytest.mark.parametrize(
    "start, cap, answer, sizes",
    [
        (4, 100, 37, [4, 8, 16, 32, 64, 48, 40, 36, 38, 37]),
        (32, 100, 37, [32, 64, 48, 40, 36, 38, 37]),
        (200, 100, 37, [100, 50, 25, 37, 43, 40, 38]),  # start above the cap
        (4, 30, 30, [4, 8, 16, 30]),  # everything fits
        (4, 100, 0, [4, 2, 1]),  # nothing fits
    ],
)
def test_search_doubles_then_bisects(start, cap, answer, sizes):
    tries = _search(_attempt(fits=lambda b: b <= answer if answer else False), start, cap)
    assert [t["batch_size"] for t in tries] == sizes and _best(tries) == answer


def test_search_in_steps_tries_multiples_of_the_step():
    tries = _search(_attempt(fits=lambda b: b <= 37), 30, 100, step=4)
    assert [t["batch_size"] for t in tries] == [32, 64, 48, 40, 36] and _best(tries) == 36
    tries = _search(_attempt(fits=lambda b: b <= 2), 1, 3, step=4)  # cap below the step
    assert [t["batch_size"] for t in tries] == [1, 2, 3] and _best(tries) == 2


def test_search_with_measured_peaks_settles_a_linear_step_in_two_narrowing_tries():
    tries = _search(_attempt(peak=lambda b: 200 + 7 * b, limit=1000), 32, 1000, 1000)
    assert [t["batch_size"] for t in tries] == [32, 64, 128, 114, 115]
    # A step in memory (no line fits it): at most two tries more than bisection.
    tries = _search(_attempt(peak=lambda b: 10**6 * (b >= 900), limit=1000), 512, 1000, 1000)
    assert _best(tries) == 899 and len(tries) <= 2 + 1 + 9 + 2


# -- bad arguments, all refused before any step ----------------------------------------------
def _no_steps(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(keras.Model, "train_on_batch", refuse)
    monkeypatch.setattr(kp.backend, "step_memory", refuse)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.zeros((8, 16), "float32"), np.zeros(8, "int32")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"settings": "bogus"}, ValueError, "`settings` must be a name or a non-empty list"),
        ({"settings": ()}, ValueError, "`settings` must be"),
        ({"settings": ("plain", "plain")}, ValueError, "distinct names"),
        ({"memory_limit_bytes": 0}, ValueError, r"`memory_limit_bytes` must be in \(0"),
        ({"memory_limit_bytes": -5}, ValueError, "`memory_limit_bytes` must be in"),
        ({"memory_limit_bytes": float("inf")}, ValueError, "`memory_limit_bytes` must be finite"),
        ({"memory_limit_bytes": "1GB"}, TypeError, "`memory_limit_bytes` must be a number"),
        ({"microbatches": 1}, ValueError, "`microbatches` must be an integer >= 2"),
        ({"microbatches": 2.5}, TypeError, "`microbatches` must be an integer"),
        ({"start_batch_size": 0}, ValueError, "`start_batch_size` must be an integer >= 1"),
        ({"max_batch_size": 0}, ValueError, "`max_batch_size` must be an integer >= 1"),
        ({"max_batch_size": 65}, ValueError, "`max_batch_size` must be at most the 64 examples"),
        ({"x": np.zeros((0, 16))}, ValueError, "`x` holds no examples"),
        ({"x": _Batches(), "y": None}, ValueError, "pass `max_batch_size`"),
        ({"x": iter([np.zeros((8, 16))]), "y": None}, TypeError, "generator or iterator"),
        ({"memory_limit_bytes": None}, ValueError, "nothing runs out of memory on a CPU"),
    ],
)
def test_bad_arguments_are_refused_before_any_step(monkeypatch, kwargs, error, match):
    _no_steps(monkeypatch)
    x, y = _data(64)
    arguments = {"x": x, "y": y, "memory_limit_bytes": 10**9, **kwargs}
    with pytest.raises(error, match=match):
        kp.find_max_batch_size(_mlp(), **arguments)


def test_a_dict_without_one_of_the_inputs_is_named_before_any_step(monkeypatch):
    """Regression (issue 41, item 9): a dict `x` missing one of the model's inputs failed
    inside the first try, in Keras' words."""
    _no_steps(monkeypatch)
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(2)(keras.layers.Concatenate()([a, b])))
    model.compile("sgd", "mse")
    x = {"a": np.zeros((16, 4), "float32")}
    with pytest.raises(
        ValueError,
        match=r"find_max_batch_size: `x` is a dict without the model's input\(s\) \['b'\]",
    ):
        kp.find_max_batch_size(model, x, np.zeros((16, 2)), memory_limit_bytes=10**9)


@pytest.mark.parametrize("attribute", ["remat", "microbatches"])
def test_a_train_step_setting_on_a_plain_model_is_refused_with_the_fix(monkeypatch, attribute):
    """Regression (issue 41, item 10): `model.remat = "full"` on a plain Keras model did
    nothing, without a word."""
    _no_steps(monkeypatch)
    x, y = _data(16)
    model = _mlp()
    setattr(model, attribute, "full" if attribute == "remat" else 4)
    with pytest.raises(
        ValueError, match=rf"`model.{attribute}` is set on a plain .*kp.loss_scaled"
    ):
        kp.find_max_batch_size(model, x, y, memory_limit_bytes=10**9)


def test_bad_models_are_refused_before_any_step(monkeypatch):
    _no_steps(monkeypatch)
    x, y = _data(16)
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        kp.find_max_batch_size("model", x, y, memory_limit_bytes=10**9)
    model = models.mlp([8], 16, 4)
    with pytest.raises(ValueError, match="is not compiled"):
        kp.find_max_batch_size(model, x, y, memory_limit_bytes=10**9)
    model = _Subclassed()
    model.compile("sgd", "mse")
    with pytest.raises(TypeError, match="subclassed model without keras-perf's train step"):
        kp.find_max_batch_size(model, x, y, settings=("plain", "remat"), memory_limit_bytes=10**9)
