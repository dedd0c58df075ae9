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

from kvedge.export.lowerings._common import const, drop_unused, rope
from kvedge.models.config import ModelConfig

NAME = "ort"
OPSET = 21
DOMAIN = "com.microsoft"
MIN_ONNXRUNTIME = (1, 32)  # GroupQueryAttention's query_seqlens input


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


def translate_qlinear(x, qweight, scales, zeros, bits: int, k: int, accuracy_level: int):
    """kvedge::qlinear -> MatMulNBits: the weights are already in its layout."""
    n, nb = qweight.shape[0], qweight.shape[1]
    return msft.MatMulNBits(x, qweight, scales, zeros, K=k, N=n, bits=bits, block_size=k // nb,
                            accuracy_level=accuracy_level)


def unsupported(cfg: ModelConfig) -> list[str]:
    return []


def unsupported_quant(bits: int) -> list[str]:
    return []


def unsupported_kv(kv_dtype: str) -> list[str]:
    return []  # int8: GQA's quantized cache (k_scale / v_scale, PER_CHANNEL), the kvedge.models.attention semantics


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


def finalize(proto) -> None:
    """Strip the views around GroupQueryAttention that the export leaves (the Decoder's [B, H, L, D] view
    of q, k, v and of the output, and this lowering's views back to [B, L, H * D]):
    - when q, k and v are the three outputs of one Split of the fused projection, GQA gets the packed
      [B, L, (Hq + 2 Hkv) * D] tensor (it splits packed QKV itself): the Split and six Reshapes go;
    - the output's Reshape/Transpose round trip to the o projection goes.
    Only chains of views whose transposes cancel are touched, so the data never moves; export verifies
    the result against PyTorch like any other graph."""
    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output}
    users: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}

    def walk(name, backward: bool):
        """Follow single-use Reshape/Transpose nodes from value `name`; returns the value reached, or None
        when the transposes on the way do not cancel (or a reshape sits between ones that do not)."""
        perm = None
        while True:
            if backward:
                n = producer.get(name)
            else:
                n = users[name][0] if users.get(name) and name not in outputs else None
            if (n is None or n.op_type not in ("Reshape", "Transpose") or len(users.get(name, [])) != 1
                    or (not backward and n.input[0] != name)):  # forward: `name` must be the data, not a shape
                break
            if n.op_type == "Transpose":
                p = list(next(a.ints for a in n.attribute if a.name == "perm"))
                perm = p if perm is None else [p[i] for i in perm] if backward else [perm[i] for i in p]
            elif perm is not None and perm != sorted(perm):
                return None
            name = n.input[0] if backward else n.output[0]
        return name if perm is None or perm == sorted(perm) else None

    for node in [n for n in graph.node if n.op_type == "GroupQueryAttention" and n.domain == DOMAIN]:
        ends = [walk(i, backward=True) for i in node.input[:3]]
        split = producer.get(ends[0]) if ends[0] else None
        if (split is not None and split.op_type == "Split" and list(split.output) == ends
                and next((a.i for a in split.attribute if a.name == "axis"), 0) in (-1, 2)):
            node.input[0], node.input[1], node.input[2] = split.input[0], "", ""
        end = walk(node.output[0], backward=False)
        if end is not None and end != node.output[0]:
            for user in users.get(end, []):
                user.input[list(user.input).index(end)] = node.output[0]
    _fuse_skip_rms_norm(graph, producer, users)
    _drop_midpoint_zero_points(graph)
    drop_unused(proto)


def _drop_midpoint_zero_points(graph) -> None:
    """MatMulNBits whose zero points are all the midpoint 2^(bits-1) (--symmetric) loses its zero-point
    input: that is the op's default, and its kernel skips the per-group zero point then (faster)."""
    import numpy as np
    from onnx import numpy_helper

    inits = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if n.op_type != "MatMulNBits" or len(n.input) < 4 or n.input[3] not in inits:
            continue
        a = {x.name: x.i for x in n.attribute}
        z = numpy_helper.to_array(inits[n.input[3]]).reshape(a["N"], -1)
        if a["bits"] == 4:  # two a byte, low nibble first; an odd count leaves a padding nibble
            z = np.stack((z & 0x0F, z >> 4), axis=-1).reshape(a["N"], -1)[:, :a["K"] // a["block_size"]]
        if (z == 2 ** (a["bits"] - 1)).all():
            if len(n.input) == 4:
                del n.input[3]
            else:
                n.input[3] = ""


def _fuse_skip_rms_norm(graph, producer, users) -> None:
    """Residual Add + the Decoder's RMSNorm (x / Sqrt(ReduceMean(x^2, -1) + eps) * w, float32) ->
    one SkipSimplifiedLayerNormalization (ONNX Runtime contrib op) whose 4th output is the sum the next
    residual Add reads. ONNX Runtime fuses the norm alone, not the Add before it."""
    import numpy as np
    from onnx import helper, numpy_helper

    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    consts.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                   if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})

    def one(name, op_type):
        n = producer.get(name)
        return n if n is not None and n.op_type == op_type and len(users.get(name, [])) == 1 else None

    for div in [n for n in graph.node if n.op_type == "Div"]:
        x = div.input[0]
        sqrt = one(div.input[1], "Sqrt")
        add_eps = sqrt and one(sqrt.input[0], "Add")
        mean = add_eps and one(add_eps.input[0], "ReduceMean")
        pow_ = mean and one(mean.input[0], "Pow")
        residual = producer.get(x)
        muls = users.get(div.output[0], [])
        if not (pow_ and pow_.input[0] == x and residual is not None and residual.op_type == "Add"
                and len(muls) == 1 and muls[0].op_type == "Mul"):
            continue
        mul = muls[0]
        weight = next((i for i in mul.input if i != div.output[0]), None)
        eps, two, axes = (consts.get(v) for v in (add_eps.input[1], pow_.input[1], mean.input[1]))
        if (weight not in consts or consts[weight].ndim != 1 or eps is None or eps.size != 1 or two is None
                or float(two) != 2.0 or axes is None or [int(a) for a in axes.reshape(-1)] != [-1]
                or {u.op_type for u in users[x]} - {"Pow", "Div", "Add"}):
            continue
        fused = helper.make_node("SkipSimplifiedLayerNormalization", [*residual.input, weight],
                                 [mul.output[0], "", "", x], domain=DOMAIN, epsilon=float(eps),
                                 name=f"{mul.name or mul.output[0]}/SkipRMSNorm")
        graph.node.insert(list(graph.node).index(residual), fused)
        for n in (residual, pow_, mean, add_eps, sqrt, div, mul):
            graph.node.remove(n)
