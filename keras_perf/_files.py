"""File-system helpers for log locations: argument checks at train begin and a torn-free append.

`append_bytes` appends one record whole or not at all; `_check_path`, `_prepare_file` and
`_prepare_dir` check a `log_path`/`log_dir` argument and create its folders before the first
step, raising a `ValueError` that names the argument. Used by `TrainingMonitor`. Not here:
the `backup_dir` checks of the stateful callbacks (`keras_perf/stopping/_state.py`) and the TensorBoard
writer (`keras_perf/_tensorboard.py`).
"""

from __future__ import annotations

import os


def append_bytes(path: str, data: bytes) -> None:
    """Append `data` to the file `path` whole, or not at all.

    Unbuffered writes, looped until every byte is out. If one fails (disk full, I/O error),
    the file is cut back to its length before the call, so a reader never meets a torn JSON
    line, and the `OSError` is re-raised. Where the cut itself fails (a device such as
    `/dev/full`), the error that stopped the write is raised all the same.
    """
    with open(path, "ab", buffering=0) as f:
        start = f.seek(0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                view = view[f.write(view) :]
        except OSError:
            try:
                f.truncate(start)
            except OSError:
                pass
            raise


def _check_path(name: str, value):
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"`{name}` must be a file system path (str or os.PathLike) or None, got {value!r}."
        )
    return os.fspath(value)


def _unwritable(name: str, path: str, exc: OSError) -> ValueError:
    return ValueError(
        f"`{name}={path!r}` cannot be written: {type(exc).__name__}: {exc}. Give a location "
        "this process can create and write to."
    )


def _first_existing_ancestor(path: str) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return folder


def _check_no_file_above(name: str, path: str) -> None:
    ancestor = _first_existing_ancestor(path)
    if not os.path.isdir(ancestor):
        raise ValueError(
            f"`{name}={path!r}` lies under {ancestor!r}, which is a file, not a folder. "
            f"Give a `{name}` in an existing folder or one that can be created."
        )


def _prepare_file(name: str, path: str) -> None:
    """At train begin: `path` is a file this process can append to; its folder is created."""
    if os.path.isdir(path):
        raise ValueError(
            f"`{name}={path!r}` is a directory; it must be a file path, e.g. "
            f"{os.path.join(path, 'run.jsonl')!r}."
        )
    _check_no_file_above(name, path)
    try:
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise _unwritable(name, path, exc) from exc


def _prepare_dir(name: str, path: str) -> None:
    """At train begin: `path` is a folder (created with its parents, as Keras' TensorBoard)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"`{name}={path!r}` is a file; it must be a folder (TensorBoard writes event "
            "files into it), e.g. 'logs/run1'."
        )
    _check_no_file_above(name, path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise _unwritable(name, path, exc) from exc
