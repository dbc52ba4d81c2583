"""`export_tflite` in a child process running Keras on TensorFlow: on the PyTorch backend, and
for a quantization-aware model on JAX too.

Keras cannot write a SavedModel from torch without `torch_xla` (and a QAT model's graph is
built from TensorFlow's fake-quant ops), so the model is saved as a `.keras` file and `_CHILD`,
a Python child process with `KERAS_BACKEND=tensorflow`, loads it and runs `export_tflite`
there; its report comes back on stdout, and so does the message of a `ValueError` it raises
(our errors that say what to do), raised again here. Not here: the checks made before
(`_convert`, `_checks`, `_calibration`, `keras_perf.quantization._model`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import keras
import numpy as np

_CHILD = """
import importlib, json, sys
import numpy as np
args = json.loads(sys.argv[1])
for name in args["custom_modules"]:
    importlib.import_module(name)
import keras, keras_perf
model = keras.saving.load_model(args["model"], compile=False)
data = None
if args["data"] is not None:
    data = [np.load(p) for p in args["data"]]
    data = data[0] if len(data) == 1 else data
try:
    report = keras_perf.export_tflite(
        model, args["path"], args["quantization"], data,
        calibration_samples=args["calibration_samples"], int8_io=args["int8_io"],
        allow_select_tf_ops=args["allow_select_tf_ops"])
except ValueError as e:
    print("KERAS_PERF_ERROR " + json.dumps(str(e)))
    sys.exit(1)
print("KERAS_PERF_REPORT " + json.dumps(report))
"""

_BACKEND_NAMES = {"jax": "JAX", "torch": "PyTorch", "tensorflow": "TensorFlow"}


def _export_via_tensorflow_process(
    model, path, quantization, arrays, int8_io, allow_select_tf_ops, custom_modules
) -> dict:
    backend = _BACKEND_NAMES.get(keras.backend.backend(), keras.backend.backend())
    with tempfile.TemporaryDirectory() as tmp:
        model_file = os.path.join(tmp, "model.keras")
        try:
            model.save(model_file)
        except Exception as e:
            raise ValueError(
                f"On the {backend} backend export_tflite saves the model as a .keras file and "
                "converts it with Keras on TensorFlow in a child process, but this model "
                f"could not be saved ({type(e).__name__}: {e}). Give custom layers/models a "
                "`get_config`, or export from the TensorFlow backend."
            ) from e
        data_files = None
        if arrays is not None:
            data_files = []
            for i, a in enumerate(arrays):
                data_files.append(os.path.join(tmp, f"data{i}.npy"))
                np.save(data_files[-1], a)
        args = {
            "model": model_file,
            "path": str(path),
            "quantization": quantization,
            "data": data_files,
            "calibration_samples": len(arrays[0]) if arrays else 1,
            "int8_io": int8_io,
            "allow_select_tf_ops": allow_select_tf_ops,
            "custom_modules": custom_modules,
        }
        env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
        # The child must import this very keras_perf (a checkout may shadow an install).
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(args)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    for line in proc.stdout.splitlines():
        if line.startswith("KERAS_PERF_ERROR "):
            raise ValueError(json.loads(line[len("KERAS_PERF_ERROR ") :]))
        if line.startswith("KERAS_PERF_REPORT "):
            report = json.loads(line[len("KERAS_PERF_REPORT ") :])
            for key in ("input_quantization", "output_quantization"):
                if report[key] is not None:
                    report[key] = tuple(report[key])
            for entry in report["inputs"] + report["outputs"]:
                if entry["quantization"] is not None:
                    entry["quantization"] = tuple(entry["quantization"])
            return report
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    raise RuntimeError(
        f"TFLite export on the {backend} backend runs Keras on TensorFlow in a child process to "
        f"convert the saved model, and that process failed (exit code {proc.returncode}). "
        "If the model has custom layers, name the modules registering them in "
        f"`custom_modules`. Its last output:\n{tail}"
    )
