"""The DequantizeLinear weight form (kvedge.export.lowerings.dq_weights): every block kvedge holds, written as signed
INT4 / INT8 DequantizeLinear -> MatMul plus a per-block offset term, equals gguf's own dequantizer (for GGUF blocks)
and kvedge's (for its own), and the exported graphs keep to TensorRT's constraints on the form, each checked below
against the source that states it."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kvedge.export import ExportOptions, export
from kvedge.export.lowerings.dq_weights import signed_form
from kvedge.models.gguf import QUANT_TYPES, unpack_blocks
from kvedge.models.quant import pack, quantize
from tests.conftest import MAX_SEQ
from tests.gguf_files import K_QUANTS, random_kquant_blocks, save_hf_checkpoint, write_gguf


def _dq_reference(w, scale, offset, group: int) -> np.ndarray:
    """onnx.reference's DequantizeLinear (blocked along axis 0) of the form's initializers, plus the offsets
    repeated over each block: the weights [K, N] the graph multiplies by."""
    from onnx.reference import ReferenceEvaluator

    k, n = w.shape
    signed = TensorProto.INT4 if w.min() >= -8 and w.max() <= 7 and group else TensorProto.INT8
    tensors = [numpy_helper.from_array(w.astype(ml_dtypes.int4 if signed == TensorProto.INT4 else np.int8), "q"),
               numpy_helper.from_array(scale, "s")]
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=0, block_size=group)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [k, n])],
                              initializer=tensors)
    got = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])).run(None, {})[0]
    return got + (0 if offset is None else np.repeat(offset, group, axis=0))


def _gguf_blocks(kind: str, rows: int, k: int, rng) -> np.ndarray:
    import gguf

    if kind in K_QUANTS:
        return random_kquant_blocks(kind, rows * k // 256, rng)
    data = rng.standard_normal((rows, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType[kind]).reshape(rows * k // 32, -1)


@pytest.mark.parametrize("kind", list(QUANT_TYPES))
def test_every_gguf_block_equals_ggufs_dequantizer(kind):
    """Q4_0 / Q4_1 / Q4_K (4 bits) and the others (in 8 bits) through the form: W * scale + offset per block equals
    gguf.quants.dequantize of the same bytes, to float32 rounding of the offset; scales are positive and the
    integers signed. Q4_0 holds negative scales (llama.cpp divides its largest-magnitude value by -8): the
    test checks that some are, so the sign flip is exercised."""
    import gguf

    rows, k = 6, 512
    blocks = _gguf_blocks(kind, rows, k, np.random.default_rng(0))
    want = gguf.quants.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType[kind])  # [rows, k]
    bits, group, affine, zero = QUANT_TYPES[kind]
    q, s, m = unpack_blocks(kind, blocks)
    q, s = torch.from_numpy(q.reshape(rows, k // group, group)), torch.from_numpy(s.reshape(rows, k // group))
    zeros = torch.empty((rows, 0), dtype=torch.uint8) if affine else torch.full(s.shape, zero, dtype=torch.uint8)
    qweight, scales, zeros = pack(q, s, zeros, bits)
    w, scale, offset = signed_form(qweight.numpy(), scales.numpy(), zeros.numpy(),
                                   None if m is None else m.reshape(-1), bits, k)
    if kind == "Q4_0":
        assert (s < 0).any()
    assert w.shape == (k, rows) and scale.shape == (k // group, rows) and (scale > 0).all()
    assert w.min() >= -(2 ** (bits - 1)) and w.max() < 2 ** (bits - 1)
    got = _dq_reference(w, scale, offset, group)
    np.testing.assert_allclose(got.T, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, False), (8, True)])
def test_kvedges_own_blocks_equal_its_dequantizer(bits, symmetric):
    """kvedge's round-to-nearest blocks: asymmetric ones (zero points) carry an offset, symmetric ones none."""
    from kvedge.models.quant import dequantize

    wf = torch.randn(24, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    q, s, z = quantize(wf, bits, 64, symmetric)
    w, scale, offset = signed_form(q.numpy(), s.numpy(), z.numpy(), None, bits, 256)
    assert (offset is None) == symmetric and (scale > 0).all()
    np.testing.assert_allclose(_dq_reference(w, scale, offset, 64).T, dequantize(q, s, z, bits, 256).numpy(),
                               rtol=0, atol=1e-6)


# -- exported graphs ------------------------------------------------------------------------------------------

def tensorrt_weight_form(graph_path, max_opset: int = 21) -> list:
    """Assert the constraints TensorRT puts on weight-only DequantizeLinear, each from its source; returns the
    DequantizeLinear nodes.
    - opset <= 21: the ONNX onnx-tensorrt bundles from 10.0 (third_party/onnx v1.16.0 at the 10.0 and 10.1
      commits) reads opset 21 at most, and its ModelImporter.cpp has no upper opset bound;
    - the quantized input a 2-D INT4 (or INT8) initializer, no zero-point input (onnx-tensorrt docs/operators.md
      10.0 and 10.16: "`x_zero_point` must be zero"; NVIDIA/TensorRT include/NvInfer.h release/10.3,
      IDequantizeLayer: "Block dequantization is supported only for 2-D input tensors with DataType::kINT4 that
      are rooted at an IConstantLayer (i.e. weights)");
    - the scale constant, positive ("All scale coefficients must have positive values", same header), of the
      weight's rank when blocked, blocks along one axis ("a 2-D RS weights input with R (dimension 0) as the
      blocking axis and B as the block size. The scale is a 2-D array of coefficients, with dimensions (R//B, S)");
    - each DequantizeLinear feeds a MatMul directly (NVIDIA/Model-Optimizer modelopt/onnx/quantization/int4.py:
      weights "plugged into the RHS (i.e. y = x @ W)", blocked over dimension 0);
    - no float initializer (but the embedding) of a dequantized weight's shape: the graph holds the integers only;
    - in bytes: each INT4 weight is two values a byte (ONNX's packing, onnx/docs/IR.md "4 bit integer types"), INT8
      one, and every float byte outside the embedding, the scales and the offsets is less than the smallest
      linear would take as float32 (norms, tables): a float copy of any weight, of any shape, would not fit."""
    model = onnx.load(str(graph_path))
    graph = model.graph
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset <= max_opset
    inits = {t.name: t for t in graph.initializer}
    readers = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.op_type)
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    assert dq
    shapes = set()
    for node in dq:
        w, s = inits[node.input[0]], inits[node.input[1]]
        # INT8 per channel carries an all-zero zero point: 8.6's parser requires 3 inputs (builtin_op_importers.cpp)
        assert len(node.input) == 2 or (w.data_type == TensorProto.INT8 and len(node.input) == 3
                                        and not numpy_helper.to_array(inits[node.input[2]]).any())
        assert w.data_type in (TensorProto.INT4, TensorProto.INT8) and len(w.dims) == 2
        scale = numpy_helper.to_array(s)
        assert (scale > 0).all()
        attrs = {a.name: a.i for a in node.attribute}
        if "block_size" in attrs:
            assert attrs["axis"] == 0 and len(s.dims) == 2 and s.dims[0] * attrs["block_size"] == w.dims[0]
        else:
            assert w.data_type == TensorProto.INT8 and attrs["axis"] == 1 and list(s.dims) == [w.dims[1]]
        assert readers[node.output[0]] == ["MatMul"]
        shapes |= {tuple(w.dims), tuple(w.dims)[::-1]}
        numel = int(np.prod(w.dims))
        assert len(w.raw_data) == ((numel + 1) // 2 if w.data_type == TensorProto.INT4 else numel), node.name
        assert len(s.dims) == 1 or s.dims[1] == w.dims[1]  # (R // B, S)
    embedding = {n.input[0] for n in graph.node if n.op_type == "Gather"}  # its own tensor, looked up by token
    floats = {tuple(t.dims) for t in graph.initializer
              if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16) and t.name not in embedding}
    assert not floats & shapes
    quant = {i for n in dq for i in n.input}
    offsets = {i for n in graph.node if n.op_type == "ReduceSum" for i in n.input}  # the offset term's constants
    other = sum(len(numpy_helper.to_array(t).tobytes()) for t in graph.initializer
                if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
                and t.name not in quant | embedding | offsets)
    smallest = min(int(np.prod(inits[n.input[0]].dims)) for n in dq) * 4
    assert other < smallest, (other, smallest)
    return dq


@pytest.fixture(scope="module")
def llama256(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama256")
    save_hf_checkpoint(path, "llama", hidden_size=256, intermediate_size=512, num_key_value_heads=2, head_dim=32,
                       num_hidden_layers=2, vocab_size=320)  # no weight of the embedding's shape
    return path


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_files_export_their_own_blocks_as_int4(kind, llama256, tmp_path):
    """A tiny GGUF file of each 4-bit type exports to the decomposed lowering (TensorRT 8.6-10.14's attention) with
    the file's integers as INT4 DequantizeLinear weights, and verifies on ONNX Runtime against the PyTorch model
    of the file's own weights."""
    gguf_path = write_gguf(tmp_path / f"{kind}.gguf", llama256, kind)
    sc = export(gguf_path, tmp_path / "out", ExportOptions(attention="decomposed", max_seq_len=MAX_SEQ))
    assert sc.verification["passed"] and sc.verification["max_abs_error"] < 1e-4, sc.verification
    assert sc.opset == 21
    dq = tensorrt_weight_form(tmp_path / "out" / "model.onnx")
    assert len(dq) == 4 * 2 + 1  # qkv, o, up, down in both layers, and the file's output.weight
    offsets = sum(n.op_type == "ReduceSum" for n in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.node)
    assert offsets > 0  # Q4_0's negative scales and the affine types' mins need the offset term
    from kvedge.tensorrt.check import check

    verdicts = {v: check(tmp_path / "out" / "model.onnx", v).buildable
                for v in ("8.6", "10.0", "10.3", "10.13", "10.16", "11.0")}
    assert verdicts == {"8.6": False, "10.0": True, "10.3": True, "10.13": True, "10.16": True, "11.0": True}


@pytest.mark.parametrize("lowering,symmetric,dtype", [("decomposed", True, "fp32"), ("decomposed", False, "fp32"),
                                                      ("onnx", True, "fp32"), ("onnx", False, "fp32"),
                                                      ("decomposed", False, "fp16")])
def test_kvedge_int4_exports_in_the_form(lowering, symmetric, dtype, llama256, tmp_path):
    """kvedge's own int4 blocks; asymmetric ones carry the offset term, in float32 under a float16 graph too."""
    sc = export(llama256, tmp_path / "out", ExportOptions(attention=lowering, max_seq_len=MAX_SEQ, quantize="int4",
                                                          group_size=64, symmetric=symmetric, allow_degraded=True,
                                                          dtype=dtype, quantize_lm_head=True))  # every linear INT4
    assert sc.verification["passed"], sc.verification
    assert dtype == "fp16" or sc.verification["max_abs_error"] < 1e-4, sc.verification
    dq = tensorrt_weight_form(tmp_path / "out" / "model.onnx", max_opset=21 if lowering == "decomposed" else 24)
    assert all(a.i == 64 for n in dq for a in n.attribute if a.name == "block_size")
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    assert any(n.op_type == "ReduceSum" for n in graph.node) != symmetric  # the offset term only where needed


def test_a_tied_head_reads_the_embeddings_one_float_table(tmp_path):
    """A tied GGUF file (no output.weight), exported for TensorRT 10.3 from the command line: every linear but the
    head is INT4, and the embedding and the head read one float table, never two. Why not INT4 there: TensorRT
    dequantizes INT4 blocks only for "2-D input tensors with DataType::kINT4 that are rooted at an IConstantLayer
    (i.e. weights)" (NVIDIA/TensorRT include/NvInfer.h, release/10.3, IDequantizeLayer), so the embedding's Gather
    reads float rows, and an INT4 head beside that table would add bytes; NVIDIA's own INT4 preset leaves the lm_head
    unquantized too (NVIDIA/Model-Optimizer modelopt_recipes/configs/ptq/presets/model/int4_awq.yaml imports
    units/default_disabled_quantizers.yaml: '*lm_head*' enable: false). `kvedge parity` passes on the export."""
    import json

    from kvedge.cli import main
    from kvedge.tensorrt.check import check

    hf = tmp_path / "hf"
    save_hf_checkpoint(hf, "llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, num_hidden_layers=2, vocab_size=160, tie_word_embeddings=True)
    gguf_path = write_gguf(tmp_path / "tied.gguf", hf, "Q4_1")
    out = tmp_path / "out"
    assert main(["export", str(gguf_path), "-o", str(out), "--trt-version", "10.3", "--max-seq-len", str(MAX_SEQ),
                 "--quiet"]) == 0
    graph = onnx.load(str(out / "model.onnx")).graph
    dq = tensorrt_weight_form(out / "model.onnx")
    assert len(dq) == 4 * 2  # qkv, o, up, down in both layers: the head is not among them
    tables = [t for t in graph.initializer if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)
              and sorted(t.dims) == [128, 160]]
    assert len(tables) == 1, [t.name for t in tables]
    readers = {n.op_type: n for n in graph.node if tables[0].name in n.input}
    assert sorted(readers) == ["Gather", "Transpose"]
    head = [n for n in graph.node if readers["Transpose"].output[0] in n.input]
    assert [n.op_type for n in head] == ["MatMul"]
    assert check(out / "model.onnx", "10.3").buildable
    assert main(["parity", str(out), "--steps", "8", "-o", str(tmp_path / "parity"), "--quiet"]) == 0
    report = json.loads((tmp_path / "parity" / "parity-onnxruntime.json").read_text())
    assert report["passed"] and report["greedy_agree"], report
