"""A dependency-free TensorBoard scalar writer (event files, no TensorFlow or tensorboard import).

TensorBoard reads `events.out.tfevents.*` files: TFRecord frames, each holding one serialized
`tensorflow.Event` protocol buffer. Scalars are written the classic way, as
`Summary.Value.simple_value`, which TensorBoard still reads into its scalars dashboard.
Encoding these few protobuf fields by hand keeps the writer identical on every Keras backend
and avoids importing TensorFlow (whose `tf.summary.scalar` also needs the `tensorboard`
package) just to log a handful of numbers once per epoch.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def _make_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _CRC32C_POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _make_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, as TFRecord frames use it."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 fields: two's complement, as protobuf does
    out = bytearray()
    while True:
        bits = n & 0x7F
        n >>= 7
        if n:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version: str | None = None, scalars=None) -> bytes:
    # Event: wall_time = 1 (double), step = 2 (int64), file_version = 3, summary = 5.
    msg = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(int(step))
    if file_version is not None:
        msg += _len_field(3, file_version.encode())
    if scalars:
        summary = b""
        for tag, value in scalars.items():
            # Summary.Value: tag = 1 (string), simple_value = 2 (float).
            val = _len_field(1, str(tag).encode()) + _key(2, 5) + struct.pack("<f", float(value))
            summary += _len_field(1, val)
        msg += _len_field(5, summary)
    return msg


def _frame(record: bytes) -> bytes:
    length = struct.pack("<Q", len(record))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + record
        + struct.pack("<I", masked_crc32c(record))
    )


def append_bytes(path: str, data: bytes) -> None:
    """Append `data` to the file `path` whole, or not at all.

    Unbuffered writes, looped until every byte is out. If one fails (disk full, I/O error),
    the file is cut back to its length before the call, so a reader never meets half a
    record (a torn JSON line, a TFRecord frame with a bad CRC), and the `OSError` is
    re-raised. Where the cut itself fails (a device such as `/dev/full`), the error that
    stopped the write is raised all the same.
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


_file_numbers = itertools.count(1)  # makes event file names unique within a process


class ScalarWriter:
    """Appends scalar summaries to one TensorBoard event file in `log_dir`.

    Each `write` appends one event to the file, unbuffered, so a crash loses nothing already
    written; a write that fails raises `OSError` and leaves the file as it was (see
    `append_bytes`).
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = os.fspath(log_dir)
        self.path = None

    def open(self) -> None:
        """Create `log_dir` if needed and start a new event file there (its header event).

        Raises:
            OSError: the folder cannot be created or the file cannot be written.
        """
        os.makedirs(self.log_dir, exist_ok=True)
        name = (
            f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_file_numbers)}.v2"
        )
        path = os.path.join(self.log_dir, name)
        append_bytes(path, _frame(_event(time.time(), 0, file_version="brain.Event:2")))
        self.path = path

    def write(self, step: int, scalars: dict) -> None:
        """Append the finite numbers in `scalars` (tag -> value) at `step`."""
        values = {
            k: v
            for k, v in scalars.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
        }
        if not values:
            return
        if self.path is None:
            self.open()
        append_bytes(self.path, _frame(_event(time.time(), step, scalars=values)))


def read_scalars(path: str | os.PathLike) -> list[tuple[int, str, float]]:
    """Read back `(step, tag, value)` from an event file written by `ScalarWriter`.

    Checks every frame's CRCs; raises `ValueError` on a corrupt file. Used by the tests and
    handy for a quick look without TensorBoard.
    """
    out = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        if crc != masked_crc32c(header):
            raise ValueError(f"{path}: corrupt record length at byte {pos}")
        record = data[pos + 12 : pos + 12 + length]
        (crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        if crc != masked_crc32c(record):
            raise ValueError(f"{path}: corrupt record at byte {pos}")
        pos += 16 + length
        out.extend(_parse_event(record))
    return out


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def _fields(buf: bytes):
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, value


def _parse_event(record: bytes) -> list[tuple[int, str, float]]:
    step, summary = 0, None
    for field, value in _fields(record):
        if field == 2:
            step = value
        elif field == 5:
            summary = value
    if summary is None:
        return []
    out = []
    for field, value in _fields(summary):
        if field != 1:
            continue
        tag, simple = None, None
        for f2, v2 in _fields(value):
            if f2 == 1:
                tag = v2.decode()
            elif f2 == 2:
                (simple,) = struct.unpack("<f", v2)
        if tag is not None and simple is not None:
            out.append((step, tag, simple))
    return out
