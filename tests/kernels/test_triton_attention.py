"""The Triton kernels against kvedge's PyTorch attention (CPU: TRITON_INTERPRET=1; a GPU runs them natively)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from kvedge.kernels import triton_attention as tk  # noqa: E402
from kvedge.models.attention import attention as reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def case(b, hq, hkv, d, s_max, starts, l, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *shape: torch.randn(*shape, generator=g).to(DEV, dtype)  # noqa: E731
    q, k, v = t(b, hq, l, d), t(b, hkv, l, d), t(b, hkv, l, d)
    kc, vc = t(b, hkv, s_max, d), t(b, hkv, s_max, d)
    pos = (torch.tensor(starts)[:, None] + torch.arange(l)).to(DEV)
    return q, k, v, kc, vc, pos


def run_both(q, k, v, kc, vc, pos, window=None, softcap=None, ref_dtype=None):
    scale = q.shape[-1] ** -0.5
    rd = ref_dtype or q.dtype
    rk, rv = kc.clone().to(rd), vc.clone().to(rd)
    ref = reference(q.to(rd), k.to(rd), v.to(rd), rk, rv, pos, scale=scale, window=window, softcap=softcap)
    tkc, tvc = kc.clone(), vc.clone()
    got = tk.attention(q, k, v, tkc, tvc, pos, scale=scale, window=window, softcap=softcap)
    return got, ref, (tkc, tvc), (rk, rv)


GQA = [(4, 4), (4, 2), (8, 2), (7, 1), (14, 2)]  # ratios 1, 2, 4, 7 (MQA), 7


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("d", [64, 80, 128])
def test_decode_ragged_rows(hq, hkv, d):
    q, k, v, kc, vc, pos = case(3, hq, hkv, d, 48, [40, 5, 17], 1)
    got, ref, caches, ref_caches = run_both(q, k, v, kc, vc, pos)
    assert (got - ref).abs().max() < 1e-5
    assert all(torch.equal(a, r) for a, r in zip(caches, ref_caches))  # the cache write


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("l,starts", [(20, [0, 0]), (5, [9, 30]), (17, [3, 11])])  # L == S and L != S
def test_prefill_and_chunked_prefill(hq, hkv, d, l, starts):
    q, k, v, kc, vc, pos = case(2, hq, hkv, d, 64, starts, l, seed=l)
    got, ref, caches, ref_caches = run_both(q, k, v, kc, vc, pos)
    assert (got - ref).abs().max() < 1e-5
    assert all(torch.equal(a, r) for a, r in zip(caches, ref_caches))


@pytest.mark.parametrize("l", [1, 9])
@pytest.mark.parametrize("window,softcap", [(6, None), (None, 3.0), (5, 2.0)])
def test_window_and_softcap(l, window, softcap):
    q, k, v, kc, vc, pos = case(2, 8, 2, 64, 48, [30, 12], l, seed=3)
    got, ref, *_ = run_both(q, k, v, kc, vc, pos, window=window, softcap=softcap)
    assert (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize("l,starts", [(1, [33, 7]), (12, [0, 20])])
def test_fp16_against_fp32_reference(l, starts):
    q, k, v, kc, vc, pos = case(2, 8, 2, 128, 48, starts, l, dtype=torch.float16, seed=4)
    got, ref, *_ = run_both(q, k, v, kc, vc, pos, ref_dtype=torch.float32)
    assert (got.float() - ref).abs().max() < 2e-3


def test_split_k_reduction_over_many_splits():
    q, k, v, kc, vc, pos = case(1, 8, 2, 64, 256, [200], 1, seed=5)
    scale = 64 ** -0.5
    rk, rv = kc.clone(), vc.clone()
    ref = reference(q, k, v, rk, rv, pos, scale=scale)
    tk.write_cache(kc, k, pos[:, 0].contiguous())
    tk.write_cache(vc, v, pos[:, 0].contiguous())
    got = tk.decode(q, kc, vc, (pos[:, 0] + 1).contiguous(), scale, split_len=32)  # 8 splits, 2 of them empty
    assert (got - ref).abs().max() < 1e-5


def test_custom_op_matches_reference_and_mutates_the_caches():
    from kvedge.kernels.op import attention_op

    q, k, v, kc, vc, pos = case(2, 8, 2, 64, 32, [3, 10], 4, seed=6)
    rk, rv = kc.clone(), vc.clone()
    ref = reference(q, k, v, rk, rv, pos, scale=0.125, window=None, softcap=None)
    got = attention_op(q, k, v, kc, vc, pos, scale=0.125)
    assert (got - ref).abs().max() < 1e-5 and torch.equal(kc, rk) and torch.equal(vc, rv)


def test_decoder_generates_the_same_tokens_through_the_triton_op(hf_checkpoint):
    from kvedge.kernels.op import attention_op
    from kvedge.models import KVCache, load_decoder

    model = load_decoder(hf_checkpoint("mistral-window")[0], device=DEV)
    ids = torch.arange(3, 23, device=DEV)[None]
    outs = []
    for op in (model.attention_op, attention_op):
        model.attention_op = op
        cache = KVCache.allocate(model.cfg, 1, 40, device=DEV)
        logits = model(ids, torch.arange(20, device=DEV)[None], cache.for_batch(1), logit_index=torch.tensor([19], device=DEV))
        toks = []
        for s in range(8):
            t = logits[0, -1].argmax()
            toks.append(int(t))
            logits = model(t.view(1, 1), torch.tensor([[20 + s]], device=DEV), cache.for_batch(1))
        outs.append((toks, logits))
    assert outs[0][0] == outs[1][0] and (outs[0][1] - outs[1][1]).abs().max() < 1e-4
