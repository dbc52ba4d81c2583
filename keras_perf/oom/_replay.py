"""`_Replay`: a Python generator made replayable from the start of the epoch in progress.

Lives here: the replay buffer, its byte limit `_REPLAY_LIMIT_BYTES` (read at call time, so
tests patch it here) and `_nbytes`. Not here: the host RNGs that make arrays, PyDatasets and
DataLoaders replay (`_snapshot`), when batches are dropped (`_callbacks`).
"""

from __future__ import annotations

import threading

import keras
import numpy as np

# A generator's batches are kept from the start of each epoch until the epoch ends, so that
# a retried epoch gets the same batches again; beyond this many bytes an epoch is not kept
# (an OOM in it then ends the run, saying so).
_REPLAY_LIMIT_BYTES = 2**30


def _nbytes(batch) -> int:
    total = 0
    for t in keras.tree.flatten(batch):
        n = getattr(t, "nbytes", None)
        if n is None and hasattr(t, "shape") and hasattr(t, "dtype"):
            n = int(np.prod(t.shape)) * np.dtype(str(getattr(t.dtype, "name", t.dtype))).itemsize
        total += int(n or 0)
    return total


class _Replay:
    """A Python generator made replayable from the start of the epoch in progress.

    Batches are counted from the start of the run (stream index). `stream(start)` is a new
    generator that yields from index `start`: the kept batches first, then the source's
    next ones, which it keeps. `keep_from(index)` (called at each epoch start with the
    number of training steps run so far) drops the batches before `index`. Batches are kept
    by reference (a generator that refills the same arrays in place cannot be replayed), at
    most `_REPLAY_LIMIT_BYTES` per epoch. A lock guards the source, which a stale input
    pipeline of a failed `fit` call may still be reading.
    """

    def __init__(self, source):
        self._source = source
        self._kept: list = []
        self._first = 0  # stream index of self._kept[0]
        self._pulled = 0  # batches taken from the source
        self._bytes, self._keeping = 0, True
        self._lock = threading.Lock()

    def keep_from(self, index: int) -> None:
        with self._lock:
            if index > self._first:
                drop = min(index, self._pulled) - self._first
                self._bytes -= sum(_nbytes(b) for b in self._kept[:drop])
                del self._kept[:drop]
                self._first += drop
            self._keeping = True

    def can_replay(self, start: int) -> bool:
        return start >= self._first

    def _get(self, index: int):
        with self._lock:
            if index < self._pulled:
                if index < self._first:
                    raise RuntimeError(
                        "fit_with_oom_retry: a batch of the generator to replay was not kept."
                    )
                return self._kept[index - self._first]
            batch = next(self._source)  # StopIteration ends the stream
            self._pulled += 1
            if self._keeping:
                self._kept.append(batch)
                self._bytes += _nbytes(batch)
                if self._bytes > _REPLAY_LIMIT_BYTES:  # give up keeping this epoch
                    self._kept, self._bytes, self._keeping = [], 0, False
                    self._first = self._pulled
            else:
                self._first = self._pulled
            return batch

    def stream(self, start: int):
        index = start
        while True:
            try:
                batch = self._get(index)
            except StopIteration:
                return
            index += 1
            yield batch
