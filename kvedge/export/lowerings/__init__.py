"""Lowerings of the one attention op, one small module each.

Each module has NAME, OPSET, `unsupported(cfg) -> list[str]` (features it cannot express, checked
before exporting) and `translate(q, k, v, k_cache, v_cache, positions, scale, window, softcap)`, an
onnxscript translation of `kvedge::cached_attention` returning (out, present_key, present_value).
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
