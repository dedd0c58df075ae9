"""Fused GQA attention in Triton: cache write with RoPE, split-K decode ("flash-decoding"), tiled prefill.

Same semantics as kvedge.models.attention.attention (the reference): q and k are rotated at their
positions by the RoPE tables (cos, sin [S_table, rotary_dim / 2], half rotation of the first
rotary_dim channels), the new K/V are written into the [B, Hkv, S_max, D] caches at each row's
positions, then the query at position p attends to cache slots j <= p (and p - j < window), softmax
over keys in float32 after the optional softcap.

- cache write: one program per (row, KV head, block of new tokens); K is rotated as it is written.
- decode: one program per (row, KV head, split of the cache). It loads (and rotates) the G query heads
  of the group once and reads each K/V block once for all of them, so a GQA group shares its cache
  reads. Partial (max, sum, acc) per split are combined afterwards.
- prefill: one program per (row, query head, block of queries), online softmax over key blocks up
  to the block's last position: no L x S score matrix is materialized. Q is rotated as it is loaded.
  With FUSED it is also the whole op in one launch (what the TensorRT plugin's AOT path compiles):
  keys before the row's first new position come from the cache, the new ones from k/v (rotated as
  loaded), and the first query head of each group writes its block's new K/V into the cache.
head_dim is padded to a power of two with masks (80, 96, 160 work); any GQA ratio, MHA and MQA; any
even rotary_dim <= head_dim (partial rotary included).
Runs on CUDA GPUs, and on the CPU under TRITON_INTERPRET=1 (how CI tests it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _load_rotated(ptr, rows, d, mask, cos, sin, pos, HALF: tl.constexpr):
    """The [R, BLOCK_D] tile at ptr + rows[:, None] + d in float32, rotated at positions pos [R] by the
    tables [S, HALF] (kvedge.models.rope.apply_rope); HALF 0: loaded as is."""
    x = tl.load(ptr + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HALF > 0:
        first = d < HALF  # x1 -> x1 cos - x2 sin; x2 -> x2 cos + x1 sin; channels past 2 * HALF pass
        rot = mask & (d < 2 * HALF)[None, :]
        partner = tl.load(ptr + rows[:, None] + tl.where(first, d + HALF, d - HALF)[None, :], mask=rot,
                          other=0.0).to(tl.float32)
        t = pos[:, None] * HALF + tl.where(first, d, d - HALF)[None, :]
        c = tl.load(cos + t, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin + t, mask=rot, other=0.0).to(tl.float32)
        x = x * c + partner * tl.where(first[None, :], -s, s)
    return x


@triton.jit
def _cache_write(new, cache, start, cos, sin, L, D, s_nb, s_nh, s_nl, s_cb, s_ch, s_cs, HALF: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h, lb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < L) & (d[None, :] < D)
    p0 = tl.load(start + b)
    x = _load_rotated(new + b * s_nb + h * s_nh, rows * s_nl, d, mask, cos, sin, p0 + rows, HALF)
    tl.store(cache + b * s_cb + h * s_ch + (p0 + rows[:, None]) * s_cs + d[None, :],
             x.to(cache.dtype.element_ty), mask=mask)


@triton.jit
def _decode(q, kc, vc, lens, cos, sin, m_out, l_out, acc_out, scale, softcap, window, D, G, split_len,
            s_qb, s_qh, s_kb, s_kh, s_ks, s_ob, s_oh, s_os, HALF: tl.constexpr,
            BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens + b)  # keys 0..n-1; the query sits at position n - 1
    lo = n * 0  # n's integer type: Triton 3.6 rejects an if that retypes a variable (int32 -> int64)
    if window > 0:
        lo = tl.maximum(n - window, 0)
    start = tl.maximum(lo, split * split_len)
    end = tl.minimum(n, (split + 1) * split_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    qmask = (g[:, None] < G) & (d[None, :] < D)
    qv = _load_rotated(q + b * s_qb, heads * s_qh, d, qmask, cos, sin, g * 0 + n - 1, HALF)
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
def _prefill(q, k, v, kc, vc, positions, cos, sin, L, out, kc_out, vc_out,
             scale: tl.constexpr, softcap: tl.constexpr, window: tl.constexpr, HQ: tl.constexpr,
             HKV: tl.constexpr, S_MAX: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, FUSED: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """All tensors contiguous: q, out [B, HQ, L, D]; k, v [B, HKV, L, D]; caches [B, HKV, S_MAX, D];
    positions [B, L]. The parameter order is the TensorRT AOT plugin's: the plugin's inputs, the scalar
    L, then its outputs (out, and the caches again: TensorRT's aliased present_key / present_value)."""
    b, h, mb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    G: tl.constexpr = HQ // HKV
    kvh = h // G
    p0 = tl.load(positions + b * L).to(tl.int32)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qmask = (rows[:, None] < L) & (d[None, :] < D)
    q_off = ((b * HQ + h) * L) * D
    qv = _load_rotated(q + q_off, rows * D, d, qmask, cos, sin, p0 + rows, HALF).to(kc.dtype.element_ty)
    cache = ((b * HKV + kvh) * S_MAX) * D
    new = ((b * HKV + kvh) * L) * D
    if FUSED:
        if h % G == 0:  # one program per KV head writes this block's new K/V; readers never read them back
            wk = _load_rotated(k + new, rows * D, d, qmask, cos, sin, p0 + rows, HALF)
            dst = cache + (p0 + rows[:, None]) * D + d[None, :]
            tl.store(kc_out + dst, wk.to(kc_out.dtype.element_ty), mask=qmask)
            wv = tl.load(v + new + rows[:, None] * D + d[None, :], mask=qmask, other=0.0)
            tl.store(vc_out + dst, wv, mask=qmask)
    qpos = p0 + rows  # absolute positions: right-aligned causal for L != S
    hi = p0 + tl.minimum((mb + 1) * BLOCK_M, L)  # keys past the block's last query are never visible
    lo = p0 * 0  # p0's integer type, as in _decode
    if window > 0:
        lo = tl.maximum(p0 + mb * BLOCK_M - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kmask = (j[:, None] < hi) & (d[None, :] < D)
        kv_off = cache + j[:, None] * D + d[None, :]
        if FUSED:  # slots < p0 from the cache, the rest from this call's k/v
            old = kmask & (j < p0)[:, None]
            fresh = kmask & (j >= p0)[:, None]
            kn = _load_rotated(k + new, (j - p0) * D, d, fresh, cos, sin, j, HALF).to(kc.dtype.element_ty)
            kt = tl.where(old, tl.load(kc + kv_off, mask=old, other=0.0), kn)
            vn = tl.load(v + new + (j - p0)[:, None] * D + d[None, :], mask=fresh, other=0.0)
            vt = tl.where(old, tl.load(vc + kv_off, mask=old, other=0.0), vn)
        else:
            kt = tl.load(kc + kv_off, mask=kmask, other=0.0)
            vt = tl.load(vc + kv_off, mask=kmask, other=0.0)
        s = tl.dot(qv, tl.trans(kt), input_precision="ieee").to(tl.float32) * scale  # fp32 stays fp32, not tf32
        if softcap > 0:
            s = _tanh(s / softcap) * softcap
        ok = (j[None, :] <= qpos[:, None]) & (j[None, :] < hi)
        if window > 0:
            ok = ok & (j[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee").to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    o = acc / l[:, None]
    tl.store(out + q_off + rows[:, None] * D + d[None, :], o.to(out.dtype.element_ty), mask=qmask)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


PREFILL_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (8 where there are none: Triton's CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _tables(rope, like):
    """(cos, sin, HALF) for the kernels: contiguous tables, or q itself as a never-read placeholder."""
    if rope is None:
        return like, like, 0
    cos, sin = (t.contiguous() for t in rope)
    return cos, sin, cos.shape[1]


def write_cache(cache: torch.Tensor, new: torch.Tensor, start: torch.Tensor, rope=None) -> None:
    """new [B, H, L, D] into cache [B, H, S, D] at start[b] + i, rotated first when rope = (cos, sin)."""
    b, h, l, d = new.shape
    new = new.contiguous()
    cos, sin, half = _tables(rope, new)
    bl = 16
    _cache_write[(b, h, triton.cdiv(l, bl))](new, cache, start, cos, sin, l, d, *new.stride()[:3],
                                            *cache.stride()[:3], HALF=half, BLOCK_L=bl, BLOCK_D=_pow2(d))


def decode(q, k_cache, v_cache, lens, scale, window=0, softcap=0.0, split_len=None, rope=None):
    """q [B, Hq, 1, D] at position lens - 1 of each row (rotated there when rope); returns [B, Hq, 1, D]."""
    b, hq, _, d = q.shape
    hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    # enough programs to keep every multiprocessor streaming (b * hkv alone is a few dozen), sized from the
    # cache, not from lens: reading lens.max() on the host would wait for the GPU at every step
    want = triton.cdiv(4 * _multiprocessors(q.device), b * hkv)
    split_len = split_len or max(64, triton.next_power_of_2(triton.cdiv(s_max, want)))
    splits = triton.cdiv(s_max, split_len)
    bd = _pow2(d)
    m = torch.empty((b, hq, splits), device=q.device)  # every split writes its entries, an empty one (-inf, 0, 0)
    lsum = torch.empty((b, hq, splits), device=q.device)
    acc = torch.empty((b, hq, splits, bd), device=q.device)
    qs = q[:, :, 0]
    cos, sin, half = _tables(rope, q)
    _decode[(b, hkv, splits)](qs, k_cache, v_cache, lens, cos, sin, m, lsum, acc, scale, softcap, window, d, g,
                              split_len, qs.stride(0), qs.stride(1), *k_cache.stride()[:3], *m.stride(), HALF=half,
                              BLOCK_G=_pow2(g, 2), BLOCK_N=32, BLOCK_D=bd, HAS_SOFTCAP=softcap > 0)
    # combine the splits: weights exp(m_i - max m), empty splits (m = -inf) weigh 0
    top = m.max(dim=-1, keepdim=True).values
    w = torch.exp(m - top)
    out = (acc[..., :d] * w[..., None]).sum(2) / (lsum * w).sum(2)[..., None]
    return out[:, :, None].to(q.dtype)


def prefill(q, k, v, k_cache, v_cache, positions, scale, window=0, softcap=0.0, rope=None, fused=False):
    """q [B, Hq, L, D] at positions [B, L] (contiguous per row); returns [B, Hq, L, D].

    fused=False: the caches already hold this call's K/V (write_cache); k, v are not read.
    fused=True: the whole op in one launch (the plugin's AOT kernel): k, v are written into the caches
    here and read from k, v directly."""
    b, hq, l, d = q.shape
    hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the prefill kernel needs contiguous [B, Hkv, S, D] caches")
    q, k, v, positions = q.contiguous(), k.contiguous(), v.contiguous(), positions.contiguous()
    out = torch.empty_like(q)
    cos, sin, half = _tables(rope, q)
    _prefill[(b, hq, triton.cdiv(l, PREFILL_BLOCKS["BLOCK_M"]))](
        q, k, v, k_cache, v_cache, positions, cos, sin, l, out, k_cache, v_cache,
        **constexprs(scale, window, softcap, hq, hkv, s_max, d, half, fused))
    return out


def constexprs(scale, window, softcap, hq, hkv, s_max, d, half, fused) -> dict:
    """The _prefill kernel's compile-time constants (shared with the TensorRT plugin's AOT compile)."""
    return dict(scale=float(scale), softcap=float(softcap or 0.0), window=int(window or 0), HQ=hq, HKV=hkv,
                S_MAX=s_max, D=d, HALF=half, FUSED=bool(fused), BLOCK_D=_pow2(d), **PREFILL_BLOCKS)


def attention(q, k, v, k_cache, v_cache, positions, *, scale, window=None, softcap=None, rope=None):
    """Drop-in for kvedge.models.attention.attention (positions contiguous per row)."""
    start = positions[:, 0].contiguous()
    write_cache(k_cache, k, start, rope)
    write_cache(v_cache, v, start)
    w, c = int(window or 0), float(softcap or 0.0)
    if q.shape[2] == 1:
        return decode(q, k_cache, v_cache, (start + 1).contiguous(), scale, w, c, rope=rope)
    return prefill(q, k, v, k_cache, v_cache, positions, scale, w, c, rope=rope)
