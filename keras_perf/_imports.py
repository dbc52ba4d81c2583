"""How keras-perf imports what it needs: Keras on first use, optional packages by extra.

This module imports nothing heavy: `keras_perf/__init__.py` reads it before anything else.

- `after_import()`: run a function right after a module's first import. `keras_perf` uses it
  to register its serializable classes with Keras as soon as Keras is imported (see
  `keras_perf/__init__.py`), so the `keras-perf` command answers `--help` without Keras while
  `keras.saving.load_model` still finds our classes after a bare `import keras_perf`.
- `require()`: an optional dependency (TensorFlow for TFLite, matplotlib for plots, ...) is
  checked where it is needed, and its absence is an `ImportError` naming the keras-perf extra
  that installs it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# `pip install keras-perf[<extra>]` installs these distributions (see pyproject.toml).
EXTRAS = {
    "tensorflow": ("tensorflow", "tensorflow"),
    "matplotlib": ("matplotlib", "plot"),
    "sklearn": ("scikit-learn", "demo"),
    "tf_keras": ("tf-keras", "tfmot"),
    "tensorflow_model_optimization": ("tensorflow-model-optimization", "tfmot"),
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """A one-shot finder: the first import of `name` runs `callback` once the module is done."""

    def __init__(self, name: str, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the other finders, this one removed
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.callback)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """Executes the module with its own loader, then calls `callback` (wrapt's pattern)."""

    def __init__(self, loader, callback):
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # the module sees its own
        self.loader.exec_module(module)
        self.callback()


def after_import(name: str, callback) -> None:
    """Call `callback()` now if module `name` is imported, else right after its first import.

    `callback` runs inside that `import` statement, after the module has executed; an exception
    it raises is the caller's to catch (it would fail the `import`). One callback per module:
    a second call for a module still awaited is ignored.
    """
    if sys.modules.get(name) is not None:
        callback()
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


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
