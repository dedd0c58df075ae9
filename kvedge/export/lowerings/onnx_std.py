"""`onnx`: standard ONNX opset 24: TensorScatter writes the cache, Attention attends over it.

Runs on ONNX Runtime and is meant for TensorRT >= 10.15, whose parser maps `Attention` to its fused
attention layer and `TensorScatter` to its KV-cache update. The Attention node gets no
past_key/past_value inputs (TensorRT's parser rejects them): the cache is written first, then
attended over with an explicit boolean mask. GQA is native to Attention (K/V carry Hkv heads).
"""

from __future__ import annotations

from onnxscript import opset18 as op
from onnxscript.values import Opset

from kvedge.export.lowerings._common import const, kv_len, live, rope, visible
from kvedge.models.config import ModelConfig

NAME = "onnx"
OPSET = 24
op24 = Opset("", 24)


def unsupported(cfg: ModelConfig) -> list[str]:
    reasons = []
    if cfg.attn_softcap:
        # The spec applies softcap after the mask is added (qk_matmul_output_mode order) while the
        # reference implementation applies it before; a masked -inf would become -softcap. Refuse.
        reasons.append("attention logit softcapping (the ONNX Attention softcap/mask order is ambiguous)")
    return reasons


def translate_qlinear(x, qweight, scales, zeros, bits: int, k: int, accuracy_level: int):
    """kvedge::qlinear -> blocked DequantizeLinear (opset 21+) then MatMul: the form TensorRT's
    weight-only path parses. INT8 only here (INT4 needs UINT4 initializers; see unsupported_quant)."""
    n, nb = qweight.shape[0], qweight.shape[1]
    w_q = op.Reshape(qweight, const([n, k]))
    w = op24.DequantizeLinear(w_q, op.Reshape(scales, const([n, nb])), op.Reshape(zeros, const([n, nb])),
                              axis=1, block_size=k // nb)
    return op.MatMul(x, op.Transpose(w, perm=[1, 0]))


def unsupported_quant(bits: int) -> list[str]:
    return [] if bits == 8 else ["INT4 in the standard-ONNX (DequantizeLinear) form is not written yet; "
                                 "use --attention ort (MatMulNBits) for INT4"]


def translate(q, k, v, k_cache, v_cache, positions, scale: float, window: int, softcap: float, cos=None, sin=None):
    q, k = rope(q, cos, sin, positions), rope(k, cos, sin, positions)
    start = op.Gather(positions, const(0), axis=1)  # [B]: each row's first position
    present_k = op24.TensorScatter(k_cache, k, start, axis=2)
    present_v = op24.TensorScatter(v_cache, v, start, axis=2)
    length = kv_len(positions)
    mask = op.Unsqueeze(visible(positions, length, window), const([1]))  # [B, 1, L, S]
    out = op24.Attention(q, live(present_k, length), live(present_v, length), mask, scale=scale,
                         softmax_precision=1)[0]  # the optional outputs are pruned after export
    return out, present_k, present_v
