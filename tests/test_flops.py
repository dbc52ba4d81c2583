"""FLOPs-per-example estimate and the peak FLOP/s table used for MFU."""

import keras
import pytest

import keras_perf as kp
from tests import models


def test_mlp_is_six_times_its_kernel_parameters():
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
    )
    assert kp.estimate_flops_per_example(model) == 6 * (64 * 32 + 32 * 10)


def test_dense_on_a_sequence_counts_every_position_and_embeddings_are_free():
    inputs = keras.Input((12,), dtype="int32")
    h = keras.layers.Embedding(100, 8)(inputs)  # (12, 8)
    h = keras.layers.LayerNormalization()(h)
    outputs = keras.layers.Dense(4)(h)  # 12 positions x 8 x 4
    model = keras.Model(inputs, outputs)
    assert kp.estimate_flops_per_example(model) == 3 * 2 * 12 * 8 * 4


def test_conv_counts_output_positions():
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(4, 3, padding="valid"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    conv = 2 * (3 * 3 * 3 * 4) * (6 * 6)
    dense = 2 * (6 * 6 * 4) * 2
    assert kp.estimate_flops_per_example(model) == 3 * (conv + dense)


def test_unknown_layers_and_subclassed_models_give_none():
    rnn = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(1)])
    assert kp.estimate_flops_per_example(rnn) is None

    sub = models.OneDense(2, name="sub")
    sub(keras.ops.ones((1, 3)))
    assert kp.estimate_flops_per_example(sub) is None


def test_nested_model_counts_its_leaves_once():
    inner = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8)])
    outer = keras.Sequential([keras.Input((16,)), inner, keras.layers.Dense(2)])
    assert kp.estimate_flops_per_example(outer) == 6 * (16 * 8 + 8 * 2)


@pytest.mark.parametrize(
    "name, dtype, expected",
    [
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
        ("NVIDIA A100-SXM4-80GB", "float32", 19.5e12),
        ("NVIDIA H100 80GB HBM3", "float16", 989e12),
        ("NVIDIA H100 PCIe", "float16", 756e12),
        ("NVIDIA L4", "float16", 121e12),
        ("NVIDIA L40S", "float16", None),  # not mistaken for an L4
        ("Tesla T4", "float32", 8.1e12),
        ("Some CPU", "float32", None),
    ],
)
def test_peak_flops_table(name, dtype, expected):
    assert kp.peak_flops_for_device(name, dtype) == expected


def test_peak_flops_uses_the_policy_dtype():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    assert kp.peak_flops_for_device("Tesla V100-SXM2-16GB") == 125e12
    keras.mixed_precision.set_global_policy("float32")
    assert kp.peak_flops_for_device("Tesla V100-SXM2-16GB") == 15.7e12
