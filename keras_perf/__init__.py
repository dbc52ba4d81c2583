"""keras-perf: faster, smaller, harder-to-break training for Keras 3.

    import keras_perf as kp

Every public name is listed once, in `_EXPORTS` below, with the module that defines it; the
modules hold one concept each. A name is imported on first use (PEP 562 `__getattr__`) and then
kept in this module's namespace, so `import keras_perf` itself imports neither Keras nor a
backend: the `keras-perf` command (keras_perf/cli.py) answers `--help` and argument errors at
once. `from keras_perf import X` works for every name in `__all__`.

Loading saved models: Keras finds a class in a `.keras` file only if it was registered
(`keras.saving.register_keras_serializable`) before `load_model`. So once Keras is imported (at
`import keras_perf` if it already is, otherwise right after the first `import keras`, through
`keras_perf._imports.after_import`), every module of `_EXPORTS` is imported, which registers
every class of ours, as before the names were lazy. `import keras_perf` then
`keras.saving.load_model(...)` works in either import order, and so does the `keras-perf
diagnose MODEL.keras` command. One case waits: when Keras is first imported by one of our own
modules (`import keras_perf.monitor` before any `import keras`), importing the others at that
point could meet that module half-initialised, so the rest is registered at the next
`kp.<name>` lookup instead.

To add a public name: one line in `_EXPORTS`.
"""

import importlib
import sys

from keras_perf import _imports

__version__ = "0.1.0"

# Public name -> the module that defines it (the only list of the public names); a subpackage
# that is public itself maps to itself.
_EXPORTS = {
    "backend": "keras_perf.backend",
    "Acceleration": "keras_perf.acceleration",
    "accelerate": "keras_perf.acceleration",
    "KerasPerfWarning": "keras_perf._utils",
    "ChannelPruningCallback": "keras_perf.channel_pruning",
    "channel_report": "keras_perf.channel_pruning",
    "shrink": "keras_perf.channel_pruning",
    "configure_devices": "keras_perf.devices",
    "device_report": "keras_perf.devices",
    "Diagnosis": "keras_perf.diagnosis",
    "diagnose": "keras_perf.diagnosis",
    "DistillationModel": "keras_perf.distillation",
    "precompute_teacher_logits": "keras_perf.distillation",
    "compression_report": "keras_perf.export",
    "export_tflite": "keras_perf.export",
    "export_onnx": "keras_perf.export",
    "onnx_predict": "keras_perf.export",
    "inference_report": "keras_perf.export",
    "InferenceReport": "keras_perf.export",
    "tflite_predict": "keras_perf.export",
    "estimate_flops_per_example": "keras_perf.flops",
    "peak_flops_for_device": "keras_perf.flops",
    "find_learning_rate": "keras_perf.lr_finder",
    "check_mixed_precision": "keras_perf.mixed_precision",
    "setup_mixed_precision": "keras_perf.mixed_precision",
    "precision_report": "keras_perf.precision",
    "TrainingMonitor": "keras_perf.monitor",
    "find_max_batch_size": "keras_perf.oom",
    "find_max_microbatch": "keras_perf.oom",
    "fit_with_oom_retry": "keras_perf.oom",
    "ConstantSparsity": "keras_perf.pruning",
    "PolynomialDecay": "keras_perf.pruning",
    "PruningCallback": "keras_perf.pruning",
    "PruningSchedule": "keras_perf.pruning",
    "prune_low_magnitude": "keras_perf.pruning",
    "sparsity_report": "keras_perf.pruning",
    "strip_pruning": "keras_perf.pruning",
    "ActivationQuantizer": "keras_perf.quantization",
    "is_quantized_model": "keras_perf.quantization",
    "quantization_report": "keras_perf.quantization",
    "quantize_aware": "keras_perf.quantization",
    "EarlyStopping": "keras_perf.stopping",
    "TimeLimit": "keras_perf.stopping",
    "LossScaledModel": "keras_perf.train_step",
    "LossScaleTrainStep": "keras_perf.train_step",
    "loss_scaled": "keras_perf.train_step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module(module)
    if module != f"{__name__}.{name}":  # else the name is a subpackage (`kp.backend`)
        value = getattr(value, name)
    globals()[name] = value
    _register()
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


_registered = False


def _register() -> None:
    """Import every module of `_EXPORTS` once Keras is imported: their classes get registered.

    Skipped (and done at a later call) while one of our modules is still executing its body:
    importing the others then could meet it half-initialised (an import cycle).
    """
    global _registered
    if _registered or sys.modules.get("keras") is None or _our_module_is_executing():
        return
    for module in dict.fromkeys(_EXPORTS.values()):
        importlib.import_module(module)
    _registered = True


def _our_module_is_executing() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__", "").startswith(
            f"{__name__}."
        ):
            return True
        frame = frame.f_back
    return False


_imports.after_import("keras", _register)
