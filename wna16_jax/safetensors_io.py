"""Reading safetensors files: a strict header check, then plain reads into numpy arrays.

The safetensors format is an 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON
mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the end of the header) plus an optional ``"__metadata__"`` object of strings, then
the data. Every tensor is little-endian and C-contiguous.

:class:`SafetensorsFile` checks the whole header when the file is opened — header length within
the file, JSON, no duplicate names, known dtypes, ``prod(shape) × itemsize == end − begin``,
offsets inside the data, no two tensors overlapping — and raises :class:`CorruptFileError`
naming the file (and the tensor) on the first violation, so a truncated or hand-edited shard
never reaches numpy. :meth:`SafetensorsFile.read` then reads one tensor with a single positioned
read into a fresh array, and :meth:`SafetensorsFile.read_into` straight into the caller's
array (a slice of a stacked layer, say): no memory map, no copy after the read, nothing kept
open between reads beyond the descriptor, which keeps loading I/O-bound and the resident memory
to what the caller keeps.

:func:`confined_path` is the one way a file name read from an index or a manifest becomes a
path: a relative name that stays inside the folder (symbolic links inside the folder are still
followed — the Hugging Face cache lays snapshots out as links into a blob store).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from .errors import CorruptFileError, MissingTensorError, ShapeError, UnsafePathError

#: the largest header the format allows (the reference implementation's limit).
MAX_HEADER_BYTES = 100_000_000


def _dtypes() -> dict[str, Any]:
    import ml_dtypes

    return {
        "BOOL": np.dtype(np.bool_), "U8": np.dtype("<u1"), "I8": np.dtype("<i1"),
        "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "U32": np.dtype("<u4"), "I32": np.dtype("<i4"),
        "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F16": np.dtype("<f2"),
        "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
        "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    }


DTYPES: dict[str, np.dtype] = _dtypes()


def confined_path(folder: str, name: Any, *, source: str) -> str:
    """``folder/name`` for a file ``name`` read from ``source`` (an index or manifest), refusing
    names that are not strings, are absolute, or climb out of ``folder`` with ``..``."""
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"{source}: expected a file name (a non-empty string), got {name!r}")
    if "\x00" in name or os.path.isabs(name) or name.startswith(("/", "\\")) or "\\" in name:
        raise UnsafePathError(f"{source}: file name {name!r} must be a relative name inside "
                              f"{folder!r} (no absolute path, no backslash)")
    parts = name.split("/")
    if any(p in ("..", "") for p in parts) or parts[0] == ".":
        raise UnsafePathError(f"{source}: file name {name!r} must stay inside {folder!r} "
                              "(no '..', empty or leading '.' components)")
    return os.path.join(folder, *parts)


def _no_duplicates(where: str):
    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise CorruptFileError(f"{where}: key {k!r} appears twice")
            seen[k] = v
        return seen
    return hook


def load_json(path: str, *, what: str) -> Any:
    """Parse the JSON file ``path`` (duplicate keys refused); errors name the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CorruptFileError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
    except UnicodeDecodeError as e:
        raise CorruptFileError(f"{path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CorruptFileError(f"{path}: {what} is not valid JSON ({e.msg} at line {e.lineno} "
                               f"column {e.colno})") from None


class TensorInfo:
    """One header entry: dtype name, numpy dtype (None if not readable here), shape, offsets."""

    __slots__ = ("name", "dtype_name", "dtype", "shape", "begin", "end")

    def __init__(self, name, dtype_name, dtype, shape, begin, end):
        self.name, self.dtype_name, self.dtype = name, dtype_name, dtype
        self.shape, self.begin, self.end = shape, begin, end


class SafetensorsFile:
    """One safetensors file, its header checked on open; :meth:`read` returns numpy arrays."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CorruptFileError(f"{path}: {size} bytes, too short for a safetensors file "
                                           "(the first 8 bytes hold the header length)")
                n = int.from_bytes(head, "little")
                if n > MAX_HEADER_BYTES:
                    raise CorruptFileError(f"{path}: header length {n} exceeds the format's limit "
                                           f"of {MAX_HEADER_BYTES} bytes")
                if n > size - 8:
                    raise CorruptFileError(f"{path}: header length {n} runs past the end of the "
                                           f"file ({size} bytes)")
                raw = f.read(n)
        except OSError as e:
            raise CorruptFileError(f"{path}: cannot read ({e.strerror or e})") from None
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(f"{path} header"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptFileError(f"{path}: the header is not valid UTF-8 JSON ({e})") from None
        if not isinstance(header, dict):
            raise CorruptFileError(f"{path}: the header must be a JSON object, got {type(header).__name__}")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (isinstance(meta, dict)
                                     and all(isinstance(v, str) for v in meta.values())):
            raise CorruptFileError(f"{path}: '__metadata__' must map names to strings, got {meta!r}")
        self.metadata: dict[str, str] = dict(meta or {})
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            self.tensors[name] = self._entry(name, entry)
        spans = sorted((t.begin, t.end, t.name) for t in self.tensors.values() if t.end > t.begin)
        for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise CorruptFileError(f"{path}: tensors {n0!r} (bytes {b0}..{e0}) and {n1!r} "
                                       f"(from byte {b1}) overlap")

    def _entry(self, name: str, entry: Any) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CorruptFileError(f"{where}: header entry must be an object, got {entry!r}")
        dt, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dt, str):
            raise CorruptFileError(f"{where}: 'dtype' must be a string, got {dt!r}")
        if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                 for s in shape)):
            raise CorruptFileError(f"{where}: 'shape' must be a list of non-negative integers, got {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise CorruptFileError(f"{where}: 'data_offsets' must be [begin, end] integers, got {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end:
            raise CorruptFileError(f"{where}: data_offsets {offs} are not 0 <= begin <= end")
        if end > self.data_size:
            raise CorruptFileError(f"{where}: data_offsets {offs} run past the end of the data "
                                   f"({self.data_size} bytes; the file is truncated or the header is wrong)")
        dtype = DTYPES.get(dt)
        if dtype is None:
            raise CorruptFileError(f"{where}: dtype {dt!r} is not one this library reads "
                                   f"(known: {sorted(DTYPES)})")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != end - begin:
            raise CorruptFileError(f"{where}: shape {shape} of {dt} needs {nbytes} bytes, but "
                                   f"data_offsets {offs} hold {end - begin}")
        return TensorInfo(name, dt, dtype, tuple(shape), begin, end)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise MissingTensorError(f"{name}: not in {self.path} (the index promised it there)")
        return t

    def read(self, name: str, fd: int | None = None) -> np.ndarray:
        """The tensor ``name`` as a new C-contiguous numpy array (native byte order)."""
        t = self.info(name)
        return self.read_into(name, self._empty(t, t.shape), fd)

    def read_into(self, name: str, out: np.ndarray, fd: int | None = None) -> np.ndarray:
        """Read the tensor ``name`` straight into ``out``: a C-contiguous array of its shape and
        dtype (a slice of a larger stack, say), with one positioned read. Returns ``out``."""
        t = self.info(name)
        if tuple(out.shape) != t.shape or out.dtype.newbyteorder("=") != t.dtype.newbyteorder("=") \
                or not out.flags.c_contiguous:
            raise ShapeError(f"{self.path}: tensor {name!r} is {t.dtype_name}{list(t.shape)}, the "
                             f"destination {out.dtype}{list(out.shape)} (contiguous: {out.flags.c_contiguous})")
        return self._fill(t, out, [(0, 0, out.nbytes)], fd)

    def read_slice(self, name: str, axis: int, sl: slice, fd: int | None = None) -> np.ndarray:
        """``tensor[..., sl, ...]`` (``sl`` a step-1 slice of axis ``axis``) as a new array,
        reading only its bytes: one positioned read per index of the axes before ``axis``."""
        t = self.info(name)
        if not 0 <= axis < len(t.shape):
            raise ShapeError(f"{self.path}: tensor {name!r} is {t.dtype_name}{list(t.shape)}; it has no axis {axis}")
        start, stop, step = sl.indices(t.shape[axis])
        if step != 1 or stop < start:
            raise ShapeError(f"{self.path}: tensor {name!r}: expected a step-1 slice of axis {axis}, got {sl}")
        outer, inner = math.prod(t.shape[:axis]), math.prod(t.shape[axis + 1:]) * t.dtype.itemsize
        chunk = (stop - start) * inner
        out = self._empty(t, t.shape[:axis] + (stop - start,) + t.shape[axis + 1:])
        spans = [((o * t.shape[axis] + start) * inner, o * chunk, chunk) for o in range(outer if chunk else 0)]
        return self._fill(t, out, spans, fd)

    def read_rows(self, name: str, rows, fd: int | None = None) -> np.ndarray:
        """Rows ``rows`` (increasing indices along the first axis) of tensor ``name`` as a new
        array, reading only their bytes: one positioned read per run of consecutive rows."""
        t = self.info(name)
        rows = [int(r) for r in rows]
        if not t.shape or any(not 0 <= r < t.shape[0] for r in rows) or any(b <= a for a, b in zip(rows, rows[1:])):
            raise ShapeError(f"{self.path}: tensor {name!r} is {t.dtype_name}{list(t.shape)}; rows {rows} are not "
                             "increasing indices of its first axis")
        out = self._empty(t, (len(rows),) + t.shape[1:])
        row = math.prod(t.shape[1:]) * t.dtype.itemsize
        spans, j = [], 0
        while j < len(rows):                                 # one span per run of consecutive rows
            k = j + 1
            while k < len(rows) and rows[k] == rows[k - 1] + 1:
                k += 1
            spans.append((rows[j] * row, j * row, (k - j) * row))
            j = k
        return self._fill(t, out, spans, fd)

    @staticmethod
    def _empty(t: TensorInfo, shape) -> np.ndarray:
        return np.empty(shape, t.dtype.newbyteorder("=") if t.dtype.byteorder == "<" else t.dtype)

    def _fill(self, t: TensorInfo, out: np.ndarray, spans, fd: int | None) -> np.ndarray:
        """Fill C-contiguous ``out`` from tensor ``t``'s bytes: each span ``(offset in the
        tensor, offset in out, bytes)`` one positioned read. Returns ``out``."""
        flat = out.reshape(-1).view(np.uint8) if out.size else np.empty(0, np.uint8)
        own = fd is None
        if own:
            fd = self.open_fd()
        try:
            for src, dst, n in spans:
                _read_fully(fd, memoryview(flat[dst:dst + n]), self.data_start + t.begin + src, self.path, t.name)
        except OSError as e:
            raise CorruptFileError(f"{self.path}: tensor {t.name!r}: read failed ({e.strerror or e})") from None
        finally:
            if own:
                os.close(fd)
        if t.dtype.byteorder == "<" and not np.little_endian:  # pragma: no cover - big-endian hosts
            out.byteswap(inplace=True)
        return out

    def open_fd(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CorruptFileError(f"{self.path}: cannot open ({e.strerror or e})") from None


def _read_fully(fd: int, buf: memoryview, pos: int, path: str, name: str) -> None:
    """Fill ``buf`` from byte ``pos`` of ``fd``; a short file is a CorruptFileError."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], pos + done) if hasattr(os, "preadv") else \
            _pread_into(fd, buf[done:], pos + done)
        if got <= 0:
            raise CorruptFileError(f"{path}: tensor {name!r}: the file ended after {done} of "
                                   f"{len(buf)} bytes (truncated while reading)")
        done += got


def _pread_into(fd: int, buf: memoryview, pos: int) -> int:  # pragma: no cover - no preadv
    data = os.pread(fd, len(buf), pos)
    buf[:len(data)] = data
    return len(data)


__all__ = ["SafetensorsFile", "TensorInfo", "confined_path", "load_json", "DTYPES", "MAX_HEADER_BYTES"]
