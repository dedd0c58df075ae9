"""Rotary position embedding: inverse frequencies (with scaling variants), cos/sin, and rotation.

Layout is the Hugging Face one: the rotated part of a head is split in two halves (not interleaved).
"""

from __future__ import annotations

import math

import torch

from kvedge.models.config import ModelConfig


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32, after the config's rope scaling."""
    dim = cfg.rotary_dim
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
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


def cos_sin(freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [batch, 1, seq, rotary_dim] for int64 positions [batch, seq]."""
    angles = positions.to(torch.float32)[..., None] * freq  # [B, L, dim/2]
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [batch, heads, seq, head_dim]; pass the rest through."""
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
