"""Lowerings of the one attention op, one small module each.

Each module has NAME, OPSET, `unsupported(cfg) -> list[str]` (features it cannot express, checked
before exporting) and `translate(q, k, v, k_cache, v_cache, positions, scale, window, softcap)`, an
onnxscript translation of `kvedge::cached_attention` returning (out, present_key, present_value).
A lowering that can hold an int8 KV cache also has `unsupported_kv(kv_dtype) -> list[str]`; the others
refuse one (kv_cache_refusals).
"""

from __future__ import annotations

from types import ModuleType

from kvedge.errors import KvedgeError
from kvedge.export.lowerings import decomposed, onnx_std, ort_gqa, trt_plugin

LOWERINGS: dict[str, ModuleType] = {m.NAME: m for m in (onnx_std, ort_gqa, decomposed, trt_plugin)}
# the lowerings ONNX Runtime can run (and so verify after export)
ORT_LOWERINGS = [n for n, m in LOWERINGS.items() if getattr(m, "RUNS_ON_ONNXRUNTIME", True)]


def get(name: str) -> ModuleType:
    try:
        return LOWERINGS[name]
    except KeyError:
        raise KvedgeError(f"unknown attention lowering {name!r}; choose one of {', '.join(LOWERINGS)}") from None


def kv_cache_refusals(low: ModuleType, kv_dtype: str | None) -> list[str]:
    """Why `low` cannot export a `kv_dtype` cache ([] if it can). A float cache of the model's dtype is every
    lowering's; int8 only a lowering's with `unsupported_kv`. decomposed and onnx could dequantize with
    DequantizeLinear, but their write (QuantizeLinear divides by the scale; GroupQueryAttention and the
    reference multiply by its reciprocal) would differ from the reference in the last bit: not written yet."""
    if kv_dtype != "int8":
        return []
    check = getattr(low, "unsupported_kv", None)
    if check is None:
        return [f"no int8 KV cache in the {low.NAME!r} lowering (its attention reads a float cache); "
                "use --attention ort, whose GroupQueryAttention quantizes the cache per channel"]
    return check(kv_dtype)
