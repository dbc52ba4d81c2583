"""The backend shim: OOM detection, memory stats, device list, host memory."""

import gc
import sys
import weakref

import keras
import numpy as np
import pytest

from keras_perf import backend

BACKEND = keras.backend.backend()


def _backend_oom():
    """Build the out-of-memory exception the current backend really raises."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")
    if BACKEND == "jax":
        from jax.errors import JaxRuntimeError

        return JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB")
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_backend_module_matches_keras():
    assert backend.BACKEND == BACKEND
    assert backend._impl.__name__ == f"keras_perf.backend.{BACKEND}"


def test_oom_detected():
    assert backend.is_oom(_backend_oom())


def test_oom_detected_through_cause():
    try:
        try:
            raise _backend_oom()
        except Exception as inner:
            raise RuntimeError("wrapped by a callback") from inner
    except RuntimeError as outer:
        assert backend.is_oom(outer)


@pytest.mark.parametrize(
    "exc",
    [ValueError("out of range"), RuntimeError("shapes do not match"), KeyError("x"), MemoryError()],
)
def test_other_errors_are_not_oom(exc):
    assert not backend.is_oom(exc)


@pytest.mark.backends("tensorflow")
def test_tf_dst_tensor_internal_error_is_oom():
    import tensorflow as tf

    assert backend.is_oom(tf.errors.InternalError(None, None, "Dst tensor is not initialized."))
    assert not backend.is_oom(tf.errors.InternalError(None, None, "some other failure"))


@pytest.mark.backends("torch")
def test_torch_runtime_error_out_of_memory_is_oom():
    assert backend.is_oom(RuntimeError("CUDA error: out of memory"))


def test_list_devices_has_cpu_with_fields():
    devices = backend.list_devices()
    assert any(d["kind"] == "CPU" for d in devices)
    for d in devices:
        assert set(d) == {"name", "kind", "memory_bytes", "compute_capability"}


def test_memory_stats_none_without_accelerator():
    if backend.has_accelerator():
        stats = backend.memory_stats()
        assert stats["peak_bytes"] >= stats["current_bytes"] >= 0
    else:
        assert backend.memory_stats() is None
        assert backend.reset_peak_memory() is False


def test_host_memory_is_plausible():
    mem = backend.host_memory()
    # A Python process with Keras loaded holds well over 50 MB and far less than 1 TB.
    assert 50e6 < mem["peak_bytes"] < 1e12
    assert mem["current_bytes"] is None or 50e6 < mem["current_bytes"] <= mem["peak_bytes"] * 1.01


def _failed_step():
    """A step that dies with an error, as on out-of-memory: its tensor outlives it in a cycle."""
    activations = keras.ops.ones((1000, 1000))
    try:
        raise MemoryError("out of memory")
    except MemoryError as e:
        error = e  # noqa: F841 (error -> traceback -> this frame -> error: a reference cycle)
    return weakref.ref(activations)


def test_clear_memory_frees_the_tensors_of_a_failed_step():
    # `fit_with_oom_retry` calls it before retrying: the failed step's tensors, reachable only
    # through the error's traceback, must be gone before the retry allocates again.
    gc.collect()
    gc.disable()  # no automatic collection between the step and the call
    try:
        activations = _failed_step()
        assert activations() is not None  # held by the cycle
        assert backend.clear_memory() is None
        assert activations() is None
    finally:
        gc.enable()


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="/proc/self/clear_refs is Linux-only"
)
def test_reset_host_peak_memory_lowers_the_peak():
    big = np.ones(40_000_000)  # 320 MB resident
    big[::512] = 2.0
    high = backend.host_memory()["peak_bytes"]
    del big
    assert backend.reset_host_peak_memory() is True
    low = backend.host_memory()["peak_bytes"]
    assert low < high - 200e6


def test_examples_seen_counts_real_batch_sizes():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    assert backend.examples_seen(model) is None  # nothing counted yet
    x, y = np.ones((21, 4), "float32"), np.ones((21, 2), "float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # batches of 8, 8 and 5
    assert backend.examples_seen(model) == 21


def test_every_memory_measure_the_code_names_is_in_the_table():
    """Issue 42: `host_peak_rss` and `xla_peak_bytes_in_use` were reported (monitor, JAX's
    `memory_stats`) but missing from `kp.oom.MEASURES`. Every `"measure": "..."` literal in
    keras_perf is a key of the one table, which `kp.oom.MEASURES` is."""
    import re
    from pathlib import Path

    import keras_perf as kp

    assert kp.oom.MEASURES is backend.MEASURES
    root = Path(backend.__file__).parents[1]
    named = {
        m.group(1)
        for path in root.rglob("*.py")
        for m in re.finditer(r"""["']measure["']\s*:\s*["']([^"']+)["']""", path.read_text())
    }
    assert {"host_peak_rss", "xla_peak_bytes_in_use", "torch_saved_tensors"} <= named
    assert named - set(backend.MEASURES) == set()
    assert all(isinstance(text, str) and text for text in backend.MEASURES.values())


@pytest.mark.skipif(
    backend.step_memory_unavailable() is not None, reason="no step measure on this backend here"
)
def test_step_memory_names_a_measure_of_the_table():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")
    model.train_on_batch(x, y)
    result = backend.step_memory(model, (x, y, None), lambda: model.train_on_batch(x, y))
    assert result["measure"] in backend.MEASURES
    assert result["bytes"] > 8 * 4 * 4  # at least the batch


def _fresh_fit():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile("adam", "mse")
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 3), "float32"), verbose=0)


@pytest.mark.backends("tensorflow")
def test_traced_graphs_released_frees_a_discarded_models_train_graph():
    """Issue 41 (memory over repeated use): Keras' TF optimizer sums gradients through a
    `tf.custom_gradient`, whose graph-mode registry entry kept every traced train graph alive
    (5-6 MiB a twin). Inside the scope the entries of discarded twins are dropped: the registry
    is the size it was, and the graph's functions leave the eager context (TensorFlow removes
    them only when the graph holding them is collected); outside it TF keeps them."""
    from tensorflow.python.eager import context
    from tensorflow.python.framework import ops

    registry = ops._gradient_registry._registry
    _fresh_fit()  # the first fit of a process also traces TF's own helpers
    gc.collect()
    names, functions = len(registry), len(context.context().list_function_names())
    with backend.traced_graphs_released():
        _fresh_fit()
    gc.collect()
    assert len(registry) == names
    assert len(context.context().list_function_names()) == functions
    _fresh_fit()  # outside the scope, TensorFlow's own behaviour: one entry more
    assert len(registry) > names


def test_traced_graphs_released_is_a_decorator_and_passes_results_and_errors():
    @backend.traced_graphs_released()
    def f(v):
        if v < 0:
            raise ValueError("v")
        return v * 2

    assert f(2) == 4 and f(3) == 6
    with pytest.raises(ValueError, match="v"):
        f(-1)


def _shuffled_fit_weights(seed_with):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    x = np.arange(64 * 4, dtype="float32").reshape(64, 4) / 256.0
    y = np.ones((64, 2), "float32")
    model.set_weights([np.full((4, 2), 0.1, "float32"), np.zeros(2, "float32")])
    seed_with(7)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=True, verbose=0)
    return model.get_weights()


def test_set_random_seed_shuffles_as_keras_own_and_keeps_tensorflows_kernel_caches(monkeypatch):
    """Issue 41 (memory over repeated use): `tf.random.set_seed` clears TensorFlow's kernel
    caches, so each tf.function is instantiated again at its next call, which left 2.3 MiB a
    call of `kp.accelerate` behind (it seeds each exactness check). `backend.set_random_seed`
    seeds as `keras.utils.set_random_seed` does (the same shuffles) without the clear."""
    ours = _shuffled_fit_weights(backend.set_random_seed)
    keras_own = _shuffled_fit_weights(keras.utils.set_random_seed)
    other_seed = _shuffled_fit_weights(lambda s: keras.utils.set_random_seed(s + 1))
    for a, b in zip(ours, keras_own):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(ours, other_seed))  # the seed matters
    if keras.backend.backend() != "tensorflow":
        return
    from tensorflow.python import pywrap_tfe

    clears = []
    real = pywrap_tfe.TFE_ContextClearCaches
    monkeypatch.setattr(pywrap_tfe, "TFE_ContextClearCaches", lambda h: clears.append(h) or real(h))
    state = backend.global_rng_state()
    backend.set_random_seed(3)
    backend.set_global_rng_state(state)
    assert clears == []
    keras.utils.set_random_seed(3)  # Keras' own clears them
    backend.set_global_rng_state(state)
    assert len(clears) == 1
