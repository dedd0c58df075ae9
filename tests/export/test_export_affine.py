"""Affine quantized blocks (w = q * scale + min: GGUF's Q4_1, Q4_K, Q5_K) through export: the `ort` lowering keeps
the integers and scales and turns each min into a per-group offset term, and so does the DequantizeLinear form."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from kvedge.artifact import Sidecar, io_spec
from kvedge.errors import KvedgeError
from kvedge.export import to_onnx
from kvedge.export.lowerings import LOWERINGS
from kvedge.export.prepare import ExportOptions, check_loaded_quant
from kvedge.export.verify import reference, verify
from kvedge.models import load_decoder
from kvedge.models.quant import PROJECTIONS, QuantLinear, _pack4, dequantize
from tests.conftest import MAX_SEQ


def affine(linear: torch.nn.Linear, bits: int, group: int, g: torch.Generator) -> QuantLinear:
    """Random integers, float16 scales and mins (the values a Q4_1 file holds), sized to the linear's weights."""
    n, k = linear.out_features, linear.in_features
    q = torch.randint(0, 2**bits, (n, k // group, group), generator=g, dtype=torch.uint8)
    w = linear.weight.detach().float().reshape(n, k // group, group)
    scale = ((w.amax(-1) - w.amin(-1)) / (2**bits - 1)).half().float()
    mins = w.amin(-1).half().float()
    packed = (_pack4(q) if bits == 4 else q, scale.reshape(-1), torch.empty(0, dtype=torch.uint8))
    return QuantLinear(linear, bits, group, packed=packed, mins=mins.reshape(-1))


@pytest.fixture(scope="module", params=[4, 8])
def affine_decoder(hf_checkpoint, request):
    ckpt, _ = hf_checkpoint("llama-gqa2-bias")
    decoder = load_decoder(ckpt, dtype="fp32")
    g = torch.Generator().manual_seed(0)
    for layer in decoder.layers:
        for name in PROJECTIONS:
            setattr(layer, name, affine(getattr(layer, name), request.param, 32, g))
    decoder.prequantized = {"method": "test", "scheme": "Q4_1-like"}  # as the GGUF loader marks its models
    return decoder


def test_dequantize_is_q_times_scale_plus_min():
    g = torch.Generator().manual_seed(1)
    m = affine(torch.nn.Linear(64, 4), 4, 32, g)
    q = torch.stack((m.qweight & 15, m.qweight >> 4), -1).reshape(4, 64).float()  # low nibble first
    want = q * m.scales.repeat_interleave(32).reshape(4, 64) + m.mins.repeat_interleave(32).reshape(4, 64)
    assert torch.equal(dequantize(m.qweight, m.scales, m.zeros, 4, 64, m.mins), want)


def test_ort_export_keeps_the_integers_and_verifies(affine_decoder, tmp_path):
    proto = to_onnx(affine_decoder, "ort", MAX_SEQ)
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert len(nbits) == 4 * affine_decoder.cfg.num_layers
    for node in nbits:  # the midpoint zero point (the op's default): the offset is a separate per-group MatMul
        assert len(node.input) == 3 or not node.input[3]
    kept = {inits[n.input[1]].tobytes() for n in nbits}
    assert {m.qweight.numpy().tobytes() for m in affine_decoder.modules() if isinstance(m, QuantLinear)} == kept
    onnx.save(proto, str(tmp_path / "model.onnx"))
    inputs, outputs = io_spec(affine_decoder.cfg, "fp32", MAX_SEQ)
    sc = Sidecar(model=affine_decoder.cfg, lowering="ort", dtype="fp32", opset=21, max_seq_len=MAX_SEQ, max_batch=1,
                 inputs=inputs, outputs=outputs)
    sc.write(tmp_path)
    report = verify(reference(affine_decoder, MAX_SEQ, prompt_len=8, steps=4), tmp_path, sc)
    assert report["passed"] and report["max_rel_error"] < 1e-4, report


@pytest.mark.parametrize("lowering", ["onnx", "decomposed"])
def test_dequantizelinear_lowerings_verify_affine_blocks(lowering, affine_decoder, tmp_path):
    """The DequantizeLinear form (dq_weights) writes an affine block as signed integers and a per-block offset term:
    the graph verifies on ONNX Runtime against the PyTorch model of the same blocks."""
    check_loaded_quant(affine_decoder, ExportOptions(), LOWERINGS[lowering])
    proto = to_onnx(affine_decoder, lowering, MAX_SEQ)
    assert sum(n.op_type == "DequantizeLinear" for n in proto.graph.node) == 4 * affine_decoder.cfg.num_layers
    onnx.save(proto, str(tmp_path / "model.onnx"))
    inputs, outputs = io_spec(affine_decoder.cfg, "fp32", MAX_SEQ)
    sc = Sidecar(model=affine_decoder.cfg, lowering=lowering, dtype="fp32", opset=21, max_seq_len=MAX_SEQ,
                 max_batch=1, inputs=inputs, outputs=outputs)
    sc.write(tmp_path)
    report = verify(reference(affine_decoder, MAX_SEQ, prompt_len=8, steps=4), tmp_path, sc)
    assert report["passed"] and report["max_rel_error"] < 1e-4, report
    with pytest.raises(KvedgeError, match="already quantized"):
        check_loaded_quant(affine_decoder, ExportOptions(quantize="int4"), LOWERINGS[lowering])


def test_ort_takes_4_and_8_bit_affine_blocks():
    assert LOWERINGS["ort"].affine_refusals(4) == LOWERINGS["ort"].affine_refusals(8) == []
