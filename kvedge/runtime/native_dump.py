"""The native engine's packed structs and the buffers they point into, written to a file that another build of the
engine runs: kvedge/runtime/native/kvedge_selftest.c, built for aarch64 and run under qemu-user by the tests
(tests/runtime/test_native_arm.py), where the Python side cannot load the library. The file format is the
driver's module comment.

Every pointer in the structs (a Linear, or a Model with its Layer array) must point into a region handed over:
the tensors the engine's pointers refer to (NativeBackend's _Keep, its caches) and the structs themselves. A
pointer into none is refused by name, not written as garbage.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import torch

from kvedge.errors import KvedgeError

SIMD, LINEAR, FORWARD, LAYOUT, HELPERS = 0, 1, 2, 3, 4  # the driver's call kinds


def _pointer_offsets(ctype, base: int = 0):
    """Byte offsets of every pointer field of a ctypes struct type, nested structs included."""
    for name, t, *_ in ctype._fields_:
        off = base + getattr(ctype, name).offset
        if t is ctypes.c_void_p or issubclass(t, ctypes._Pointer):
            yield off
        elif issubclass(t, ctypes.Structure):
            yield from _pointer_offsets(t, off)


class Dump:
    """dump.struct(obj) / dump.tensor(t) register regions (by index); dump.call(kind, *args) adds a call; write()."""

    def __init__(self):
        self.regions: list[tuple[int, int, object]] = []  # (address, bytes, ctypes object or tensor)
        self.calls: list[tuple[int, ...]] = []
        self._index: dict[int, int] = {}

    def _add(self, address: int, nbytes: int, obj) -> int:
        key = id(obj)
        if key not in self._index:
            self._index[key] = len(self.regions)
            self.regions.append((address, nbytes, obj))
        return self._index[key]

    def struct(self, obj: ctypes.Structure | ctypes.Array) -> int:
        return self._add(ctypes.addressof(obj), ctypes.sizeof(obj), obj)

    def tensor(self, t: torch.Tensor) -> int:
        if not t.is_contiguous():
            raise KvedgeError("native_dump: a region must be a contiguous tensor")
        return self._add(t.data_ptr(), t.numel() * t.element_size(), t)

    def call(self, kind: int, *args: int) -> None:
        self.calls.append((kind, *args))

    def _target(self, p: int) -> tuple[int, int]:
        for i, (a, n, _) in enumerate(self.regions):
            if a <= p < a + n or (p == a and n == 0):
                return i, p - a
        raise KvedgeError(f"native_dump: pointer {p:#x} is in no region handed over")

    def write(self, path: str | Path) -> Path:
        out = [b"KVD1", struct.pack("<I", len(self.regions))]
        relocs = []
        for i, (a, n, obj) in enumerate(self.regions):
            data = bytearray(ctypes.string_at(a, n)) if n else bytearray()
            if isinstance(obj, (ctypes.Structure, ctypes.Array)):
                one = obj._type_ if isinstance(obj, ctypes.Array) else type(obj)
                count = obj._length_ if isinstance(obj, ctypes.Array) else 1
                for e in range(count):
                    for off in _pointer_offsets(one, e * ctypes.sizeof(one)):
                        p = struct.unpack_from("<Q", data, off)[0]
                        if p:
                            relocs.append((i, off, *self._target(p)))
                            struct.pack_into("<Q", data, off, 0)
            out += [struct.pack("<Q", n), bytes(data)]
        out.append(struct.pack("<I", len(relocs)))
        out += [struct.pack("<IQIQ", *r) for r in relocs]
        out.append(struct.pack("<I", len(self.calls)))
        out += [struct.pack(f"<{len(c)}I", *c) for c in self.calls]
        Path(path).write_bytes(b"".join(out))
        return Path(path)


def dump_backend(backend, dump: Dump | None = None) -> tuple[Dump, int]:
    """A NativeBackend's model: its Model struct (the returned region), Layer array, every kept tensor and its
    caches, for FORWARD calls."""
    dump = dump or Dump()
    model = dump.struct(backend.m)
    dump.struct(backend._layers)
    for t in [*backend.caches, *backend._keep.tensors]:
        dump.tensor(t)
    return dump, model


def parse_layout(raw: bytes) -> tuple[dict[str, tuple[int, int]], bytes]:
    """A LAYOUT call's output -> ({"kv_linear.n": (offset, size), ...}, the bytes after it)."""
    got, at = {}, 0
    while True:
        (length,) = struct.unpack_from("<I", raw, at)
        at += 4
        if not length:
            return got, raw[at:]
        name = raw[at:at + length].decode()
        got[name] = struct.unpack_from("<QQ", raw, at + length)
        at += length + 16
