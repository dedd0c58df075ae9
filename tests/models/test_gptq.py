"""GPTQ: less output error than round-to-nearest on correlated inputs, RTN's integers when there is
nothing to compensate, the same storage layout, an int4 export of a tiny trained llama that keeps
its top-1, and perplexity against transformers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvedge.export import ExportOptions, export
from kvedge.runtime.calibration import calibration_rows, heldout_rows
from kvedge.export.verify import compare_on_text, perplexity
from kvedge.models import load_config, load_decoder
from kvedge.models.gptq import gptq_quantize
from kvedge.models.quant import dequantize, quantize, quantize_decoder
from tests.conftest import hf_config
from tests.models.test_quant import onnxruntime_matmulnbits

K, N = 128, 64


def _correlated(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """X = Z A (512 samples with correlated columns), W random: the case GPTQ exists for."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, K, generator=g) @ torch.randn(K, K, generator=g)
    return x, torch.randn(N, K, generator=g)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_output_error_is_below_rtn(bits, group):
    x, w = _correlated(bits + group)
    h = 2 * x.double().T @ x.double() / x.shape[0]
    packed, rtn = gptq_quantize(w, h, bits, group), quantize(w, bits, group)

    def err(p):
        return (x @ w.T - x @ dequantize(*p, bits, K).T).norm().item()

    assert err(packed) < 0.8 * err(rtn)  # measured 0.68-0.69 for int4 and int8, groups of 32 and 128
    # the same storage as RTN, consumed as is by ONNX Runtime's MatMulNBits kernel
    assert [(t.shape, t.dtype) for t in packed] == [(t.shape, t.dtype) for t in rtn]
    xs = x[:4].numpy().astype(np.float32)
    np.testing.assert_allclose(onnxruntime_matmulnbits(xs, *packed, bits, group),
                               xs @ dequantize(*packed, bits, K).numpy().T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale", [1.0, 3.7])
def test_identity_hessian_gives_exactly_rtn(bits, scale):
    # H = c I: damping adds to the diagonal only, so H stays a multiple of I, the Cholesky factor of its
    # inverse is diagonal and every propagated error term err * U[c, c+1:] is exactly 0. Columns go in
    # order (kvedge has no act-order), so each group's scale and zero are RTN's, from untouched weights.
    _, w = _correlated(0)
    packed = gptq_quantize(w, scale * torch.eye(K), bits, 32)
    assert all(torch.equal(a, b) for a, b in zip(packed, quantize(w, bits, 32)))


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory):
    """A tiny llama (tests/conftest.py's config: 2 layers, hidden 64) trained for 100 seeded steps on the
    built-in text's bytes: random weights give near-flat logits, a trained model has real preferences."""
    from importlib import resources

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("llama"), attn_implementation="eager")
    data = torch.tensor(list(resources.files("kvedge.models").joinpath("calibration.txt").read_bytes()))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        x = torch.stack([data[i:i + 64] for i in torch.randint(0, len(data) - 65, (16,), generator=g)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = tmp_path_factory.mktemp("trained-llama")
    model.eval().requires_grad_(False).save_pretrained(path)
    return path


def test_int4_gptq_export_keeps_top1_of_a_trained_tiny_llama(trained_llama, tmp_path):
    sc = export(trained_llama, tmp_path / "q", ExportOptions(quantize="int4", quant_method="gptq", group_size=32,
                                                             max_seq_len=96, verify_steps=64))
    v = sc.verification
    assert v["passed"] and v["max_abs_error"] < 1e-4  # the graph against kvedge's GPTQ PyTorch model
    gptq = v["vs_unquantized"]
    # issue #9's acceptance: >= 90% top-1 over 64 teacher-forced steps (measured 98%; RTN 91%)
    assert gptq["top1_agreement"] >= 0.9
    record = sc.extra["quantization"]
    assert record["method"] == "gptq" and record["linears"] == 4 * sc.model.num_layers
    cal = record["calibration"]
    assert cal["tokenizer"].startswith("utf-8 bytes") and cal["tokens"] == cal["rows"] * cal["row_length"] > 1000
    assert cal["output_error"] < 0.7 * cal["rtn_output_error"]  # measured 3.2% against 6.2%

    # round-to-nearest on the same model, in PyTorch, teacher-forced on the held-out text the export's report
    # measured on (never the calibration text GPTQ fitted). Perplexity differences this small are within
    # what luck gives either method, so only the two steadier figures are compared.
    rows, what = heldout_rows(trained_llama, load_config(trained_llama), None, 2048)
    rtn_model = load_decoder(trained_llama)
    quantize_decoder(rtn_model, 4, 32)
    rtn = compare_on_text(rtn_model, load_decoder(trained_llama), rows)
    text = gptq["on_text"]
    assert text["text"] == what["text"] == "built-in heldout.txt" != cal["text"]
    assert text["reference_perplexity"] == pytest.approx(rtn["reference_perplexity"])
    assert text["top1_agreement"] > rtn["top1_agreement"] and text["mean_cosine"] > rtn["mean_cosine"]


def test_perplexity_equals_transformers_loss(hf_checkpoint):
    path, hf = hf_checkpoint("llama-gqa4-llama3rope")
    rows, what = calibration_rows(path, load_config(path), None, 300)
    assert rows.shape == (2, 128) and what["tokens"] == 256  # rows of at most the model's 128 positions
    with torch.no_grad():
        loss = hf(input_ids=rows, labels=rows).loss.item()  # the mean over every row's predicted tokens
    assert perplexity(load_decoder(path), rows) == pytest.approx(math.exp(loss), rel=1e-4)
