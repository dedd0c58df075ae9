"""Which TensorRT path a version takes: pure Python, tested in CI without TensorRT.

kvedge.tensorrt.build and kvedge.tensorrt.backend are the thin layers that hand these choices to TensorRT.

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
