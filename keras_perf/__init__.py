"""keras-perf: faster, smaller, harder-to-break training for Keras 3.

    import keras_perf as kp

Every public name is re-exported here explicitly; the modules hold one concept each.
"""

from keras_perf import backend
from keras_perf._utils import KerasPerfWarning
from keras_perf.devices import configure_devices, device_report
from keras_perf.mixed_precision import check_mixed_precision, setup_mixed_precision
from keras_perf.oom import find_max_microbatch, fit_with_oom_retry
from keras_perf.train_step import LossScaledModel, LossScaleTrainStep, loss_scaled

__version__ = "0.1.0"

__all__ = [
    "KerasPerfWarning",
    "LossScaleTrainStep",
    "LossScaledModel",
    "backend",
    "check_mixed_precision",
    "configure_devices",
    "device_report",
    "find_max_microbatch",
    "fit_with_oom_retry",
    "loss_scaled",
    "setup_mixed_precision",
]
