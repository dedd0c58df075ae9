"""kvedge bench writes every report, and its figures are the timed steps' (on a controlled clock); on a Jetson it
warns of unpinned clocks and records tegrastats; it fails when the KV formula and the allocation differ. kvedge
parity passes, catches a perturbed weight, and applies the documented per-dtype tolerances; the native backend
refuses a GPTQ export."""

from __future__ import annotations

import functools
import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from kvedge.bench import latency
from kvedge.bench.parity import compare
from kvedge.cli import main
from kvedge.runtime import load
from kvedge.runtime.ort_backend import OrtBackend
from tests.jetson.test_jetson import RELEASE_JP62, fake_tegrastats  # noqa: F401  (a fixture)


@pytest.fixture
def demo(demo_export):
    """The demo checkpoint and its default export (max_seq_len 96, max_batch 2)."""
    return demo_export(96, 2)


def test_bench_writes_every_report_with_consistent_figures(demo, tmp_path, capsys):
    """Every report, and figures consistent with each other; that they are the timed steps' is proved on a controlled
    clock (test_measure_reports_the_median_runs_figures_on_a_controlled_clock)."""
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


class _Clock:
    """Stands for the time module in kvedge.bench.latency: perf_counter() is what the session made it."""

    now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _TimedSession:
    """prefill and decode advance the clock by scripted durations: runs = [(prefill s, [decode step s, ...]), ...]."""

    def __init__(self, clock: _Clock, runs: list):
        self.cfg = SimpleNamespace(vocab_size=10)
        self.clock, self.durations = clock, iter([d for prefill, steps in runs for d in (prefill, *steps)])

    def _step(self, rows: int) -> torch.Tensor:
        self.clock.now += next(self.durations)
        return torch.zeros(rows, 10)

    def prefill(self, prompts):
        return self._step(len(prompts))

    def decode(self, tokens):
        return self._step(len(tokens))


def test_measure_reports_the_median_runs_figures_on_a_controlled_clock(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(latency, "time", clock)
    ms = 1e-3
    runs = [(45 * ms, [3 * ms] * 5),  # warmup, total 60 ms: counted, it would be the median of four runs
            (30 * ms, [4 * ms, 1 * ms, 3 * ms, 2 * ms, 10 * ms]),  # total 50 ms: the median of the timed runs
            (25 * ms, [10 * ms] * 5),  # total 75 ms (the median prefill, and the middle run in time order)
            (10 * ms, [2 * ms] * 5)]  # total 20 ms
    session = _TimedSession(clock, runs)
    m = latency.measure(session, prompt_len=4, batch=2, gen_len=6, warmup=1, repeat=3)
    # by hand, from the 50 ms run: 2 rows x 4 tokens in 30 ms; steps sorted 1, 2, 3, 4, 10 ms, percentiles linear
    # between ranks (p90 at rank 3.6: 4 + 0.6 x 6; p99 at rank 3.96: 4 + 0.96 x 6); mean 4 ms: 250 tokens/s a row
    assert m == pytest.approx(dict(ttft_ms=30, prefill_tokens_per_s=8 / 0.030, decode_ms_p50=3, decode_ms_p90=7.6,
                                   decode_ms_p99=9.76, decode_ms_mean=4, decode_tokens_per_s=250,
                                   decode_tokens_per_s_total=500))
    assert next(session.durations, None) is None  # every scripted call was made: 4 runs of 1 prefill + 5 decodes


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


BENCH_SMALL = ["--backend", "onnxruntime", "--prompt-lens", "4", "--gen-len", "3", "--repeat", "1", "--warmup", "0",
               "--quiet"]


@pytest.mark.parametrize("pinned", [False, True])
def test_bench_on_a_jetson_records_tegrastats_and_warns_of_unpinned_clocks(pinned, demo, tmp_path, monkeypatch,
                                                                            capsys, fake_tegrastats):
    tools = fake_tegrastats().parent  # on PATH; nvpmodel and jetson_clocks join it
    freq = "MinFreq=1728000 MaxFreq=1728000" if pinned else "MinFreq=115200 MaxFreq=1728000"
    for name, text in (("nvpmodel", "NV Power Mode: 15W"), ("jetson_clocks", f"cpu0: Online=1 {freq}")):
        (tools / name).write_text(f"#!/bin/sh\necho '{text}'\n")
        (tools / name).chmod(0o755)
    (tmp_path / "model").write_bytes(b"NVIDIA Jetson Orin Nano Developer Kit\x00")
    (tmp_path / "release").write_text(RELEASE_JP62)
    import kvedge.jetson

    monkeypatch.setattr(kvedge.jetson, "detect", functools.partial(kvedge.jetson.detect, tmp_path / "model",
                                                                   tmp_path / "release"))
    out = tmp_path / "report"
    assert main(["bench", str(demo[1]), *BENCH_SMALL, "-o", str(out)]) == 0
    assert ("warning: the clocks are not pinned" in capsys.readouterr().err) is not pinned
    context = json.loads((out / "bench.json").read_text())["context"]
    assert context["jetson"]["module"] == "Orin Nano" and context["jetson"]["power_mode"] == "15W"
    assert context["jetson"]["clocks_pinned"] is pinned
    stats = context["tegrastats"]  # the fake prints its two lines (tests/jetson) each round: RAM 2166 and 2458 of
    assert stats["samples"] >= 2 and stats["error"] is None and stats["ram_total_mb"] == 7620  # 7620 MB, VDD_IN
    assert stats["ram_used_mb"]["max"] == 2458 and stats["rails_mw"]["VDD_IN"]["max"] == 7931  # 7931 and 4008 mW


def test_bench_fails_when_the_kv_formula_and_the_allocation_differ(demo, tmp_path, monkeypatch, capsys):
    allocated = OrtBackend.cache_tensors
    monkeypatch.setattr(OrtBackend, "cache_tensors", lambda self: allocated(self) + [torch.zeros(8, dtype=torch.uint8)])
    out = tmp_path / "report"
    assert main(["bench", str(demo[1]), *BENCH_SMALL, "-o", str(out)]) == 2
    formula = 4 * 2 * 2 * 32 * 4 * 96  # demo: layers x (K, V) x kv heads x head_dim x 4 bytes x 96 positions, 1 row
    assert f"onnxruntime: KV cache formula {formula} B != allocated {formula + 8} B" in capsys.readouterr().err
    assert not (out / "bench.json").exists()


def test_native_backend_refuses_a_gptq_export_in_bench_and_parity(demo, tmp_path, capsys):
    gptq = tmp_path / "gptq"
    shutil.copytree(demo[1], gptq)
    record = json.loads((gptq / "kvedge.json").read_text())
    record["quantization"] = {"scheme": "int4", "bits": 4, "group_size": 32, "method": "gptq", "lm_head": False}
    (gptq / "kvedge.json").write_text(json.dumps(record))
    for command in (["bench", "--prompt-lens", "8", "--gen-len", "4"], ["parity", "--steps", "2"]):
        assert main([*command, str(gptq), "--backend", "native", "-o", str(tmp_path / command[0])]) == 2
        assert f"{gptq} was quantized with gptq; the native backend quantizes the checkpoint round-to-nearest" \
            in capsys.readouterr().err


class _Fixed:
    """A session answering every step with the same logits [1, 1, V]; its greedy run is token 0 throughout."""

    def __init__(self, logits: torch.Tensor):
        self.backend, self.logits = SimpleNamespace(name="fixed"), logits

    def prefill(self, prompts):
        return self.logits

    def decode(self, tokens):
        return self.logits

    def generate(self, prompts, max_new_tokens, eos_token_id=None):
        return SimpleNamespace(tokens=[[0] * max_new_tokens])


# docs/proving.md: fp32: max relative error 1e-3 and cosine >= 0.9999; fp16: 2e-2 and 0.999; bf16: 5e-2 and 0.995
DOCUMENTED = {"fp32": (1e-3, 0.9999), "fp16": (2e-2, 0.999), "bf16": (5e-2, 0.995)}


@pytest.mark.parametrize("dtype", DOCUMENTED)
def test_parity_applies_the_documented_tolerances_of_each_dtype(dtype):
    max_rel, min_cos = DOCUMENTED[dtype]
    ref = torch.zeros(1, 1, 4000)
    ref[..., 0] = 10.0  # largest |logit| 10: max rel = max abs / 10

    def passes(n: int, e: float) -> bool:  # n logits off by e: max rel e / 10, cosine 10 / sqrt(100 + n e^2)
        got = ref.clone()
        got[..., 1:1 + n] += e
        rep = compare(_Fixed(got), _Fixed(ref), [1, 2, 3], steps=1, dtype=dtype)
        assert rep.steps[0].max_rel == pytest.approx(e / 10)
        assert rep.steps[0].cosine == pytest.approx(10 / math.sqrt(100 + n * e * e))
        return rep.passed

    assert passes(1, 0.9 * max_rel * 10) and not passes(1, 1.1 * max_rel * 10)  # just inside / outside max rel
    e = 0.5 * max_rel * 10  # within max rel; the cosine reaches min_cos with `budget` logits off by e
    budget = 100 * (1 / min_cos**2 - 1) / e**2
    assert passes(math.floor(0.95 * budget), e) and not passes(math.ceil(1.05 * budget), e)
