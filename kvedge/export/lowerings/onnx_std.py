"""`onnx`: standard ONNX opset 24: TensorScatter writes the cache, Attention attends over it.

Runs on ONNX Runtime and is meant for TensorRT >= 10.15, whose parser maps `Attention` to its fused
attention layer and `TensorScatter` to its KV-cache update. The Attention node gets no
past_key/past_value inputs (TensorRT's parser rejects them): the cache is written first, then
attended over with an explicit boolean mask. GQA is native to Attention (K/V carry Hkv heads). MLA is one
Attention with one KV head whose key is the two caches concatenated, [k_rope, c_kv] (d_R + d_c), and whose value
is c_kv (d_c): Attention takes a value head size other than the query's.
Quantized linears: blocked DequantizeLinear (UINT8 / UINT4 with zero points) + MatMul, see
translate_qlinear; ONNX Runtime runs them, TensorRT does not (it is symmetric only).
"""

from __future__ import annotations

from onnxscript import opset18 as op
from onnxscript.values import Opset

from kvedge.errors import KvedgeError
from kvedge.export.lowerings import Lowering
from kvedge.export.lowerings._common import const, drop_unused, kv_len, live, rope, visible
from kvedge.models.config import ModelConfig
from kvedge.models.quant import unpack4

op24 = Opset("", 24)


def unsupported(cfg: ModelConfig) -> list[str]:
    reasons = []
    if cfg.attn_softcap:
        # The spec applies softcap after the mask is added (qk_matmul_output_mode order) while the
        # reference implementation applies it before; a masked -inf would become -softcap. Refuse.
        reasons.append("attention logit softcapping (the ONNX Attention softcap/mask order is ambiguous)")
    return reasons


PLACEHOLDER = "kvedge_quant"


def _register_placeholder() -> None:
    """kvedge_quant::BlockedWeight(qweight, scales, zeros) -> W [K, N]: where translate_qlinear leaves the
    stored integers; `finalize` replaces each by a standard DequantizeLinear over new initializers (the
    node never reaches a saved graph, so the exporter's optimizer cannot fold the 4-bit weights to float)."""
    from onnx import defs

    if defs.has("BlockedWeight", PLACEHOLDER):
        return
    P, A = defs.OpSchema.FormalParameter, defs.OpSchema.Attribute
    ints = defs.OpSchema.AttrType.INT
    defs.register_schema(defs.OpSchema(
        "BlockedWeight", PLACEHOLDER, 1, inputs=[P("qweight", "U"), P("scales", "T"), P("zeros", "U")],
        outputs=[P("W", "T")], attributes=[A("bits", ints, "", required=True), A("K", ints, "", required=True)],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("U", ["tensor(uint8)"], "")]))


_register_placeholder()
_placeholder = Opset(PLACEHOLDER, 1)


def translate_qlinear(x, qweight, scales, zeros, bits: int, k: int, accuracy_level: int, mins=None):
    """kvedge::qlinear -> blocked DequantizeLinear (opset 21+) then MatMul, laid out as TensorRT's weight-only
    path takes it: W [K, N] (the MatMul's right-hand side as is, no Transpose), blocks of `group` along K
    (axis 0). The integers are UINT8 / UINT4 with zero points (kvedge quantizes asymmetrically), which
    ONNX Runtime runs and TensorRT refuses (signed, zero points all zero; `kvedge check` says so).
    Emitted as a placeholder node that `finalize` turns into the DequantizeLinear and its initializers."""
    if mins is not None:  # export refuses these first (Lowering.affine_refusals)
        raise KvedgeError("the onnx lowering has no form for affine blocks (q * scale + min)")
    return op.MatMul(x, _placeholder.BlockedWeight(qweight, scales, zeros, bits=bits, K=k))


def dq_initializers(qweight, scales, zeros, bits: int, k: int):
    """The MatMulNBits layout (kvedge.models.quant) -> numpy (W [K, N], scale [K / group, N], zero point
    [K / group, N] or None) for DequantizeLinear(axis=0, block_size=group): uint8, or ml_dtypes.uint4 for
    4 bits, which onnx.numpy_helper stores as ONNX UINT4, two a byte, the lower index in the low nibble.
    Symmetric weights (every zero point at the midpoint 2^(bits-1), --symmetric) become signed INT8 /
    INT4 values q - midpoint with no zero point: the form TensorRT's weight-only path builds."""
    import ml_dtypes
    import numpy as np

    q, z = np.asarray(qweight, dtype=np.uint8), np.asarray(zeros, dtype=np.uint8)
    n, nb = q.shape[0], q.shape[1]
    if bits == 4:
        q, z = unpack4(q.reshape(n, -1), k), unpack4(z.reshape(n, -1), nb)
    w, s, z = q.reshape(n, k).T, np.asarray(scales).reshape(n, nb).T.copy(), z.reshape(n, nb).T
    mid = 2 ** (bits - 1)
    if np.all(z == mid):
        signed = ml_dtypes.int4 if bits == 4 else np.int8
        return np.ascontiguousarray(w.astype(np.int16) - mid).astype(signed), s, None
    unsigned = ml_dtypes.uint4 if bits == 4 else np.uint8
    return np.ascontiguousarray(w).astype(unsigned), s, np.ascontiguousarray(z).astype(unsigned)


def finalize(proto) -> None:
    """Drop the Attention nodes' trailing outputs nobody reads (its optional present / qk outputs), so runtimes
    neither compute nor allocate them; replace each BlockedWeight placeholder by DequantizeLinear over UINT8 /
    UINT4 initializers."""
    from onnx import helper, numpy_helper

    from kvedge.errors import KvedgeError

    graph = proto.graph
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for node in graph.node:
        if node.op_type == "Attention":
            keep = list(node.output)
            while len(keep) > 1 and keep[-1] not in used:
                keep.pop()
            del node.output[len(keep):]
    inits = {t.name: t for t in graph.initializer}
    for i, node in enumerate(list(graph.node)):  # one node replaced in place at a time
        if node.domain != PLACEHOLDER:
            continue
        missing = [name for name in node.input if name not in inits]
        if missing:
            raise KvedgeError(f"quantized linear {node.name!r}: {missing} are not initializers; the onnx "
                              "lowering needs constant weights to write its DequantizeLinear")
        attrs = {a.name: a.i for a in node.attribute}
        w, s, z = dq_initializers(*(numpy_helper.to_array(inits[name]) for name in node.input), attrs["bits"],
                                  attrs["K"])
        names = [f"{node.input[0]}.dq_{part}" for part, a in zip(("w", "scale", "zero"), (w, s, z)) if a is not None]
        graph.initializer.extend(numpy_helper.from_array(a, name) for a, name in zip((w, s, z), names))
        graph.node.remove(node)
        graph.node.insert(i, helper.make_node("DequantizeLinear", names, list(node.output), name=node.name,
                                              axis=0, block_size=attrs["K"] // s.shape[0]))
    for op_set in [o for o in proto.opset_import if o.domain == PLACEHOLDER]:
        proto.opset_import.remove(op_set)
    drop_unused(proto)


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
                    unsupported=unsupported, translate_qlinear=translate_qlinear, finalize=finalize)
