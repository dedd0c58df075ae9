"""The kvedge TensorRT plugin without TensorRT: its shape/dtype/alias rules and its ONNX node."""

from __future__ import annotations

import onnx
import pytest

from kvedge.export import trt_plugin
from kvedge.export.trt_support import check


def test_output_shapes_and_dtypes():
    q, k, kc, pos = (2, 8, 5, 64), (2, 2, 5, 64), (2, 2, 96, 64), (2, 5)
    assert trt_plugin.output_shapes(q, k, k, kc, kc, pos) == [q, kc, kc]
    assert trt_plugin.output_dtypes("float16", "float16", "float16", "float16", "float16", "int64") == \
        ["float16", "float16", "float16"]
    assert trt_plugin.ALIASES == {1: 3, 2: 4}  # present_key aliases k_cache, present_value aliases v_cache
    with pytest.raises(ValueError, match="not a multiple"):
        trt_plugin.output_shapes((2, 7, 5, 64), (2, 2, 5, 64), (2, 2, 5, 64), kc, kc, pos)
    with pytest.raises(ValueError, match="positions"):
        trt_plugin.output_shapes(q, k, k, kc, kc, (2, 4))
    with pytest.raises(ValueError, match="head_dim 320"):
        trt_plugin.output_shapes((1, 2, 1, 320), (1, 1, 1, 320), (1, 1, 1, 320), (1, 1, 8, 320), (1, 1, 8, 320), (1, 1))
    with pytest.raises(ValueError, match="share one of"):
        trt_plugin.output_dtypes("float16", "float32", "float16", "float16", "float16", "int64")


def test_trt_lowering_emits_one_plugin_node_per_layer(exported):
    out, sidecar = exported("llama-gqa4-llama3rope", "trt")
    assert "runs only inside TensorRT" in sidecar.verification["skipped"]
    model = onnx.load(str(out / "model.onnx"))
    nodes = [n for n in model.graph.node if n.op_type == trt_plugin.NAME]
    assert len(nodes) == sidecar.model.num_layers
    n = nodes[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
    assert n.domain == "kvedge" and attrs["plugin_namespace"] == b"kvedge" and attrs["plugin_version"] == b"1"
    assert attrs["scale"] == pytest.approx(sidecar.model.attn_scale) and attrs["window"] == 0
    assert len(n.input) == 6 and len(n.output) == 3
    assert "past_key.0" in n.input and "present_key.0" in n.output  # cache in, aliased cache out
    assert check(out / "model.onnx", "10.15").buildable
    rep = check(out / "model.onnx", "10.3")
    assert not rep.buildable and any("needs TensorRT >= 10.7" in f.message for f in rep.findings)
