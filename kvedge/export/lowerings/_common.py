"""ONNX pieces the lowerings share: the visible-keys mask, slicing the cache to the live length, RoPE."""

from __future__ import annotations

from onnxscript import opset18 as op


def constants(graph, base_dir: str = ""):
    """name -> the value (numpy) of an initializer or Constant node, or None. Converted on each call, not up front:
    the initializers are the weights, and converting them all would copy every weight of the model. base_dir: the
    folder of the initializers' external data, if any."""
    from onnx import numpy_helper

    tensors = {t.name: t for t in graph.initializer}
    tensors.update({n.output[0]: n.attribute[0].t for n in graph.node
                    if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})

    def value(name: str):
        t = tensors.get(name)
        return None if t is None else numpy_helper.to_array(t, base_dir)

    return value


def drop_unused(proto) -> None:
    """Remove the nodes and initializers nothing reads any more (after a lowering's graph rewrite)."""
    graph = proto.graph
    while True:
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    for t in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(t)


def const(value):
    """An int64 constant (a list gives a 1-D tensor, an int a scalar)."""
    return op.Constant(value_ints=list(value)) if isinstance(value, (list, tuple)) else op.Constant(value_int=value)


def fconst(value: float):
    """A float32 scalar constant."""
    return op.Constant(value_float=float(value))


def kv_len(positions):
    """[1] int64: one past the largest position in the batch; cache slots beyond are never visible."""
    return op.Add(op.Reshape(op.ReduceMax(positions, keepdims=0), const([1])), const([1]))


def live(cache, length):
    """cache[:, :, :length]."""
    return op.Slice(cache, const([0]), length, const([2]))


def visible(positions, length, window: int):
    """Boolean [B, L, S]: the query at positions[b, i] may see slot j (j <= p, and p - j < window)."""
    keys = op.Range(const(0), op.Squeeze(length, const([0])), const(1))  # [S]
    q = op.Unsqueeze(positions, const([-1]))  # [B, L, 1]
    ok = op.LessOrEqual(keys, q)
    if window > 0:
        ok = op.And(ok, op.Greater(keys, op.Sub(q, const(window))))
    return ok


def rope(x, cos, sin, positions):
    """x [B, H, L, D] rotated at positions [B, L] by the tables [S, rot/2] (kvedge.models.rope.apply_rope);
    cos None: x unchanged."""
    if cos is None:
        return x
    half, d = cos.shape[1], x.shape[3]
    c = op.Unsqueeze(op.Gather(cos, positions, axis=0), const([1]))  # [B, 1, L, rot/2]
    s = op.Unsqueeze(op.Gather(sin, positions, axis=0), const([1]))
    x1 = op.Slice(x, const([0]), const([half]), const([3]))
    x2 = op.Slice(x, const([half]), const([2 * half]), const([3]))
    parts = [op.Sub(op.Mul(x1, c), op.Mul(x2, s)), op.Add(op.Mul(x2, c), op.Mul(x1, s))]
    if 2 * half < d:
        parts.append(op.Slice(x, const([2 * half]), const([d]), const([3])))
    return op.Concat(*parts, axis=3)
