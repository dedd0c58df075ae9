"""What deploys on a TensorRT version: the export (lowering and weight form) whose graph that TensorRT builds for a
weight precision, or why none does. `kvedge plan` and `kvedge check` end with it. Pure Python, no TensorRT.

A form is listed only where its graph passes `kvedge check` for that version (kvedge.tensorrt.check: the parser's
opset, the attention ops, QUANT_FORMS); tests/tensorrt/test_recipe.py exports each recipe and checks it. Float
weights take the version's own lowering (kvedge.tensorrt.versions.select_path).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvedge.tensorrt.versions import INT4, select_path

# Weight-only quantized forms kvedge exports that TensorRT builds: precision -> (the oldest TensorRT that builds it,
# what it is). Both are kvedge's DequantizeLinear weight form (kvedge/export/lowerings/dq_weights.py), in the lowering
# the version wants, as `kvedge export --trt-version` writes it (kvedge.tensorrt.versions.export_recipe; sources
# there and in kvedge.tensorrt.check.QUANT_FORMS). A new form is one more entry here.
# int8 is absent on purpose: per-channel INT8 DequantizeLinear builds from 8.6 (`--trt-version X.Y --quantize int8`
# writes it), but "Weight-only quantization is supported for INT4" (TensorRT docs, Working with Quantized Types,
# 10.11 and 11.0): nothing says an engine keeps INT8 weights without quantized activations in 8 bits, so a plan
# that fits by int8's bytes would not be a recipe.
TRT_WEIGHT_FORMS: dict[str, tuple[tuple[int, int], str]] = {
    "int4": (INT4, "INT4 DequantizeLinear blocks of 128 or 64"),
}
INT8_WHY = ("TensorRT's weight-only quantization is INT4 only (its docs: \"Weight-only quantization is supported for "
            "INT4\"); per-channel INT8 DequantizeLinear builds (--trt-version X.Y --quantize int8), but the engine may "
            "hold the weights as float")
QUANTIZED = ("int4", "int8")


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
    if weights == "int8":
        return Recipe(weights, version, None, INT8_WHY)
    if weights not in TRT_WEIGHT_FORMS:  # float weights: the lowering this version wants
        return Recipe(weights, version, f"--attention {path.lowering} --dtype {weights}",
                      f"TensorRT {version} takes the {path.lowering!r} lowering")
    since, form = TRT_WEIGHT_FORMS[weights]
    if path.version < since:
        return Recipe(weights, version, None, f"kvedge's {weights} weights build as {form}, on TensorRT >= "
                                              f"{since[0]}.{since[1]}")
    return Recipe(weights, version, f"--trt-version {version} --quantize {weights} --dtype fp16",
                  f"{form} in the {path.lowering!r} lowering, TensorRT >= {since[0]}.{since[1]}")


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
