"""Lowerings of the one attention op (and the one quantized linear), one small module each.

Each module declares one `Lowering` below; every field the exporter, the runtime or the CLI reads is a field
here, with its default. Adding a lowering: a module with its `LOWERING`, its name in `_load`, and its cases
in the tests (docs/adding-a-backend.md says where).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvedge.errors import KvedgeError
from kvedge.models.config import ModelConfig


def _nothing(_) -> list[str]:
    return []


def _any_opset(bits: set[int], blocked: bool) -> int:
    return 0


@dataclass(frozen=True)
class Lowering:
    name: str
    opset: int
    summary: str  # one line for `kvedge export --help`
    # onnxscript translation of kvedge::cached_attention(q, k, v, k_cache, v_cache, positions, scale, window,
    # softcap, cos, sin[, k_scale, v_scale]) -> (out, present_key, present_value)
    translate: Callable
    unsupported: Callable[[ModelConfig], list[str]] = _nothing  # model features it cannot express
    # quantized linears: kvedge::qlinear's translation, and why a bit width cannot be exported ([] if it can)
    translate_qlinear: Callable | None = None
    # kvedge::qembedding's translation (a GGUF file's quantized embedding gathered in its integers, a tied head as
    # translate_qlinear over them); None: export loads that embedding as float
    translate_qembedding: Callable | None = None
    unsupported_quant: Callable[[int], list[str]] = _nothing
    # affine blocks, w = q * scale + min (GGUF's Q4_1, Q4_K, Q5_K): why these bits cannot be exported; None:
    # the lowering has no form for them
    unsupported_affine: Callable[[int], list[str]] | None = None
    # the least opset its quantized weights need, given their bit widths and whether any is blocked (0: any)
    weights_opset: Callable[[set[int], bool], int] = _any_opset
    int8_cache: bool = False  # it can hold an int8 KV cache (scales as graph initializers)
    # its own rewrite of the traced ModelProto, in place: finalize(proto, base_dir), base_dir the folder of the
    # proto's external data (its weights; "" when they are in the proto)
    finalize: Callable | None = None
    runs_on_onnxruntime: bool = True  # export verifies the graph on ONNX Runtime's CPU provider
    min_onnxruntime: tuple[int, int] | None = None  # the oldest ONNX Runtime that runs its graphs
    plugins: tuple[str, ...] = ()  # custom ops a runtime must register before parsing (sidecar "plugins")

    def affine_refusals(self, bits: int) -> list[str]:
        """Why this lowering cannot export affine `bits`-bit blocks ([] if it can)."""
        if self.unsupported_affine is None:
            return [f"the {self.name!r} lowering has no form for affine blocks (q * scale + min, GGUF's Q4_1 / "
                    "Q4_K / Q5_K); use --attention ort"]
        return self.unsupported_affine(bits)

    def kv_refusals(self, kv_dtype: str | None) -> list[str]:
        """Why this lowering cannot export a `kv_dtype` cache ([] if it can). A float cache of the model's dtype
        is every lowering's. decomposed and onnx could dequantize an int8 one with DequantizeLinear, but their
        write (QuantizeLinear divides by the scale; GroupQueryAttention and the reference multiply by its
        reciprocal) would differ from the reference in the last bit: not written yet."""
        if kv_dtype != "int8" or self.int8_cache:
            return []
        return [f"no int8 KV cache in the {self.name!r} lowering (its attention reads a float cache); "
                "use --attention ort, whose GroupQueryAttention quantizes the cache per channel"]


def _load() -> dict[str, Lowering]:
    from kvedge.export.lowerings import decomposed, onnx_std, ort_gqa, trt

    return {m.LOWERING.name: m.LOWERING for m in (onnx_std, ort_gqa, decomposed, trt)}


LOWERINGS: dict[str, Lowering] = _load()
ORT_LOWERINGS = [n for n, low in LOWERINGS.items() if low.runs_on_onnxruntime]  # export can verify these


def get(name: str) -> Lowering:
    try:
        return LOWERINGS[name]
    except KeyError:
        raise KvedgeError(f"unknown attention lowering {name!r}; choose one of {', '.join(LOWERINGS)}") from None
