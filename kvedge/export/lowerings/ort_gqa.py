"""`ort`: ONNX Runtime's fused com.microsoft.GroupQueryAttention, past and present in one buffer.

GQA takes [B, L, H*D] projections and caches [B, Hkv, S_max, D]. With present bound to the same
buffer as past (IO binding) it writes the new K/V in place at each row's position
(seqlens_k + 1 - L), so the cache is never copied. Sliding windows and softcap are attributes.
Contract caveat: unlike the other lowerings, present outputs are only complete when they share the
past buffer; the kvedge runtime always binds them so.
"""

from __future__ import annotations

from onnxscript import opset18 as op
from onnxscript.values import Opset

from kvedge.export.lowerings import Lowering
from kvedge.export.lowerings._common import const, fconst, rope
from kvedge.models.config import ModelConfig

DOMAIN = "com.microsoft"


FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
# The contrib ops this lowering writes, with their signatures as ONNX Runtime's contrib operator spec documents
# them: (inputs, outputs, attributes, type constraints); a "?" marks an optional input or output, "!" a required
# attribute.
CONTRIB_OPS = {
    "GroupQueryAttention": (
        ["query:T", "key:T?", "value:T?", "past_key:T_CACHE?", "past_value:T_CACHE?", "seqlens_k:M",
         "total_sequence_length:M", "cos_cache:T?", "sin_cache:T?", "position_ids:tensor(int64)?",
         "attention_bias:T?", "head_sink:T?", "k_scale:S?", "v_scale:S?", "q_norm_weight:T?", "k_norm_weight:T?",
         "query_seqlens:M?"],
        ["output:T", "present_key:T_CACHE", "present_value:T_CACHE"],  # output_qk left out
        {"num_heads!": "INT", "kv_num_heads!": "INT", "scale": "FLOAT", "softcap": "FLOAT",
         "local_window_size": "INT", "do_rotary": "INT", "rotary_interleaved": "INT", "smooth_softmax": "INT",
         "qk_output": "INT", "kv_cache_bit_width": "INT", "k_quant_type": "STRING", "v_quant_type": "STRING"},
        {"T": FLOATS, "T_CACHE": [*FLOATS, "tensor(int8)"], "M": ["tensor(int32)"], "S": ["tensor(float)"]}),
    "MatMulNBits": (
        ["A:T1", "B:T2", "scales:T1", "zero_points:T3?", "g_idx:T4?", "bias:T1?"], ["Y:T1"],
        {"K!": "INT", "N!": "INT", "bits!": "INT", "block_size!": "INT", "accuracy_level": "INT"},
        {"T1": FLOATS, "T2": ["tensor(uint8)", "tensor(int32)"],
         "T3": ["tensor(uint8)", "tensor(int32)", "tensor(float16)", "tensor(float)"], "T4": ["tensor(int32)"]}),
    "SkipSimplifiedLayerNormalization": (
        ["input:T", "skip:T", "gamma:T", "bias:T?"],
        ["output:T", "mean:U?", "inv_std_var:U?", "input_skip_bias_sum:T?"],
        {"epsilon": "FLOAT"}, {"T": FLOATS, "U": ["tensor(float)"]}),
    "GatherBlockQuantized": (
        ["data:T1", "indices:Tind", "scales:T2", "zero_points:T1?"], ["output:T2"],
        {"gather_axis": "INT", "quantize_axis": "INT", "block_size": "INT", "bits": "INT"},
        {"T1": ["tensor(uint8)", "tensor(int4)", "tensor(uint4)"], "T2": FLOATS,
         "Tind": ["tensor(int32)", "tensor(int64)"]}),
}


def _register_schemas() -> None:
    """Teach onnx (and so onnxscript and onnx.checker) CONTRIB_OPS' signatures. Shape inference stays ONNX
    Runtime's."""
    from onnx import defs

    S = defs.OpSchema

    def param(spec: str):
        name, kind = spec.rstrip("?").split(":", 1)
        return S.FormalParameter(name, kind, param_option=S.FormalParameterOption.Optional if spec.endswith("?")
                                 else S.FormalParameterOption.Single)

    for op_name, (inputs, outputs, attributes, types) in CONTRIB_OPS.items():
        if defs.has(op_name, DOMAIN):
            continue
        defs.register_schema(S(
            op_name, DOMAIN, 1, inputs=[param(i) for i in inputs], outputs=[param(o) for o in outputs],
            attributes=[S.Attribute(a.rstrip("!"), getattr(S.AttrType, t), "", required=a.endswith("!"))
                        for a, t in attributes.items()],
            type_constraints=[(t, allowed, "") for t, allowed in types.items()]))


_register_schemas()
msft = Opset(DOMAIN, 1)


def translate_qlinear(x, qweight, scales, zeros, bits: int, k: int, accuracy_level: int, mins=None):
    """kvedge::qlinear -> MatMulNBits: the weights are already in its layout.
    An affine block (w = q * scale + min, GGUF's Q4_1 / Q4_K / Q5_K) keeps its integers and scales and splits:
    x @ w = MatMulNBits(x) with the default midpoint zero point, + per group sum(x) * (midpoint * scale + min),
    a [.., K / group] x [K / group, N] MatMul. (A float zero point -min / scale would say the same in one node,
    but ONNX Runtime's CPU kernel runs those several times slower, and not at all for 8 bits.)"""
    n, nb = qweight.shape[0], qweight.shape[1]
    y = msft.MatMulNBits(x, qweight, scales, None if mins is not None else zeros, K=k, N=n, bits=bits,
                         block_size=k // nb, accuracy_level=accuracy_level)
    if mins is None:
        return y
    offset = op.Transpose(_affine_offset(scales, mins, bits, n, nb), perm=[1, 0])  # [nb, N]
    sums = op.ReduceSum(op.Reshape(x, op.Concat(op.Shape(x, end=-1), const([nb, k // nb]), axis=0)), const([-1]),
                        keepdims=0)  # [..., nb]
    return op.Add(y, op.MatMul(sums, offset))


def _affine_offset(scales, mins, bits: int, n: int, nb: int):
    """midpoint * scale + min [N, nb]: what an affine block adds per group to (q - midpoint) * scale."""
    return op.Reshape(op.Add(op.Mul(scales, op.CastLike(fconst(2 ** (bits - 1)), scales)), mins), const([n, nb]))


def translate_qembedding(ids, qweight, scales, zeros, bits: int, k: int, mins=None):
    """kvedge::qembedding -> GatherBlockQuantized over the integers a tied head's MatMulNBits reads: its uint8 data
    [N, K * bits / 8] (low nibble first, as MatMulNBits), scales [N, K / block], zero points packed as MatMulNBits
    packs them (onnxruntime contrib_ops/cpu/quantization/gather_block_quantized.cc: gather_axis 0, quantize_axis
    last, block_size a power of 2 >= 16, output (q - zero) * scale in the scales' type). An affine block has no zero
    point (the midpoint) and adds midpoint * scale + min per group, gathered beside."""
    n, nb = qweight.shape[0], qweight.shape[1]
    data = op.Reshape(qweight, const([n, k * bits // 8]))
    rows = msft.GatherBlockQuantized(data, ids, op.Reshape(scales, const([n, nb])),
                                     None if mins is not None else op.Reshape(zeros, const([n, -1])),
                                     gather_axis=0, quantize_axis=1, block_size=k // nb, bits=bits)
    if mins is None:
        return rows
    lead = op.Shape(ids)
    blocks = op.Reshape(rows, op.Concat(lead, const([nb, k // nb]), axis=0))
    offset = op.Unsqueeze(op.Gather(_affine_offset(scales, mins, bits, n, nb), ids, axis=0), const([-1]))
    return op.Reshape(op.Add(blocks, offset), op.Concat(lead, const([k]), axis=0))


def unsupported_affine(bits: int) -> list[str]:
    return []  # 4 and 8 bits alike (translate_qlinear)


def unsupported(cfg: ModelConfig) -> list[str]:
    if cfg.mla:  # its query, key and value are [B, L, heads * head_size] with one head_size for all three
        return [f"multi-head latent attention (MLA): GroupQueryAttention takes one head size for q, k and v, while "
                f"attention over MLA's latent has keys of d_R + d_c = {cfg.head_dim + cfg.value_dim} and values of "
                f"d_c = {cfg.value_dim}"]
    # GroupQueryAttention fails at run time otherwise ("head_size must be a multiple of 8", onnxruntime 1.32)
    return [] if cfg.head_dim % 8 == 0 else [f"head_dim {cfg.head_dim} is not a multiple of 8, which ONNX Runtime's "
                                             "GroupQueryAttention requires"]


def translate(q, k, v, k_cache, v_cache, positions, scale: float, window: int, softcap: float, cos=None, sin=None,
              k_scale=None, v_scale=None):
    hq, d = q.shape[1], q.shape[3]
    hkv = k_cache.shape[1]
    # GQA rotates q and k itself (do_rotary) from the same cos/sin tables, at each row's positions
    # past..past+L-1 (past = seqlens_k + 1 - L): kvedge's positions. Its kernel needs rotary_dim / 2 to be
    # a multiple of 8; other rotary widths are rotated by plain ops first.
    fused_rope = cos is not None and cos.shape[1] % 8 == 0
    if cos is not None and not fused_rope:
        q, k = rope(q, cos, sin, positions), rope(k, cos, sin, positions)

    def bsh(x, heads):  # [B, H, L, D] -> [B, L, H*D]
        return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), const([0, 0, heads * d]))

    last = op.Gather(positions, const(-1), axis=1)  # [B] each row's last position in this chunk
    seqlens_k = op.Cast(last, to=6)  # int32: total length - 1 per row
    total = op.Cast(op.Add(op.ReduceMax(last, keepdims=0), const(1)), to=6)  # int32 scalar
    # query_seqlens: every row's chunk is L tokens long (a shorter row's padding lands past its last token,
    # as in the other lowerings). With it GQA continues a multi-row, multi-token chunk over a filled cache.
    chunk = op.Cast(op.Expand(op.Shape(positions, start=1, end=2), op.Shape(positions, start=0, end=1)), to=6)
    # int8 cache: GQA quantizes the new k (after its rotation) and v with the [1, Hkv, 1, D] scales and reads
    # the dequantized cache, as kvedge.models.attention does
    quant = {} if k_scale is None else dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    out, present_k, present_v = msft.GroupQueryAttention(
        bsh(q, hq), bsh(k, hkv), bsh(v, hkv), k_cache, v_cache, seqlens_k, total,
        cos if fused_rope else None, sin if fused_rope else None, None, None, None, k_scale, v_scale, None, None,
        chunk, num_heads=hq, kv_num_heads=hkv, scale=scale, local_window_size=window if window > 0 else -1,
        softcap=softcap, do_rotary=int(fused_rope), **quant,
    )
    out = op.Transpose(op.Reshape(out, const([0, 0, hq, d])), perm=[0, 2, 1, 3])
    return out, present_k, present_v


def finalize(proto, base_dir: str = "") -> None:
    from kvedge.export.lowerings import ort_fusions

    ort_fusions.fuse(proto, base_dir)


# int8 cache: GQA's quantized cache (k_scale / v_scale, PER_CHANNEL), the kvedge.models.attention semantics
LOWERING = Lowering("ort", 21, "com.microsoft.GroupQueryAttention: the fastest on ONNX Runtime CPU (the default)",
                    translate, unsupported=unsupported, translate_qlinear=translate_qlinear,
                    translate_qembedding=translate_qembedding, unsupported_affine=unsupported_affine,
                    int8_cache=True, finalize=finalize,
                    min_onnxruntime=(1, 32))  # GroupQueryAttention's query_seqlens input
