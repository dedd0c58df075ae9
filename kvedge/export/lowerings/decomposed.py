"""`decomposed`: MatMul / Softmax / Where / ScatterElements only, opset 17.

For TensorRT 8.6-10.14 (JetPack 5 and 6) and any ONNX runtime. Quantized weights take the DequantizeLinear form
(dq_weights): INT4 or blocks raise the graph to opset 21; per-channel INT8 stays at 17. GQA stays GQA: the query heads are
viewed as [B, Hkv, G, L, D] and broadcast against the [B, Hkv, 1, S, D] cache; K/V are never
repeated. The cache write is a ScatterElements along the sequence axis. MLA is the same graph with one KV
head whose key is the two caches concatenated, [k_rope, c_kv], and whose value is c_kv.
"""

from __future__ import annotations

import numpy as np
from onnxscript import opset18 as op

from kvedge.export.lowerings import Lowering, dq_weights
from kvedge.export.lowerings._common import const, fconst, kv_len, live, rope, visible


def translate(q, k, v, k_cache, v_cache, positions, scale: float, window: int, softcap: float, cos=None, sin=None):
    hq, d = q.shape[1], q.shape[3]
    hkv, dv = k_cache.shape[1], v_cache.shape[3]
    q, k = rope(q, cos, sin, positions), rope(k, cos, sin, positions)
    at = op.Unsqueeze(positions, const([1, 3]))
    present_k = op.ScatterElements(k_cache, op.Expand(at, op.Shape(k)), k, axis=2)  # index [B, Hkv, L, D]
    present_v = op.ScatterElements(v_cache, op.Expand(at, op.Shape(v)), v, axis=2)
    length = kv_len(positions)
    keys, values = live(present_k, length), live(present_v, length)
    if d != k_cache.shape[3]:  # MLA: the key is [k_rope, c_kv] (kvedge.models.attention)
        keys = op.Concat(keys, values, axis=3)
    keys, values = op.Unsqueeze(keys, const([2])), op.Unsqueeze(values, const([2]))  # [B, Hkv, 1, S, D]
    qg = op.Reshape(q, const([0, hkv, hq // hkv, -1, d]))  # [B, Hkv, G, L, D]
    scores = op.MatMul(qg, op.Transpose(keys, perm=[0, 1, 2, 4, 3]))
    scores = op.Cast(scores, to=1)  # softmax in float32
    scores = op.Mul(scores, fconst(scale))
    if softcap > 0:
        c = fconst(softcap)
        scores = op.Mul(op.Tanh(op.Div(scores, c)), c)
    mask = op.Unsqueeze(visible(positions, length, window), const([1, 2]))  # [B, 1, 1, L, S]
    scores = op.Where(mask, scores, fconst(-np.inf))
    probs = op.CastLike(op.Softmax(scores, axis=-1), q)
    out = op.Reshape(op.MatMul(probs, values), const([0, hq, -1, dv]))
    return out, present_k, present_v


LOWERING = Lowering("decomposed", 17, "opset 17 MatMul/Softmax/Where, for TensorRT 8.6-10.14 and any runtime",
                    translate, translate_qlinear=dq_weights.translate_qlinear, finalize=dq_weights.finalize,
                    unsupported_affine=dq_weights.no_refusals,
                    weights_opset=dq_weights.min_opset)  # expresses every feature of the Decoder
