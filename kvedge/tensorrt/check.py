"""`kvedge check`: will TensorRT X.Y's ONNX parser build this graph? A pre-flight with no TensorRT.

The table below is kvedge's reading of the ONNX-TensorRT operator support documents
(onnx-tensorrt `docs/operators.md` at each release tag) and the TensorRT release notes, restricted
to the operators decoder graphs use. An operator missing from the table is reported as unsupported
("not in kvedge's table"), on purpose: the check errs toward saying no.

Per version: the newest ONNX opset the parser reads, operators added after 8.6 (with the release
that added them), and data types. Custom-domain nodes (com.microsoft.*, kvedge.*) are plugins: they
need a plugin library loaded at build time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvedge.dtypes import ONNX_ENUM
from kvedge.errors import KvedgeError
from kvedge.tensorrt import plugin as trt_plugin
from kvedge.tensorrt.versions import parse_version

# The newest opset each parser reads. 10.0-10.8: docs/operators.md says "opset 9 to opset 20", but the parser has no
# upper bound (onnx-tensorrt ModelImporter.cpp importModel warns only below opset 7, at the 10.0 commit eb43908b and
# the 10.16 one 6bde6596) and links ONNX v1.16.0 (third_party/onnx 990217f0 at 10.0 and 10.1), whose newest opset
# is 21: the opset of DequantizeLinear's block_size and INT4, which the 10.0 parser imports (docs/operators.md 10.0:
# "DequantizeLinear | Y | INT8, FP8, INT4").
MAX_OPSET = {(8, 6): 17, (9, 0): 19, (10, 0): 21, (10, 9): 22, (10, 13): 24, (11, 0): 24}

# Operators the 8.6 parser supports (subset relevant to decoder graphs).
BASE_OPS = {
    "Abs", "Add", "And", "ArgMax", "Cast", "Ceil", "Clip", "Concat", "Constant", "ConstantOfShape", "Cos", "CumSum",
    "Div", "Einsum", "Equal", "Erf", "Exp", "Expand", "Flatten", "Floor", "Gather", "GatherElements", "GatherND",
    "Gemm", "Greater", "GreaterOrEqual", "Identity", "LayerNormalization", "Less", "LessOrEqual", "Log", "MatMul",
    "Max", "Min", "Mod", "Mul", "Neg", "Not", "Or", "Pad", "Pow", "Range", "Reciprocal", "ReduceL2", "ReduceMax",
    "ReduceMean", "ReduceMin", "ReduceSum", "Relu", "Reshape", "ScatterElements", "ScatterND", "Shape", "Sigmoid",
    "Sign", "Sin", "Slice", "Softmax", "Split", "Sqrt", "Squeeze", "Sub", "Tanh", "Tile", "TopK", "Transpose",
    "Trilu", "Unsqueeze", "Where", "Xor", "DequantizeLinear", "QuantizeLinear",
    "GroupNormalization",  # onnx-tensorrt docs/Changelog.md, 8.6 EA: "Added support for GroupNormalization"
}
# Operators added later: op -> first TensorRT release whose parser maps it.
# Attention, TensorScatter, RotaryEmbedding, RMSNormalization: NVIDIA/TensorRT CHANGELOG.md "Parser changes" of
# 10.14 GA ("Added support for the `Attention` operator") and 10.15 GA (the other three).
LATER_OPS = {
    "Gelu": (10, 0),
    "Attention": (10, 14),  # to the fused attention layer
    "TensorScatter": (10, 15),  # to IKVCacheUpdateLayer (in-place cache write)
    "RotaryEmbedding": (10, 15),  # to IRotaryEmbeddingLayer
    "RMSNormalization": (10, 15),
}
# What the parser rejects on these ops, whatever wrote the graph (onnx-tensorrt docs/operators.md, 10.15):
# Attention: "`past_key`, `past_value` and `nonpad_kv_seqlen` inputs are unsupported. `present_key`, `present_value`
# and `qk_matmul_output` outputs are unsupported. `qk_matmul_output_mode` and `softcap` attributes are unsupported."
# TensorScatter: "`past_cache` and `update` must be 4D. `axis` must be -2."
ATTENTION_INPUTS_REFUSED = {4: "past_key", 5: "past_value", 6: "nonpad_kv_seqlen"}
ATTENTION_OUTPUTS_REFUSED = {1: "present_key", 2: "present_value", 3: "qk_matmul_output"}
ATTENTION_ATTRS_REFUSED = ("qk_matmul_output_mode", "softcap")
# ONNX tensor dtypes: first TensorRT release that builds with them.
DTYPE_SINCE = {1: (8, 6), 10: (8, 6), 6: (8, 6), 7: (8, 6), 9: (8, 6), 2: (8, 6), 3: (8, 6),
               16: (9, 0), 17: (9, 0), 22: (10, 0)}  # float, fp16, int32, int64, bool, uint8, int8, bf16, fp8, int4
PLUGINS = {  # custom-domain op -> what provides it (which lowering to take instead depends on the weights it must
    # carry: kvedge.tensorrt.recipe, which `kvedge check` prints last)
    ("com.microsoft", "GroupQueryAttention"): "ONNX Runtime's contrib op: no TensorRT implementation",
    ("com.microsoft", "MatMulNBits"): "ONNX Runtime's contrib op (weight-only INT4/INT8): no TensorRT "
                                      "implementation",
}


# Weight-only quantized forms TensorRT builds: DequantizeLinear(x, scale[, zero point]) -> MatMul, by the type of
# x. Sources: onnx-tensorrt docs/operators.md (10.15: "DequantizeLinear | INT8, FP8, FP4, INT4 | `x_zero_point`
# must be zero"; "UINT8 is only supported as network input or output tensor types"; no UINT4); TensorRT docs
# "Working with Quantized Types" (symmetric only; INT8 signed; INT4 signed, weight-only), "Quantization Schemes"
# (INT4: per-block scales, block sizes {64, 128}, blocked along one of the last two axes), the IDequantizeLayer
# reference (zeroPt must be all zeros); TensorRT 10.0 release notes (parser: "Added support for INT4 quantization",
# INT4 weight-only with block quantization); TensorRT Model Optimizer support matrix (W4A16 block-wise INT4: Ampere
# and later; FP8: Ada and later). Blocked forms: NVIDIA/TensorRT include/NvInfer.h, IDequantizeLayer: "Block
# dequantization is supported only for input tensors with DataType::kINT4" (release/10.0 to 10.12), "supported for
# input types DataType::kFP4, DataType::kFP8 and DataType::kINT4" (release/10.13 to 11.1): blocked INT8 never
# ("blocked_since": None). GPUs: Jetson Orin is Ampere (sm_87), Thor is Blackwell. The parser itself
# (onnx-tensorrt onnxOpImporters.cpp QuantDequantLinearHelper at the 10.0 eb43908b, 10.13 346bdcae and 10.16 6bde6596
# commits): blocking is inferred from a scale of the input's rank, one blocked dimension, any block size; initializer
# scales "must all be positive"; a zero point, if given, all zeros. 8.6's (builtin_op_importers.cpp at 6ba67d34):
# "This version of TensorRT requires 3 inputs for the INT8 QuantizeLinear/DequantizeLinear operator", and it reads
# the scale as float32 (`static_cast<float const*>(scale.values)`).
QUANT_FORMS = {  # x dtype (ONNX) -> what TensorRT needs
    3: {"name": "INT8", "since": (8, 6), "blocked_since": None, "block_sizes": None, "gpus": "Turing and later"},
    22: {"name": "INT4", "since": (10, 0), "blocked_since": (10, 0), "block_sizes": (64, 128),
         "gpus": "Ampere and later (Jetson Orin, Thor)"},
    17: {"name": "FP8", "since": (9, 0), "blocked_since": (10, 13), "block_sizes": None,
         "gpus": "Ada, Hopper, Blackwell (Thor); not Ampere (Orin)"},
}
UNSIGNED = {2: "UINT8", 21: "UINT4"}  # no TensorRT quantized type; kvedge's asymmetric quantizer stores these


@dataclass
class Finding:
    kind: str  # "opset" | "op" | "attribute" | "dtype" | "plugin" | "shape" | "quantization"
    message: str
    blocking: bool = True


@dataclass
class CheckReport:
    version: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def buildable(self) -> bool:
        return not any(f.blocking for f in self.findings)


def _version_key(v: tuple[int, int], table: dict) -> int:
    best = None
    for k in sorted(table):
        if k <= v:
            best = table[k]
    if best is None:
        raise KvedgeError(f"TensorRT {v[0]}.{v[1]} is older than kvedge's support table (8.6)")
    return best


def check(model_path: str | Path, trt_version: str,
          dynamic_axes: tuple[str, ...] = ("batch", "seq", "logits")) -> CheckReport:
    import onnx

    v = parse_version(trt_version)
    model = onnx.load(str(model_path), load_external_data=False)
    rep = CheckReport(trt_version)
    inputs = {vi.name: vi for vi in model.graph.input}
    elem_types = {name: vi.type.tensor_type.elem_type for name, vi in inputs.items()}
    max_opset = _version_key(v, MAX_OPSET)
    opset = next((i.version for i in model.opset_import if i.domain in ("", "ai.onnx")), None)
    if opset is not None and opset > max_opset:
        rep.findings.append(Finding("opset", f"graph opset {opset} is newer than TensorRT {trt_version}'s parser "
                                             f"reads (<= {max_opset})"))  # the way out: kvedge.tensorrt.recipe
    seen: set[tuple[str, str]] = set()
    for node in model.graph.node:
        key = (node.domain or "", node.op_type)
        if key == (trt_plugin.NAMESPACE, trt_plugin.NAME):
            if key not in seen:
                rep.findings += _plugin_findings(node, elem_types, trt_version)
        elif key[0] not in ("", "ai.onnx"):
            if key not in seen:
                why = PLUGINS.get(key, "a custom op: needs its TensorRT plugin library loaded at build time")
                rep.findings.append(Finding("plugin", f"{key[0]}::{key[1]} is a plugin node: {why}"))
        elif node.op_type in LATER_OPS and v < LATER_OPS[node.op_type]:
            if key not in seen:
                since = LATER_OPS[node.op_type]
                rep.findings.append(Finding("op", f"{node.op_type} needs TensorRT >= {since[0]}.{since[1]} "
                                                  f"(node {node.name!r})"))
        elif node.op_type not in BASE_OPS and node.op_type not in LATER_OPS:
            if key not in seen:
                rep.findings.append(Finding("op", f"{node.op_type} is not in kvedge's TensorRT support table "
                                                  f"(node {node.name!r}); treated as unsupported"))
        if key == ("", "Attention"):
            refused = [f"input {name}" for i, name in ATTENTION_INPUTS_REFUSED.items()
                       if len(node.input) > i and node.input[i]]
            refused += [f"output {name}" for i, name in ATTENTION_OUTPUTS_REFUSED.items()
                        if len(node.output) > i and node.output[i]]
            refused += [f"attribute {a.name}" for a in node.attribute if a.name in ATTENTION_ATTRS_REFUSED
                        and onnx.helper.get_attribute_value(a)]
            if refused:
                rep.findings.append(Finding("attribute", f"Attention node {node.name!r} has {', '.join(refused)}, "
                                                         "which TensorRT's parser does not support"))
        if key == ("", "TensorScatter"):
            axis = next((a.i for a in node.attribute if a.name == "axis"), -2)
            ranks = [len(inputs[x].type.tensor_type.shape.dim) for x in node.input[:2] if x in inputs]
            if axis != -2 or any(r != 4 for r in ranks):
                rep.findings.append(Finding("attribute", f"TensorScatter node {node.name!r} has axis {axis} and "
                                            f"ranks {ranks}: TensorRT's parser takes 4-D tensors and axis -2 only"))
        seen.add(key)
    rep.findings += quantization_findings(model, v)
    dtypes = {t.data_type for t in model.graph.initializer}
    dtypes |= {vi.type.tensor_type.elem_type for vi in list(model.graph.input) + list(model.graph.output)}
    for dt in sorted(dtypes - {0}):
        since = DTYPE_SINCE.get(dt)
        name = ONNX_ENUM.get(dt, f"onnx dtype {dt}")
        if since is None:
            rep.findings.append(Finding("dtype", f"{name} tensors are not supported by TensorRT"))
        elif v < since:
            rep.findings.append(Finding("dtype", f"{name} needs TensorRT >= {since[0]}.{since[1]}"))
        elif dt == 7 and v < (10, 0):
            rep.findings.append(Finding("dtype", "int64 tensors are cast down to int32 by TensorRT 8.x's parser "
                                                 "(positions and ids fit)", blocking=False))
    for vi in model.graph.input:
        for i, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.dim_param and d.dim_param not in dynamic_axes:
                rep.findings.append(Finding("shape", f"input {vi.name!r} axis {i} is dynamic ({d.dim_param!r}) but "
                                                     f"the planned profiles only cover {', '.join(dynamic_axes)}"))
            elif not d.dim_param and not d.HasField("dim_value"):
                rep.findings.append(Finding("shape", f"input {vi.name!r} axis {i} has no size and no name"))
    return rep


def _plugin_findings(node, elem_types: dict[str, int], trt_version: str) -> list[Finding]:
    """kvedge's own plugin node: whether TensorRT `trt_version` runs it and how, and whether its parser will find the
    registered creator: it looks one up by (op type, plugin_version, plugin_namespace), plugin_version "1" when the
    node has none (onnx-tensorrt FallbackPluginImporter), and a tensorrt.plugin creator is always version "1"."""
    import onnx

    name = f"{trt_plugin.NAMESPACE}::{trt_plugin.NAME}"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    dtype = ONNX_ENUM.get(elem_types.get(node.input[3] if len(node.input) > 3 else ""), "")  # k_cache, a graph input
    refused = trt_plugin.refusals(trt_version, dtype)
    if refused:
        out = [Finding("plugin", f"{name} is kvedge's fused-attention plugin: it {refused[0]}")]
    else:
        aot = trt_plugin.AOT_TENSORRT
        how = ("ahead of time: its Triton kernel compiled to PTX and embedded in the engine"
               if trt_plugin.implementation(trt_version) == "aot" else
               f"just in time: Python launches its kernels at run time (ahead of time needs TensorRT >= "
               f"{aot[0]}.{aot[1]})")
        out = [Finding("plugin", f"{name} is kvedge's fused-attention plugin: registered by `kvedge build` "
                                 f"(kvedge.tensorrt.plugin.register()), {how}", blocking=False)]
    version = attrs.get("plugin_version", b"1").decode()
    if version != trt_plugin.VERSION:
        out.append(Finding("plugin", f"{name} node {node.name!r} has plugin_version {version!r}: TensorRT looks the "
                                     f"plugin up as version {trt_plugin.VERSION!r} and would not find it; re-export "
                                     "with --attention trt"))
    elif attrs.get("schema") != trt_plugin.SCHEMA:
        out.append(Finding("plugin", f"{name} node {node.name!r} is schema {attrs.get('schema')}; this kvedge's "
                                     f"plugin is schema {trt_plugin.SCHEMA}: re-export with --attention trt"))
    return out


def quantization_findings(model, v: tuple[int, int]) -> list[Finding]:
    """Weight-only DequantizeLinear nodes (an initializer dequantized) against QUANT_FORMS: one finding per
    distinct problem, with its node count, and a note naming the GPUs each form builds for."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    problems: dict[str, int] = {}
    cautions: dict[str, int] = {}
    used: set[int] = set()
    for node in model.graph.node:
        x = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" and node.input else None
        if x is None or node.domain not in ("", "ai.onnx"):
            continue
        block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
        form = QUANT_FORMS.get(x.data_type)
        zero = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        scale = inits.get(node.input[1]) if len(node.input) > 1 else None
        if x.data_type in UNSIGNED:
            msg = (f"DequantizeLinear of {UNSIGNED[x.data_type]} weights with zero points (kvedge's asymmetric "
                   "quantization): TensorRT's quantized weights are signed INT8 / INT4 with zero points all zero "
                   "(symmetric only), so no TensorRT builds this graph: export with --symmetric, or run it on "
                   "ONNX Runtime")
        elif form is None:
            msg = f"DequantizeLinear of {ONNX_ENUM.get(x.data_type, x.data_type)} weights: not a TensorRT " \
                  "quantized type"
        elif block and form["blocked_since"] is None:
            msg = (f"blocked {form['name']} DequantizeLinear: TensorRT's block dequantization takes FP4, FP8 and INT4 "
                   "only, in no release (export --quantize int4, blocks of 64 or 128)")
        elif v < (since := form["blocked_since"] if block else form["since"]):
            msg = (f"{'blocked ' if block else ''}{form['name']} DequantizeLinear needs TensorRT >= "
                   f"{since[0]}.{since[1]}")
        elif scale is None:
            msg = (f"{form['name']} DequantizeLinear whose scale is not an initializer: TensorRT needs weight scales "
                   "to be build-time constants")
        elif scale.data_location != TensorProto.EXTERNAL and not (numpy_helper.to_array(scale) > 0).all():
            msg = f"{form['name']} DequantizeLinear with scales <= 0: TensorRT's parser takes positive scales only"
        elif zero is not None and zero.data_location != TensorProto.EXTERNAL and numpy_helper.to_array(zero).any():
            msg = f"{form['name']} DequantizeLinear with non-zero zero points: TensorRT is symmetric only"
        elif v < (9, 0) and zero is None:
            msg = ("INT8 DequantizeLinear without a zero-point input: TensorRT 8.6's parser requires 3 inputs "
                   "(an all-zero zero point)")
        elif v < (9, 0) and scale.data_type != TensorProto.FLOAT:
            msg = ("DequantizeLinear with float16 / bfloat16 scales: TensorRT 8.6's parser reads scales as float32; "
                   "export --dtype fp32 and build with --precision fp16")
        else:
            used.add(x.data_type)
            if block and form["block_sizes"] and block not in form["block_sizes"]:
                msg = (f"{form['name']} block size {block}: outside the sizes NVIDIA documents "
                       f"({' or '.join(map(str, form['block_sizes']))}); the parser and NvInfer.h put no limit on it, "
                       "but no kvedge engine build has proven it (a GGUF file's own blocks, kept exact; a documented size "
                       "needs requantizing, e.g. --quantize int4 --group-size 128 from a float checkpoint)")
                cautions[msg] = cautions.get(msg, 0) + 1
            continue
        problems[msg] = problems.get(msg, 0) + 1
    out = [Finding("quantization", f"{msg} ({n} node{'s' if n > 1 else ''})") for msg, n in problems.items()]
    out += [Finding("quantization", f"{msg} ({n} node{'s' if n > 1 else ''})", blocking=False)
            for msg, n in cautions.items()]
    out += [Finding("quantization", f"{QUANT_FORMS[dt]['name']} weight-only layers build for "
                                    f"{QUANT_FORMS[dt]['gpus']} GPUs", blocking=False) for dt in sorted(used)]
    if 3 in used:  # TensorRT docs, Working with Quantized Types (10.11, 11.0)
        out.append(Finding("quantization", "INT8 weights without quantized activations: TensorRT's weight-only "
                                           "quantization is INT4 only, so the engine may hold them as float",
                           blocking=False))
    return out
