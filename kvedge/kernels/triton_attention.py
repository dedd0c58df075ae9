"""Fused GQA attention in Triton: cache write, split-K decode ("flash-decoding"), tiled prefill.

Same semantics as kvedge.models.attention.attention (the reference): the new K/V are written into
the [B, Hkv, S_max, D] caches at each row's positions, then the query at position p attends to
cache slots j <= p (and p - j < window), softmax over keys in float32 after the optional softcap.

- decode: one program per (row, KV head, split of the cache). It loads the G query heads of the
  group once and reads each K/V block once for all of them, so a GQA group shares its cache reads.
  Partial (max, sum, acc) per split are combined afterwards.
- prefill: one program per (row, query head, block of queries), online softmax over key blocks up
  to the block's last position: no L x S score matrix is materialized.
head_dim is padded to a power of two with masks (80, 96, 160 work); any GQA ratio, MHA and MQA.
Runs on CUDA GPUs, and on the CPU under TRITON_INTERPRET=1 (how CI tests it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _cache_write(new, cache, start, L, D, s_nb, s_nh, s_nl, s_cb, s_ch, s_cs, BLOCK_L: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    b, h, lb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < L) & (d[None, :] < D)
    p0 = tl.load(start + b)
    x = tl.load(new + b * s_nb + h * s_nh + rows[:, None] * s_nl + d[None, :], mask=mask)
    tl.store(cache + b * s_cb + h * s_ch + (p0 + rows[:, None]) * s_cs + d[None, :], x, mask=mask)


@triton.jit
def _decode(q, kc, vc, lens, m_out, l_out, acc_out, scale, softcap, window, D, G, split_len,
            s_qb, s_qh, s_kb, s_kh, s_ks, s_ob, s_oh, s_os,
            BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens + b)  # keys 0..n-1; the query sits at position n - 1
    lo = 0
    if window > 0:
        lo = tl.maximum(n - window, 0)
    start = tl.maximum(lo, split * split_len)
    end = tl.minimum(n, (split + 1) * split_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    qmask = (g[:, None] < G) & (d[None, :] < D)
    qv = tl.load(q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kmask = (j[:, None] < end) & (d[None, :] < D)
        kv_off = b * s_kb + kvh * s_kh + j[:, None] * s_ks + d[None, :]
        k = tl.load(kc + kv_off, mask=kmask, other=0.0).to(tl.float32)
        s = tl.sum(qv[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]: the group shares this read
        if HAS_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        s = tl.where((j < end)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(vc + kv_off, mask=kmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    gmask = g < G
    o = b * s_ob + heads * s_oh + split * s_os
    tl.store(m_out + o, m, mask=gmask)
    tl.store(l_out + o, l, mask=gmask)
    tl.store(acc_out + o[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None] & (d[None, :] < BLOCK_D))


@triton.jit
def _prefill(q, kc, vc, out, start_pos, scale, softcap, window, L, D, G,
             s_qb, s_qh, s_ql, s_kb, s_kh, s_ks, s_ob, s_oh, s_ol,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    b, h, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh = h // G
    p0 = tl.load(start_pos + b)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qmask = (rows[:, None] < L) & (d[None, :] < D)
    qv = tl.load(q + b * s_qb + h * s_qh + rows[:, None] * s_ql + d[None, :], mask=qmask, other=0.0)
    qpos = p0 + rows  # absolute positions: right-aligned causal for L != S
    hi = p0 + tl.minimum((mb + 1) * BLOCK_M, L)  # keys past the block's last query are never visible
    lo = 0
    if window > 0:
        lo = tl.maximum(p0 + mb * BLOCK_M - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kmask = (j[:, None] < hi) & (d[None, :] < D)
        kv_off = b * s_kb + kvh * s_kh + j[:, None] * s_ks + d[None, :]
        k = tl.load(kc + kv_off, mask=kmask, other=0.0)
        s = tl.dot(qv, tl.trans(k)).to(tl.float32) * scale
        if HAS_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        ok = (j[None, :] <= qpos[:, None]) & (j[None, :] < hi)
        if window > 0:
            ok = ok & (j[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(vc + kv_off, mask=kmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    o = acc / l[:, None]
    tl.store(out + b * s_ob + h * s_oh + rows[:, None] * s_ol + d[None, :], o.to(out.dtype.element_ty), mask=qmask)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def write_cache(cache: torch.Tensor, new: torch.Tensor, start: torch.Tensor) -> None:
    b, h, l, d = new.shape
    new = new.contiguous()
    bl = 16
    _cache_write[(b, h, triton.cdiv(l, bl))](new, cache, start, l, d, *new.stride()[:3], *cache.stride()[:3],
                                            BLOCK_L=bl, BLOCK_D=_pow2(d))


def decode(q, k_cache, v_cache, lens, scale, window=0, softcap=0.0, split_len=None):
    """q [B, Hq, 1, D] at position lens - 1 of each row; returns [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    split_len = split_len or max(64, triton.next_power_of_2(triton.cdiv(int(lens.max()), 8)))
    splits = triton.cdiv(s_max, split_len)
    bd = _pow2(d)
    m = torch.full((b, hq, splits), float("-inf"), device=q.device)
    lsum = torch.zeros((b, hq, splits), device=q.device)
    acc = torch.zeros((b, hq, splits, bd), device=q.device)
    qs = q[:, :, 0]
    _decode[(b, hkv, splits)](qs, k_cache, v_cache, lens, m, lsum, acc, scale, softcap, window, d, g, split_len,
                              qs.stride(0), qs.stride(1), *k_cache.stride()[:3], *m.stride(),
                              BLOCK_G=_pow2(g, 2), BLOCK_N=32, BLOCK_D=bd, HAS_SOFTCAP=softcap > 0)
    # combine the splits: weights exp(m_i - max m), empty splits (m = -inf) weigh 0
    top = m.max(dim=-1, keepdim=True).values
    w = torch.exp(m - top)
    out = (acc[..., :d] * w[..., None]).sum(2) / (lsum * w).sum(2)[..., None]
    return out[:, :, None].to(q.dtype)


def prefill(q, k_cache, v_cache, start, scale, window=0, softcap=0.0):
    """q [B, Hq, L, D] at positions start[b] + i; returns [B, Hq, L, D]."""
    b, hq, l, d = q.shape
    g = hq // k_cache.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    bm = 16
    _prefill[(b, hq, triton.cdiv(l, bm))](q, k_cache, v_cache, out, start, scale, softcap, window, l, d, g,
                                          *q.stride()[:3], *k_cache.stride()[:3], *out.stride()[:3],
                                          BLOCK_M=bm, BLOCK_N=16, BLOCK_D=_pow2(d), HAS_SOFTCAP=softcap > 0)
    return out


def attention(q, k, v, k_cache, v_cache, positions, *, scale, window=None, softcap=None):
    """Drop-in for kvedge.models.attention.attention (positions contiguous per row)."""
    start = positions[:, 0].contiguous()
    write_cache(k_cache, k, start)
    write_cache(v_cache, v, start)
    w, c = int(window or 0), float(softcap or 0.0)
    if q.shape[2] == 1:
        return decode(q, k_cache, v_cache, (start + 1).contiguous(), scale, w, c)
    return prefill(q, k_cache, v_cache, start, scale, w, c)
