"""Weight-only quantization: round-trip bounds, and the MatMulNBits / DequantizeLinear layouts checked
against ONNX Runtime's kernel and onnx.reference (independent of kvedge's own dequantizer)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kvedge.errors import KvedgeError
from kvedge.export import ExportOptions, export
from kvedge.models.quant import dequantize, quantize

W = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_round_trip_error_is_at_most_half_a_step(bits, group):
    q, s, z = quantize(W, bits, group)
    back = dequantize(q, s, z, bits, W.shape[1])
    step = s.reshape(48, -1).repeat_interleave(group, dim=1)
    assert torch.all((back - W).abs() <= step / 2 + 1e-6)
    assert q.shape == (48, 128 // group, group * bits // 8) and q.dtype == torch.uint8


@pytest.mark.parametrize("symmetric", [False, True])
def test_scales_are_float16_values_rounded_up(symmetric):
    """Every scale is exactly a float16 (runtimes may store 16 bits), the least one >= the exact range / steps."""
    for bits in (4, 8):
        _, s, _ = quantize(W, bits, 32, symmetric=symmetric)
        wg = W.reshape(48, -1, 32)
        exact = (wg.abs().amax(-1) / (2 ** (bits - 1) - 1) if symmetric else
                 (wg.amax(-1).clamp(min=0) - wg.amin(-1).clamp(max=0)) / (2**bits - 1)).reshape(-1)
        assert torch.equal(s.half().float(), s)
        below = torch.nextafter(s.half(), torch.tensor(float("-inf"), dtype=torch.float16)).float()
        assert torch.all(s >= exact) and torch.all(below < exact)  # the least float16 >= exact


def test_bad_group():
    with pytest.raises(KvedgeError, match="not a multiple of the group size 48"):
        quantize(W, 4, 48)


def onnxruntime_matmulnbits(x: np.ndarray, q, s, z, bits: int, group: int) -> np.ndarray:
    """x [M, K] through ONNX Runtime's MatMulNBits kernel over stored (qweight, scales, zeros)."""
    (m, k), n = x.shape, q.shape[0]
    node = helper.make_node("MatMulNBits", ["x", "B", "scales", "zp"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=group)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
                              initializer=[numpy_helper.from_array(q.numpy(), "B"),
                                           numpy_helper.from_array(s.numpy(), "scales"),
                                           numpy_helper.from_array(z.numpy(), "zp")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("bits", [4, 8])
def test_layout_matches_onnxruntime_matmulnbits(bits):
    q, s, z = quantize(W, bits, 32)
    x = np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32)
    ref = x @ dequantize(q, s, z, bits, 128).numpy().T
    np.testing.assert_allclose(onnxruntime_matmulnbits(x, q, s, z, bits, 32), ref, atol=1e-4)


@pytest.mark.parametrize("lowering,scheme,op", [("ort", "int4", "MatMulNBits"), ("ort", "int8", "MatMulNBits"),
                                                ("onnx", "int8", "DequantizeLinear"),
                                                ("onnx", "int4", "DequantizeLinear")])
def test_quantized_export_agrees_with_the_quantized_reference(lowering, scheme, op, hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("llama-gqa4-llama3rope")
    sc = export(path, tmp_path / "q", ExportOptions(attention=lowering, quantize=scheme, max_seq_len=96,
                                                    verify_steps=64, allow_degraded=True))
    v = sc.verification
    assert v["passed"] and v["max_abs_error"] < 1e-4  # the ONNX graph vs kvedge's quantized PyTorch model
    vs_fp = v["vs_unquantized"]  # against the unquantized model, 65 teacher-forced steps
    if scheme == "int8":  # measured 95% top-1, cosine 0.9998
        assert vs_fp["top1_agreement"] >= 0.95 and vs_fp["min_cosine"] > 0.999
    else:  # int4 RTN on random weights: measured 71% top-1, cosine 0.91 (below the 85% export threshold)
        assert vs_fp["min_cosine"] > 0.85
    graph = onnx.load(str(tmp_path / "q" / "model.onnx"))
    assert sum(n.op_type == op for n in graph.graph.node) == 4 * sc.model.num_layers
    assert sc.extra["quantization"]["bits"] == (4 if scheme == "int4" else 8)
    if lowering == "onnx":  # the saved graph holds the integers and the DequantizeLinear, not folded floats
        inits = {t.name: t for t in graph.graph.initializer}
        consumers = {i: n.op_type for n in graph.graph.node for i in n.input}
        stored = TensorProto.INT4 if scheme == "int4" else TensorProto.INT8  # signed, no zero point
        for node in (n for n in graph.graph.node if n.op_type == "DequantizeLinear"):
            w = inits[node.input[0]]
            assert w.data_type == stored and len(node.input) == 2
            assert consumers[node.output[0]] == "MatMul" and {a.name: a.i for a in node.attribute}["axis"] == 0
        weight_shapes = {tuple(inits[n.input[0]].dims) for n in graph.graph.node if n.op_type == "DequantizeLinear"}
        float_shapes = {tuple(t.dims) for t in graph.graph.initializer if t.data_type == TensorProto.FLOAT}
        assert not float_shapes & (weight_shapes | {s[::-1] for s in weight_shapes})  # no dequantized copy


def test_quantization_refusals(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("llama-mha")
    with pytest.raises(KvedgeError, match="per channel.*round-to-nearest only"):
        export(path, tmp_path / "a", ExportOptions(attention="decomposed", quantize="int8", group_size=0,
                                                   quant_method="gptq"))
    assert not (tmp_path / "a").exists()


def test_tied_lm_head_gets_a_quantized_copy_and_the_embedding_stays_fp(hf_checkpoint):
    from kvedge.models import KVCache, load_decoder
    from kvedge.models.quant import QuantLinear, quantize_decoder

    path, _ = hf_checkpoint("gemma")  # tied embeddings
    model = load_decoder(path)
    ids = torch.arange(3, 13)[None]
    ref = model(ids, torch.arange(10)[None], KVCache.allocate(model.cfg, 1, 16).for_batch(1))
    embed = model.embed.weight.clone()
    assert quantize_decoder(model, 8, 32, lm_head=True) == 4 * model.cfg.num_layers + 1
    assert isinstance(model.lm_head, QuantLinear) and torch.equal(model.embed.weight, embed)
    got = model(ids, torch.arange(10)[None], KVCache.allocate(model.cfg, 1, 16).for_batch(1))
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.99


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_groups_put_zero_at_the_midpoint(bits):
    q, s, z = quantize(W, bits, 32, symmetric=True)
    mid = 2 ** (bits - 1)
    zeros = torch.stack((z & 0x0F, z >> 4), -1).flatten() if bits == 4 else z
    assert torch.all(zeros == mid)
    back = dequantize(q, s, z, bits, W.shape[1])
    step = s.reshape(48, -1).repeat_interleave(32, dim=1)
    assert torch.all((back - W).abs() <= step / 2 + 1e-6)
    # each group's largest |w| lands on +-(mid - 1) steps: the signed range TensorRT takes, symmetric (the
    # scale is max|w| / (mid - 1) rounded up to a float16 value, by 2^-10 of itself at most)
    amax = W.reshape(48, -1, 32).abs().amax(-1).reshape(-1)
    assert torch.all(amax / s <= mid - 1) and torch.all(amax / s >= (mid - 1) * (1 - 2**-10))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_symmetric_ort_export_drops_the_zero_points(scheme, hf_checkpoint, tmp_path):
    """--symmetric zero points all sit at MatMulNBits' default (the midpoint): the ort lowering leaves the
    input out, so ONNX Runtime takes its no-zero-point kernel path, and the graph still agrees with the
    quantized PyTorch model."""
    path, _ = hf_checkpoint("llama-gqa4-llama3rope")
    sc = export(path, tmp_path / "q", ExportOptions(attention="ort", quantize=scheme, symmetric=True, max_seq_len=96,
                                                    allow_degraded=True))
    assert sc.verification["passed"] and sc.verification["max_abs_error"] < 1e-4
    nodes = [n for n in onnx.load(str(tmp_path / "q" / "model.onnx")).graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 4 * sc.model.num_layers and all(len(n.input) < 4 or not n.input[3] for n in nodes)


@pytest.mark.parametrize("bits,affine", [(4, False), (8, False), (4, True)])
def test_the_reference_dequantizes_a_few_rows_at_a_time_and_computes_the_same(bits, affine, monkeypatch):
    """torch.ops.kvedge.qlinear dequantizes whole output rows a chunk at a time (a float copy of a large matrix
    never exists): with chunks of 7 rows (48 = 6 x 7 + 6, a short last chunk), the product equals x times the
    whole dequantized matrix, row for row, and a mins term (affine blocks) stays with its rows."""
    import kvedge.models.quant as quant

    q, s, z = quantize(W, bits, 32)
    mins = torch.randn(s.numel(), generator=torch.Generator().manual_seed(1)) if affine else None
    zeros = torch.empty((48, 0), dtype=torch.uint8) if affine else z
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(2))
    whole = torch.nn.functional.linear(x, dequantize(q, s, zeros, bits, 128, mins))
    monkeypatch.setattr(quant, "DEQUANT_ROWS_OF", 7 * 128)
    chunked = torch.ops.kvedge.qlinear(x, q, s, zeros, bits, 128, 0, mins)
    assert chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
