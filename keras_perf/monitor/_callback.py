"""`TrainingMonitor`, the Keras callback: hooks, the per-epoch record and its writes.

It forwards the batch and epoch hooks to an `EpochMeter` (`_meter.py`), adds what needs the
model (examples seen, memory, loss scale, FLOPs), puts the figures into the logs and writes
each record to the JSON-lines file and TensorBoard. Not here: the timing arithmetic
(`_meter.py`), the summary, CSV and plot (`_report.py`), the log-location checks and the
all-or-nothing append (`keras_perf/_files.py`), the TensorBoard writer
(`keras_perf/_tensorboard.py`).
"""

from __future__ import annotations

import json
import math
import os
import time

import keras
import numpy as np

from keras_perf import backend as _backend
from keras_perf._files import _check_path, _prepare_dir, _prepare_file, _unwritable, append_bytes
from keras_perf._tensorboard import ScalarWriter, require_writer
from keras_perf._utils import check_bool, check_choice, check_int, check_number, warn
from keras_perf.flops import estimate_flops_per_example, peak_flops_for_device
from keras_perf.monitor._meter import EpochMeter
from keras_perf.monitor._report import MONITOR_KEYS, plot_history, summarize, write_csv
from keras_perf.monitor._report import is_number as _is_number
from keras_perf.precision import measured_peak_flops

__all__ = ["TrainingMonitor"]


# Saved configs name it "keras_perf>TrainingMonitor" (Keras looks that up, not the module).
@keras.saving.register_keras_serializable(package="keras_perf", name="TrainingMonitor")
class TrainingMonitor(keras.callbacks.Callback):
    """Records throughput, step-time percentiles, peak memory and MFU for every epoch.

    After each epoch a record goes into `history` (one dict per epoch) and, when `log_path` is
    set, one JSON line is appended to that file, unbuffered, so a crash of the training
    process loses nothing already logged. The figures are also added to the epoch's `logs`, so Keras' progress bar,
    `History` and callbacks listed *after* the monitor see them (put the monitor first).

    Each record holds `epoch` (1-based), `fit` (which `fit` call of this monitor), the Keras
    logs (`loss`, `val_*`, metrics), and:

    - `epoch_time_s`: the training part, epoch start to the last step's end; validation is
      timed separately as `val_time_s`;
    - `steps`, `examples` (real batch sizes: a short last batch counts as it is),
      `steps_per_s`, `examples_per_s`;
    - `step_time_ms_p50`, `step_time_ms_p90`: per-step time percentiles (with
      `steps_per_execution=N`, per execution divided by its steps);
    - `peak_memory_bytes`: peak memory of the epoch, `memory_device` says where and
      `memory_measure` which measure: on an accelerator its allocator's peak
      (`tf_allocator_peak`: TF `get_memory_info`; `torch_cuda_peak`: `max_memory_allocated`,
      both reset each epoch; `xla_peak_bytes_in_use`: JAX's peak since start, which JAX cannot
      reset). On a CPU the backend's own count of the training step where it has one:
      TensorFlow's CPU allocator peak over the epoch (`tf_allocator_peak`, when
      `TF_CPU_ALLOCATOR_USE_BFC=true` was set before TensorFlow was imported), XLA's memory
      analysis of the compiled step for the epoch's first batch (`xla_memory_analysis`: state,
      batch and scratch buffers, read from JAX's compilation cache), the bytes torch's autograd
      saves for backward in the epoch's first step plus the weights, gradients, optimizer state
      and batch (`torch_saved_tensors`); else this process's peak resident memory
      (`host_peak_rss`, `memory_device` "host", reset each epoch on Linux);
    - `loss_scale` when the optimizer scales the loss;
    - `mfu` when FLOPs per example and peak FLOP/s are known: given, or estimated
      (`kp.estimate_flops_per_example`: 3 x forward multiply-adds of Dense/Conv layers, i.e.
      6 x params for an MLP; `kp.peak_flops_for_device`: a table of known GPUs; on a CPU the
      measured matmul FLOP/s of the model's compute dtype, from `kp.precision_report()`).

    Timing adds no device synchronisation per batch and keeps Keras' asynchronous dispatch on
    JAX and PyTorch (`async_safe = True`); see the `keras_perf.monitor` docstring for how.

    Log locations are checked when training begins, before the first step: `log_path` must
    be a file path (its missing folders are created), `log_dir` a folder (created with its
    parents), both writable; otherwise `fit` stops there with a `ValueError` naming the
    argument. A write that fails later (disk full, I/O error) never stops training: the
    monitor warns once per `fit` and argument (`KerasPerfWarning`), the epoch's record gets
    `log_error` (which argument, which error), `summary()["log_complete"]` becomes False,
    and later epochs are still written. A failed write leaves no partial JSON line behind
    (the file is cut back); a TensorBoard event torn by a full disk cannot be cut back (the
    writer libraries offer no way), and TensorBoard skips it.

    One monitor used for several `fit` calls *continues*: `history` and the log file keep
    growing, and epochs are numbered on: a second `fit` from `initial_epoch=0` after 3 epochs
    logs epochs 4, 5, ...; a resumed `fit(initial_epoch=3)` also logs 4, 5, .... Call `reset()`
    to start over.

    Args:
        log_path: File to append one JSON line per epoch to (its folder is created when
            training begins), or `None`. Defaults to `None`.
        flops_per_example: Training FLOPs per example, or `None` to estimate them for
            Dense/Conv models (no MFU when unknown). Defaults to `None`.
        peak_flops: Peak FLOP/s of the device, or `None` to look the accelerator up in a
            small table, or on a CPU to measure its matmul FLOP/s in the model's compute dtype
            (`kp.precision_report()`'s `tflops`; about a second, once per process, and only
            when the FLOPs per example are known). Defaults to `None`.
        step_timing: Time every step for the percentiles. With `False` the batch hooks do
            nothing, the step count comes from Keras' `params["steps"]` and the percentiles are
            absent. Defaults to `True`.
        verbose: `1` prints one line per epoch. Defaults to `0`.
        log_dir: Folder for TensorBoard scalars (tags `keras_perf/<key>`, one event file per
            `fit`), written with `tf.summary` when TensorFlow is installed (on any backend),
            else with tensorboardX (the `tensorboard` extra), or `None`. Defaults to `None`.

    Raises:
        ImportError: when training begins with `log_dir` set and neither TensorFlow nor
            tensorboardX is installed.
        TypeError: `log_path`/`log_dir` is not a path, a number is not a number, `step_timing`
            is not a bool or `verbose` is not an int.
        ValueError: `flops_per_example` or `peak_flops` <= 0, or `verbose` not 0 or 1; when
            training begins: `log_path` is a directory, `log_dir` is a file, either lies
            under a file or cannot be created or written.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> x, y = np.ones((40, 4)), np.zeros((40, 1))
        >>> mon = kp.TrainingMonitor(log_path="run.jsonl")
        >>> _ = model.fit(x, y, epochs=2, validation_split=0.2, callbacks=[mon], verbose=0)
        >>> len(mon.history), mon.history[-1]["examples"], mon.history[-1]["examples_per_s"] > 0
        (2, 32, True)
        >>> mon.summary()["best"]["metric"], mon.summary()["best"]["epoch"]
        ('val_loss', 2)
        >>> mon.plot("run.png")
        'run.png'
    """

    def __init__(
        self,
        log_path: str | os.PathLike | None = None,
        flops_per_example: float | None = None,
        peak_flops: float | None = None,
        step_timing: bool = True,
        verbose: int = 0,
        log_dir: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        self.log_path = _check_path("log_path", log_path)
        self.flops_per_example = check_number(
            "flops_per_example", flops_per_example, low=0.0, low_inclusive=False, allow_none=True
        )
        self.peak_flops = check_number(
            "peak_flops", peak_flops, low=0.0, low_inclusive=False, allow_none=True
        )
        self.step_timing = check_bool("step_timing", step_timing)
        self.verbose = check_choice("verbose", check_int("verbose", verbose), (0, 1))
        self.log_dir = _check_path("log_dir", log_dir)
        # Per-batch work is a clock read and a list append, safe from Keras' worker
        # threads; so Keras may keep dispatching batches asynchronously (JAX, PyTorch).
        self.async_safe = True
        self._meter = EpochMeter(step_timing=self.step_timing)
        self._writer = ScalarWriter(self.log_dir) if self.log_dir is not None else None
        self.reset()
        self._epoch_memory = None  # the backend's per-epoch memory meter during a fit
        self._memory_model = None  # the model it measures

    # ----------------------------------------------------------------- state
    def reset(self) -> None:
        """Forget every recorded epoch (files already written are left alone)."""
        self.history: list[dict] = []
        self._fits = 0
        self._in_epoch = False

    def state_dict(self) -> dict:
        """The monitor's state (recorded epochs and fit count), for `load_state_dict`."""
        return {"history": [dict(r) for r in self.history], "fits": self._fits}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned, e.g. to keep numbering epochs after a restart."""
        self.history = [dict(r) for r in state.get("history", [])]
        self._fits = int(state.get("fits", 0))

    def get_config(self) -> dict:
        return {
            "log_path": self.log_path,
            "flops_per_example": self.flops_per_example,
            "peak_flops": self.peak_flops,
            "step_timing": self.step_timing,
            "verbose": self.verbose,
            "log_dir": self.log_dir,
        }

    @classmethod
    def from_config(cls, config: dict) -> TrainingMonitor:
        return cls(**config)

    # ----------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None) -> None:
        self._warned_write: set[str] = set()
        if self.log_path is not None:
            _prepare_file("log_path", self.log_path)
        if self._writer is not None:
            require_writer("TrainingMonitor(log_dir=...)")
            _prepare_dir("log_dir", self.log_dir)
            try:
                self._writer.open()  # a new event file for each fit, closed at its end
            except OSError as exc:
                raise _unwritable("log_dir", self.log_dir, exc) from exc
        self._fits += 1
        self._offset = None
        self._warned_examples = False
        self._accelerator = _backend.has_accelerator()
        self._close_epoch_memory()  # left open by a fit that raised
        self._open_epoch_memory()
        self._flops = self.flops_per_example
        if self._flops is None:
            self._flops = estimate_flops_per_example(self.model)
        self._peak = self.peak_flops
        if self._peak is None and self._accelerator:
            self._peak = peak_flops_for_device()
        elif self._peak is None and self._flops:
            # A CPU's peak is its measured matmul throughput in the model's compute dtype.
            dtype = getattr(self.model.dtype_policy, "compute_dtype", None)
            self._peak = measured_peak_flops(dtype or "float32")

    def on_train_end(self, logs=None) -> None:
        self._close_epoch_memory()
        if self._writer is None or not self._writer.is_open:
            return
        try:
            self._writer.close()
        except OSError as exc:
            if self.history:
                self._write_failed(self.history[-1], "log_dir", self.log_dir, exc)

    def on_epoch_begin(self, epoch, logs=None) -> None:
        if self._offset is None:
            last = self.history[-1]["epoch"] if self.history else 0
            self._offset = last - epoch if epoch + 1 <= last else 0
        if self._accelerator:
            _backend.reset_peak_memory()
        else:
            _backend.reset_host_peak_memory()
            if self._memory_model is not self.model:
                # `fit_with_oom_retry` re-pointed the callbacks at the model that trains now
                # (a `kp.loss_scaled` twin after an out-of-memory error): measure that one.
                self._close_epoch_memory()
                self._open_epoch_memory()
            if self._epoch_memory is not None:
                self._epoch_memory.start_epoch()
        self._examples = None
        self._in_epoch = True
        self._meter.start()

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._meter.step_begin(batch)

    def on_train_batch_end(self, batch, logs=None) -> None:
        self._meter.step_end(batch)

    def on_test_begin(self, logs=None) -> None:
        if not self._in_epoch:  # an evaluate() outside fit
            return
        # Validation inside fit: read the examples before evaluate() resets the loss tracker.
        # Reading it waits for the last training step, so the training part ends here at most.
        self._examples = _backend.examples_seen(self.model)
        self._meter.val_start()

    def on_test_end(self, logs=None) -> None:
        if self._in_epoch:
            self._meter.val_end()

    def on_epoch_end(self, epoch, logs=None) -> None:
        if not self._in_epoch:
            return
        self._in_epoch = False
        if self._meter._val_start is None:
            self._examples = _backend.examples_seen(self.model)
        full = (self.params or {}).get("steps")
        figures = self._meter.finish(steps=None if self.step_timing else full, max_steps=full)
        record = {"epoch": epoch + 1 + self._offset, "fit": self._fits}
        record.update(_plain(logs or {}))
        for key in MONITOR_KEYS:
            if key not in record:
                record[key] = None
        record.update(figures)
        self._add_examples(record)
        self._add_memory(record)
        self._add_loss_scale(record)
        if record["examples_per_s"] and self._flops and self._peak:
            record["mfu"] = self._flops * record["examples_per_s"] / self._peak
        record["time"] = time.time()
        self.history.append(record)
        if logs is not None:
            logs.update({k: record[k] for k in MONITOR_KEYS if record[k] is not None})
        self._write(record)
        if self.verbose:
            print(_one_line(record))

    # ----------------------------------------------------------- epoch parts
    def _add_examples(self, record: dict) -> None:
        examples = self._examples
        if examples is None and not self._warned_examples:
            self._warned_examples = True
            warn(
                "TrainingMonitor cannot count examples: the model's train_step does not update "
                "Keras' loss tracker (`self._loss_tracker.update_state(loss, "
                "sample_weight=batch_size)`); `examples` and `examples_per_s` are left empty."
            )
        record["examples"] = examples
        if examples is not None:
            record["examples_per_s"] = examples / record["epoch_time_s"]

    def _add_memory(self, record: dict) -> None:
        if self._accelerator:
            stats = _backend.memory_stats()
            if stats is not None:
                stats = {"bytes": stats["peak_bytes"], **stats}
        else:
            meter = self._epoch_memory
            stats = meter.finish_epoch() if meter is not None else None
        if stats is None:
            stats = {
                "bytes": _backend.host_memory()["peak_bytes"],
                "device": "host",
                "measure": "host_peak_rss",
            }
        record["peak_memory_bytes"] = int(stats["bytes"])
        record["memory_device"] = stats["device"]
        record["memory_measure"] = stats["measure"]

    def _open_epoch_memory(self) -> None:
        self._memory_model = self.model
        if self._accelerator or _runs_traced(self.model):
            # keras-perf's traced torch step runs one graph without autograd: the saved-tensor
            # count would see nothing, so the epochs log the process's peak resident memory.
            self._epoch_memory = None
        else:
            self._epoch_memory = _backend.epoch_memory(self.model)

    def _close_epoch_memory(self) -> None:
        meter, self._epoch_memory = self._epoch_memory, None
        if meter is not None:
            meter.close()

    def _add_loss_scale(self, record: dict) -> None:
        if record.get("loss_scale") is not None:
            return
        optimizer = getattr(self.model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            scale = getattr(optimizer, "dynamic_scale", None)
            if scale is not None:
                record["loss_scale"] = float(getattr(scale, "value", scale))

    def _write(self, record: dict) -> None:
        """Append the record to `log_path` and `log_dir`; a failed write never stops `fit`."""
        if self.log_path is not None:
            line = json.dumps(_json_safe(record), allow_nan=False) + "\n"
            try:
                # Unbuffered and closed at once: a crash of this process (an exception,
                # SIGKILL, OOM kill) loses nothing. No fsync: it costs 1-20 ms per epoch and
                # only guards against the machine itself going down.
                append_bytes(self.log_path, line.encode("utf-8"))
            except OSError as exc:
                self._write_failed(record, "log_path", self.log_path, exc)
        if self._writer is not None:
            try:
                for k, v in record.items():
                    if k not in ("epoch", "fit", "time") and _is_number(v):
                        self._writer.scalar(f"keras_perf/{k}", v, record["epoch"])
                self._writer.flush()  # on disk as each epoch ends, as the JSON lines are
            except OSError as exc:
                self._write_failed(record, "log_dir", self.log_dir, exc)

    def _write_failed(self, record: dict, name: str, path: str, exc: OSError) -> None:
        """Mark the record (`log_error`) and warn once per fit and argument."""
        error = f"{name}: {type(exc).__name__}: {exc}"
        record["log_error"] = (
            f"{record['log_error']}; {error}" if record.get("log_error") else error
        )
        if name not in self._warned_write:
            self._warned_write.add(name)
            warn(
                f"TrainingMonitor could not write epoch {record['epoch']} to `{name}`={path!r} "
                f"({type(exc).__name__}: {exc}). Training goes on; the epoch stays in "
                "`history` with a `log_error` entry, `summary()['log_complete']` is False, "
                "and later epochs are still tried (no further warning in this fit)."
            )

    # ----------------------------------------------------------------- results
    def summary(self, monitor: str | None = None, mode: str = "auto") -> dict:
        """Totals over every recorded epoch.

        Args:
            monitor: Metric whose best epoch is reported, or `None` for `val_loss` when
                recorded, else `loss`. Defaults to `None`.
            mode: `"min"`, `"max"`, or `"auto"` (max for accuracy-like names: acc, auc,
                precision, recall, f1, iou, top_k; min otherwise). Defaults to `"auto"`.

        Returns:
            A dict: `epochs`, `fits`, `total_time_s` (training plus validation),
            `train_time_s`, `val_time_s`, `steps`, `examples`, `mean_/median_examples_per_s`,
            `mean_/median_steps_per_s`, `step_time_ms_p50` (median over epochs),
            `peak_memory_bytes` (max), `mean_mfu`, `log_complete` (False when a write to
            `log_path` or `log_dir` failed for some epoch: see `log_error` in `history`), and
            `best`: `{"metric", "value", "epoch"}`.
            With no epoch recorded, `{"epochs": 0}`.

        Raises:
            ValueError: `mode` is not one of the three, or `monitor` was never logged (the
                message lists the keys that were).
        """
        return summarize(self.history, monitor, mode)

    def to_csv(self, path: str | os.PathLike) -> str:
        """Write `history` as CSV (one row per epoch, the union of keys as columns).

        Args:
            path: File to write (overwritten).

        Returns:
            The path written, as a string.
        """
        return write_csv(self.history, path)

    def plot(self, path: str | os.PathLike, metrics: list[str] | None = None) -> str:
        """Save a PNG with one panel per kind of figure, epochs along a shared x axis.

        Panels, each drawn only when something in it was recorded: loss, other metrics,
        throughput, step time (p50 and p90), peak memory, then `grad_norm`, `skipped_steps`
        and `loss_scale` (log2 axis) each in its own. Every series has its own colour and
        each legend sits outside its panel, to the right; rates, times and memory start at
        zero. Uses matplotlib's Agg canvas directly (no pyplot, no display needed): the
        `plot` extra. Built by `keras_perf.monitor._report.plot_history`.

        Args:
            path: PNG file to write (overwritten).
            metrics: Keras log keys for the loss and metric panels (keys holding "loss" go
                to the first), or `None` for every recorded Keras metric. Defaults to `None`.

        Returns:
            The path written, as a string.

        Raises:
            RuntimeError: No epoch has been recorded yet.
        """
        return plot_history(self.history, path, metrics)


# --------------------------------------------------------------------- helpers
def _plain(logs: dict) -> dict:
    out = {}
    for k, v in logs.items():
        if isinstance(v, (np.generic, np.ndarray)) and np.size(v) == 1:
            v = v.item()
        out[k] = v
    return out


def _json_safe(record: dict) -> dict:
    out = {}
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        elif isinstance(v, np.generic):
            v = v.item()
        elif not isinstance(v, (int, float, str, bool, type(None))):
            v = str(v)
        out[k] = v
    return out


def _one_line(r: dict) -> str:
    parts = [f"monitor epoch {r['epoch']}: {r['epoch_time_s']:.2f} s"]
    if r.get("examples_per_s"):
        parts.append(f"{r['examples_per_s']:.0f} examples/s")
    if r.get("steps_per_s"):
        parts.append(f"{r['steps_per_s']:.1f} steps/s")
    if r.get("step_time_ms_p50") is not None:
        parts.append(f"step p50 {r['step_time_ms_p50']:.1f} ms p90 {r['step_time_ms_p90']:.1f} ms")
    if r.get("peak_memory_bytes"):
        where = r.get("memory_measure") or r.get("memory_device")
        parts.append(f"peak {r['peak_memory_bytes'] / 2**20:.0f} MiB ({where})")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    return ", ".join(parts)


def _runs_traced(model) -> bool:
    """True when `model`'s next steps run as keras-perf's traced torch graph."""
    if keras.backend.backend() != "torch":
        return False
    from keras_perf.train_step.torch_traced import traced_step_state

    return traced_step_state(model)["active"]
