"""KV-cache allocation and size arithmetic (calibrating an int8 cache's scales: kvedge.runtime.calibration).

Per layer the cache is two tensors [max_batch, kv_heads, max_seq_len, head_dim], allocated once and
written in place. It holds kv_heads, never q_heads: GQA's memory saving is kept in the cache. MLA's two are
[max_batch, 1, max_seq_len, d_rope] (the decoupled RoPE key) and [max_batch, 1, max_seq_len, d_c] (the latent):
ModelConfig.cache_shapes.

Size per token (both K and V, every layer):
    MHA / GQA / MQA: 2 * n_layers * kv_heads * head_dim * bytes_per_element
    MLA:             (d_c + d_rope) * n_layers * bytes_per_element   (one latent, shared by K and V)
An int8 cache (1 byte an element) also holds its float32 scales, per layer, KV head and channel, once
(not per token): 2 * n_layers * kv_heads * head_dim * 4 bytes (kv_scale_bytes; MLA's (d_c + d_rope) * n_layers * 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvedge.dtypes import nbytes
from kvedge.errors import KvedgeError
from kvedge.models.config import ModelConfig



def kv_bytes_per_token(n_layers: int, kv_heads: int, head_dim: int, dtype: str | torch.dtype = "fp16") -> int:
    """Bytes of K and V for one token across all layers (MHA, GQA and MQA alike)."""
    return int(2 * n_layers * kv_heads * head_dim * nbytes(dtype))


def mla_bytes_per_token(n_layers: int, d_c: int, d_rope: int, dtype: str | torch.dtype = "fp16") -> int:
    """Bytes for one token of an MLA cache: the compressed latent d_c plus the decoupled RoPE key d_rope."""
    return int((d_c + d_rope) * n_layers * nbytes(dtype))


def cache_bytes_per_token(cfg: ModelConfig, dtype: str | torch.dtype = "fp16") -> int:
    """Bytes of one token's cache over every layer, as the model allocates it (MHA/GQA/MQA or MLA)."""
    return int(cfg.cache_elements_per_token * nbytes(dtype))


def kv_scale_bytes(cfg: ModelConfig, dtype: str | torch.dtype = "fp16") -> int:
    """Bytes of an int8 (or fp8) cache's float32 scales (K and V, per layer, KV head and channel: one a token's
    cache element, once); 0 for float caches."""
    return cfg.cache_elements_per_token * 4 if dtype in ("int8", torch.int8, "fp8") else 0


def kv_cache_bytes(cfg: ModelConfig, tokens: int, batch: int = 1, dtype: str | torch.dtype = "fp16") -> int:
    """Bytes of a cache holding `tokens` positions for `batch` sequences of this model (int8: with its scales)."""
    return cache_bytes_per_token(cfg, dtype) * tokens * batch + kv_scale_bytes(cfg, dtype)


@dataclass
class KVCache:
    """The preallocated per-layer caches. `for_batch(b)` gives views of the first b rows (no copy)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # an int8 cache's per-layer scales [1, Hkv, 1, D] float32 (kvedge.models.attention); None for float caches
    scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_batch: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> KVCache:
        """dtype torch.int8 needs `scales` (k_scales, v_scales), one per layer (calibrate_kv_scales)."""
        if max_batch < 1 or max_seq_len < 1:
            raise KvedgeError(f"cache needs max_batch >= 1 and max_seq_len >= 1, got {max_batch}, {max_seq_len}")
        if (dtype == torch.int8) != (scales is not None):
            raise KvedgeError(f"a {dtype} cache {'needs' if dtype == torch.int8 else 'takes no'} k/v scales; "
                              "int8 caches are calibrated by kvedge.runtime.calibration.calibrate_kv_scales")
        if scales is not None:
            scales = tuple([s.to(device=device, dtype=torch.float32) for s in side] for side in scales)
            if any(len(side) != cfg.num_layers for side in scales):
                raise KvedgeError(f"int8 cache scales: {len(scales[0])}/{len(scales[1])} layers given, the model "
                                  f"has {cfg.num_layers}")
        k_shape, v_shape = cfg.cache_shapes(max_batch, max_seq_len)
        return cls([torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
                   [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)], scales)

    @property
    def max_batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        scales = [t for side in self.scales for t in side] if self.scales else []
        return sum(t.numel() * t.element_size() for t in self.keys + self.values + scales)

    def for_batch(self, batch: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (k, v), or (k, v, k_scale, v_scale) for an int8 cache: what Decoder.forward takes."""
        if not 1 <= batch <= self.max_batch:
            raise KvedgeError(f"batch {batch} does not fit the cache, allocated for max_batch={self.max_batch}")
        if self.scales is not None:
            return [(k[:batch], v[:batch], ks, vs) for k, v, ks, vs in zip(self.keys, self.values, *self.scales)]
        return [(k[:batch], v[:batch]) for k, v in zip(self.keys, self.values)]

    def zero_(self) -> None:
        for t in self.keys + self.values:
            t.zero_()
