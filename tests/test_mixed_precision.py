import keras
import pytest

import keras_perf as kp
from keras_perf import precision
from keras_perf.mixed_precision import auto_policy
from tests import models


@pytest.fixture(autouse=True)
def _neutral_report(monkeypatch):
    """A measured report in which no policy is slower than float32, so these tests check the
    model rules alone and measure nothing (tests/test_precision.py measures for real)."""
    report = precision.PrecisionReport(
        {
            "backend": keras.backend.backend(),
            "device": {"kind": "CPU", "name": "test"},
            "tflops": {"float32": 1.0, "bfloat16": 1.0, "float16": 1.0},
            "conv_tflops": {"float32": 1.0, "bfloat16": 1.0, "float16": 1.0},
            "speedup": {"matmul": 1.0, "conv": 1.0, "float16_matmul": 1.0, "float16_conv": 1.0},
            "policy": "mixed_bfloat16",
            "reason": "test",
            "seconds": 0.0,
        }
    )
    monkeypatch.setattr(precision, "_CACHE", {"report": report})


def test_auto_sets_the_measured_policy():
    assert kp.setup_mixed_precision("auto") == "mixed_bfloat16"
    assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16", "float32"])
def test_explicit_policy_is_set(name):
    assert kp.setup_mixed_precision(name) == name
    assert keras.mixed_precision.global_policy().name == name


@pytest.mark.parametrize(
    "devices, expected",
    [
        ([{"kind": "CPU", "compute_capability": None}], "float32"),
        ([{"kind": "GPU", "compute_capability": (8, 0)}], "mixed_bfloat16"),
        ([{"kind": "GPU", "compute_capability": (9, 0)}], "mixed_bfloat16"),
        ([{"kind": "GPU", "compute_capability": (7, 5)}], "mixed_float16"),
        ([{"kind": "GPU", "compute_capability": (7, 0)}], "mixed_float16"),
        (
            [
                {"kind": "GPU", "compute_capability": (9, 0)},
                {"kind": "GPU", "compute_capability": (7, 0)},
            ],
            "mixed_float16",
        ),
        ([{"kind": "GPU", "compute_capability": (6, 1)}], "float32"),
        (
            [
                {"kind": "GPU", "compute_capability": (9, 0)},
                {"kind": "GPU", "compute_capability": (6, 0)},
            ],
            "float32",
        ),
        ([{"kind": "CPU"}, {"kind": "TPU"}], "mixed_bfloat16"),
    ],
)
def test_auto_policy_rules(devices, expected):
    assert auto_policy(devices) == expected


def test_bad_policy_names_the_argument():
    with pytest.raises(ValueError, match=r"`policy` must be one of .*mixed_float16.*'fp8'"):
        kp.setup_mixed_precision("fp8")
    with pytest.raises(TypeError, match="policy"):
        kp.setup_mixed_precision(16)
    assert keras.mixed_precision.global_policy().name == "float32"


def _mlp(output_dtype=None):
    return models.mlp(
        [16], 8, 4, out_activation="softmax", out_name="probs", functional=True, dtype=output_dtype
    )


def test_float16_softmax_output_is_found():
    keras.mixed_precision.set_global_policy("mixed_float16")
    findings = kp.check_mixed_precision(_mlp())
    assert any("'probs'" in f and "softmax" in f and "float16" in f for f in findings), findings


def test_float32_softmax_output_passes():
    keras.mixed_precision.set_global_policy("mixed_float16")
    findings = kp.check_mixed_precision(_mlp(output_dtype="float32"))
    assert not [f for f in findings if "Output layer" in f]


def test_sequential_output_checked_too():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2, activation="sigmoid", name="out")]
    )
    findings = kp.check_mixed_precision(model)
    assert len(findings) == 1 and "'out'" in findings[0] and "bfloat16" in findings[0]


def test_float32_model_is_clean():
    assert kp.check_mixed_precision(_mlp()) == []


def test_float16_layer_under_float32_policy_found():
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, dtype="mixed_float16", name="half")(inputs)
    outputs = keras.layers.Dense(4, dtype="float32")(x)
    findings = kp.check_mixed_precision(keras.Model(inputs, outputs))
    assert len(findings) == 1 and "'half'" in findings[0]


def test_custom_train_step_without_loss_scaling_found():
    class Custom(keras.Model):
        def train_step(self, *args, **kwargs):  # pragma: no cover - never run
            return super().train_step(*args, **kwargs)

    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((8,))
    model = Custom(inputs, keras.layers.Dense(4, dtype="float32")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse", auto_scale_loss=False)
    findings = kp.check_mixed_precision(model)
    assert any("custom train_step" in f and "not loss-scaled" in f for f in findings), findings


def test_check_rejects_non_models():
    with pytest.raises(TypeError, match="model"):
        kp.check_mixed_precision("model.keras")
