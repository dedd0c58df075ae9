"""`onnx`: standard ONNX opset 24: TensorScatter writes the cache, Attention attends over it.

Runs on ONNX Runtime and is meant for TensorRT >= 10.15, whose parser maps `Attention` to its fused
attention layer and `TensorScatter` to its KV-cache update. The Attention node gets no
past_key/past_value inputs (TensorRT's parser rejects them): the cache is written first, then
attended over with an explicit boolean mask. GQA is native to Attention (K/V carry Hkv heads). MLA is one
Attention with one KV head whose key is the two caches concatenated, [k_rope, c_kv] (d_R + d_c), and whose value
is c_kv (d_c): Attention takes a value head size other than the query's.
Quantized linears: the DequantizeLinear weight form (dq_weights): signed INT4 / INT8, what TensorRT builds.
"""

from __future__ import annotations

from onnxscript import opset18 as op
from onnxscript.values import Opset

from kvedge.export.lowerings import Lowering, dq_weights
from kvedge.export.lowerings._common import const, kv_len, live, rope, visible
from kvedge.models.config import ModelConfig

op24 = Opset("", 24)


def unsupported(cfg: ModelConfig) -> list[str]:
    reasons = []
    if cfg.attn_softcap:
        # The spec applies softcap after the mask is added (qk_matmul_output_mode order) while the
        # reference implementation applies it before; a masked -inf would become -softcap. Refuse.
        reasons.append("attention logit softcapping (the ONNX Attention softcap/mask order is ambiguous)")
    return reasons


def finalize(proto, base_dir: str = "") -> None:
    """Drop the Attention nodes' trailing outputs nobody reads (its optional present / qk outputs), so runtimes
    neither compute nor allocate them; write the quantized weights (dq_weights.finalize)."""
    graph = proto.graph
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type == "Attention":
            keep = list(node.output)
            while len(keep) > 1 and keep[-1] not in used:
                keep.pop()
            del node.output[len(keep):]
    dq_weights.finalize(proto, base_dir)


def translate(q, k, v, k_cache, v_cache, positions, scale: float, window: int, softcap: float, cos=None, sin=None):
    latent = q.shape[3] != k_cache.shape[3]  # MLA: the key is [k_rope, c_kv] (kvedge.models.attention)
    q, k = rope(q, cos, sin, positions), rope(k, cos, sin, positions)
    start = op.Gather(positions, const(0), axis=1)  # [B]: each row's first position
    # axis -2 (the sequence axis of [B, Hkv, S, D]): TensorRT's parser takes no other (onnx-tensorrt operators.md)
    present_k = op24.TensorScatter(k_cache, k, start, axis=-2)
    present_v = op24.TensorScatter(v_cache, v, start, axis=-2)
    length = kv_len(positions)
    mask = op.Unsqueeze(visible(positions, length, window), const([1]))  # [B, 1, L, S]
    keys, values = live(present_k, length), live(present_v, length)
    if latent:
        keys = op.Concat(keys, values, axis=3)
    out = op24.Attention(q, keys, values, mask, scale=scale, softmax_precision=1)[0]  # optional outputs: pruned
    return out, present_k, present_v


LOWERING = Lowering("onnx", 24, "opset 24 Attention + TensorScatter: ONNX Runtime and TensorRT >= 10.15", translate,
                    unsupported=unsupported, translate_qlinear=dq_weights.translate_qlinear, finalize=finalize,
                    unsupported_affine=dq_weights.no_refusals, weights_opset=dq_weights.min_opset)
