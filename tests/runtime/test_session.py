"""Session behaviour: in-place caches, bad input (and recovery), cache limits, stops, streaming, CLI."""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch

from kvedge.cli import main
from kvedge.errors import KvedgeError
from kvedge.runtime import SamplingParams, load
from kvedge.runtime.ort_backend import OrtBackend


@pytest.fixture
def demo(demo_export):
    """The demo checkpoint and its default export (max_seq_len 256, max_batch 2)."""
    return demo_export(256, 2)


def test_decode_steps_reuse_the_cache_and_logits_buffers(demo):
    """The proof is the addresses: ONNX Runtime writes every step into the caches and logits allocated at load.
    tracemalloc sees Python objects only, not ONNX Runtime's or torch's native allocations; RSS cannot stand
    in for them (freed pages stay resident and absorb a leak), so no test here claims native memory is flat."""
    session = load(demo[1])
    backend = session.backend
    addresses = [t.data_ptr() for t in backend.cache_tensors()] + [backend.logits.data_ptr()]
    session.prefill([[0, 5, 6, 7]])
    bound = [v.data_ptr() for v in backend.binding.get_outputs()]  # the caches' present outputs, then logits
    assert bound == addresses  # present outputs are the cache buffers themselves
    tok = torch.tensor([9])
    for _ in range(20):  # warm up
        session.decode(tok)
    tracemalloc.start()
    traced = []  # after 40, 110 and 180 steps: a leak grows in both windows, a one-time allocation in one
    for steps in (40, 70, 70):
        for _ in range(steps):
            logits = session.decode(tok)
        traced.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    assert logits.data_ptr() == backend.logits.data_ptr()  # a view of the preallocated logits, not a copy
    assert [t.data_ptr() for t in backend.cache_tensors()] + [backend.logits.data_ptr()] == addresses
    assert [v.data_ptr() for v in backend.binding.get_outputs()] == addresses  # 200 decode steps later
    growth = [b - a for a, b in zip(traced, traced[1:])]
    assert min(growth) < 8 * 1024, f"Python-side memory grows with decode steps: {growth} bytes per 70 steps"
    assert int(session.lengths[0]) == 4 + 200


def fresh_tokens(session):
    return session.generate([[0, 40, 41, 42]], max_new_tokens=8, eos_token_id=None).tokens


def test_bad_inputs_raise_and_the_session_stays_usable(demo):
    session = load(demo[1])
    good = fresh_tokens(session)
    cases = [
        (lambda: session.generate([[0] * 250], max_new_tokens=10), r"250 prompt tokens \+ 10 to generate exceed"),
        (lambda: session.generate([[0, 300]]), r"token id 300 at position 1 of row 0 of the input is outside the vocabulary"),
        (lambda: session.generate([[-1]]), r"token id -1"),
        (lambda: session.generate([[0, True]]), r"True at position 1 of row 0 of the input is not a token id"),
        (lambda: session.generate([[1], [2], [3]]), r"batch 3 exceeds this session's max_batch 2"),
        (lambda: session.generate([[]]), r"row 0 of the input is empty"),
        (lambda: session.decode([1, 2]), r"decode got 2 tokens for a batch of 1"),
        (lambda: session.decode([999]), r"outside the vocabulary"),
        (lambda: session.generate("hi", max_new_tokens=0), r"max_new_tokens must be >= 1"),
    ]
    for call, msg in cases:
        with pytest.raises(KvedgeError, match=msg):
            call()
        assert fresh_tokens(session) == good, msg


def test_after_a_refused_call_decoding_goes_on_as_if_it_never_happened(demo):
    """Refused calls between decode steps change neither lengths nor caches: step by step, the logits equal those
    of a session that never saw an error (generate() alone would not show it: its prefill resets everything)."""
    clean, session = load(demo[1]), load(demo[1])
    prompts = [[0, 40, 41, 42, 43, 44], [0, 50, 51]]  # ragged: the rows are at different positions
    refused = [
        (lambda: session.decode([1]), r"decode got 1 tokens for a batch of 2"),
        (lambda: session.decode([1, 999]), r"outside the vocabulary"),
        (lambda: session.decode([-1, 1]), r"outside the vocabulary"),
        (lambda: session.decode([1.0, 2.0]), r"decode takes integer token ids, got torch.float32"),
        (lambda: session.decode(torch.tensor([True, False])), r"decode takes integer token ids, got torch.bool"),
        (lambda: session.prefill([[0, 300]]), r"token id 300"),
        (lambda: session.prefill([[0] * 257]), r"257 prompt tokens \+ 0 to generate exceed"),
        (lambda: session.prefill([[1], [2], [3]]), r"batch 3 exceeds"),
        (lambda: session.prefill([[5], []]), r"row 1 of the input is empty"),
        (lambda: session.generate([[0] * 250], max_new_tokens=10), r"250 prompt tokens \+ 10 to generate exceed"),
        (lambda: session.generate("hi", max_new_tokens=0), r"max_new_tokens must be >= 1"),
    ]
    want = clean.prefill(prompts)
    assert torch.equal(session.prefill(prompts), want)
    for call, msg in refused:
        with pytest.raises(KvedgeError, match=msg):
            call()
        assert torch.equal(session.lengths, clean.lengths) and session.batch == clean.batch, msg
        nxt = want.argmax(-1)  # the clean session's greedy tokens, fed to both
        want = clean.decode(nxt)
        assert torch.equal(session.decode(nxt), want), msg


def test_truncation_only_when_asked(demo):
    session = load(demo[1])
    long = [0] + list(range(3, 253))  # 251 tokens
    r = session.generate([long], max_new_tokens=10, truncate=True, eos_token_id=None)
    assert r.prompt_tokens == [246] and len(r.tokens[0]) == 10
    assert r.tokens == session.generate([long[-246:]], max_new_tokens=10, eos_token_id=None).tokens


def test_cache_never_overflows(demo):
    session = load(demo[1])
    session.prefill([[0] * 250])
    for _ in range(6):
        session.decode([5])
    with pytest.raises(KvedgeError, match=r"the cache is full \(max_seq_len 256\)"):
        session.decode([5])


def test_sidecar_and_graph_disagreeing_or_from_another_version(demo, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(demo[1], bad)
    meta = json.loads((bad / "kvedge.json").read_text())
    meta["inputs"][3]["name"] = "past_key.99"
    (bad / "kvedge.json").write_text(json.dumps(meta))
    with pytest.raises(KvedgeError, match=r"the graph and .*kvedge.json disagree"):
        load(bad)
    meta["inputs"][3]["name"] = "past_key.0"
    meta["inputs"][3]["shape"] = ["batch", 8, 256, 32]  # as if the cache had q_heads
    (bad / "kvedge.json").write_text(json.dumps(meta))
    with pytest.raises(KvedgeError, match=r"input 'past_key.0' has shape .* in the graph but"):
        load(bad)
    meta["kvedge_version"] = "7.0.0"
    (bad / "kvedge.json").write_text(json.dumps(meta))
    with pytest.raises(KvedgeError, match=r"written by kvedge '7.0.0', which this kvedge .* cannot read"):
        load(bad)


def test_ort_lowering_refuses_an_onnxruntime_too_old_for_its_graph(demo, monkeypatch):
    import onnxruntime

    assert json.loads((demo[1] / "kvedge.json").read_text())["lowering"] == "ort"  # the CPU default
    monkeypatch.setattr(onnxruntime, "__version__", "1.31.1")
    with pytest.raises(KvedgeError, match=r"'ort' lowering need onnxruntime >= 1.32; this is 1.31.1"):
        OrtBackend(demo[1])


def test_missing_provider(demo):
    with pytest.raises(KvedgeError, match=r"provider\(s\) \['CUDAExecutionProvider'\] are not available"):
        OrtBackend(demo[1], providers=["CUDAExecutionProvider"])


def test_eos_stop_strings_and_streaming(demo):
    session = load(demo[1])
    base = session.generate("Once", max_new_tokens=12, eos_token_id=None)
    toks = base.tokens[0]
    eos_at = toks[4]
    r = session.generate("Once", max_new_tokens=12, eos_token_id=eos_at)
    assert r.finish_reasons == ["eos"] and r.tokens[0] == toks[:toks.index(eos_at) + 1]
    assert len(base.texts[0]) >= 3
    stop = base.texts[0][1:3]
    r = session.generate("Once", max_new_tokens=12, eos_token_id=None, stop=[stop])
    assert r.finish_reasons == ["stop"] and stop not in r.texts[0] and base.texts[0].startswith(r.texts[0])
    pieces = []
    session.generate("Once", max_new_tokens=12, eos_token_id=None, on_token=lambda r, t, s: pieces.append(s))
    assert "".join(pieces) == base.texts[0]
    assert "".join(s for _, _, s in session.stream("Once", max_new_tokens=12, eos_token_id=None)) == base.texts[0]


def test_chat_template_and_sampled_generation(demo):
    session = load(demo[1])
    text = session.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|user|>\nhi</s>\n<|assistant|>\n"
    a = session.generate("hi", chat=True, max_new_tokens=6, sampling=SamplingParams(temperature=0.8, seed=3))
    b = session.generate("hi", chat=True, max_new_tokens=6, sampling=SamplingParams(temperature=0.8, seed=3))
    assert a.tokens == b.tokens
    others = [session.generate("hi", chat=True, max_new_tokens=6, sampling=SamplingParams(temperature=0.8, seed=s))
              for s in (4, 5, 6)]
    assert any(o.tokens != a.tokens for o in others)  # the seed reaches the sampler
    assert a.prompt_tokens == [len(text.encode()) - len("</s>") + 1]  # </s> is one special token, no BOS added


def test_torch_backend_refuses_an_export_folder(demo):
    with pytest.raises(KvedgeError, match="torch backend needs the Hugging Face checkpoint"):
        load(demo[1], backend="torch")
    with pytest.raises(KvedgeError, match="run `kvedge export` first"):
        load(demo[0], backend="onnxruntime")


def test_cli_generate_streams_and_reports(demo, capsys):
    assert main(["generate", str(demo[1]), "--prompt", "Once", "--max-new-tokens", "5", "--ignore-eos"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.err and "5 tokens" in captured.err
    assert main(["generate", str(demo[1]), "--ids", "0,70,71", "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 3 and len(out["tokens"]) <= 3 and out["backend"] == "onnxruntime"


def test_cli_generate_with_an_int8_cache(demo, capsys):
    """--kv-dtype int8 runs on the native and torch backends; an export's cache dtype is fixed at export."""
    for backend in ("native", "torch"):
        assert main(["generate", str(demo[0]), "--backend", backend, "--kv-dtype", "int8", "--ids", "0,70,71",
                     "--max-new-tokens", "3", "--max-seq-len", "64", "--json", "--ignore-eos"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["backend"] == backend and len(out["tokens"]) == 3
    with pytest.raises(KvedgeError, match="fixed when it is exported"):
        load(demo[1], kv_dtype="int8")


def test_load_leaves_the_garbage_collector_as_it_found_it(demo, tmp_path):
    """load() turns the collector off while it builds the session (kvedge.runtime.load); it is on again after a
    load, and after one that fails, and stays off where the caller had turned it off."""
    import gc

    assert gc.isenabled()
    load(demo[1])
    assert gc.isenabled()
    with pytest.raises(Exception):
        load(tmp_path / "missing.gguf")
    assert gc.isenabled()
    gc.disable()
    try:
        load(demo[1])
        assert not gc.isenabled()
    finally:
        gc.enable()
