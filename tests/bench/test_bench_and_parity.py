"""kvedge bench writes consistent figures and every report; kvedge parity passes, and catches a perturbed weight."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kvedge.bench.parity import compare
from kvedge.cli import main
from kvedge.runtime import load


@pytest.fixture
def demo(demo_export):
    """The demo checkpoint and its default export (max_seq_len 96, max_batch 2)."""
    return demo_export(96, 2)


def test_bench_writes_every_report_with_consistent_figures(demo, tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(["bench", str(demo[1]), "--prompt-lens", "8,32", "--gen-len", "6", "--batch", "1,2",
               "--repeat", "1", "--warmup", "0", "-o", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "8/8 torch prompt 32 batch 2" in captured.err  # the progress bar reached the end
    for name in ("bench.json", "bench.csv", "bench.md"):
        assert (out / name).stat().st_size > 100
    for name in ("latency_vs_context.png", "tokens_per_s.png", "memory.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    results = json.loads((out / "bench.json").read_text())["results"]
    assert {(r["backend"], r["prompt_len"], r["batch"]) for r in results} == {
        (b, p, n) for b in ("onnxruntime", "torch") for p in (8, 32) for n in (1, 2)}
    for r in results:
        assert r["decode_tokens_per_s"] == pytest.approx(1000 / r["decode_ms_mean"], rel=1e-9)
        assert r["decode_tokens_per_s_total"] == pytest.approx(r["batch"] * r["decode_tokens_per_s"], rel=1e-9)
        assert r["prefill_tokens_per_s"] == pytest.approx(r["batch"] * r["prompt_len"] / (r["ttft_ms"] / 1e3), rel=1e-9)
        assert r["decode_ms_p50"] <= r["decode_ms_p90"] <= r["decode_ms_p99"]
        # demo: 4 layers * 2 (K, V) * 2 kv heads * 32 head_dim * 4 bytes * positions * 2 rows; positions are
        # the export's 96 on onnxruntime, and prompt 32 + gen 6 on torch, which sizes its cache to the run
        positions = 96 if r["backend"] == "onnxruntime" else 38
        assert r["kv_formula_bytes"] == r["kv_allocated_bytes"] == 4 * 2 * 2 * 32 * 4 * positions * 2
        assert r["peak_rss_bytes"] > r["weights_bytes"] > 0
    # demo parameters: embed + lm_head 2 * 259 * 256, per layer qkv 256 * 384, o 256^2, mlp 3 * 256 * 704,
    # norms 512 (= 705,024) * 4 layers, final norm 256: 2,952,960 parameters, fp32
    assert {r["weights_bytes"] for r in results if r["backend"] == "torch"} == {2_952_960 * 4}
    assert "KV (formula)" in (out / "bench.md").read_text()


def test_parity_passes_for_onnxruntime_in_fp32(demo, tmp_path):
    assert main(["parity", str(demo[1]), "--steps", "12", "-o", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "parity-onnxruntime.json").read_text())
    assert rep["passed"] and rep["greedy_agree"] and len(rep["steps"]) == 13
    assert all(s["top1_agree"] and s["cosine"] > 0.9999 for s in rep["steps"])
    assert "PASSED" in (tmp_path / "parity-onnxruntime.md").read_text()


def test_parity_finds_the_first_divergent_step_of_a_perturbed_onnx_weight(demo, tmp_path):
    ckpt, onnx_dir = demo
    reference = load(ckpt, backend="torch", max_batch=1, max_seq_len=96)
    prompt = [0, 40, 41, 42, 43]
    greedy = reference.generate([prompt], max_new_tokens=12, eos_token_id=None).tokens[0]
    k = next(i for i, t in enumerate(greedy) if t not in prompt and t not in greedy[:i] and i >= 2)
    token = greedy[k]  # first produced at step k, so first *fed* to the model at step k + 1

    bad = tmp_path / "bad"
    shutil.copytree(onnx_dir, bad)
    model = onnx.load(str(bad / "model.onnx"))
    for t in model.graph.initializer:
        if t.name == "decoder.embed.weight":
            w = numpy_helper.to_array(t).copy()
            w[token] = 5.0 * np.random.default_rng(0).standard_normal(w.shape[1])  # only this token's row
            t.CopyFrom(numpy_helper.from_array(w, t.name))
    onnx.save(model, str(bad / "model.onnx"))

    rep = compare(load(bad), reference, prompt, steps=11)
    assert not rep.passed
    assert rep.first_failing_step == k + 1
    assert all(s.ok for s in rep.steps[:k + 1])
    assert rep.first_divergent_step is not None and rep.first_divergent_step >= k + 1
    ids = ",".join(map(str, prompt))
    assert main(["parity", str(bad), "--reference", str(ckpt), "--ids", ids, "--steps", "11", "-o", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "parity-onnxruntime.json").read_text())["first_failing_step"] == k + 1
