"""The kvedge fused-attention TensorRT plugin: `kvedge::gqa_attention`, version 1.

One node does what kvedge::cached_attention does: write the new K/V into the caches at each row's
position and attend over them (kvedge's Triton kernels). Its two cache outputs alias the cache
inputs (TensorDesc.aliased()), so TensorRT updates the cache in place.

Inputs:  q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D], k_cache [B, Hkv, S, D], v_cache [B, Hkv, S, D],
         positions [B, L] int64
Outputs: out [B, Hq, L, D] (q's dtype), present_key (aliases k_cache), present_value (aliases v_cache)
Attributes: scale (float), window (int, 0 = none), softcap (float, 0 = none)

Registration uses TensorRT's Python plugin API (`tensorrt.plugin`, TensorRT >= 10.7 for the
quickly-deployable plugins, aliased outputs as documented for TensorDesc.aliased()). Only the JIT
implementation (`trtp.impl`, launching the Triton kernels from Python on TensorRT's stream) exists;
the AOT path (`trtp.aot_impl`, PTX embedded in the engine) is not written yet. The shape, dtype and
alias rules below are plain Python, tested without TensorRT.
"""

from __future__ import annotations

NAMESPACE, NAME, VERSION = "kvedge", "gqa_attention", "1"
PLUGIN_ID = f"{NAMESPACE}::{NAME}"
MIN_TENSORRT = (10, 7)
DTYPES = ("float32", "float16", "bfloat16")
ALIASES = {1: 3, 2: 4}  # output index -> the input index it aliases


def output_shapes(q, k, v, k_cache, v_cache, positions) -> list[tuple]:
    """Shapes of (out, present_key, present_value); raises ValueError on inconsistent inputs."""
    if not all(len(s) == 4 for s in (q, k, v, k_cache, v_cache)) or len(positions) != 2:
        raise ValueError("q, k, v and the caches must be rank 4, positions rank 2")
    b, hq, l, d = q
    if k != v or k[0] != b or k[2] != l or k[3] != d:
        raise ValueError(f"k {k} and v {v} must be [B, Hkv, L, D] matching q {q}")
    if k_cache != v_cache or k_cache[0] != b or k_cache[1] != k[1] or k_cache[3] != d:
        raise ValueError(f"caches {k_cache}, {v_cache} must be [B, Hkv, S, D] matching k {k}")
    if hq % k[1]:
        raise ValueError(f"{hq} query heads are not a multiple of {k[1]} KV heads")
    if d > 256:
        raise ValueError(f"head_dim {d} > 256 is not supported by the kernels")
    if tuple(positions) != (b, l):
        raise ValueError(f"positions {positions} must be [B, L] = {(b, l)}")
    return [tuple(q), tuple(k_cache), tuple(v_cache)]


def output_dtypes(q, k, v, k_cache, v_cache, positions) -> list[str]:
    if q not in DTYPES or len({q, k, v, k_cache, v_cache}) != 1:
        raise ValueError(f"q, k, v and the caches must share one of {DTYPES}; got {q}, {k}, {v}, {k_cache}, {v_cache}")
    if positions not in ("int64", "int32"):
        raise ValueError(f"positions must be int32 or int64, got {positions}")
    return [q, k_cache, v_cache]


def register():
    """Register the plugin with TensorRT (call before building or deserializing an engine that uses it)."""
    import tensorrt as trt
    import tensorrt.plugin as trtp
    import torch

    from kvedge.errors import KvedgeError
    from kvedge.export.trt_plan import parse_version

    if parse_version(trt.__version__) < MIN_TENSORRT:
        raise KvedgeError(f"the kvedge plugin needs TensorRT >= {MIN_TENSORRT[0]}.{MIN_TENSORRT[1]}, "
                          f"found {trt.__version__}")

    @trtp.register(PLUGIN_ID)
    def _desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_cache: trtp.TensorDesc,
              v_cache: trtp.TensorDesc, positions: trtp.TensorDesc, scale: float, window: int,
              softcap: float) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return q.like(), k_cache.aliased(), v_cache.aliased()

    @trtp.impl(PLUGIN_ID)
    def _impl(q: trtp.Tensor, k: trtp.Tensor, v: trtp.Tensor, k_cache: trtp.Tensor, v_cache: trtp.Tensor,
              positions: trtp.Tensor, scale: float, window: int, softcap: float,
              outputs: tuple[trtp.Tensor], stream: int) -> None:
        from kvedge.kernels import triton_attention as tk

        t = [torch.as_tensor(x, device="cuda") for x in (q, k, v, k_cache, v_cache, positions)]
        out = torch.as_tensor(outputs[0], device="cuda")
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            out.copy_(tk.attention(*t[:5], t[5].long(), scale=scale, window=window or None,
                                   softcap=softcap or None))
    return PLUGIN_ID
