"""keras-perf: faster, smaller, harder-to-break training for Keras 3.

    import keras_perf as kp

Every public name is re-exported here explicitly; the modules hold one concept each.
"""

from keras_perf import _imports

__version__ = "0.1.0"

if _imports.command_start():
    # The `keras-perf` command: arguments are parsed before Keras is imported (`--help` at
    # once); the names below are imported on first use. See keras_perf/_imports.py.
    def __getattr__(name):
        return _imports.load_deferred(__name__, name)

else:
    from keras_perf import backend
    from keras_perf._utils import KerasPerfWarning
    from keras_perf.channel_pruning import ChannelPruningCallback, channel_report, shrink
    from keras_perf.devices import configure_devices, device_report
    from keras_perf.diagnosis import Diagnosis, diagnose
    from keras_perf.distillation import DistillationModel, precompute_teacher_logits
    from keras_perf.export import compression_report, export_tflite, tflite_predict
    from keras_perf.flops import estimate_flops_per_example, peak_flops_for_device
    from keras_perf.mixed_precision import check_mixed_precision, setup_mixed_precision
    from keras_perf.monitor import TrainingMonitor
    from keras_perf.oom import find_max_microbatch, fit_with_oom_retry
    from keras_perf.precision import precision_report
    from keras_perf.pruning import (
        ConstantSparsity,
        PolynomialDecay,
        PruningCallback,
        PruningSchedule,
        prune_low_magnitude,
        sparsity_report,
        strip_pruning,
    )
    from keras_perf.quantization import (
        ActivationQuantizer,
        is_quantized_model,
        quantization_report,
        quantize_aware,
    )
    from keras_perf.stopping import EarlyStopping, TimeLimit
    from keras_perf.train_step import LossScaledModel, LossScaleTrainStep, loss_scaled

__all__ = [
    "ActivationQuantizer",
    "ChannelPruningCallback",
    "ConstantSparsity",
    "Diagnosis",
    "DistillationModel",
    "EarlyStopping",
    "KerasPerfWarning",
    "LossScaleTrainStep",
    "LossScaledModel",
    "PolynomialDecay",
    "PruningCallback",
    "PruningSchedule",
    "TimeLimit",
    "TrainingMonitor",
    "backend",
    "channel_report",
    "check_mixed_precision",
    "compression_report",
    "configure_devices",
    "device_report",
    "diagnose",
    "estimate_flops_per_example",
    "export_tflite",
    "find_max_microbatch",
    "fit_with_oom_retry",
    "is_quantized_model",
    "loss_scaled",
    "peak_flops_for_device",
    "precision_report",
    "precompute_teacher_logits",
    "prune_low_magnitude",
    "quantization_report",
    "quantize_aware",
    "setup_mixed_precision",
    "shrink",
    "sparsity_report",
    "strip_pruning",
    "tflite_predict",
]
