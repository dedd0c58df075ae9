"""Sampling: reproducible with a seed, and top-k / top-p / repetition penalty as transformers defines them."""

from __future__ import annotations

import pytest
import torch

from kvedge.errors import KvedgeError
from kvedge.runtime.sampling import SamplingParams, apply_repetition_penalty, filter_logits, greedy_tokens, next_tokens

LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])


def test_top_k_and_top_p_match_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    for k in (1, 5, 20):
        ref = TopKLogitsWarper(top_k=k)(None, logits.clone())
        assert torch.equal(torch.isinf(filter_logits(logits, k, 1.0)), torch.isinf(ref))
    for p in (0.1, 0.5, 0.9):
        ref = TopPLogitsWarper(top_p=p)(None, logits.clone())
        assert torch.equal(torch.isinf(filter_logits(logits, 0, p)), torch.isinf(ref)), p


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 3, 3], [0, 9, 4]])
    seen = torch.zeros(2, 10, dtype=torch.bool).scatter_(1, ids, True)
    ref = RepetitionPenaltyLogitsProcessor(penalty=1.7)(ids, logits.clone())
    assert torch.allclose(apply_repetition_penalty(logits, seen, 1.7), ref)


def sample_many(params: SamplingParams, n=40000, seed=3):
    return next_tokens(LOGITS.expand(n, -1).clone(), params, torch.Generator().manual_seed(seed))


def test_seeded_sampling_is_reproducible():
    p = SamplingParams(temperature=0.9, top_k=5, top_p=0.95, seed=7)
    assert torch.equal(sample_many(p, 500, seed=7), sample_many(p, 500, seed=7))
    assert not torch.equal(sample_many(p, 500, seed=7), sample_many(p, 500, seed=8))


def test_top_k_distribution():
    tokens = sample_many(SamplingParams(temperature=1.0, top_k=3))
    counts = torch.bincount(tokens, minlength=8).float() / tokens.numel()
    assert counts[3:].sum() == 0  # nothing outside the top 3
    expected = torch.softmax(LOGITS[0, :3], 0)
    assert torch.allclose(counts[:3], expected, atol=0.01)  # ~4 sigma at n = 40000


def test_top_p_distribution():
    probs = torch.softmax(LOGITS[0], 0)  # 0.405, 0.245, 0.149, ...: cumulative 0.405, 0.650, 0.799
    tokens = sample_many(SamplingParams(temperature=1.0, top_p=0.7))
    counts = torch.bincount(tokens, minlength=8).float() / tokens.numel()
    assert counts[3:].sum() == 0  # the smallest set reaching 0.7 is the first three tokens
    assert torch.allclose(counts[:3], probs[:3] / probs[:3].sum(), atol=0.01)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_distribution(temperature):
    """Sampled at temperature T, token i comes with probability softmax(logits / T)_i (transformers' warper)."""
    tokens = sample_many(SamplingParams(temperature=temperature))
    counts = torch.bincount(tokens, minlength=8).float() / tokens.numel()
    assert torch.allclose(counts, torch.softmax(LOGITS[0] / temperature, 0), atol=0.01)  # ~4 sigma at n = 40000


def test_temperature_sharpens_and_zero_is_greedy():
    assert torch.all(sample_many(SamplingParams(temperature=0.0), 100) == 0)
    hot = torch.bincount(sample_many(SamplingParams(temperature=2.0)), minlength=8)
    cold = torch.bincount(sample_many(SamplingParams(temperature=0.5)), minlength=8)
    assert cold[0] > hot[0]


@pytest.mark.parametrize("kw,msg", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                    (dict(top_k=-2), "top_k"), (dict(repetition_penalty=0), "repetition_penalty")])
def test_bad_sampling_params(kw, msg):
    with pytest.raises(KvedgeError, match=msg):
        SamplingParams(**kw)


def test_greedy_tokens_are_torch_argmax_ties_and_nans_included():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (64, 50), generator=g).float()  # integers: many rows with tied largest values
    logits[5, [7, 30]] = float("nan")
    logits[9] = float("-inf")
    for x in (logits, logits.half(), logits.bfloat16()):
        got = greedy_tokens(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.float().argmax(-1))
