"""How keras-perf imports what it needs: late for the command, optional packages by extra.

This module imports nothing heavy: `keras_perf/__init__.py` reads it before anything else.

- `command_start()`: the process is the `keras-perf` command (`keras-perf ...`,
  `python -m keras_perf ...`). The package then defers its imports to first use, so argparse
  answers `--help` and bad arguments before Keras (and TensorFlow) is imported. Imported as a
  library, keras-perf imports everything at once as before, so that
  `keras.saving.load_model` finds its registered classes after a bare `import keras_perf`.
- `require()`: an optional dependency (TensorFlow for TFLite, matplotlib for plots, ...) is
  checked where it is needed, and its absence is an `ImportError` naming the keras-perf extra
  that installs it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

# `pip install keras-perf[<extra>]` installs these distributions (see pyproject.toml).
EXTRAS = {
    "tensorflow": ("tensorflow", "tensorflow"),
    "matplotlib": ("matplotlib", "plot"),
    "sklearn": ("scikit-learn", "demo"),
    "tf_keras": ("tf-keras", "tfmot"),
    "tensorflow_model_optimization": ("tensorflow-model-optimization", "tfmot"),
}

_COMMAND_MODULES = ("keras_perf", "keras_perf.cli", "keras_perf.__main__")
_loading_deferred = False


def command_start() -> bool:
    """True while the `keras-perf` command (or `python -m keras_perf[.cli]`) starts up."""
    if _loading_deferred or not sys.argv:
        return False
    script = os.path.basename(sys.argv[0])
    for suffix in ("-script.pyw", "-script.py", ".exe"):  # pip's Windows launchers
        script = script.removesuffix(suffix)
    if script == "keras-perf":
        return True
    if sys.argv[0] != "-m":  # Python sets argv[0] to "-m" while it imports the -m package
        return False
    args = getattr(sys, "orig_argv", [])
    for i, arg in enumerate(args[1:], start=1):
        if arg == "-m":
            return i + 1 < len(args) and args[i + 1] in _COMMAND_MODULES
        if arg.startswith("-m"):
            return arg[2:] in _COMMAND_MODULES
    return False


def load_deferred(package: str, name: str):
    """Import the whole package now (its module `__getattr__` during the command)."""
    global _loading_deferred
    if name.startswith("_"):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = sys.modules[package]
    vars(module).pop("__getattr__", None)
    _loading_deferred = True
    importlib.reload(module)  # `__init__` runs again, now importing everything
    return getattr(module, name)


def require(module: str, feature: str, extra: str | None = None):
    """Check that optional `module` is installed, without importing it.

    Args:
        module: Top-level module name, e.g. `"tensorflow"` or `"matplotlib"`.
        feature: What needs it, for the message, e.g. `"export_tflite"`.
        extra: The keras-perf extra to name. Defaults to `None`: the one in `EXTRAS`.

    Raises:
        ImportError: `module` is not installed; the message names the extra to install.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec is there
        found = module in sys.modules and sys.modules[module] is not None
    if found:
        return
    dist, default_extra = EXTRAS.get(module, (module, None))
    extra = extra or default_extra
    how = (
        f"`pip install 'keras-perf[{extra}]'` (or `pip install {dist}`)"
        if extra
        else (f"`pip install {dist}`")
    )
    raise ImportError(f"{feature} needs {dist}, which is not installed: {how}.", name=module)
