"""`trt`: one kvedge::gqa_attention plugin node per layer (kvedge.tensorrt.plugin), for TensorRT.

TensorRT's ONNX parser builds an unknown op from the plugin registry by its op type, with the
`plugin_namespace` and `plugin_version` attributes (version "1": every tensorrt.plugin creator's); the `schema`
attribute is kvedge's own version of the node, which the registered plugin checks. The graph runs only inside
TensorRT with the plugin registered: ONNX Runtime cannot run it, so export skips the ORT verification.
RoPE is the plugin's: the node takes the cos/sin tables (a [1, 0] pair for a model without RoPE) and
rotates q and k inside its kernels, so no rotation ops precede it. Quantized weights take the DequantizeLinear form
(dq_weights).
"""

from __future__ import annotations

from onnxscript import opset18 as op
from onnxscript.values import Opset

from kvedge.artifact import PLUGIN_ID, PLUGIN_NAMESPACE, PLUGIN_OP, PLUGIN_SCHEMA, PLUGIN_VERSION
from kvedge.export.lowerings import Lowering, dq_weights
from kvedge.export.lowerings._common import const
from kvedge.models.config import ModelConfig


def _register_schema() -> None:
    from onnx import defs

    if defs.has(PLUGIN_OP, PLUGIN_NAMESPACE):
        return
    P, A = defs.OpSchema.FormalParameter, defs.OpSchema.Attribute
    T = defs.OpSchema.AttrType
    defs.register_schema(defs.OpSchema(
        PLUGIN_OP, PLUGIN_NAMESPACE, 1,
        inputs=[P("q", "T"), P("k", "T"), P("v", "T"), P("k_cache", "T"), P("v_cache", "T"), P("positions", "I"),
                P("cos", "R"), P("sin", "R")],
        outputs=[P("out", "T"), P("present_key", "T"), P("present_value", "T")],
        attributes=[A("scale", T.FLOAT, "", required=True), A("window", T.INT, "", required=True),
                    A("softcap", T.FLOAT, "", required=True), A("schema", T.INT, "", required=True),
                    A("plugin_namespace", T.STRING, "", required=True),
                    A("plugin_version", T.STRING, "", required=True)],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("R", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("I", ["tensor(int64)", "tensor(int32)"], "")]))


_register_schema()
kvedge_ops = Opset(PLUGIN_NAMESPACE, 1)


def unsupported(cfg: ModelConfig) -> list[str]:
    if cfg.mla:
        return ["multi-head latent attention (MLA): the plugin's kernels take one head width for q, k and v, while "
                "attention over MLA's latent has keys of d_R + d_c and values of d_c"]
    return [] if cfg.head_dim <= 256 else [f"head_dim {cfg.head_dim} > 256"]


def translate(q, k, v, k_cache, v_cache, positions, scale: float, window: int, softcap: float, cos=None, sin=None):
    if cos is None:  # no RoPE: zero-width tables, never read by the kernels
        cos = sin = op.ConstantOfShape(const([1, 0]))
    return getattr(kvedge_ops, PLUGIN_OP)(
        q, k, v, k_cache, v_cache, positions, cos, sin, scale=scale, window=window, softcap=softcap,
        schema=PLUGIN_SCHEMA, plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION)


LOWERING = Lowering("trt", 17, "kvedge's fused-attention TensorRT plugin; TensorRT >= 10.6 only", translate,
                    unsupported=unsupported, translate_qlinear=dq_weights.translate_qlinear,
                    finalize=dq_weights.finalize, unsupported_affine=dq_weights.no_refusals,
                    weights_opset=dq_weights.min_opset, runs_on_onnxruntime=False, plugins=(PLUGIN_ID,))
