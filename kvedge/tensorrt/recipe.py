"""What deploys on a TensorRT version: the export (lowering and weight form) whose graph that TensorRT builds for a
weight precision, or why none does. `kvedge plan` and `kvedge check` end with it. Pure Python, no TensorRT.

A form is listed only where its graph passes `kvedge check` for that version (kvedge.tensorrt.check: the parser's
opset, the attention ops, QUANT_FORMS); tests/tensorrt/test_recipe.py exports each recipe and checks it. Float
weights take the version's own lowering (kvedge.tensorrt.versions.select_path).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvedge.tensorrt.versions import select_path

# Weight-only quantized forms kvedge exports that TensorRT builds: precision -> (lowering, export flags, the oldest
# TensorRT that builds the whole graph). int4: blocked signed INT4 DequantizeLinear (blocks of 64 / 128, TensorRT
# >= 10.0) in the `onnx` lowering, whose Attention + TensorScatter need 10.15; `decomposed` (opset 17) and `trt`
# carry no quantized weights. int8: TensorRT's block dequantization never takes INT8, and kvedge writes int8 weights
# blocked. A new form (another lowering or TensorRT version) is one more entry here.
TRT_WEIGHT_FORMS: dict[str, tuple[tuple[str, str, tuple[int, int]], ...]] = {
    "int4": (("onnx", "--quantize int4 --symmetric --group-size 128", (10, 15)),),
    "int8": (),
}
QUANTIZED = tuple(TRT_WEIGHT_FORMS)


@dataclass(frozen=True)
class Recipe:
    weights: str  # "fp16", "bf16", "fp32", "int8" or "int4" (weight-only, fp16 otherwise)
    tensorrt: str
    export: str | None  # the `kvedge export` flags whose graph this TensorRT builds; None: no export does
    why: str  # what holds: the lowering and what it needs, or why nothing does

    def line(self, model: str = "MODEL") -> str:
        if self.export is None:
            return f"{self.weights} on TensorRT {self.tensorrt}: none deploys: {self.why}"
        return (f"{self.weights} on TensorRT {self.tensorrt}: kvedge export {model} -o OUT {self.export}, then on the "
                f"device kvedge build OUT --precision {'fp16' if self.weights in QUANTIZED else self.weights} "
                f"({self.why})")


def recipe(trt_version: str, weights: str) -> Recipe:
    """The export whose graph TensorRT `trt_version` builds with `weights`, or why none does."""
    path = select_path(trt_version)
    version = ".".join(map(str, path.version))
    if weights not in TRT_WEIGHT_FORMS:  # float weights: the lowering this version wants
        return Recipe(weights, version, f"--attention {path.lowering} --dtype {weights}",
                      f"TensorRT {version} takes the {path.lowering!r} lowering")
    forms = TRT_WEIGHT_FORMS[weights]
    for lowering, flags, since in forms:
        if path.version >= since:
            return Recipe(weights, version, f"--attention {lowering} {flags} --dtype fp16",
                          f"the {lowering!r} lowering with {weights.upper()} DequantizeLinear weights needs TensorRT "
                          f">= {since[0]}.{since[1]}")
    if forms:
        why = f"kvedge's {weights} weights build only in " + " or ".join(
            f"the {low!r} lowering ({flags}), on TensorRT >= {since[0]}.{since[1]}" for low, flags, since in forms)
    else:
        why = (f"no TensorRT release builds kvedge's {weights} weights (blocked {weights.upper()} DequantizeLinear) "
               f"and its other lowerings carry none")
    return Recipe(weights, version, None, why)


def cpu_recipe(weights: str, model: str = "MODEL") -> str:
    """Where TensorRT builds none: what runs these weights on the CPU instead (tested here, unlike TensorRT)."""
    if weights in QUANTIZED:
        return (f"on the CPU instead: kvedge export {model} -o OUT --quantize {weights} (onnxruntime), or kvedge "
                f"serve {model} --backend native --quantize {weights}")
    return f"on the CPU instead: kvedge export {model} -o OUT (onnxruntime)"


def graph_weights(model) -> str | None:
    """The weight-only precision of an ONNX graph (an onnx ModelProto): "int4" or "int8" when it holds
    MatMulNBits or DequantizeLinear of integer initializers, None for float weights."""
    from onnx import TensorProto

    inits = {t.name: t.data_type for t in model.graph.initializer}
    bits = set()
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            bits |= {a.i for a in node.attribute if a.name == "bits"}
        elif node.op_type == "DequantizeLinear" and node.input and node.input[0] in inits:
            kind = inits[node.input[0]]
            bits |= {4} if kind in (TensorProto.INT4, TensorProto.UINT4) else \
                {8} if kind in (TensorProto.INT8, TensorProto.UINT8) else set()
    return None if not bits else f"int{min(bits)}"
