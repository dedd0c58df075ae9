"""Rotary position embedding: inverse frequencies (with scaling variants), cos/sin, and rotation.

Layout is the Hugging Face one: the rotated part of a head is split in two halves (not interleaved).
"""

from __future__ import annotations

import math

import torch

from kvedge.models.config import ModelConfig


def inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32, after the config's rope scaling (local: those of the
    sliding-window layers, rope_local_theta, unscaled)."""
    dim = cfg.rotary_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = None if local else cfg.rope_scaling
    if s is None:
        return freq
    if s["rope_type"] == "linear":
        return freq / s["factor"]
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between smoothed.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_len / lo, freq / factor, freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled)


def tables(freq: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [length, rotary_dim / 2]: row p holds the angles p * freq, for positions 0..length-1.

    This is the layout ONNX Runtime's GroupQueryAttention (do_rotary) and ONNX's RotaryEmbedding take as
    cos_cache / sin_cache, so every lowering can share one table."""
    angles = torch.arange(length, dtype=torch.float32, device=freq.device)[:, None] * freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [batch, heads, seq, head_dim] by the table rows at
    positions [batch, seq] (half rotation: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)); pass the rest."""
    c, s = cos[positions][:, None], sin[positions][:, None]  # [B, 1, L, rot/2]
    half = c.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)
