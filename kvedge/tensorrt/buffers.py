"""TensorRT plans that need no TensorRT: the two optimization profiles and the device-buffer plan.

Pure Python over the sidecar, tested in CI; kvedge.tensorrt.build and kvedge.tensorrt.backend hand them
to TensorRT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvedge.artifact import LOGITS_CHUNK, TOKEN_INPUTS, Sidecar
from kvedge.dtypes import nbytes, to_torch
from kvedge.errors import KvedgeError
from kvedge.tensorrt.versions import TrtPath


@dataclass(frozen=True)
class Profile:
    name: str  # "prefill" | "decode"
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # input -> (min, opt, max)


def logits_per_row(sc: Sidecar, max_prefill_len: int) -> int:
    """The most positions a prefill call returns logits for: kvedge eval's chunk (within the prefill length), or 1
    for an export from before the contract's logits_index [batch, logits]."""
    return min(LOGITS_CHUNK, max_prefill_len) if sc.logits_per_call else 1


def profiles(sc: Sidecar, max_batch: int | None = None, max_prefill_len: int | None = None) -> list[Profile]:
    """Two optimization profiles over the contract's inputs: prefill (1..max_prefill_len tokens, logits of
    1..logits_per_row positions) and decode (exactly 1 token, its logits). The cache's sequence axis is fixed at
    max_seq_len in both."""
    b = max_batch or sc.max_batch
    lp = max_prefill_len or min(512, sc.max_seq_len)
    if b > sc.max_batch:
        raise KvedgeError(f"--max-batch {b} exceeds the export's max_batch {sc.max_batch}")
    if not 1 <= lp <= sc.max_seq_len:
        raise KvedgeError(f"--max-prefill-len {lp} must be in [1, {sc.max_seq_len}]")
    out, k = [], logits_per_row(sc, lp)
    for name, lo, opt, hi in (("prefill", 1, max(1, lp // 2), lp), ("decode", 1, 1, 1)):
        ids = ((1, lo), (b, opt), (b, hi))
        last = ((1, 1), (b, 1), (b, k if name == "prefill" else 1)) if sc.logits_per_call else ((1,), (b,), (b,))
        shapes = dict(zip(TOKEN_INPUTS, (ids, ids, last)))
        for (past, _), cache in zip(sc.cache_pairs, sc.cache_shapes(b)):  # (MLA: keys and values of two widths)
            shapes[past] = ((1, *cache[1:]), cache, cache)
        out.append(Profile(name, shapes))
    return out


@dataclass(frozen=True)
class Buffer:
    name: str  # a graph tensor name, or "present_key.0 <-> past_key.0" for a swapped pair
    bytes: int
    role: str  # "cache-inplace" | "cache-double" | "io"
    binds: tuple[str, ...]  # the graph tensors bound to this buffer


def in_place_cache(sc: Sidecar, path: TrtPath) -> bool:
    """Whether present shares past's buffer: TensorRT's own KV-cache update (path.in_place_cache) on the `onnx`
    lowering's TensorScatter, or a plugin graph, whose plugin's cache outputs alias its cache inputs (built with
    ALIASED_PLUGIN_IO_10_03; NVIDIA's samples/python/quickly_deployable_plugins/qdp_runner.py binds such an input and
    output at one address). A `decomposed` graph's ScatterElements writes a whole new present on every release, so
    it stays double-buffered on 10.15+ too: an output bound over its own input would be read while written."""
    return bool(sc.plugins) or (path.in_place_cache and sc.lowering == "onnx")


def buffer_plan(sc: Sidecar, path: TrtPath, max_batch: int | None = None,
                max_prefill_len: int | None = None) -> list[Buffer]:
    """Device buffers the runtime allocates once. In place: one buffer per cache tensor, bound to both
    past and present. Double-buffered: two per cache tensor, swapped after every step."""
    cfg = sc.model
    b = max_batch or sc.max_batch
    lp = max_prefill_len or min(512, sc.max_seq_len)
    plan: list[Buffer] = []
    for (past, present), shape in zip(sc.cache_pairs, sc.cache_shapes(b)):
        cache_bytes = int(math.prod(shape) * nbytes(sc.cache_dtype))
        if in_place_cache(sc, path):
            plan.append(Buffer(past, cache_bytes, "cache-inplace", (past, present)))
        else:
            plan.append(Buffer(f"{past}#A", cache_bytes, "cache-double", (past, present)))
            plan.append(Buffer(f"{past}#B", cache_bytes, "cache-double", (present, past)))
    logits_elem, index = nbytes(sc.logits_dtype), nbytes(to_torch(path.index_dtype))  # int32 ids on 8.6
    k = logits_per_row(sc, lp)
    plan += [Buffer("input_ids", b * lp * index, "io", ("input_ids",)),
             Buffer("position_ids", b * lp * index, "io", ("position_ids",)),
             Buffer("logits_index", b * k * index, "io", ("logits_index",)),
             Buffer("logits", int(b * k * cfg.vocab_size * logits_elem), "io", ("logits",))]
    return plan
