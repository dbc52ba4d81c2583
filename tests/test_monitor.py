"""TrainingMonitor and its EpochMeter: counts, timing, JSONL, summary, plot, CSV, TensorBoard."""

import errno
import functools
import gc
import json
import os
import sys
import warnings

import keras
import numpy as np
import pytest

import keras_perf as kp
from keras_perf._tensorboard import ScalarWriter
from keras_perf.monitor import MONITOR_KEYS, EpochMeter
from tests import models
from tests._child import tensorflow_with_bfc

BACKEND = keras.backend.backend()


def _read_scalars(folder):
    """`(step, tag, value)` of every scalar in the event files in `folder`, read by TensorFlow's
    own reader (`summary_iterator` checks each record's CRC): `simple_value` (tensorboardX)
    and scalar tensors (`tf.summary.write`) alike."""
    tf = pytest.importorskip("tensorflow")
    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for v in event.summary.value:
                kind = v.WhichOneof("value")
                value = v.simple_value if kind == "simple_value" else tf.make_ndarray(v.tensor)
                out.append((event.step, v.tag, float(value)))
    return out


def _mlp(spe=1, optimizer="adam"):
    model = models.mlp([16])
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=spe,
    )
    return model


class _FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"log_path": 3}, TypeError, "log_path"),
        ({"log_dir": 3.5}, TypeError, "log_dir"),
        ({"flops_per_example": 0}, ValueError, "flops_per_example"),
        ({"flops_per_example": "big"}, TypeError, "flops_per_example"),
        ({"peak_flops": -1e12}, ValueError, "peak_flops"),
        ({"step_timing": 1}, TypeError, "step_timing"),
        ({"verbose": 2}, ValueError, "verbose"),
        ({"verbose": 1.0}, TypeError, "verbose"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        kp.TrainingMonitor(**kwargs)


def test_config_round_trip(tmp_path):
    mon = kp.TrainingMonitor(
        log_path=tmp_path / "a.jsonl",
        flops_per_example=1e6,
        peak_flops=2e12,
        step_timing=False,
        verbose=1,
        log_dir=str(tmp_path / "tb"),
    )
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(mon))
    assert isinstance(again, kp.TrainingMonitor)
    assert again.get_config() == mon.get_config()
    assert again.get_config()["log_path"] == str(tmp_path / "a.jsonl")


# ---------------------------------------------------------------- the meter
def test_meter_step_times_and_percentiles_from_a_fake_clock():
    clock = _FakeClock()
    meter = EpochMeter(clock=clock)
    meter.start()
    for i, dt in enumerate([0.010, 0.020, 0.030, 0.040, 0.100]):
        clock.t += dt
        meter.step_end(i)
    clock.t += 0.5  # sync before validation
    meter.val_start()
    clock.t += 0.25
    meter.val_end()
    out = meter.finish()
    assert out["steps"] == 5
    assert out["epoch_time_s"] == pytest.approx(0.2)  # last step's end, not the later sync
    assert out["steps_per_s"] == pytest.approx(25.0)
    assert out["val_time_s"] == pytest.approx(0.25)
    assert out["step_time_ms_p50"] == pytest.approx(30.0)
    assert out["step_time_ms_p90"] == pytest.approx(40 + 0.6 * 60)


def test_meter_divides_an_execution_by_its_steps_and_caps_the_overshoot():
    clock = _FakeClock()
    meter = EpochMeter(clock=clock)
    meter.start()
    # steps_per_execution=3 over 7 batches: Keras reports ends 2, 5 and (overshooting) 8.
    for end, dt in [(2, 0.030), (5, 0.060), (8, 0.010)]:
        clock.t += dt
        meter.step_end(end)
    out = meter.finish(max_steps=7)
    assert out["steps"] == 7
    assert sorted([out["step_time_ms_p50"]]) == [pytest.approx(10.0)]
    assert out["step_time_ms_p90"] == pytest.approx(18.0)  # per-step: 10, 20, 10


def test_meter_out_of_order_worker_readings():
    clock = _FakeClock()
    meter = EpochMeter(clock=clock)
    meter.start()
    clock.t = 0.02
    meter.step_end(1)  # a worker thread reports step 1 before step 0
    clock.t = 0.021
    meter.step_end(0)
    out = meter.finish()
    assert out["steps"] == 2
    # Readings are matched to steps in time order: 20 ms, then 1 ms.
    assert out["step_time_ms_p50"] == pytest.approx(10.5)
    assert out["epoch_time_s"] == pytest.approx(0.021)


def test_meter_device_bound_async_times_completions_not_dispatch():
    # JAX-style: all 4 steps dispatched at once, each completes 50 ms after the previous one.
    clock = _FakeClock()
    meter = EpochMeter(clock=clock)
    meter.start()
    for i in range(4):
        meter.step_begin(i)
        clock.t += 0.0001
    for i in range(4):
        clock.t = 0.05 * (i + 1)
        meter.step_end(i)
    out = meter.finish()
    assert out["step_time_ms_p50"] == pytest.approx(50.0)
    assert out["epoch_time_s"] == pytest.approx(0.2)


def test_meter_host_bound_async_times_dispatch_when_end_readings_bunch_up():
    # Host-bound: steps start 10 ms apart; starved worker threads read all ends at the end.
    clock = _FakeClock()
    meter = EpochMeter(clock=clock)
    meter.start()
    for i in range(5):
        clock.t = 0.010 * i
        meter.step_begin(i)
    for i in range(5):
        clock.t = 0.0500 + 0.00001 * i
        meter.step_end(i)
    out = meter.finish()
    assert out["step_time_ms_p50"] == pytest.approx(10.0, rel=1e-3)
    assert out["epoch_time_s"] == pytest.approx(0.05, rel=1e-3)


def test_meter_without_step_timing_uses_the_given_count():
    clock = _FakeClock()
    meter = EpochMeter(step_timing=False, clock=clock)
    meter.start()
    meter.step_end(0)
    clock.t = 2.0
    out = meter.finish(steps=10)
    assert out["steps"] == 10 and out["steps_per_s"] == pytest.approx(5.0)
    assert out["step_time_ms_p50"] is None and out["step_time_ms_p90"] is None


# ---------------------------------------------------------------- fit: counts
@pytest.mark.parametrize("spe", [1, 3])
def test_counts_with_short_last_batch_validation_and_steps_per_execution(digits, spe):
    if spe > 1 and BACKEND == "torch":
        pytest.skip("Keras' torch backend requires steps_per_execution=1")
    (x, y), (xv, yv) = digits
    model = _mlp(spe)
    mon = kp.TrainingMonitor()
    history = model.fit(
        x[:203],
        y[:203],
        batch_size=32,
        epochs=3,
        validation_data=(xv[:50], yv[:50]),
        validation_freq=2,
        callbacks=[mon],
        verbose=0,
    )
    assert [r["epoch"] for r in mon.history] == [1, 2, 3]
    for r in mon.history:
        assert r["examples"] == 203  # 6 batches of 32 and one of 11
        assert r["steps"] == 7
        assert r["examples_per_s"] == pytest.approx(203 / r["epoch_time_s"])
        assert r["steps_per_s"] == pytest.approx(7 / r["epoch_time_s"])
        assert 0 < r["step_time_ms_p50"] <= r["step_time_ms_p90"]
        assert r["peak_memory_bytes"] > 0
        assert r["memory_measure"] in _MEASURES, r
        assert np.isfinite(r["loss"])
    # Validation ran in epoch 2 only: timed separately there, absent elsewhere.
    assert mon.history[1]["val_time_s"] > 0 and "val_loss" in mon.history[1]
    assert mon.history[0]["val_time_s"] is None and mon.history[2]["val_time_s"] is None
    # The figures reach Keras' logs, hence History.
    assert history.history["examples"] == [203, 203, 203]
    assert history.history["steps_per_s"] == [r["steps_per_s"] for r in mon.history]


def test_step_timing_off_still_counts(digits):
    (x, y), _ = digits
    mon = kp.TrainingMonitor(step_timing=False)
    _mlp().fit(x[:100], y[:100], batch_size=25, epochs=1, callbacks=[mon], verbose=0)
    r = mon.history[0]
    assert (r["steps"], r["examples"]) == (4, 100)
    assert r["step_time_ms_p50"] is None and r["step_time_ms_p90"] is None


class _Tick(keras.layers.Layer):
    """Identity that advances a fake clock by `seconds` inside each (compiled) forward pass,
    so that every training step lasts exactly `seconds` on that clock, whatever the load."""

    def __init__(self, clock, seconds, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.seconds = clock, seconds

    def _tick(self):
        self.clock.t += self.seconds

    def call(self, x):
        if BACKEND == "tensorflow":
            import tensorflow as tf

            s = tf.py_function(lambda: (self._tick(), np.float32(0.0))[1], [], tf.float32)
            s.set_shape(())
            return x + s
        if BACKEND == "jax":
            import jax

            jax.debug.callback(self._tick, ordered=True)
            return x
        self._tick()
        return x


def test_steps_per_s_matches_a_step_of_known_duration():
    # The monitor reads a clock that only the model's forward pass moves: each step lasts
    # exactly 0.1 s on it, so the figures are exact (a wall clock on a loaded 2-core machine
    # is not: Keras' own per-step and per-epoch costs vary by 2x there).
    seconds, steps = 0.1, 12
    clock = _FakeClock()
    model = keras.Sequential([keras.Input((4,)), _Tick(clock, seconds), keras.layers.Dense(1)])
    model.compile("sgd", "mse", jit_compile=False if BACKEND == "tensorflow" else "auto")
    x, y = np.ones((steps * 4, 4), "float32"), np.ones((steps * 4, 1), "float32")
    mon = kp.TrainingMonitor()
    mon._meter.clock = clock
    model.fit(x, y, batch_size=4, epochs=2, callbacks=[mon], verbose=0)
    r = mon.history[1]  # epoch 2: no tracing
    assert r["steps"] == steps
    assert r["epoch_time_s"] == pytest.approx(steps * seconds)
    assert r["steps_per_s"] == pytest.approx(1 / seconds)
    assert r["step_time_ms_p50"] == pytest.approx(1000 * seconds)
    assert r["step_time_ms_p90"] == pytest.approx(1000 * seconds)


# ---------------------------------------------------------------- peak memory
_MEASURES = {
    "tf_allocator_peak",
    "torch_cuda_peak",
    "xla_peak_bytes_in_use",
    "xla_memory_analysis",
    "torch_saved_tensors",
    "host_peak_rss",
}


def _memory_mlp(remat=None):
    keras.utils.set_random_seed(0)
    model = kp.loss_scaled(models.mlp([256, 256, 256], activation="gelu"), remat=remat)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _monitored_peaks(model, batch_size, epochs=1, callbacks=()):
    rng = np.random.default_rng(0)
    x, y = rng.random((256, 64), dtype=np.float32), rng.integers(0, 10, 256)
    mon = kp.TrainingMonitor()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[mon, *callbacks])
    return mon.history, (x[:batch_size], y[:batch_size], None)


@pytest.mark.skipif(kp.backend.has_accelerator(), reason="a CPU's measure")
def test_peak_memory_on_a_cpu_is_the_backends_own_count_of_the_step():
    """JAX and torch: each epoch's peak is `kp.backend.step_memory` of that batch (XLA's
    analysis of the compiled step; the tensors autograd saves plus the state and batch),
    taken during `fit`, and the model's train function is its own again afterwards.
    TensorFlow without the BFC allocator: the process's peak resident memory, named so."""
    sizes = {}
    for batch_size, epochs in ((32, 2), (128, 1)):
        model = _memory_mlp()
        history, batch = _monitored_peaks(model, batch_size, epochs=epochs)
        assert getattr(model.train_function, "_kp_original", None) is None
        if kp.backend.step_memory_unavailable() is not None:  # TensorFlow, no BFC allocator
            assert {(r["memory_measure"], r["memory_device"]) for r in history} == {
                ("host_peak_rss", "host")
            }
            return
        step = functools.partial(model.train_on_batch, *batch[:2])
        expected = kp.backend.step_memory(model, batch, step)
        assert [r["memory_measure"] for r in history] == [expected["measure"]] * epochs
        if BACKEND != "tensorflow":  # a count of the step, the same in every epoch
            assert [r["peak_memory_bytes"] for r in history] == [expected["bytes"]] * epochs
        sizes[batch_size] = history[-1]["peak_memory_bytes"]
    # The larger batch's activations: 96 more examples x 3 x 256 float32 values at least.
    assert sizes[128] - sizes[32] >= 96 * 3 * 256 * 4


@pytest.mark.backends("torch")
@pytest.mark.skipif(kp.backend.has_accelerator(), reason="a CPU's measure")
def test_the_monitor_shows_what_remat_saves():
    """Per-layer recomputation keeps each Dense(gelu)'s input, not its pre-activation: the
    monitor's count at batch 128 drops by about half the plain step's saved activations."""
    plain, _ = _monitored_peaks(_memory_mlp(), 128)
    remat, _ = _monitored_peaks(_memory_mlp("full"), 128)
    assert plain[0]["memory_measure"] == remat[0]["memory_measure"] == "torch_saved_tensors"
    saved = 128 * 3 * 256 * 4  # one pre-activation per hidden layer
    assert plain[0]["peak_memory_bytes"] - remat[0]["peak_memory_bytes"] >= 0.9 * saved


@pytest.mark.backends("torch")
@pytest.mark.skipif(kp.backend.has_accelerator(), reason="a CPU's measure")
def test_a_traced_step_logs_the_process_peak_and_stays_traced():
    """keras-perf's traced step runs one graph without autograd, so the saved-tensor count
    would read 0: the monitor logs the process's peak instead, and the step neither falls
    back nor warns (the count's hooks once broke the trace)."""
    from keras_perf.train_step.torch_traced import traced_step_state

    model = kp.loss_scaled(_memory_mlp(), traced_step=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history, _ = _monitored_peaks(model, 32, epochs=2)
    state = traced_step_state(model)
    assert state["active"] and state["reason"] is None and state["signatures"] >= 1
    assert [r["memory_measure"] for r in history] == ["host_peak_rss"] * 2
    assert all(r["peak_memory_bytes"] > 10 * 2**20 for r in history)


class _RebuildTrainFunction(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.make_train_function(force=True)


@pytest.mark.skipif(kp.backend.has_accelerator(), reason="a CPU's measure")
def test_peak_memory_survives_a_crashed_fit_and_a_rebuilt_train_function():
    """A fit that raised leaves the monitor's stand-in for the train function behind; the next
    fit measures as before and ends with the model's own function. A callback rebuilding the
    train function between epochs does not stop the measure."""
    model = _memory_mlp()
    mon = kp.TrainingMonitor()
    x, y = np.ones((64, 64), np.float32), np.zeros(64, np.int64)
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[mon, _CrashInEpoch(0)])
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[mon, _RebuildTrainFunction()])
    assert getattr(model.train_function, "_kp_original", None) is None
    measures = [r["memory_measure"] for r in mon.history]
    assert len(set(measures)) == 1 and measures[0] in _MEASURES
    if measures[0] in ("xla_memory_analysis", "torch_saved_tensors"):
        peaks = [r["peak_memory_bytes"] for r in mon.history]
        assert peaks == [peaks[0]] * 2


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
@pytest.mark.skipif(kp.backend.has_accelerator(), reason="a CPU's measure")
def test_peak_memory_tensorflow_with_bfc_allocator():
    """With TF_CPU_ALLOCATOR_USE_BFC=true (set before TensorFlow is imported: a child
    process), TensorFlow's CPU allocator peak over the epoch, which grows with the batch.
    The peak moves by about 0.3 MB from run to run (the executor's order of frees, tf.data's
    prefetched batches): between batches 16 and 256 it grew by 0.73-1.44 MB over 8 runs
    (2026-11-28), for 0.74 MB of hidden activations; half of those is the bound."""
    code = (
        "import json\n"
        "from test_monitor import _memory_mlp, _monitored_peaks\n"
        "out = [_monitored_peaks(_memory_mlp(), b)[0][0] for b in (16, 256)]\n"
        "print(json.dumps([[r['memory_measure'], r['memory_device'], r['peak_memory_bytes']]"
        " for r in out]))\n"
    )
    small, large = tensorflow_with_bfc(code)
    assert small[:2] == large[:2] == ["tf_allocator_peak", "CPU:0"]
    weights = 64 * 256 + 2 * 256 * 256 + 256 * 10  # float32 kernels, the peak holds them
    assert small[2] >= 4 * weights
    assert large[2] - small[2] >= 0.5 * (256 - 16) * 3 * 256 * 4


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
@pytest.mark.skipif(kp.backend.has_accelerator(), reason="a CPU's measure")
def test_tensorflow_peak_is_the_epochs_own_over_repeated_fits():
    """Regression (issue 41, memory over repeated use): the BFC allocator's raw peak holds every
    tensor of the process, and a model trained by Keras' traced step leaves its weights and
    Adam slots allocated after `del model` (TensorFlow 2.21), so fresh models' peaks grew
    fit by fit (88, 125, 171 MB). The figure is the peak above the epoch's start plus the
    model's own state: fresh identical models log the same, micro-batches show their saving."""
    code = (
        "import gc, json\n"
        "from test_monitor import _memory_mlp, _monitored_peaks\n"
        "out = []\n"
        "for k in (1, 4, 1, 1):\n"
        "    model = _memory_mlp()\n"
        "    model.microbatches = k\n"
        "    out.append(_monitored_peaks(model, 256)[0][0]['peak_memory_bytes'])\n"
        "    del model\n"
        "    gc.collect()\n"
        "print(json.dumps(out))\n"
    )
    first, micro, again, third = tensorflow_with_bfc(code)
    weights = 64 * 256 + 2 * 256 * 256 + 256 * 10
    # Each earlier model left about 3 x its weights behind (weights and two Adam slots: 2.6 MB,
    # half the figure), which the figure must not count. Fresh identical models measured
    # 5.24 / 4.47 / 5.00 MB in one run (the allocator's reuse varies by up to 15 %).
    assert abs(third - first) < 0.25 * first and abs(again - first) < 0.25 * first
    assert first - micro >= 0.5 * 192 * 3 * 256 * 4  # 3/4 of the batch's activations, at least half
    assert first >= 3 * weights * 4


# ---------------------------------------------------------------- JSONL, reuse
class _CrashInEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.crash_epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == self.crash_epoch and batch == 1:
            raise RuntimeError("simulated crash")


def test_jsonl_lines_survive_a_crash_in_epoch_3(tmp_path, digits):
    (x, y), _ = digits
    path = tmp_path / "logs" / "run.jsonl"  # the folder does not exist yet
    mon = kp.TrainingMonitor(log_path=path)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _mlp().fit(
            x[:96], y[:96], batch_size=32, epochs=5, verbose=0, callbacks=[mon, _CrashInEpoch(2)]
        )
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        assert r["examples"] == 96 and r["steps"] == 3
        assert set(MONITOR_KEYS) <= set(r)
        assert r["loss"] > 0


def test_reuse_continues_numbering_and_appends(tmp_path, digits):
    (x, y), _ = digits
    path = tmp_path / "run.jsonl"
    mon = kp.TrainingMonitor(log_path=path)
    model = _mlp()
    model.fit(x[:64], y[:64], batch_size=32, epochs=2, callbacks=[mon], verbose=0)
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, callbacks=[mon], verbose=0)
    assert [(r["epoch"], r["fit"]) for r in mon.history] == [(1, 1), (2, 1), (3, 2)]
    # A resumed fit numbers its epochs as Keras does.
    model.fit(x[:64], y[:64], batch_size=32, epochs=5, initial_epoch=3, callbacks=[mon], verbose=0)
    assert [r["epoch"] for r in mon.history] == [1, 2, 3, 4, 5]
    assert [json.loads(s)["epoch"] for s in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    state = mon.state_dict()
    fresh = kp.TrainingMonitor()
    fresh.load_state_dict(state)
    assert fresh.history == mon.history and fresh.state_dict()["fits"] == 3
    mon.reset()
    assert mon.history == [] and mon.summary() == {"epochs": 0}


# ---------------------------------------------------------------- summary, plot, csv
def _monitor_with_made_up_history():
    mon = kp.TrainingMonitor()
    for epoch, (loss, acc, val_loss, eps, mem) in enumerate(
        [(1.0, 0.5, 1.1, 100.0, 3e8), (0.5, 0.8, 0.7, 300.0, 5e8), (0.4, 0.85, 0.9, 200.0, 4e8)],
        start=1,
    ):
        mon.history.append(
            {
                "epoch": epoch,
                "fit": 1,
                "loss": loss,
                "accuracy": acc,
                "val_loss": val_loss,
                "epoch_time_s": 2.0,
                "val_time_s": 0.5,
                "steps": 10,
                "examples": 320,
                "steps_per_s": 5.0,
                "examples_per_s": eps,
                "step_time_ms_p50": 190.0,
                "step_time_ms_p90": 250.0,
                "peak_memory_bytes": mem,
                "loss_scale": None,
                "mfu": None,
                "memory_device": "host",
            }
        )
    return mon


def test_summary_numbers():
    s = _monitor_with_made_up_history().summary()
    assert s["epochs"] == 3 and s["fits"] == 1
    assert s["total_time_s"] == pytest.approx(7.5) and s["train_time_s"] == pytest.approx(6.0)
    assert s["examples"] == 960 and s["steps"] == 30
    assert s["mean_examples_per_s"] == pytest.approx(200.0)
    assert s["median_examples_per_s"] == pytest.approx(200.0)
    assert s["peak_memory_bytes"] == 5e8
    assert s["mean_mfu"] is None
    assert s["best"] == {"metric": "val_loss", "value": 0.7, "epoch": 2, "mode": "min"}


def test_summary_best_by_monitor_and_mode():
    mon = _monitor_with_made_up_history()
    assert mon.summary("accuracy")["best"]["epoch"] == 3  # auto: max for accuracy
    assert mon.summary("loss")["best"]["epoch"] == 3
    assert mon.summary("val_loss", mode="max")["best"]["epoch"] == 1
    with pytest.raises(ValueError, match="numeric keys recorded are .*'accuracy'"):
        mon.summary("val_auc")
    with pytest.raises(ValueError, match="mode"):
        mon.summary(mode="best")


def test_plot_writes_a_png_that_opens(tmp_path):
    from PIL import Image

    path = _monitor_with_made_up_history().plot(tmp_path / "run.png")
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.size == (800, 1060)  # 5 panels: loss, metrics, throughput, step, memory
        pixels = np.asarray(img.convert("L"))
    assert (tmp_path / "run.png").stat().st_size > 20_000
    assert pixels.std() > 10  # not a blank canvas


def _panels(fig):
    fig.canvas.draw()
    out = {}
    for ax in fig.axes:
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        out[ax.get_title(loc="left")] = (ax, lines)
    return out


def test_plot_panels_colours_legends_and_axes():
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    from keras_perf.monitor._report import history_figure

    mon = _monitor_with_made_up_history()
    for r, (norm, skipped, scale) in zip(
        mon.history, [(2.0, 0, 2.0**15), (1.0, 3, 2.0**14), (0.5, 0, 2.0**15)]
    ):
        r.update(grad_norm=norm, skipped_steps=skipped, loss_scale=scale)
    fig = history_figure(mon.history)
    panels = _panels(fig)
    assert list(panels) == [
        "Loss",
        "Metrics",
        "Throughput",
        "Step time",
        "Peak memory (host)",
        "Gradient norm",
        "Skipped steps (non-finite gradients)",
        "Loss scale",
    ]
    assert len(fig.axes) == 8  # no twin axes: one y scale per panel
    assert set(panels["Loss"][1]) == {"loss", "val_loss"}
    assert set(panels["Metrics"][1]) == {"accuracy"}  # health keys are not metrics
    assert set(panels["Step time"][1]) == {"p50", "p90"}
    colours = [to_hex(ln.get_color()) for _, lines in panels.values() for ln in lines.values()]
    assert len(colours) == 10 and len(set(colours)) == 10  # one colour per series
    # Memory is a line in MiB (no bars), from zero; so are throughput and step time.
    ax, lines = panels["Peak memory (host)"]
    assert not ax.patches and list(lines["peak memory"].get_ydata()) == pytest.approx(
        [3e8 / 2**20, 5e8 / 2**20, 4e8 / 2**20]
    )
    for title in (
        "Throughput",
        "Step time",
        "Peak memory (host)",
        "Skipped steps (non-finite gradients)",
    ):
        assert panels[title][0].get_ylim()[0] == 0
    assert panels["Loss scale"][0].get_yscale() == "log"
    # Every legend lies right of its panel's plotting area: it covers no line.
    renderer = fig.canvas.get_renderer()
    for ax, _ in panels.values():
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.x0 >= ax.get_window_extent(renderer).x1
    assert [int(t) for t in panels["Loss scale"][0].get_xticks() if t == int(t)] == panels[
        "Loss scale"
    ][0].get_xticks().tolist()


def test_plot_without_history_raises(tmp_path):
    with pytest.raises(RuntimeError, match="no epoch recorded"):
        kp.TrainingMonitor().plot(tmp_path / "x.png")


def test_to_csv_round_trip(tmp_path):
    import csv

    mon = _monitor_with_made_up_history()
    path = mon.to_csv(tmp_path / "run.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    assert [float(r["examples_per_s"]) for r in rows] == [100.0, 300.0, 200.0]
    assert rows[0]["mfu"] == ""


# ---------------------------------------------------------------- extras
def test_mfu_loss_scale_and_tensorboard(tmp_path, digits):
    (x, y), _ = digits
    model = _mlp(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))
    mon = kp.TrainingMonitor(peak_flops=1e12, log_dir=tmp_path / "tb")
    model.fit(x[:64], y[:64], batch_size=32, epochs=2, callbacks=[mon], verbose=0)
    flops = 6 * (64 * 16 + 16 * 10)
    assert kp.estimate_flops_per_example(model) == flops
    for r in mon.history:
        assert r["mfu"] == pytest.approx(flops * r["examples_per_s"] / 1e12)
        assert r["loss_scale"] > 0
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1
    scalars = _read_scalars(tmp_path / "tb")
    eps = [(step, v) for step, tag, v in scalars if tag == "keras_perf/examples_per_s"]
    assert [s for s, _ in eps] == [1, 2]
    assert eps[1][1] == pytest.approx(mon.history[1]["examples_per_s"], rel=1e-6)


def _block_tensorflow(monkeypatch):
    gc.collect()  # TF objects freed while TF is blocked would fail to import their cleanup
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` now fails


@pytest.mark.parametrize("library", ["tensorflow", "tensorboardX"])
def test_scalar_writer_files_read_back_with_a_library_reader(library, tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        if library == "tensorboardX":
            _block_tensorflow(m)
        writer = ScalarWriter(tmp_path / "a" / "b")
        writer.scalar("a/b", 1.5, step=3)
        writer.scalar("n", np.float32(7), step=3)
        writer.scalar("a/b", -2.25, step=4)
        writer.close()
        assert writer.library == library
    (path,) = (tmp_path / "a" / "b").glob("events.out.tfevents.*")
    assert _read_scalars(tmp_path / "a" / "b") == [
        (3, "a/b", 1.5),
        (3, "n", 7.0),
        (4, "a/b", -2.25),
    ]


@pytest.mark.parametrize("library", ["tensorflow", "tensorboardX"])
def test_scalar_writer_raises_oserror_where_it_cannot_write(library, tmp_path, monkeypatch):
    # TensorFlow raises tf.errors.FailedPreconditionError (not an OSError): the shim turns
    # every writer error into OSError, the one type the monitor catches.
    (tmp_path / "a_file").write_text("")
    if library == "tensorboardX":
        _block_tensorflow(monkeypatch)
    with pytest.raises(OSError, match="a_file"):
        ScalarWriter(tmp_path / "a_file" / "tb").scalar("x", 1.0, step=1)


def test_neither_writer_installed_names_the_tensorboard_extra(tmp_path, monkeypatch):
    mon = kp.TrainingMonitor(log_dir=tmp_path / "tb")  # construction touches nothing
    mon.set_model(_mlp())
    _block_tensorflow(monkeypatch)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"TrainingMonitor\(log_dir=...\).*\[tensorboard\]"):
        mon.on_train_begin()  # the first thing `fit` calls: no step taken
    with pytest.raises(ImportError, match=r"PruningCallback\(log_dir=...\).*\[tensorboard\]"):
        kp.PruningCallback(kp.ConstantSparsity(0.5), log_dir=str(tmp_path))
    assert not (tmp_path / "tb").exists()


@pytest.mark.backends("jax", "torch")
def test_monitor_writes_tensorboard_files_through_tensorboardx_without_tensorflow(
    tmp_path, digits, monkeypatch
):
    # `pip install keras-perf[jax,tensorboard]`: no TensorFlow anywhere.
    (x, y), _ = digits
    with monkeypatch.context() as m:
        _block_tensorflow(m)
        mon = kp.TrainingMonitor(log_dir=tmp_path / "tb")
        _fit_with(mon, x, y, epochs=2)
        assert mon._writer.library == "tensorboardX"
    losses = [
        (step, v) for step, tag, v in _read_scalars(tmp_path / "tb") if tag == "keras_perf/loss"
    ]
    assert losses == [(r["epoch"], pytest.approx(r["loss"], rel=1e-6)) for r in mon.history]


def test_hooks_warn_when_examples_cannot_be_counted(capsys):
    model = _mlp()  # compiled, never trained: its loss tracker counted nothing
    mon = kp.TrainingMonitor(verbose=1)
    mon.set_model(model)
    mon.set_params({"epochs": 1, "steps": 2, "verbose": 0})
    mon.on_train_begin()
    mon.on_epoch_begin(0)
    mon.on_train_batch_end(0)
    mon.on_train_batch_end(1)
    logs = {"loss": 1.25}
    with pytest.warns(kp.KerasPerfWarning, match="cannot count examples"):
        mon.on_epoch_end(0, logs)
    r = mon.history[0]
    assert r["examples"] is None and r["examples_per_s"] is None and r["steps"] == 2
    assert logs["steps"] == 2 and "examples" not in logs  # unknown values stay out of logs
    assert "monitor epoch 1:" in capsys.readouterr().out


# ---------------------------------------------------------------- log locations and failures
def _fit_with(mon, x, y, epochs=1):
    model = _mlp()
    history = model.fit(x[:64], y[:64], batch_size=32, epochs=epochs, callbacks=[mon], verbose=0)
    return model, history


def _bad_locations(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return {
        "log_path is a folder": ({"log_path": folder}, r"`log_path=.*folder'` is a directory"),
        "log_path under a file": (
            {"log_path": a_file / "sub" / "run.jsonl"},
            r"`log_path=.*run.jsonl'` lies under .*a_file', which is a file",
        ),
        "log_dir is a file": (
            {"log_dir": a_file},
            r"`log_dir=.*a_file'` is a file; it must be a folder",
        ),
        "log_dir under a file": (
            {"log_dir": a_file / "tb"},
            r"`log_dir=.*tb'` lies under .*a_file'",
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["log_path is a folder", "log_path under a file", "log_dir is a file", "log_dir under a file"],
)
def test_regression_bad_log_location_raises_before_the_first_step(case, tmp_path, digits):
    # Before: accepted; the first epoch trained, then its end raised IsADirectoryError /
    # NotADirectoryError (log_path) or FileExistsError (log_dir) out of fit.
    (x, y), _ = digits
    kwargs, match = _bad_locations(tmp_path)[case]
    mon = kp.TrainingMonitor(**kwargs)
    model = _mlp()
    with pytest.raises(ValueError, match=match):
        model.fit(x[:64], y[:64], batch_size=32, epochs=1, callbacks=[mon], verbose=0)
    assert _steps_taken(model) == 0
    assert mon.history == []


def _steps_taken(model):
    optimizer = model.optimizer
    return int(keras.ops.convert_to_numpy(optimizer.iterations)) if optimizer.built else 0


@pytest.mark.skipif(
    not os.path.isdir("/sys/kernel"), reason="needs Linux sysfs (read-only even for root)"
)
@pytest.mark.parametrize("arg", ["log_path", "log_dir"])
def test_unwritable_log_location_raises_before_the_first_step(arg, digits):
    (x, y), _ = digits
    mon = kp.TrainingMonitor(**{arg: "/sys/keras_perf_test/run"})
    model = _mlp()
    with pytest.raises(ValueError, match=f"`{arg}='/sys/keras_perf_test/run'` cannot be written"):
        model.fit(x[:64], y[:64], batch_size=32, epochs=1, callbacks=[mon], verbose=0)
    assert _steps_taken(model) == 0


def test_missing_log_folders_are_created_when_training_begins(tmp_path):
    # log_path: its folder is created (as Keras' ModelCheckpoint does; CSVLogger would raise);
    # log_dir: created with its parents, as Keras' TensorBoard callback does.
    path, tb = tmp_path / "a" / "b" / "run.jsonl", tmp_path / "c" / "d" / "tb"
    mon = kp.TrainingMonitor(log_path=path, log_dir=tb)
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()  # not at construction
    mon.set_model(_mlp())
    mon.on_train_begin()
    assert path.is_file() and path.read_text() == ""
    events = list(tb.glob("events.out.tfevents.*"))
    assert len(events) == 1 and _read_scalars(tb) == []  # the header event only
    mon.on_train_end()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_regression_disk_full_log_path_warns_once_and_fit_completes(digits):
    # Before: OSError [Errno 28] out of the first epoch's end killed fit.
    (x, y), _ = digits
    mon = kp.TrainingMonitor(log_path="/dev/full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, history = _fit_with(mon, x, y, epochs=3)
    ours = [w for w in caught if issubclass(w.category, kp.KerasPerfWarning)]
    assert len(ours) == 1 and "could not write epoch 1 to `log_path`='/dev/full'" in str(
        ours[0].message
    )
    assert len(history.history["loss"]) == 3 and [r["epoch"] for r in mon.history] == [1, 2, 3]
    assert all("No space left on device" in r["log_error"] for r in mon.history)
    assert mon.summary()["log_complete"] is False


def _fail_on_call(n, real):
    calls = {"n": 0}

    def append(path, data):
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(errno.EIO, "injected I/O error")
        real(path, data)

    return append


def test_injected_write_errors_skip_one_epoch_and_leave_readable_files(
    tmp_path, digits, monkeypatch
):
    (x, y), _ = digits
    from keras_perf.monitor import _callback

    # JSONL: the 2nd append fails (patched where the callback looks it up); TensorBoard: every
    # scalar of epoch 2.
    monkeypatch.setattr(_callback, "append_bytes", _fail_on_call(2, _callback.append_bytes))
    real_scalar = ScalarWriter.scalar

    def scalar(self, tag, value, step):
        if step == 2:
            raise OSError(errno.EIO, "injected I/O error")
        real_scalar(self, tag, value, step)

    monkeypatch.setattr(ScalarWriter, "scalar", scalar)
    path, tb = tmp_path / "run.jsonl", tmp_path / "tb"
    mon = kp.TrainingMonitor(log_path=path, log_dir=tb)
    with pytest.warns(kp.KerasPerfWarning, match="could not write epoch 2") as record:
        _, history = _fit_with(mon, x, y, epochs=4)
    ours = [w for w in record if issubclass(w.category, kp.KerasPerfWarning)]
    assert len(ours) == 2  # one per argument
    assert len(history.history["loss"]) == 4
    assert [json.loads(line)["epoch"] for line in path.read_text().splitlines()] == [1, 3, 4]
    steps = sorted({step for step, tag, _ in _read_scalars(tb) if tag == "keras_perf/loss"})
    assert steps == [1, 3, 4]
    errors = [r.get("log_error") for r in mon.history]
    assert errors[0] is None and errors[2:] == [None, None]
    assert errors[1] == (
        "log_path: OSError: [Errno 5] injected I/O error; log_dir: OSError: [Errno 5] injected I/O error"
    )
    assert mon.summary()["log_complete"] is False


def test_log_complete_when_every_write_succeeds(tmp_path, digits):
    (x, y), _ = digits
    mon = kp.TrainingMonitor(log_path=tmp_path / "run.jsonl", log_dir=tmp_path / "tb")
    _fit_with(mon, x, y, epochs=2)
    assert mon.summary()["log_complete"] is True
    assert all("log_error" not in r for r in mon.history)


def test_append_bytes_cuts_a_torn_record_back(tmp_path, monkeypatch):
    # A write that gets half its bytes out, then fails (disk full mid-record): the file is
    # cut back to its previous length, so the next record starts on a clean line.
    import io

    from keras_perf._files import append_bytes

    path = str(tmp_path / "f")
    append_bytes(path, b"first\n")
    real_write = io.FileIO.write

    class _Torn(io.FileIO):
        def write(self, b):
            if len(b) > 3:
                return real_write(self, bytes(b)[:3])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("builtins.open", lambda p, mode, buffering=-1: _Torn(p, mode))
    with pytest.raises(OSError, match="No space left"):
        append_bytes(path, b"second\n")
    monkeypatch.undo()
    append_bytes(path, b"third\n")
    assert open(path, "rb").read() == b"first\nthird\n"


@pytest.mark.skipif(kp.backend.has_accelerator(), reason="a CPU's measured peak")
@pytest.mark.parametrize("policy, tflops", [("float32", 0.5), ("mixed_bfloat16", 2.0)])
def test_mfu_on_cpu_uses_the_measured_peak_of_the_compute_dtype(
    monkeypatch, digits, policy, tflops
):
    from keras_perf import precision

    report = precision.PrecisionReport(
        {"tflops": {"float32": 0.5, "bfloat16": 2.0, "float16": None}, "policy": "float32"}
    )
    monkeypatch.setattr(precision, "_CACHE", {"report": report})
    keras.mixed_precision.set_global_policy(policy)
    (x, y), _ = digits
    model = _mlp()
    mon = kp.TrainingMonitor()
    model.fit(x[:64], y[:64], batch_size=32, epochs=2, callbacks=[mon], verbose=0)
    flops = 6 * (64 * 16 + 16 * 10)
    for r in mon.history:
        assert r["mfu"] == pytest.approx(flops * r["examples_per_s"] / (tflops * 1e12))


@pytest.mark.skipif(kp.backend.has_accelerator(), reason="a CPU's measured peak")
def test_no_mfu_on_cpu_where_the_compute_dtype_cannot_run(monkeypatch, digits):
    from keras_perf import precision

    report = precision.PrecisionReport({"tflops": {"float32": None}, "policy": "float32"})
    monkeypatch.setattr(precision, "_CACHE", {"report": report})
    (x, y), _ = digits
    mon = kp.TrainingMonitor()
    _mlp().fit(x[:64], y[:64], batch_size=32, epochs=1, callbacks=[mon], verbose=0)
    assert "mfu" not in mon.history[0] or mon.history[0]["mfu"] is None
