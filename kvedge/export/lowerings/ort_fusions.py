"""The `ort` lowering's rewrites of the traced graph into the shapes ONNX Runtime's fused kernels want.

Pattern matching only: GroupQueryAttention over the packed QKV projection, residual Add + RMSNorm as
SkipSimplifiedLayerNormalization, MatMulNBits without midpoint zero points. Export verifies the result
against PyTorch like any other graph.
"""

from __future__ import annotations

from kvedge.export.lowerings._common import constants, drop_unused
from kvedge.export.lowerings.ort_gqa import DOMAIN
from kvedge.models.quant import unpack4


def fuse(proto, base_dir: str = "") -> None:
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
    _fuse_skip_rms_norm(graph, producer, users, base_dir)
    _drop_midpoint_zero_points(graph, base_dir)
    drop_unused(proto)


def _drop_midpoint_zero_points(graph, base_dir: str) -> None:
    """MatMulNBits whose zero points are all the midpoint 2^(bits-1) (--symmetric) loses its zero-point
    input: that is the op's default, and its kernel skips the per-group zero point then (faster)."""
    import onnx
    from onnx import numpy_helper

    inits = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if (n.op_type != "MatMulNBits" or len(n.input) < 4 or n.input[3] not in inits
                or inits[n.input[3]].data_type != onnx.TensorProto.UINT8):  # float zero points: affine blocks
            continue
        a = {x.name: x.i for x in n.attribute}
        z = numpy_helper.to_array(inits[n.input[3]], base_dir).reshape(a["N"], -1)
        if a["bits"] == 4:  # two a byte, low nibble first; an odd count leaves a padding nibble
            z = unpack4(z, a["K"] // a["block_size"])
        if (z == 2 ** (a["bits"] - 1)).all():
            if len(n.input) == 4:
                del n.input[3]
            else:
                n.input[3] = ""


def _fuse_skip_rms_norm(graph, producer, users, base_dir: str) -> None:
    """Residual Add + the Decoder's RMSNorm (x / Sqrt(ReduceMean(x^2, -1) + eps) * w, float32) ->
    one SkipSimplifiedLayerNormalization (ONNX Runtime contrib op) whose 4th output is the sum the next
    residual Add reads. ONNX Runtime fuses the norm alone, not the Add before it."""
    from onnx import helper

    const = constants(graph, base_dir)

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
        eps, two, axes = (const(v) for v in (add_eps.input[1], pow_.input[1], mean.input[1]))
        w = const(weight) if weight else None
        if (w is None or w.ndim != 1 or eps is None or eps.size != 1 or two is None
                or float(two) != 2.0 or axes is None or [int(a) for a in axes.reshape(-1)] != [-1]
                or {u.op_type for u in users[x]} - {"Pow", "Div", "Add"}):
            continue
        fused = helper.make_node("SkipSimplifiedLayerNormalization", [*residual.input, weight],
                                 [mul.output[0], "", "", x], domain=DOMAIN, epsilon=float(eps),
                                 name=f"{mul.name or mul.output[0]}/SkipRMSNorm")
        graph.node.insert(list(graph.node).index(residual), fused)
        for n in (residual, pow_, mean, add_eps, sqrt, div, mul):
            graph.node.remove(n)
