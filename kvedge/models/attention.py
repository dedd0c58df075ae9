"""The one attention op of kvedge, and the semantics every lowering must reproduce.

    attention(q, k, v, k_cache, v_cache, positions, scale=..., window=..., softcap=...)

- q [B, Hq, L, D]; k, v [B, Hkv, L, D]: the new tokens' projections.
- rope: None (no rotary embedding, or it was applied by the caller) or (cos, sin) tables
  [S_table, rotary_dim / 2] (kvedge.models.rope.tables): q and k are rotated at `positions` first.
  Rotation belongs to the op so that a target can fuse it with the cache write (ONNX Runtime's
  GroupQueryAttention do_rotary, the Triton kernels).
- k_cache, v_cache [B, Hkv, S_max, D]: preallocated; the new k, v are written in place at `positions`.
- positions [B, L] int64: each row's absolute positions, contiguous within a row (p0, p0+1, ...).
  Rows may start at different positions (ragged batches).
- Query at position p sees cache slot j iff j <= p, and p - j < window when a window is set.
  For a block of L queries against S = p0 + L keys this is the causal mask aligned right
  (query i sees keys <= S - L + i), never a square L x L mask.
- GQA: query head h reads KV head h // (Hq / Hkv). K/V are never repeated to Hq heads.
- MLA (multi-head latent attention, absorbed): q is [B, Hq, L, Dk + Dv], wider than the key cache by the value
  cache's width. Then the key of a slot is [its k entry, its v entry] (the decoupled RoPE key k_rope, d_R = Dk,
  then the latent c_kv, d_c = Dv) and its value is its v entry; Hkv = 1 and the output is [B, Hq, L, Dv]. RoPE
  rotates q's first Dk channels (q_rope; the rest, q_nope @ W_uk, passes) and all of k (k_rope).
- An int8 cache comes with k_scale, v_scale (float32, broadcastable to the cache: [1, Hkv, 1, D] per
  channel, calibrated per layer): the new k (after RoPE) and v are quantized on write, symmetric,
  round(x * (1 / scale)) half to even, clamped to [-128, 127], and attention reads the dequantized
  cache (int8 * scale), new tokens included. This is ONNX Runtime's GroupQueryAttention CPU kernel
  bit for bit (tests/models/test_kv_int8.py).
- A float cache narrower than q (float16 under a float32 model, kv_dtype "fp16") holds the new k and v
  rounded to its dtype on write (to nearest even), and attention reads it as q's dtype.
- Softmax runs over the key axis, in float32, after masking (masked scores are -inf, not zeroed
  probabilities), and after the optional softcap tanh(s / c) * c.

Export replaces this function per target (see kvedge.export); the Decoder calls it through
`Decoder.attention_op`, so there is one model definition for every lowering.
"""

from __future__ import annotations

import torch

from kvedge.models.rope import apply_rope


def write_cache(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> None:
    """Write new [B, Hkv, L, D] into cache [B, Hkv, S, D] at positions [B, L], in place."""
    b, h, l, d = new.shape
    index = positions[:, None, :, None].expand(b, h, l, d)
    cache.scatter_(2, index, new.to(cache.dtype))  # a float16 cache under a float32 model: rounded here


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float -> int8 cache entries: round-half-even(x * (1 / scale)) clamped to [-128, 127], in float32."""
    return torch.round(x.float() * torch.reciprocal(scale)).clamp_(-128, 127).to(torch.int8)


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (cache.float() * scale).to(dtype)


def visible(positions: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """Boolean [B, L, kv_len]: may the query at positions[b, i] see cache slot j."""
    keys = torch.arange(kv_len, device=positions.device)
    q = positions[:, :, None]
    ok = keys <= q
    if window is not None:
        ok = ok & (keys > q - window)
    return ok


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q, k (if rope), write k, v into the caches at `positions` (quantized with k_scale, v_scale
    for an int8 cache), then attend q over the cache. Returns [B, Hq, L, Dv] (the value cache's width)."""
    if rope is not None:
        q, k = apply_rope(q, *rope, positions), apply_rope(k, *rope, positions)
    if k_scale is not None:
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    write_cache(k_cache, k, positions)
    write_cache(v_cache, v, positions)
    b, hq, l, d = q.shape
    hkv = k_cache.shape[1]
    kv_len = int(positions.max()) + 1  # slots past every row's last position are never visible
    keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
    if k_scale is not None:
        keys, values = dequantize_kv(keys, k_scale, q.dtype), dequantize_kv(values, v_scale, q.dtype)
    elif keys.dtype != q.dtype:  # a float16 cache under a float32 model: read as q's dtype
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if d != keys.shape[-1]:  # MLA: the key is [k_rope, c_kv]
        keys = torch.cat((keys, values), dim=-1)
    keys, values = keys.unsqueeze(2), values.unsqueeze(2)  # [B, Hkv, 1, S, D]: shared by the group, not copied
    qg = q.view(b, hkv, hq // hkv, l, d)  # [B, Hkv, G, L, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = visible(positions, kv_len, window)[:, None, None]  # [B, 1, 1, L, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).view(b, hq, l, -1)
