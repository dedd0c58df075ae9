"""kvedge's Decoder against transformers, for every supported architecture (fp32, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from kvedge.models import KVCache, load_decoder
from tests.conftest import ARCH_CASES, transformers_logits

TOL = 1e-4
PROMPT, STEPS = 16, 32


def greedy(model, prompt: torch.Tensor, steps: int, cache: KVCache):
    """Prefill the prompt, then `steps` greedy decode steps through the cache. Returns tokens, step logits."""
    b, n = prompt.shape
    logits = model(prompt, torch.arange(n).expand(b, n), cache.for_batch(b),
                   logit_index=torch.full((b,), n - 1))[:, -1]
    tokens, step_logits = [], [logits]
    for s in range(steps):
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        if s == steps - 1:
            break
        logits = model(nxt[:, None], torch.full((b, 1), n + s), cache.for_batch(b))[:, -1]
        step_logits.append(logits)
    return torch.stack(tokens, 1), torch.stack(step_logits, 1)


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_prefill_logits_match_transformers(case, hf_checkpoint):
    path, hf = hf_checkpoint(case)
    model = load_decoder(path)
    ids = torch.randint(3, model.cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits
    got = model(ids, torch.arange(PROMPT)[None], KVCache.allocate(model.cfg, 1, 64).for_batch(1))
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_greedy_decode_through_cache_matches_transformers(case, hf_checkpoint):
    path, hf = hf_checkpoint(case)
    model = load_decoder(path)
    prompt = torch.randint(3, model.cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    cache = KVCache.allocate(model.cfg, 1, PROMPT + STEPS)
    tokens, step_logits = greedy(model, prompt, STEPS, cache)
    _, ref = transformers_logits(hf, prompt, tokens)  # the logits every step should have had
    assert (step_logits - ref).abs().max().item() < TOL
    assert torch.equal(ref.argmax(-1), tokens), "transformers' greedy choice differs from kvedge's"


def test_the_llama3_case_interpolates_a_frequency(hf_checkpoint):
    """llama3 scaling keeps short wavelengths, divides long ones by `factor` and interpolates those between
    original / high_freq_factor and original / low_freq_factor. The parity tests above prove that branch only if
    the case has a frequency in the band: checked here from the formula, not from kvedge."""
    path, hf = hf_checkpoint("llama-gqa4-llama3rope")
    case = ARCH_CASES["llama-gqa4-llama3rope"][1]
    s, theta, d = case["rope_scaling"], case["rope_theta"], hf.config.head_dim
    old, lo, hi = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    freqs = [theta ** (-i / d) for i in range(0, d, 2)]
    wavelens = [2 * math.pi / f for f in freqs]
    band = [i for i, w in enumerate(wavelens) if old / hi < w < old / lo]
    assert band, f"no wavelength of {wavelens} is in ({old / hi}, {old / lo}): nothing is interpolated"
    model = load_decoder(path)
    for i in band:
        smooth = (old / wavelens[i] - lo) / (hi - lo)
        interpolated = (1 - smooth) * freqs[i] / s["factor"] + smooth * freqs[i]
        assert freqs[i] / s["factor"] < interpolated < freqs[i]
        assert model.inv_freq[i].item() == pytest.approx(interpolated, rel=1e-6)
    torch.testing.assert_close(model.inv_freq, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", ["llama-gqa4-llama3rope", "gemma2", "gpt2"])
def test_prefill_then_decode_equals_full_recompute_and_cache_is_write_once(case, hf_checkpoint):
    path, _ = hf_checkpoint(case)
    model = load_decoder(path)
    prompt = torch.randint(3, model.cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    cache = KVCache.allocate(model.cfg, 1, PROMPT + STEPS)
    b = 1
    model(prompt, torch.arange(PROMPT)[None], cache.for_batch(b))
    after_prefill = [k[:, :, :PROMPT].clone() for k in cache.keys + cache.values]
    tokens, step_logits = greedy(model, prompt, STEPS, KVCache.allocate(model.cfg, 1, PROMPT + STEPS))
    # decode steps continuing from this cache must leave the prompt's slots untouched
    for s in range(8):
        model(tokens[:, s:s + 1], torch.tensor([[PROMPT + s]]), cache.for_batch(b))
    for before, now in zip(after_prefill, cache.keys + cache.values):
        assert torch.equal(before, now[:, :, :PROMPT])

    full = torch.cat([prompt, tokens], 1)
    recompute = model(full, torch.arange(full.shape[1])[None],
                      KVCache.allocate(model.cfg, 1, full.shape[1]).for_batch(1))
    assert (recompute[:, PROMPT - 1:PROMPT - 1 + STEPS] - step_logits).abs().max().item() < TOL


@pytest.mark.parametrize("case", ["llama-gqa4-llama3rope", "mistral-window", "gemma2", "gpt2", "deepseek_v2-mla"])
def test_ragged_batch_with_per_row_positions_equals_single_rows(case, hf_checkpoint):
    path, _ = hf_checkpoint(case)
    model = load_decoder(path)
    g = torch.Generator().manual_seed(4)
    lens = [PROMPT, 9, 13]
    prompts = [torch.randint(3, model.cfg.vocab_size, (n,), generator=g) for n in lens]
    steps = 12

    singles = [greedy(model, p[None], steps, KVCache.allocate(model.cfg, 1, 64)) for p in prompts]

    # One batch: right-padded prompts; each row has its own positions and last index.
    b, n = len(lens), max(lens)
    ids = torch.zeros(b, n, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = p
    cache = KVCache.allocate(model.cfg, 4, 64)  # max_batch 4 > 3: rows are views of a larger cache
    last = torch.tensor(lens) - 1
    logits = model(ids, torch.arange(n).expand(b, n), cache.for_batch(b), logit_index=last)[:, -1]
    pos = torch.tensor(lens)
    for s in range(steps):
        for r in range(b):
            assert (logits[r] - singles[r][1][0, s]).abs().max().item() < TOL
        nxt = logits.argmax(-1)
        for r in range(b):
            assert nxt[r].item() == singles[r][0][0, s].item()
        logits = model(nxt[:, None], pos[:, None], cache.for_batch(b))[:, -1]
        pos = pos + 1


def test_sharded_checkpoint_and_requested_dtype(tmp_path):
    from tests.conftest import save_hf_model

    hf = save_hf_model(tmp_path, "llama", max_position_embeddings=64)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = torch.arange(3, 13)[None]
    ref = hf(ids).logits
    model = load_decoder(tmp_path)
    got = model(ids, torch.arange(10)[None], KVCache.allocate(model.cfg, 1, 16).for_batch(1))
    assert (got - ref).abs().max().item() < TOL

    half = load_decoder(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    got16 = half(ids, torch.arange(10)[None],
                 KVCache.allocate(half.cfg, 1, 16, dtype=torch.bfloat16).for_batch(1)).float()
    cos = torch.nn.functional.cosine_similarity(got16.flatten(), ref.flatten(), dim=0)
    assert cos > 0.99
