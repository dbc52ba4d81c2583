"""The package's one TensorBoard scalar writer: `tf.summary` when TensorFlow is installed, else
tensorboardX (the `tensorboard` extra).

`TrainingMonitor(log_dir=...)` and `PruningCallback(log_dir=...)` both write through
`ScalarWriter`. Neither library is imported until a writer opens its file, so
`import keras_perf` stays light on every backend.

- TensorFlow (any Keras backend): `tf.summary.create_file_writer` and `tf.summary.write` with
  the scalars plugin's metadata, which is what `tf.summary.scalar` writes (that one needs the
  `tensorboard` package as well).
- Else tensorboardX: its synchronous `EventsWriter` (not `SummaryWriter`, whose background
  thread would swallow a failed write) and `tensorboardX.summary.scalar`.

Any error either library raises while writing is re-raised as `OSError`, so callers catch one
type. Neither library can cut back a record half written when the disk fills up: TensorBoard
then skips the torn record or stops reading that file at it.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import time

from keras_perf._imports import require

_file_numbers = itertools.count(1)  # tensorboardX names files by the second: keep them apart


def available(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a blocked module is absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # in sys.modules without a spec, or set to None
        return sys.modules.get(module) is not None


def require_writer(feature: str) -> None:
    """Check that TensorFlow or tensorboardX is installed, without importing either.

    Args:
        feature: What needs it, for the message, e.g. `"PruningCallback(log_dir=...)"`.

    Raises:
        ImportError: neither is installed; the message names the `tensorboard` extra.
    """
    if not available("tensorflow"):
        require("tensorboardX", f"{feature} (TensorBoard files without TensorFlow)", "tensorboard")


class ScalarWriter:
    """Writes scalars to one TensorBoard event file in `log_dir`.

    The file is created by `open()` (or the first `scalar()`); `flush()` pushes what was
    written to disk, `close()` ends the file. After `close()` the next `scalar()` starts a
    new file in the same folder.

    Args:
        log_dir: Folder for the event file (created with its parents).

    Example:
        >>> import os
        >>> w = ScalarWriter("logs/run1")
        >>> w.scalar("loss", 0.5, step=1)
        >>> w.flush()
        >>> w.close()
        >>> len(os.listdir("logs/run1"))
        1
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = os.fspath(log_dir)
        self.library: str | None = None  # "tensorflow" or "tensorboardX" once open
        self._impl = None

    @property
    def is_open(self) -> bool:
        return self._impl is not None

    def open(self) -> None:
        """Create `log_dir` if needed and start a new event file there (its header event).

        Raises:
            ImportError: neither TensorFlow nor tensorboardX is installed.
            OSError: the folder or the file cannot be created.
        """
        if self._impl is not None:
            return
        require_writer("TensorBoard scalars")
        self.library = "tensorflow" if available("tensorflow") else "tensorboardX"
        impl = _TFWriter if self.library == "tensorflow" else _TBXWriter
        self._impl = _guard(impl, self.log_dir)

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Write `value` (a Python or NumPy number) under `tag` at `step`.

        Raises:
            OSError: the write failed.
        """
        self.open()
        _guard(self._impl.scalar, str(tag), float(value), int(step))

    def flush(self) -> None:
        """Push every scalar written so far to the file.

        Raises:
            OSError: the write failed (e.g. the disk is full).
        """
        if self._impl is not None:
            _guard(self._impl.flush)

    def close(self) -> None:
        """Flush and close the file; a later `scalar()` opens a new one.

        Raises:
            OSError: the final write failed (the writer is closed all the same).
        """
        impl, self._impl = self._impl, None
        if impl is not None:
            _guard(impl.close)


def _guard(fn, *args):
    """Call `fn`; any error a writer library raises comes out as `OSError`."""
    try:
        return fn(*args)
    except OSError:
        raise
    except Exception as exc:  # tf.errors.OpError and the like: not OSError subclasses
        tf_errors = getattr(sys.modules.get("tensorflow"), "errors", None)
        if tf_errors is not None and isinstance(exc, tf_errors.OpError):
            raise OSError(f"{type(exc).__name__}: {exc.message}") from exc
        raise


class _TFWriter:
    def __init__(self, log_dir: str) -> None:
        # TensorFlow the library, not the Keras backend: `tf.summary` writes event files on
        # every Keras backend where TensorFlow is installed, so this import does not go
        # through `keras_perf.backend` (which dispatches on the Keras backend), and it is the
        # only one in this module.
        import tensorflow as tf

        self._tf = tf
        self._writer = tf.summary.create_file_writer(log_dir)
        plugin = tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars")
        self._metadata = tf.compat.v1.SummaryMetadata(plugin_data=plugin)

    def scalar(self, tag: str, value: float, step: int) -> None:
        tf = self._tf
        with self._writer.as_default():
            tf.summary.write(
                tag, tf.constant(value, tf.float32), step=step, metadata=self._metadata
            )

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _TBXWriter:
    def __init__(self, log_dir: str) -> None:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2
        from tensorboardX.summary import scalar

        os.makedirs(log_dir, exist_ok=True)
        self._event, self._summary = event_pb2.Event, scalar
        suffix = f".{os.getpid()}.{next(_file_numbers)}.v2"
        self._writer = EventsWriter(os.path.join(log_dir, "events"), suffix)
        self._writer.flush()  # the header event, now: the file is complete from the start

    def scalar(self, tag: str, value: float, step: int) -> None:
        event = self._event(wall_time=time.time(), step=step, summary=self._summary(tag, value))
        self._writer.write_event(event)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
