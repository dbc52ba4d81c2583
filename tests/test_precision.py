"""kp.precision_report and the measured choice of setup_mixed_precision("auto")."""

import json
import time

import keras
import pytest

import keras_perf as kp
from keras_perf import precision
from keras_perf.mixed_precision import check_mixed_precision
from tests import models

CPU = {"kind": "CPU", "name": "test cpu", "half_precision_units": ["amx_bf16"]}


def _kernels(bf16=3.0, f16=0.8):
    """Fake `_measure_kernels` output: float32 at 1 TFLOP/s, the others `x` times as fast."""

    def per(x):
        return (None, None) if x is None else (x, 1.0 / x)

    return {
        op: {"float32": (1.0, 1.0), "bfloat16": per(bf16), "float16": per(f16)}
        for op in ("matmul", "conv")
    }


@pytest.fixture
def fake(monkeypatch):
    """Install fake measurements; returns a function (kernels, steps, device) -> fresh report."""
    monkeypatch.setattr(precision, "_CACHE", {})

    def make(bf16=3.0, f16=0.8, steps=(2.0, 2.5), device=CPU):
        calls = []

        def measure_steps():
            calls.append(1)
            if steps is None:
                raise AssertionError("training steps measured where they decide nothing")
            return {"dense_step": steps[0], "conv_step": steps[1]}

        monkeypatch.setattr(precision, "_device", lambda: dict(device))
        monkeypatch.setattr(precision, "_measure_kernels", lambda on_cpu: _kernels(bf16, f16))
        monkeypatch.setattr(precision, "_measure_steps", measure_steps)
        report = kp.precision_report(refresh=True)
        report.step_calls = len(calls)
        return report

    return make


def _suffix(name):
    return int(name.rsplit("_", 1)[1]) if "_" in name else 0


def test_real_report_structure_and_auto_follows_it():
    before = keras.layers.Dense(2).name
    report = kp.precision_report(refresh=True)
    after = keras.layers.Dense(2).name
    # No global state moved: dtype policy and Keras' layer-name counter are as they were.
    assert keras.mixed_precision.global_policy().name == "float32"
    assert _suffix(after) == _suffix(before) + 1
    assert report["backend"] == keras.backend.backend()
    assert set(report) >= {"backend", "device", "tflops", "policy", "reason", "conv_tflops"}
    assert set(report["tflops"]) == {"float32", "bfloat16", "float16"}
    assert report["tflops"]["float32"] > 0
    for value in list(report["tflops"].values()) + list(report["conv_tflops"].values()):
        assert value is None or value > 0
    assert report["policy"] in ("float32", "mixed_bfloat16", "mixed_float16")
    assert isinstance(report["reason"], str) and report["reason"]
    if report["device"]["kind"] == "CPU" and "half_precision_units" in report["device"]:
        assert set(report["device"]["half_precision_units"]) <= set(precision._CPU_FLAGS)
    if report["device"]["kind"] == "CPU":
        assert report["policy"] != "mixed_float16"
    json.dumps(report.to_dict())
    assert kp.precision_report() is report  # cached for the process
    assert kp.setup_mixed_precision("auto") == report["policy"]
    assert keras.mixed_precision.global_policy().name == report["policy"]


def test_fast_bfloat16_cpu_picks_mixed_bfloat16(fake):
    report = fake(bf16=3.0, steps=(2.0, 2.5))
    assert report["policy"] == "mixed_bfloat16"
    assert "Dense 2.00x" in report["reason"] and "Conv 2.50x" in report["reason"]
    assert "1.3" in report["reason"]
    assert report["speedup"]["matmul"] == pytest.approx(3.0)
    assert report["speedup"]["float16_conv"] == pytest.approx(0.8)
    assert kp.setup_mixed_precision("auto") == "mixed_bfloat16"
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize(
    "steps, slow", [((1.2, 2.0), "Dense"), ((2.0, 0.66), "Conv"), ((1.29, 1.29), "Dense and Conv")]
)
def test_fast_kernels_but_slow_training_step_picks_float32(fake, steps, slow):
    # torch on an AMX CPU: bfloat16 convolutions 2.2x, a Keras CNN 0.66x: the step decides.
    report = fake(bf16=5.6, steps=steps)
    assert report["policy"] == "float32"
    assert f"on {slow} layers" in report["reason"]
    assert kp.setup_mixed_precision("auto") == "float32"


@pytest.mark.parametrize("bf16", [0.84, 1.29, None])
def test_slow_or_missing_bfloat16_kernels_pick_float32_without_measuring_steps(fake, bf16):
    report = fake(bf16=bf16, steps=None)  # JAX on CPU: XLA has no fast bfloat16 path
    assert report["policy"] == "float32" and report.step_calls == 0
    assert "not clearly faster" in report["reason"]
    assert report["speedup"]["dense_step"] is None
    assert report["tflops"]["bfloat16"] == (None if bf16 is None else pytest.approx(bf16))


@pytest.mark.parametrize(
    "devices, expected",
    [
        ([{"kind": "GPU", "compute_capability": (8, 0)}], "mixed_bfloat16"),
        ([{"kind": "GPU", "compute_capability": (7, 0)}], "mixed_float16"),
        ([{"kind": "GPU", "compute_capability": (6, 1)}], "float32"),
        ([{"kind": "TPU", "compute_capability": None}], "mixed_bfloat16"),
    ],
)
def test_accelerators_follow_the_device_rule(fake, monkeypatch, devices, expected):
    monkeypatch.setattr(precision._backend, "list_devices", lambda: devices)
    report = fake(bf16=0.5, steps=None, device={"kind": devices[0]["kind"], "name": "x"})
    assert report["policy"] == expected and report.step_calls == 0
    assert "rule" in report["reason"]


def test_report_prints_as_a_table(fake):
    report = fake(bf16=None, f16=0.8, steps=None)
    text = str(report)
    assert text == repr(report)
    lines = text.splitlines()
    assert "test cpu" in lines[0] and "amx_bf16" in lines[0]
    row = next(line for line in lines if line.startswith("bfloat16"))
    assert row.split()[1:] == ["-", "-"]
    assert next(line for line in lines if line.startswith("float32")).split()[1:] == ["1", "1"]
    assert lines[-1].startswith("'auto' picks float32")


def test_refresh_must_be_a_bool():
    with pytest.raises(TypeError, match="refresh"):
        kp.precision_report(refresh=1)


def _softmax_mlp():
    return models.mlp([16], 8, 4, out_activation="softmax", out_name="probs", functional=True)


def test_check_warns_about_a_policy_measured_slower(fake):
    fake(bf16=5.6, f16=0.8, steps=(0.76, 0.66))
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    findings = check_mixed_precision(_softmax_mlp())
    assert any("'probs'" in f and "softmax" in f for f in findings), findings
    slow = [f for f in findings if "measured slower" in f]
    assert len(slow) == 1 and "Dense training step 0.76x" in slow[0] and "0.66x" in slow[0]
    assert "picks 'float32'" in slow[0]
    keras.mixed_precision.set_global_policy("mixed_float16")
    slow = [f for f in check_mixed_precision(_softmax_mlp()) if "measured slower" in f]
    assert len(slow) == 1 and "matmul 0.80x" in slow[0]


def test_check_is_quiet_about_a_policy_measured_faster(fake):
    fake(bf16=3.0, f16=1.2, steps=(2.0, 2.5))
    for policy in ("mixed_bfloat16", "mixed_float16"):
        keras.mixed_precision.set_global_policy(policy)
        findings = check_mixed_precision(_softmax_mlp())
        assert findings and not [f for f in findings if "measured slower" in f], findings
    keras.mixed_precision.set_global_policy("float32")
    assert check_mixed_precision(_softmax_mlp()) == []


def test_a_half_dtype_far_slower_than_float32_is_timed_once():
    """An emulated dtype (torch's bfloat16 on a CPU without bf16 units: seconds a matmul) is
    measured by its warm-up call alone, so the report stays about a second."""
    calls = []

    def slow():
        calls.append(1)
        end = time.process_time() + 0.02
        while time.process_time() < end:
            pass

    wall, cost = precision._time_calls(slow, True, 0.0, 2, give_up_s=0.005)
    assert len(calls) == 1 and cost >= 0.02 and wall > 0
    precision._time_calls(slow, True, 0.0, 2, give_up_s=1.0)
    assert len(calls) == 1 + 3  # warm-up and two timed calls where it is not far slower


def _draws():
    """One draw from each random source a `fit` may shuffle or initialise with."""
    import random

    import numpy as np

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        native = float(torch.rand(1))
    elif backend == "tensorflow":
        import tensorflow as tf

        native = float(tf.random.uniform(()))
    else:
        native = 0.0  # JAX keeps no global random state
    return random.random(), float(np.random.rand()), native, float(keras.random.uniform(()))


def test_measuring_the_kernels_draws_from_no_global_random_source(monkeypatch):
    # A TrainingMonitor measures the peak FLOP/s at the start of the first fit it watches; on
    # torch the kernels' inputs came from torch's global generator, so that fit shuffled
    # otherwise than an unwatched one (weights 0.01 apart after 2 epochs).
    monkeypatch.setitem(precision._CACHE, "report", None)
    monkeypatch.setitem(precision._CACHE, "kernels", None)
    keras.utils.set_random_seed(1)
    reference = _draws()
    keras.utils.set_random_seed(1)
    assert precision.measured_peak_flops("float32") > 0
    assert precision._CACHE["kernels"] is not None  # measured here, not cached from before
    assert _draws() == reference
