"""`kvedge eval`: perplexity through a backend's cache, a chunk of positions a call, against transformers' own loss
and against the same backend stepped one token at a time."""

from __future__ import annotations

import json
import math
import re

import numpy as np
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


# -- issue 32: eval prefills in chunks, one forward a chunk, on every backend ---------------------------------------
def token_at_a_time(session, rows: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The computation eval's chunks replace, written out here: every row from an empty cache, one decode step per
    token (logits of its one position), each step's logits scoring the next token. (perplexity, logits [R, L-1, V])"""
    be, out, nll = session.backend, [], 0.0
    for row in rows:
        be.reset()
        steps = [be.forward(row[None, t:t + 1], torch.tensor([[t]]), torch.tensor([0]))[0, -1].double().clone()
                 for t in range(row.numel() - 1)]
        logits = torch.stack(steps)
        nll += torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum").item()
        out.append(logits)
    return math.exp(nll / rows[:, 1:].numel()), torch.stack(out)


class Counting:
    """A backend's forward calls, counted, and the logits positions each asked for."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []
        self.name, self.cfg, self.max_batch, self.max_seq_len = (backend.name, backend.cfg, backend.max_batch,
                                                                 backend.max_seq_len)

    def forward(self, ids, pos, index, first_row=0):
        self.calls.append((tuple(ids.shape), tuple(index.shape)))
        return self.backend.forward(ids, pos, index, first_row)

    def reset(self):
        self.backend.reset()


def _open(backend: str, hf_checkpoint, exported):
    path, _ = hf_checkpoint("llama-gqa4-llama3rope")
    if backend == "onnxruntime":
        return load(exported("llama-gqa4-llama3rope", "ort")[0], "onnxruntime", max_batch=3)
    if backend == "native":  # float32 weights, int16 activations: chunked and stepwise differ by float rounding only
        return load(path, "native", max_batch=3, max_seq_len=64, quantize=None, activations="int16")
    return load(path, "torch", max_batch=3, max_seq_len=64)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "native"])
def test_chunked_eval_equals_one_token_at_a_time(backend, hf_checkpoint, exported):
    """Issue 32: eval scores a row with a prefill a chunk (one forward per chunk, the logits of every position), not
    one decode step per token; its perplexity must be the token-at-a-time one's (the acceptance: within 1%; here
    within float rounding), and every position's logits the same, on every backend that runs a tiny model here."""
    session = _open(backend, hf_checkpoint, exported)
    rows, what = heldout_rows(hf_checkpoint("llama-gqa4-llama3rope")[0], session.cfg, None, 256)
    rows = rows.reshape(-1)[:120].reshape(3, 40)  # 3 rows of 40 tokens: 39 predicted each
    ppl, stepwise = token_at_a_time(session, rows)
    counting = Counting(session.backend)
    session.backend = counting
    chunked = []
    import kvedge.bench.eval as ev

    for _, t, logits, _ in ev.teacher_forced(session, rows, batch=2, chunk=16):  # rows 0-1, then 2: 16 + 16 + 7
        chunked.append((t, logits.clone()))
    assert [t for t, _ in chunked] == [0, 16, 32] * 2
    got = torch.cat([torch.cat([lg for t, lg in chunked[:3]], 1), torch.cat([lg for t, lg in chunked[3:]], 1)], 0)
    assert torch.allclose(got, stepwise, rtol=0, atol=2e-4 * stepwise.abs().max().item())
    counting.calls.clear()
    rep = evaluate(session, rows, what)
    assert rep.perplexity == pytest.approx(ppl, rel=1e-5) and rep.predicted_tokens == 3 * 39
    # one forward per chunk: rows 3 at a time, 39 predicting positions in one chunk of up to LOGITS_CHUNK
    assert counting.calls == [((3, 39), (3, 39))]


def test_an_export_from_before_multi_position_logits_still_generates_and_eval_says_re_export(exported, tmp_path):
    """Exports written before the contract's logits_index [batch, logits] take [batch]: the onnxruntime backend
    still runs them for generation, one position a call, and refuses several with a one-line reason."""
    import shutil

    import onnx
    from onnx import helper

    from kvedge.artifact import Sidecar
    from kvedge.errors import KvedgeError

    src, _ = exported("llama-gqa4-llama3rope", "ort")
    out = tmp_path / "old"
    shutil.copytree(src, out)
    model = onnx.load(str(out / "model.onnx"))  # logits_index [batch] unsqueezed to the [batch, 1] the graph takes
    for node in model.graph.node:
        node.input[:] = ["logits_index_2d" if x == "logits_index" else x for x in node.input]
    model.graph.node.insert(0, helper.make_node("Unsqueeze", ["logits_index", "one_axis"], ["logits_index_2d"]))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], dtype=np.int64), "one_axis"))
    index = next(i for i in model.graph.input if i.name == "logits_index")
    del index.type.tensor_type.shape.dim[1]
    onnx.save(model, str(out / "model.onnx"))
    sc = Sidecar.read(out)
    sc.inputs[2]["shape"] = ["batch"]
    sc.write(out)
    old, new = load(out, "onnxruntime", max_batch=1), load(src, "onnxruntime", max_batch=1)
    assert not old.backend.sidecar.logits_per_call and new.backend.sidecar.logits_per_call
    ids = [5, 9, 17, 33, 2, 8]
    assert old.generate(ids, max_new_tokens=4, eos_token_id=None).tokens == \
        new.generate(ids, max_new_tokens=4, eos_token_id=None).tokens
    rows = torch.tensor([ids])
    with pytest.raises(KvedgeError, match="re-export it"):
        evaluate(old, rows, {"text": "ids"})


def test_eval_cli_reads_at_most_tokens_and_shows_progress(demo_export):
    """`kvedge eval OUT --tokens 64` said "evaluating onnxruntime on 256 tokens" (a whole 256-token row): --tokens
    is at most. Progress lines (tokens scored, running perplexity) go to stderr, the result to stdout."""
    import subprocess
    import sys

    _, onnx_dir = demo_export(64, 1)
    r = subprocess.run([sys.executable, "-m", "kvedge", "eval", str(onnx_dir), "--tokens", "50"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "evaluating onnxruntime on 50 tokens" in r.stderr and "over 49 predicted tokens" in r.stdout
    assert re.search(r"^  49/49 tokens, perplexity \d+\.\d+ \(", r.stderr, re.M), r.stderr
