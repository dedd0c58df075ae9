"""Rotary position embedding: inverse frequencies (with scaling variants), cos/sin, and rotation.

Layout is the Hugging Face one: the rotated part of a head is split in two halves (not interleaved).
"""

from __future__ import annotations

import math

import torch

from kvedge.errors import ConfigError
from kvedge.models.config import ModelConfig


def inv_freq(cfg: ModelConfig, local: bool = False, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32, after the config's rope scaling (local: those of the
    sliding-window layers, rope_local_theta, unscaled; long: longrope's set past its original length)."""
    dim = cfg.rotary_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    s = None if local else cfg.rope_scaling
    if s is not None and s["rope_type"] == "longrope":  # each frequency divided by its own factor
        ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
        if ext.numel() != dim // 2:
            raise ConfigError(f"longrope has {ext.numel()} factors for {dim // 2} rotary frequencies")
        return 1.0 / (ext * theta ** exponents)
    freq = 1.0 / (theta ** exponents)
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


def attention_factor(cfg: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (longrope's attention_factor; 1 otherwise)."""
    s = cfg.rope_scaling
    return s["attention_factor"] if s is not None and s["rope_type"] == "longrope" else 1.0


def long_switch(cfg: ModelConfig) -> int | None:
    """longrope: a forward whose largest position reaches this (original_max_position_embeddings) runs on the
    long frequencies, every row and position of it, as transformers switches; None without longrope."""
    s = cfg.rope_scaling
    return s["original_max_position_embeddings"] if s is not None and s["rope_type"] == "longrope" else None


def buffers(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The Decoder's frequency buffers: inv_freq, and inv_freq_local (gemma3's sliding layers) or inv_freq_long
    (longrope) where the config has them."""
    if cfg.positions != "rope":
        return {"inv_freq": torch.empty(0)}
    out = {"inv_freq": inv_freq(cfg)}
    if cfg.rope_local_theta is not None:
        out["inv_freq_local"] = inv_freq(cfg, local=True)
    if long_switch(cfg) is not None:
        out["inv_freq_long"] = inv_freq(cfg, long=True)
    return out


def layer_kind(cfg: ModelConfig, index: int) -> str | None:
    """Which table layer `index` rotates with: None (no RoPE), "global" or "local" (gemma3's sliding-window
    layers, rope_local_theta)."""
    if cfg.positions != "rope" or not cfg.layer_rope[index]:
        return None
    return "local" if cfg.rope_local_theta is not None and cfg.layer_windows[index] else "global"


def all_tables(cfg: ModelConfig, freqs: dict[str, torch.Tensor], length: int,
               dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"global": tables[, "local": rope_local_theta's][, "long": longrope's]} from the frequency buffers
    (`buffers(cfg)`, or a Decoder's own)."""
    scale = attention_factor(cfg)
    out = {"global": tables(freqs["inv_freq"], length, dtype, scale)}
    if "inv_freq_local" in freqs:
        out["local"] = tables(freqs["inv_freq_local"], length, dtype)
    if "inv_freq_long" in freqs:
        out["long"] = tables(freqs["inv_freq_long"], length, dtype, scale)
    return out


def tables(freq: torch.Tensor, length: int, dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [length, rotary_dim / 2]: row p holds the angles p * freq, for positions 0..length-1,
    times `scale` (attention_factor).

    This is the layout ONNX Runtime's GroupQueryAttention (do_rotary) and ONNX's RotaryEmbedding take as
    cos_cache / sin_cache, so every lowering can share one table."""
    angles = torch.arange(length, dtype=torch.float32, device=freq.device)[:, None] * freq
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)  # scale 1: the same values


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [batch, heads, seq, head_dim] by the table rows at
    positions [batch, seq] (half rotation: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)); pass the rest."""
    c, s = cos[positions][:, None], sin[positions][:, None]  # [B, 1, L, rot/2]
    half = c.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)
