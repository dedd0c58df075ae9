"""TensorRT plans that need no TensorRT: version gating, optimization profiles, the buffer plan.

Everything here is pure Python and tested in CI; kvedge.export.trt_build and
kvedge.runtime.trt_backend are the thin layers that hand these plans to TensorRT.

Version gating (sources: the TensorRT docs for each release):
- >= 10.15: the ONNX parser maps `Attention` to TensorRT's fused attention layer and `TensorScatter`
  to IKVCacheUpdateLayer, whose output "must be a network output and shares the same device memory
  address with the cache input" (TensorRT operators reference, KVCacheUpdate). -> lowering `onnx`,
  caches updated in place: present aliases past.
- 8.6 - 10.14 (JetPack 5: 8.5/8.6; JetPack 6: 8.6 / 10.3): no attention layer, no in-place cache
  update; a network output never aliases an input. -> lowering `decomposed` (opset 17); present is a
  second buffer and the runtime swaps past/present each step (double buffering, never a per-step
  allocation). The graph's ScatterElements writes the whole cache into present.
- 11.x: strongly typed networks only: precision comes from the graph's dtypes (export with --dtype),
  the FP16/BF16 builder flags are gone; the v3 execution API (set_tensor_address / execute_async_v3)
  and name-based I/O, as in 10.x.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvedge.errors import KvedgeError
from kvedge.export.contract import Sidecar, input_names, output_names
from kvedge.models.cache import dtype_bytes

NATIVE_ATTENTION = (10, 15)
MIN_SUPPORTED = (8, 6)


def parse_version(v: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in v.split(".")[:2])
    except ValueError:
        raise KvedgeError(f"TensorRT version {v!r}: expected MAJOR.MINOR such as 10.3") from None
    return major, minor


@dataclass(frozen=True)
class TrtPath:
    version: tuple[int, int]
    lowering: str  # the export lowering this TensorRT wants
    in_place_cache: bool  # present aliases past (else: double buffers swapped by the runtime)
    strongly_typed: bool  # precision from the graph; no FP16/BF16 builder flags
    precision_flags: bool  # BuilderFlag.FP16 / BF16 exist and apply
    progress_monitor: bool  # trt.IProgressMonitor exists (10.0+)
    explicit_batch_flag: bool  # NetworkDefinitionCreationFlag.EXPLICIT_BATCH must be passed (8.x)
    user_managed_memory: str  # how contexts share device memory: "v2" (10.x+) or "legacy" (8.x)


def select_path(version: str) -> TrtPath:
    v = parse_version(version)
    if v < MIN_SUPPORTED:
        raise KvedgeError(f"TensorRT {version} is older than kvedge supports ({MIN_SUPPORTED[0]}.{MIN_SUPPORTED[1]})")
    native = v >= NATIVE_ATTENTION
    return TrtPath(
        version=v,
        lowering="onnx" if native else "decomposed",
        in_place_cache=native,
        strongly_typed=v[0] >= 11,
        precision_flags=v[0] < 11,
        progress_monitor=v[0] >= 10,
        explicit_batch_flag=v[0] < 10,
        user_managed_memory="v2" if v[0] >= 10 else "legacy",
    )


@dataclass(frozen=True)
class Profile:
    name: str  # "prefill" | "decode"
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # input -> (min, opt, max)


def profiles(sc: Sidecar, max_batch: int | None = None, max_prefill_len: int | None = None) -> list[Profile]:
    """Two optimization profiles over the contract's inputs: prefill (1..max_prefill_len tokens) and
    decode (exactly 1 token). The cache's sequence axis is fixed at max_seq_len in both."""
    cfg = sc.model
    b = max_batch or sc.max_batch
    lp = max_prefill_len or min(512, sc.max_seq_len)
    if b > sc.max_batch:
        raise KvedgeError(f"--max-batch {b} exceeds the export's max_batch {sc.max_batch}")
    if not 1 <= lp <= sc.max_seq_len:
        raise KvedgeError(f"--max-prefill-len {lp} must be in [1, {sc.max_seq_len}]")
    cache = (cfg.num_kv_heads, sc.max_seq_len, cfg.head_dim)
    out = []
    for name, lo, opt, hi in (("prefill", 1, max(1, lp // 2), lp), ("decode", 1, 1, 1)):
        shapes = {
            "input_ids": ((1, lo), (b, opt), (b, hi)),
            "position_ids": ((1, lo), (b, opt), (b, hi)),
            "logits_index": ((1,), (b,), (b,)),
        }
        for n in input_names(cfg.num_layers)[3:]:
            shapes[n] = ((1, *cache), (b, *cache), (b, *cache))
        out.append(Profile(name, shapes))
    return out


@dataclass(frozen=True)
class Buffer:
    name: str  # a graph tensor name, or "present_key.0 <-> past_key.0" for a swapped pair
    bytes: int
    role: str  # "cache-inplace" | "cache-double" | "io"
    binds: tuple[str, ...]  # the graph tensors bound to this buffer


def buffer_plan(sc: Sidecar, path: TrtPath, max_batch: int | None = None,
                max_prefill_len: int | None = None) -> list[Buffer]:
    """Device buffers the runtime allocates once. In place: one buffer per cache tensor, bound to both
    past and present. Double-buffered: two per cache tensor, swapped after every step."""
    cfg = sc.model
    b = max_batch or sc.max_batch
    lp = max_prefill_len or min(512, sc.max_seq_len)
    elem = dtype_bytes(sc.dtype)
    cache_bytes = int(b * cfg.num_kv_heads * sc.max_seq_len * cfg.head_dim * elem)
    plan: list[Buffer] = []
    for past, present in zip(input_names(cfg.num_layers)[3:], output_names(cfg.num_layers)[1:]):
        if path.in_place_cache:
            plan.append(Buffer(past, cache_bytes, "cache-inplace", (past, present)))
        else:
            plan.append(Buffer(f"{past}#A", cache_bytes, "cache-double", (past, present)))
            plan.append(Buffer(f"{past}#B", cache_bytes, "cache-double", (present, past)))
    logits_elem = 4 if sc.outputs[0]["dtype"] == "float32" else elem
    plan += [Buffer("input_ids", b * lp * 8, "io", ("input_ids",)),
             Buffer("position_ids", b * lp * 8, "io", ("position_ids",)),
             Buffer("logits_index", b * 8, "io", ("logits_index",)),
             Buffer("logits", int(b * cfg.vocab_size * logits_elem), "io", ("logits",))]
    return plan
