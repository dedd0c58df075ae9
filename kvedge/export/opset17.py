"""Rewrite an opset-18 graph as opset 17, for TensorRT 8.6's parser.

torch.onnx emits opset >= 18 and onnx's version converter has no Split 18->17 adapter. Between 17
and 18 only a few operators changed in ways our graphs meet: Reduce* (but ReduceSum) took `axes` as
an input instead of an attribute, and Split gained `num_outputs`. Both are rewritten here when the
values are constants; anything else raises, and onnx.checker validates the result against 17.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kvedge.errors import KvedgeError
from kvedge.export.lowerings._common import constants

_AXES_TO_ATTR = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                 "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"}
_CHANGED_IN_18 = {"Pad", "Resize", "ScatterElements", "ScatterND", "CenterCropPad", "Col2Im", "LpPool",
                  "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "OptionalHasElement",
                  "OptionalGetElement"}


def _static_dims(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    dims = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        shape = vi.type.tensor_type.shape
        dims[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]
    return dims


def _split_sizes(n, dims) -> list[int]:
    """Split-18's num_outputs as Split-13's explicit sizes (equal parts, the last one smaller)."""
    count = next(a.i for a in n.attribute if a.name == "num_outputs")
    axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
    shape = dims.get(n.input[0])
    size = shape[axis] if shape and -len(shape) <= axis < len(shape) else None
    if size is None:
        raise KvedgeError(f"opset 17: Split node {n.name!r} splits a dynamic axis into num_outputs parts")
    part = -(-size // count)
    return [part] * (count - 1) + [size - part * (count - 1)]


def downgrade_to_17(model: onnx.ModelProto, base_dir: str = "") -> onnx.ModelProto:
    g = model.graph
    dims = _static_dims(model)
    const = constants(g, base_dir)
    for n in g.node:
        if n.domain not in ("", "ai.onnx"):
            continue
        if n.op_type in _AXES_TO_ATTR:
            if any(a.name == "noop_with_empty_axes" and a.i for a in n.attribute):
                raise KvedgeError(f"opset 17: {n.op_type} node {n.name!r} uses noop_with_empty_axes=1")
            kept = [a for a in n.attribute if a.name != "noop_with_empty_axes"]  # an opset-18 attribute
            if len(n.input) > 1 and n.input[1]:
                axes = const(n.input[1])
                if axes is None:
                    raise KvedgeError(f"opset 17: {n.op_type} node {n.name!r} has non-constant axes")
                kept.append(helper.make_attribute("axes", [int(a) for a in axes.reshape(-1)]))
                del n.input[1:]
            del n.attribute[:]
            n.attribute.extend(kept)
        elif n.op_type == "Split":
            attrs = [a for a in n.attribute if a.name != "num_outputs"]
            if len(attrs) != len(n.attribute) and (len(n.input) < 2 or not n.input[1]):
                sizes = numpy_helper.from_array(np.array(_split_sizes(n, dims), dtype=np.int64),
                                                f"{n.name}_split_sizes")
                g.initializer.append(sizes)
                del n.input[1:]
                n.input.append(sizes.name)
            del n.attribute[:]
            n.attribute.extend(attrs)
        elif n.op_type == "ScatterElements":
            if any(a.name == "reduction" and a.s in (b"max", b"min") for a in n.attribute):
                raise KvedgeError(f"opset 17: ScatterElements node {n.name!r} uses an opset-18 reduction")
        elif n.op_type in _CHANGED_IN_18 - {"ScatterElements"}:
            raise KvedgeError(f"opset 17: no rewrite for {n.op_type} (node {n.name!r})")
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = 17
    return model
