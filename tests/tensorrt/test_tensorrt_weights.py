"""Issue 31: `kvedge export --trt-version X.Y` picks the lowering and the weight form that TensorRT builds, and
`kvedge check` passes those exports on the versions that build them and says why on the others. No TensorRT here:
the verdicts come from kvedge's reading of NVIDIA's sources, cited in kvedge/tensorrt/check.py and versions.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kvedge.cli import main
from kvedge.errors import KvedgeError
from kvedge.export import ExportOptions, export
from kvedge.tensorrt.check import check
from kvedge.tensorrt.versions import export_recipe
from tests.conftest import MAX_SEQ
from tests.gguf_files import save_hf_checkpoint, write_gguf

TARGETS = ["8.6", "10.0", "10.3", "10.13", "10.16", "11.0"]  # JetPack 5/6.0, 6.1-6.2, 7.x, and the next major


def test_the_recipe_per_version():
    assert export_recipe("10.3", "int4", {576, 1536}) == {"attention": "decomposed", "group_size": 64,
                                                          "symmetric": True, "quantize": "int4"}
    assert export_recipe("10.16", "int4", {2048, 8192})["group_size"] == 128  # Model-Optimizer's default
    assert export_recipe("10.16", None, {2048}) == {"attention": "onnx", "group_size": 128, "symmetric": True,
                                                    "requantize": "int4"}
    assert export_recipe("8.6", "int8", {2048}) == {"attention": "decomposed", "group_size": 0, "symmetric": True,
                                                    "quantize": "int8"}  # per channel: blocked INT8 never builds
    assert export_recipe("8.6", None, {2048})["requantize"] == "int8"  # no INT4 before 10.0
    assert export_recipe("10.16", "int4", {2048}, attention="trt")["attention"] == "trt"
    for args, why in [(("8.6", "int4", {2048}), "TensorRT 8.6 has no INT4 weights"),
                      (("10.3", "int4", {96}), "no INT4 block size TensorRT documents"),
                      (("10.3", None, {64}, "ort"), "no TensorRT builds"),
                      (("10.3", None, {64}, "onnx"), "needs TensorRT >= 10.15")]:
        with pytest.raises(KvedgeError, match=why):
            export_recipe(*args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama128")
    save_hf_checkpoint(path, "llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, num_hidden_layers=2, vocab_size=160)
    return path


@pytest.mark.parametrize("version", TARGETS)
def test_each_targets_export_passes_its_check(version, tiny, tmp_path):
    """--quantize int4 where the target has INT4 (10.0 on), int8 per channel on 8.6: the export verifies on ONNX
    Runtime and `kvedge check` finds nothing blocking for that version; an int4 export is refused on 8.6."""
    scheme = "int8" if version == "8.6" else "int4"
    recipe = export_recipe(version, scheme, {128, 256})
    sc = export(tiny, tmp_path / "out", ExportOptions(max_seq_len=MAX_SEQ, allow_degraded=True, **recipe))
    assert sc.verification["passed"] and sc.verification["max_abs_error"] < 1e-4
    report = check(tmp_path / "out" / "model.onnx", version)
    assert report.buildable, [f.message for f in report.findings]
    graph = onnx.load(str(tmp_path / "out" / "model.onnx"))
    dq = [n for n in graph.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 8
    if scheme == "int4":
        assert sc.opset == (21 if recipe["attention"] == "decomposed" else 24)
        assert {a.i for n in dq for a in n.attribute if a.name == "block_size"} == {128}
        refused = [f.message for f in check(tmp_path / "out" / "model.onnx", "8.6").findings if f.blocking]
        assert "blocked INT4 DequantizeLinear needs TensorRT >= 10.0 (8 nodes)" in refused
    else:
        assert sc.opset == 17 and all(len(n.input) == 3 for n in dq)  # 8.6 reads opset 17 and 3-input INT8 DQ


def _dq_graph(path, scale: np.ndarray, zero: bool):
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.ones((64, 8), np.int8), "w"), numpy_helper.from_array(scale, "s")]
    if zero:
        inits.append(numpy_helper.from_array(np.zeros(scale.shape, np.int8), "z"))
    nodes = [helper.make_node("DequantizeLinear", [t.name for t in inits], ["wf"], axis=1),
             helper.make_node("MatMul", ["x", "wf"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], initializer=inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_check_wants_positive_scales_and_8_6_wants_a_zero_point_and_float32_scales(tmp_path):
    """onnx-tensorrt onnxOpImporters.cpp QuantDequantLinearHelper (10.0 eb43908b to 10.16 6bde6596): initializer
    scales "must all be positive"; 8.6's builtin_op_importers.cpp (6ba67d34): "This version of TensorRT requires 3
    inputs for the INT8 QuantizeLinear/DequantizeLinear operator", and it reads the scale as float32
    (`static_cast<float const*>(scale.values)`)."""
    good = np.full(8, 0.01, np.float32)
    assert check(_dq_graph(tmp_path / "ok.onnx", good, zero=True), "8.6").buildable
    two = _dq_graph(tmp_path / "two.onnx", good, zero=False)
    assert check(two, "10.3").buildable and not check(two, "8.6").buildable
    assert any("requires 3 inputs" in f.message for f in check(two, "8.6").findings)
    half = _dq_graph(tmp_path / "half.onnx", good.astype(np.float16), zero=True)
    assert check(half, "10.3").buildable and any("reads scales as float32" in f.message
                                                 for f in check(half, "8.6").findings if f.blocking)
    negative = _dq_graph(tmp_path / "neg.onnx", np.where(np.arange(8) == 3, -0.01, 0.01).astype(np.float32), True)
    assert [f.message for f in check(negative, "10.3").findings if f.blocking] == [
        "INT8 DequantizeLinear with scales <= 0: TensorRT's parser takes positive scales only (1 node)"]


def test_a_gguf_files_8_bit_blocks_are_requantized_for_tensorrt(tmp_path):
    """A file whose projections hold Q8_0 and Q6_K blocks (blocked INT8: no TensorRT builds it) exports for 10.3
    with them requantized to INT4 blocks of 128 (its Q4_0 ones kept), the quality report against the file's own
    model, and passes check."""
    ckpt = tmp_path / "ckpt"
    save_hf_checkpoint(ckpt, "llama", hidden_size=256, intermediate_size=512, num_key_value_heads=2, head_dim=32,
                       num_hidden_layers=1, vocab_size=300)
    gguf = write_gguf(tmp_path / "mixed.gguf", ckpt, "Q4_0", types={"ffn_down.weight": "Q8_0", "output.weight": "Q6_K"})
    recipe = export_recipe("10.3", None, {256, 512})
    sc = export(gguf, tmp_path / "out", ExportOptions(max_seq_len=MAX_SEQ, allow_degraded=True, **recipe))
    q = sc.extra["quantization"]
    assert q["scheme"] == "int4" and q["requantized"] == {"linears": 2, "group_size": 128, "symmetric": True}
    assert "vs_unquantized" in sc.verification and sc.verification["passed"]
    report = check(tmp_path / "out" / "model.onnx", "10.3")
    assert report.buildable, [f.message for f in report.findings]
    blocks = {a.i for n in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.node
              if n.op_type == "DequantizeLinear" for a in n.attribute if a.name == "block_size"}
    assert blocks == {32, 128}  # the file's Q4_0 blocks, and the requantized ones


def test_the_cli_names_the_target_and_refuses_what_it_cannot_build(tiny, tmp_path, capsys):
    assert main(["export", str(tiny), "-o", str(tmp_path / "a"), "--trt-version", "8.6", "--quantize", "int4"]) == 2
    assert "TensorRT 8.6 has no INT4 weights" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    assert main(["export", str(tiny), "-o", str(tmp_path / "b"), "--trt-version", "10.3", "--quantize", "int4",
                 "--max-seq-len", str(MAX_SEQ), "--allow-degraded", "--quiet"]) == 0
    assert main(["check", str(tmp_path / "b" / "model.onnx"), "--trt-version", "10.3"]) == 0
