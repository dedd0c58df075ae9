"""The DequantizeLinear weight form: kvedge::qlinear -> signed INT4 / INT8 `DequantizeLinear` -> `MatMul`, the form
TensorRT's weight-only path builds, shared by the `onnx`, `decomposed` and `trt` lowerings.

    y = MatMul(x, DequantizeLinear(W, scale, axis=0[, block_size]))  [+ MatMul(block sums of x, offset)]

- W [K, N]: the MatMul's right-hand side as is (no Transpose), 2-D, signed INT4 (ml_dtypes.int4, ONNX INT4, opset
  21) or INT8; no zero-point input (TensorRT rejects a non-zero one in every release), but an all-zero one for
  per-channel INT8, which TensorRT 8.6's parser requires.
- scale: positive, constant, the rank of W: [K / group, N] blocked along axis 0 (opset 21's block_size); a
  whole-row group (per-channel INT8, which TensorRT 8.6 builds) is a 1-D [N] scale on axis 1 with no block_size.
- Every block kvedge holds, w = s * (q - z) or w = s * q + m (GGUF's affine Q4_1 / Q4_K / Q5_K), is written exactly
  as w = s' * q' + o: q' = q - 2^(bits-1) signed, o = s * (2^(bits-1) - z) or m + 2^(bits-1) * s. A negative scale
  (Q4_0's d is negative when the largest |w| is positive) flips sign: s * q' = |s| * (-1 - q') + |s|, and -1 - q'
  stays in range; a zero scale becomes the least positive float with q' = 0. The per-block offsets o, when any is
  non-zero, are one float32 [K / group, N] MatMul with the sums of x over each group: 1 / group of the main
  product's work.

The traced graph holds placeholder nodes (domain kvedge_quant) over the QuantLinear's buffers; `finalize` turns
them into the DequantizeLinear and its initializers, so the exporter's optimizer never folds 4-bit weights to
float, and drops the offset term where every offset is zero (symmetric weights).
"""

from __future__ import annotations

import numpy as np
from onnxscript import ir
from onnxscript import opset18 as op
from onnxscript.values import Opset

from kvedge.errors import KvedgeError
from kvedge.export.lowerings._common import const, drop_unused
from kvedge.models.quant import unpack4, unpack_zeros

PLACEHOLDER = "kvedge_quant"
WEIGHT, OFFSET = "BlockedWeight", "BlockOffset"
BLOCKED_OPSET = 21  # DequantizeLinear's block_size and the INT4 type (ONNX opset 21)


def _register_placeholders() -> None:
    """kvedge_quant::BlockedWeight(qweight, scales, zeros[, mins]) -> W [K, N] and ::BlockOffset(...) -> o
    [K / group, N]: never in a saved graph (finalize replaces both)."""
    from onnx import defs

    P, A, S = defs.OpSchema.FormalParameter, defs.OpSchema.Attribute, defs.OpSchema
    ints = S.AttrType.INT
    for name in (WEIGHT, OFFSET):
        if defs.has(name, PLACEHOLDER):
            continue
        defs.register_schema(S(
            name, PLACEHOLDER, 1,
            inputs=[P("qweight", "U"), P("scales", "T"), P("zeros", "U"),
                    P("mins", "T", "", param_option=S.FormalParameterOption.Optional)],
            outputs=[P("out", "F")], attributes=[A("bits", ints, "", required=True), A("K", ints, "", required=True)],
            type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                              ("F", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                              ("U", ["tensor(uint8)"], "")]))


_register_placeholders()
_placeholder = Opset(PLACEHOLDER, 1)


def translate_qlinear(x, qweight, scales, zeros, bits: int, k: int, accuracy_level: int, mins=None):
    """kvedge::qlinear -> MatMul over the dequantized weight, plus the offset term (dropped by finalize where it is
    zero). accuracy_level is MatMulNBits's hint: nothing here."""
    nb = qweight.shape[1]
    parts = (qweight, scales, zeros) if mins is None else (qweight, scales, zeros, mins)
    y = op.MatMul(x, getattr(_placeholder, WEIGHT)(*parts, bits=bits, K=k))
    sums = op.ReduceSum(op.Reshape(x, op.Concat(op.Shape(x, end=-1), const([nb, k // nb]), axis=0)), const([-1]),
                        keepdims=0)  # [..., K / group]
    offset = getattr(_placeholder, OFFSET)(*parts, bits=bits, K=k)  # float32
    if x.dtype == ir.DataType.FLOAT:
        return op.Add(y, op.MatMul(sums, offset))
    return op.Add(y, op.Cast(op.MatMul(op.Cast(sums, to=ir.DataType.FLOAT), offset), to=x.dtype))


def signed_form(qweight, scales, zeros, mins, bits: int, k: int):
    """A QuantLinear's buffers (kvedge.models.quant's layout) -> (W [K, N] int8 values in the signed range of
    `bits`, scale [K / group, N] > 0 in the scales' dtype, offset [K / group, N] float32, or None if all zero):
    dequantize(...) == W * scale (per block) + offset, exactly up to float32 rounding of the offset (module doc)."""
    q = np.asarray(qweight, dtype=np.uint8)
    n, nb = q.shape[0], q.shape[1]
    q = (unpack4(q.reshape(n, -1), k) if bits == 4 else q.reshape(n, k)).reshape(n, nb, k // nb).astype(np.int16)
    s = np.asarray(scales).reshape(n, nb)
    s32 = s.astype(np.float32)
    mid = 2 ** (bits - 1)
    if mins is not None:
        offset = np.asarray(mins, dtype=np.float32).reshape(n, nb) + np.float32(mid) * s32
    else:
        z = unpack_zeros(np.asarray(zeros, dtype=np.uint8), bits, n, nb).astype(np.float32)
        offset = s32 * (np.float32(mid) - z)
    q = q - mid
    neg = s32 < 0
    if neg.any():
        q = np.where(neg[..., None], -1 - q, q)
        s = np.where(neg, -s, s)
        offset = offset + np.where(neg, s.astype(np.float32), np.float32(0))
    zero = s == 0
    if zero.any():
        q = np.where(zero[..., None], 0, q)
        s = np.where(zero, np.finfo(s.dtype).smallest_subnormal, s)
    w = np.ascontiguousarray(q.reshape(n, k).T).astype(np.int8)
    return w, np.ascontiguousarray(s.T), (np.ascontiguousarray(offset.T) if offset.any() else None)


def no_refusals(bits: int) -> list[str]:
    return []  # every block kvedge holds has this form (module doc)


def min_opset(bits: set[int], blocked: bool) -> int:
    """The opset the weights need: 21 for INT4 or blocks (DequantizeLinear-21), none otherwise (per-channel INT8
    is DequantizeLinear-13)."""
    return BLOCKED_OPSET if 4 in bits or blocked else 0


def finalize(proto, base_dir: str = "") -> None:
    """Replace each BlockedWeight by DequantizeLinear over INT4 / INT8 initializers, each BlockOffset by its float32
    initializer, or, where every offset is zero, drop the offset term."""
    import ml_dtypes
    from onnx import helper, numpy_helper

    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    forms: dict[tuple[str, ...], tuple] = {}
    dropped: set[str] = set()
    for node in [n for n in graph.node if n.domain == PLACEHOLDER]:
        missing = [name for name in node.input if name and name not in inits]
        if missing:
            raise KvedgeError(f"quantized linear {node.name!r}: {missing} are not initializers; DequantizeLinear "
                              "weights must be constant")
        attrs = {a.name: a.i for a in node.attribute}
        key = tuple(node.input)
        if key not in forms:
            arrays = [numpy_helper.to_array(inits[name], base_dir) for name in node.input]
            forms[key] = signed_form(*arrays[:3], arrays[3] if len(arrays) > 3 else None, attrs["bits"], attrs["K"])
        w, s, offset = forms[key]
        at = list(graph.node).index(node)
        graph.node.remove(node)
        if node.op_type == OFFSET:
            if offset is None:
                dropped.add(node.output[0])
            else:
                graph.initializer.append(numpy_helper.from_array(offset, node.output[0]))
            continue
        base = node.input[0]
        signed = ml_dtypes.int4 if attrs["bits"] == 4 else np.int8
        blocked = s.shape[0] > 1 or attrs["bits"] == 4  # TensorRT's INT4 is blocked only: one block of K is a block
        scale = s if blocked else s.reshape(-1)
        names = [f"{base}.dq_w", f"{base}.dq_scale"]
        graph.initializer.extend([numpy_helper.from_array(w.astype(signed), names[0]),
                                  numpy_helper.from_array(scale, names[1])])
        if not blocked:  # TensorRT 8.6's parser takes INT8 DequantizeLinear with 3 inputs only
            names.append(f"{base}.dq_zero")
            graph.initializer.append(numpy_helper.from_array(np.zeros(scale.shape, np.int8), names[2]))
        extra = {"axis": 0, "block_size": attrs["K"] // s.shape[0]} if blocked else {"axis": 1}
        graph.node.insert(at, helper.make_node("DequantizeLinear", names, list(node.output), name=node.name,
                                               **extra))
    _drop_offset_terms(graph, dropped)
    for op_set in [o for o in proto.opset_import if o.domain == PLACEHOLDER]:
        proto.opset_import.remove(op_set)
    drop_unused(proto)


def _drop_offset_terms(graph, dropped: set[str]) -> None:
    """y + [Cast](MatMul(sums, o)) -> y for each zero offset o: the Add's readers read y instead (an Add that
    writes a graph output, a quantized lm_head's logits, becomes Identity(y))."""
    zero = {n.output[0] for n in graph.node if n.op_type == "MatMul" and n.input[1] in dropped}
    zero |= {n.output[0] for n in graph.node if n.op_type == "Cast" and n.input[0] in zero}
    outputs = {o.name for o in graph.output}
    for add in [n for n in graph.node if n.op_type == "Add" and any(i in zero for i in n.input)]:
        keep = next(i for i in add.input if i not in zero)
        if add.output[0] in outputs:
            add.op_type = "Identity"
            del add.input[:]
            add.input.append(keep)
            continue
        for n in graph.node:
            for j, name in enumerate(n.input):
                if name == add.output[0]:
                    n.input[j] = keep
        graph.node.remove(add)
