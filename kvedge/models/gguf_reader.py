"""The GGUF container read directly: header, metadata and tensor infos, over one read-only memory map.

gguf-py's GGUFReader builds a numpy view for every part of every metadata entry; a 49152-token vocabulary
with its merges is about 300k of them, seconds of Python before a model is ready. This reader walks the same
layout (ggml-org/llama.cpp gguf-py/gguf/gguf_reader.py, docs/gguf.md) with struct over the mapped bytes and
returns plain values: ints, floats, bools, strings and lists of them. Tensor data stays in the map, as numpy
views shaped as GGUFReader shapes them (float arrays for F32 / F16 / F64 / I*, bytes [..., row bytes] for
block types), so gguf.quants.dequantize reads them as it reads GGUFReader's.

Errors are ValueError with the byte offset; kvedge.models.gguf turns them into one CheckpointError.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUFValueType -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; Python names it from 3.13
# tensor types whose data GGUFReader views as numbers rather than bytes
_ITEMS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclass
class Tensor:
    """One tensor's info (the fields of gguf-py's ReaderTensor that kvedge reads)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # innermost dimension first, as stored
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a view into the map


class Reader:
    """fields: metadata key -> value; tensors: list of Tensor in file order; version; the map (`data`)."""

    def __init__(self, path: str | Path):
        import gguf

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._map, dtype=np.uint8)
        buf, at = self._map, 0

        def take(fmt: str):
            nonlocal at
            v = struct.unpack_from(fmt, buf, at)[0]
            at += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal at
            n = struct.unpack_from("<Q", buf, at)[0]
            end = at + 8 + n
            if end > len(buf):
                raise ValueError(f"a string of {n} bytes at byte {at} runs past the end of the file")
            s = buf[at + 8:end].decode("utf-8")
            at = end
            return s

        def value(kind: int):
            nonlocal at
            if kind == _STRING:
                return string()
            if kind in _SCALARS:
                return take(_SCALARS[kind])
            if kind != _ARRAY:
                raise ValueError(f"unknown metadata value type {kind} at byte {at}")
            item, count = take("<I"), take("<Q")
            if item in _NUMPY:
                a = np.frombuffer(buf, dtype=_NUMPY[item], count=count, offset=at)
                at += a.nbytes
                return a.tolist()
            return [value(item) for _ in range(count)]

        magic, self.version = take("<4s"), take("<I")
        if magic != b"GGUF":
            raise ValueError("no GGUF magic")
        n_tensors, n_fields = take("<Q"), take("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = string()
            self.fields[key] = value(take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("<Q") for _ in range(take("<I"))]
            infos.append((name, dims, take("<I"), take("<Q")))
        align = self.fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        start = (at + align - 1) // align * align
        self.tensors: list[Tensor] = []
        for name, dims, raw, offset in infos:
            kind = gguf.GGMLQuantizationType(raw)
            block, size = gguf.GGML_QUANT_SIZES[kind]
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            n_bytes, where = n * size // block, start + offset
            shape = tuple(reversed(dims))
            if where + n_bytes > len(buf):  # the caller names the tensor and the sizes
                data = np.empty(0, dtype=np.uint8)
            elif kind.name in _ITEMS:
                data = np.frombuffer(buf, dtype=_ITEMS[kind.name], count=n, offset=where).reshape(shape)
            else:
                data = self.data[where:where + n_bytes].reshape(*shape[:-1], shape[-1] // block * size)
            self.tensors.append(Tensor(name, kind, np.array(dims, dtype=np.uint64), n, n_bytes, where, data))

    def populate(self, start: int, end: int) -> None:
        """Map the pages of bytes [start, end) now, in one call (MADV_POPULATE_READ, Linux 5.14+; elsewhere they
        fault in as they are read): a page at a time, the faults cost more than the copy that reads them."""
        page = mmap.PAGESIZE
        lo = start // page * page
        try:
            self._map.madvise(_MADV_POPULATE_READ, lo, min(end, len(self._map)) - lo)
        except (OSError, ValueError, AttributeError):
            pass

    def release(self, start: int, end: int) -> None:
        """Drop the mapped pages of bytes [start, end) from this process (they stay in the page cache): a
        tensor copied elsewhere then no longer counts twice in the process's resident memory."""
        page = mmap.PAGESIZE
        lo, hi = (start + page - 1) // page * page, end // page * page
        if hi > lo and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
