"""The attention op against an independent reference, and one test per classic attention bug.

The bugs (from the lessons this project grew from): softmax on the wrong axis, the mask applied after
softmax, a square mask where L != S, and h_q used instead of h_kv.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvedge.models import KVCache, ModelConfig, attention, kv_bytes_per_token


def naive(q, k_cache, v_cache, positions, scale, window=None, softcap=None):
    """Per (row, head, query) loops in float64 numpy, written from the formula, not from kvedge."""
    q, kc, vc, pos = (t.double().numpy() for t in (q, k_cache, v_cache, positions))
    b, hq, l, d = q.shape
    g = hq // kc.shape[1]
    out = np.zeros_like(q)
    for r in range(b):
        for h in range(hq):
            kvh = h // g
            for i in range(l):
                p = int(pos[r, i])
                lo = 0 if window is None else max(0, p - window + 1)
                keys = range(lo, p + 1)
                s = np.array([q[r, h, i] @ kc[r, kvh, j] * scale for j in keys])
                if softcap is not None:
                    s = np.tanh(s / softcap) * softcap
                w = np.exp(s - s.max())
                w /= w.sum()
                out[r, h, i] = sum(wj * vc[r, kvh, j] for wj, j in zip(w, keys))
    return torch.from_numpy(out)


def random_case(b, hq, hkv, d, s_max, starts, l, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, l, d, generator=g)
    k = torch.randn(b, hkv, l, d, generator=g)
    v = torch.randn(b, hkv, l, d, generator=g)
    kc = torch.randn(b, hkv, s_max, d, generator=g)  # "history" (and garbage beyond it)
    vc = torch.randn(b, hkv, s_max, d, generator=g)
    positions = torch.tensor(starts)[:, None] + torch.arange(l)
    return [t.to(dtype) for t in (q, k, v, kc, vc)] + [positions]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (7, 1), (14, 2)])
@pytest.mark.parametrize("l,window,softcap", [(1, None, None), (5, None, None), (4, 6, None), (3, None, 2.0)])
def test_matches_naive_reference(hq, hkv, l, window, softcap):
    d = 16
    q, k, v, kc, vc, pos = random_case(2, hq, hkv, d, 24, [9, 3], l)
    out = attention(q, k, v, kc, vc, pos, scale=d**-0.5, window=window, softcap=softcap)
    # the new k, v are in the cache now: the reference reads the same cache
    ref = naive(q, kc, vc, pos, d**-0.5, window, softcap)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def identity_values(b, hkv, s, d):
    """v_cache whose slot j holds e_j: attention output over it is the probability row itself."""
    assert d >= s
    eye = torch.zeros(b, hkv, s, d)
    eye[..., torch.arange(s), torch.arange(s)] = 1.0
    return eye


def test_softmax_runs_over_keys_and_masked_keys_get_zero_probability():
    b, hq, hkv, s, l = 1, 2, 1, 12, 4
    q, k, _, kc, _, pos = random_case(b, hq, hkv, s, s, [5], l)
    vc = identity_values(b, hkv, s, s)
    v = vc[:, :, 5:9].clone()  # writing the new v keeps the identity layout
    probs = attention(q, k, v, kc, vc, pos, scale=1.0)  # [B, Hq, L, S]: one probability row per query
    # Bug "softmax on the wrong axis": rows would not sum to 1 over the keys.
    assert torch.allclose(probs.sum(-1), torch.ones(b, hq, l), atol=1e-6)
    # Bug "mask after softmax": masked keys would still have taken probability mass (rows sum < 1),
    # and the renormalization would be wrong. Every key after the query's position has exactly 0.
    for i in range(l):
        p = 5 + i
        assert torch.all(probs[0, :, i, p + 1:] == 0)
        assert torch.all(probs[0, :, i, :p + 1] > 0)


def test_cache_contents_after_a_rows_position_are_invisible():
    q, k, v, kc, vc, pos = random_case(2, 4, 2, 8, 20, [6, 2], 3)
    out = attention(q, k, v, kc.clone(), vc.clone(), pos, scale=0.3)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[0, :, 9:] = 1e4  # far future of row 0 (its last position is 8)
    vc2[0, :, 9:] = -1e4
    kc2[1, :, 5:] = 1e4  # row 1's last position is 4
    vc2[1, :, 5:] = 1e4
    assert torch.equal(out, attention(q, k, v, kc2, vc2, pos, scale=0.3))


def test_query_block_shorter_than_keys_uses_right_aligned_causal_mask():
    """Bug "square mask where L != S": 3 queries against S = 10 keys; query i sees keys <= 7 + i."""
    l, s, d = 3, 10, 8
    q, k, v, kc, vc, pos = random_case(1, 2, 1, d, s, [7], l)
    out = attention(q, k, v, kc, vc, pos, scale=d**-0.5)
    assert torch.allclose(out.double(), naive(q, kc, vc, pos, d**-0.5), atol=1e-6)
    # With a square (L x L) lower-triangular mask the first query would see one key; it must see 8.
    kc_changed = kc.clone()
    kc_changed[0, :, 4] += 3.0  # an old key: visible to every query of the block
    changed = attention(q, k, v, kc_changed, vc.clone(), pos, scale=d**-0.5)
    assert not torch.allclose(changed[0, :, 0], out[0, :, 0])
    # ... and must not see keys 8 and 9, which belong to the later queries.
    first_only = attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], kc.clone(), vc.clone(), pos[:, :1],
                           scale=d**-0.5)
    assert torch.allclose(first_only[0, :, 0], out[0, :, 0], atol=1e-6)


def test_each_query_head_reads_its_groups_kv_head():
    """Bug "h_q instead of h_kv": query head h must read KV head h // (Hq / Hkv)."""
    b, hq, hkv, d, s = 1, 8, 2, 4, 6
    q, k, _, kc, _, pos = random_case(b, hq, hkv, d, s, [0], s)
    vc = torch.zeros(b, hkv, s, d)
    v = torch.stack([torch.full((s, d), float(j)) for j in range(hkv)])[None]  # KV head j holds value j
    out = attention(q, k, v, kc, vc, pos, scale=1.0)
    for h in range(hq):
        assert torch.allclose(out[0, h], torch.full((s, d), float(h // (hq // hkv))))


def test_cache_is_allocated_with_kv_heads_not_query_heads():
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=2,
                      head_dim=8, intermediate_size=32)
    cache = KVCache.allocate(cfg, max_batch=2, max_seq_len=16)
    assert len(cache.keys) == len(cache.values) == 3
    assert all(t.shape == (2, 2, 16, 8) for t in cache.keys + cache.values)
    assert cache.nbytes == kv_bytes_per_token(3, 2, 8, torch.float32) * 16 * 2


def test_fp16_attention_close_to_fp32_reference():
    d = 64
    q, k, v, kc, vc, pos = random_case(2, 8, 2, d, 32, [20, 7], 4)
    ref = naive(q, kc.clone().scatter_(2, pos[:, None, :, None].expand(2, 2, 4, d), k),
                vc.clone().scatter_(2, pos[:, None, :, None].expand(2, 2, 4, d), v), pos, d**-0.5)
    half = [t.half() for t in (q, k, v, kc, vc)]
    out = attention(*half, pos, scale=d**-0.5)
    assert (out.double() - ref).abs().max() < 2e-3


def test_float16_cache_under_float32_queries_holds_rounded_keys_and_values():
    """kv_dtype fp16 under a float32 model: the new k, v are rounded to float16 as they are written, and
    attention (in float32) reads the cache as float32: the naive formula over the float16-rounded cache."""
    d = 64
    q, k, v, kc, vc, pos = random_case(2, 6, 2, d, 32, [20, 7], 3)
    kc16, vc16 = kc.half(), vc.half()
    out = attention(q, k, v, kc16, vc16, pos, scale=d**-0.5)
    index = pos[:, None, :, None].expand(2, 2, 3, d)
    assert torch.equal(kc16.gather(2, index), k.half()) and torch.equal(vc16.gather(2, index), v.half())
    ref = naive(q, kc.scatter(2, index, k.half().float()).half(), vc.scatter(2, index, v.half().float()).half(),
                pos, d**-0.5)
    assert out.dtype == torch.float32 and (out.double() - ref).abs().max() < 1e-5
    full = naive(q, kc.scatter(2, index, k), vc.scatter(2, index, v), pos, d**-0.5)  # what rounding changes
    assert (full - ref).abs().max() > 1e-4
