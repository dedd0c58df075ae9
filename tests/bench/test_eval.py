"""`kvedge eval`: perplexity through a backend's cache, one decode step a token, against transformers' own loss."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvedge.bench.eval import evaluate, fit_rows
from kvedge.cli import main
from kvedge.runtime import load
from kvedge.runtime.calibration import calibration_rows, heldout_rows


def test_torch_perplexity_equals_transformers_loss(hf_checkpoint):
    path, hf = hf_checkpoint("llama-gqa4-llama3rope")
    session = load(path, "torch", max_batch=2, max_seq_len=128)
    rows, what = heldout_rows(path, session.cfg, None, 300)
    with torch.no_grad():
        loss = hf(input_ids=rows, labels=rows).loss.item()  # the mean over every row's predicted tokens
    rep = evaluate(session, rows, what)
    assert rep.predicted_tokens == rows[:, 1:].numel() and rep.perplexity == pytest.approx(math.exp(loss), rel=1e-5)


def test_the_heldout_text_is_not_the_calibration_text(hf_checkpoint):
    """Disjoint: no 48-character stretch of one stands in the other (a shared sentence would)."""
    from importlib import resources

    held, cal = (resources.files("kvedge.models").joinpath(f).read_text("utf-8") for f in ("heldout.txt",
                                                                                         "calibration.txt"))
    windows = {cal[i:i + 48] for i in range(len(cal) - 48)}
    assert len(held) > 4000 and not any(held[i:i + 48] in windows for i in range(len(held) - 48))
    path, _ = hf_checkpoint("llama-gqa4-llama3rope")
    session = load(path, "torch", max_batch=1, max_seq_len=128)
    assert heldout_rows(path, session.cfg, None, 64)[1]["text"] == "built-in heldout.txt"
    assert calibration_rows(path, session.cfg, None, 64)[1]["text"] == "built-in calibration.txt"


def test_fit_rows_cuts_rows_to_the_cache():
    rows = torch.arange(2 * 10).reshape(2, 10)
    assert torch.equal(fit_rows(rows, 10), rows)
    assert torch.equal(fit_rows(rows, 6), torch.arange(18).reshape(3, 6))


def test_eval_cli_on_an_export_compares_onnxruntime_with_torch(demo_export, capsys):
    _, onnx_dir = demo_export(64, 1)
    assert main(["eval", str(onnx_dir), "--tokens", "256", "--json", "--quiet"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["backend"] == "onnxruntime" and rep["reference"] == "torch" and rep["text"]["row_length"] == 64
    assert rep["perplexity"] == pytest.approx(rep["reference_perplexity"], rel=1e-4)
    assert rep["top1_agreement"] == 1.0 and rep["mean_cosine"] > 0.99999
