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


def _register_schema() -> None:
    """Teach onnx (and so onnxscript and onnx.checker) the contrib op's signature, as ONNX Runtime
    documents it in its contrib operator spec. Shape inference stays ONNX Runtime's."""
    from onnx import defs

    if defs.has("GroupQueryAttention", DOMAIN):
        return
    P, A = defs.OpSchema.FormalParameter, defs.OpSchema.Attribute
    opt = defs.OpSchema.FormalParameterOption.Optional
    ints, floats, strings = defs.OpSchema.AttrType.INT, defs.OpSchema.AttrType.FLOAT, defs.OpSchema.AttrType.STRING
    inputs = [P("query", "T"), P("key", "T", param_option=opt), P("value", "T", param_option=opt),
              P("past_key", "T_CACHE", param_option=opt), P("past_value", "T_CACHE", param_option=opt),
              P("seqlens_k", "M"), P("total_sequence_length", "M"),
              P("cos_cache", "T", param_option=opt), P("sin_cache", "T", param_option=opt),
              P("position_ids", "tensor(int64)", param_option=opt),
              P("attention_bias", "T", param_option=opt), P("head_sink", "T", param_option=opt),
              P("k_scale", "S", param_option=opt), P("v_scale", "S", param_option=opt),
              P("q_norm_weight", "T", param_option=opt), P("k_norm_weight", "T", param_option=opt),
              P("query_seqlens", "M", param_option=opt)]
    outputs = [P("output", "T"), P("present_key", "T_CACHE"), P("present_value", "T_CACHE")]  # output_qk left out
    attributes = [A("num_heads", ints, "query heads", required=True),
                  A("kv_num_heads", ints, "key/value heads", required=True)]
    attributes += [A(n, t, "", required=False) for n, t in (("scale", floats), ("softcap", floats), ("local_window_size", ints),
                                             ("do_rotary", ints), ("rotary_interleaved", ints),
                                             ("smooth_softmax", ints), ("qk_output", ints),
                                             ("kv_cache_bit_width", ints), ("k_quant_type", strings),
                                             ("v_quant_type", strings))]
    defs.register_schema(defs.OpSchema(
        "GroupQueryAttention", DOMAIN, 1, inputs=inputs, outputs=outputs, attributes=attributes,
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("T_CACHE", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(int8)"], ""),
                          ("M", ["tensor(int32)"], ""), ("S", ["tensor(float)"], "")]))


def _register_matmulnbits() -> None:
    """com.microsoft.MatMulNBits as ONNX Runtime's contrib operator spec documents it."""
    from onnx import defs

    if defs.has("MatMulNBits", DOMAIN):
        return
    P, A = defs.OpSchema.FormalParameter, defs.OpSchema.Attribute
    opt = defs.OpSchema.FormalParameterOption.Optional
    ints = defs.OpSchema.AttrType.INT
    defs.register_schema(defs.OpSchema(
        "MatMulNBits", DOMAIN, 1,
        inputs=[P("A", "T1"), P("B", "T2"), P("scales", "T1"), P("zero_points", "T3", param_option=opt),
                P("g_idx", "T4", param_option=opt), P("bias", "T1", param_option=opt)],
        outputs=[P("Y", "T1")],
        attributes=[A("K", ints, "", required=True), A("N", ints, "", required=True),
                    A("bits", ints, "", required=True), A("block_size", ints, "", required=True),
                    A("accuracy_level", ints, "", required=False)],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("T2", ["tensor(uint8)", "tensor(int32)"], ""),
                          ("T3", ["tensor(uint8)", "tensor(int32)", "tensor(float16)", "tensor(float)"], ""),
                          ("T4", ["tensor(int32)"], "")]))


def _register_skip_rms_norm() -> None:
    """com.microsoft.SkipSimplifiedLayerNormalization as ONNX Runtime's contrib operator spec documents it."""
    from onnx import defs

    if defs.has("SkipSimplifiedLayerNormalization", DOMAIN):
        return
    P, A = defs.OpSchema.FormalParameter, defs.OpSchema.Attribute
    opt = defs.OpSchema.FormalParameterOption.Optional
    defs.register_schema(defs.OpSchema(
        "SkipSimplifiedLayerNormalization", DOMAIN, 1,
        inputs=[P("input", "T"), P("skip", "T"), P("gamma", "T"), P("bias", "T", param_option=opt)],
        outputs=[P("output", "T"), P("mean", "U", param_option=opt), P("inv_std_var", "U", param_option=opt),
                 P("input_skip_bias_sum", "T", param_option=opt)],
        attributes=[A("epsilon", defs.OpSchema.AttrType.FLOAT, "", required=False)],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("U", ["tensor(float)"], "")]))


_register_schema()
_register_matmulnbits()
_register_skip_rms_norm()
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
    offset = op.Add(op.Mul(scales, op.CastLike(fconst(2 ** (bits - 1)), scales)), mins)  # [N * nb]
    offset = op.Transpose(op.Reshape(offset, const([n, nb])), perm=[1, 0])  # [nb, N]
    sums = op.ReduceSum(op.Reshape(x, op.Concat(op.Shape(x, end=-1), const([nb, k // nb]), axis=0)), const([-1]),
                        keepdims=0)  # [..., nb]
    return op.Add(y, op.MatMul(sums, offset))


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
                    unsupported_affine=unsupported_affine,
                    int8_cache=True, finalize=finalize,
                    min_onnxruntime=(1, 32))  # GroupQueryAttention's query_seqlens input
