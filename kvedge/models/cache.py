"""KV-cache allocation and size arithmetic.

Per layer the cache is two tensors [max_batch, kv_heads, max_seq_len, head_dim], allocated once and
written in place. It holds kv_heads, never q_heads: GQA's memory saving is kept in the cache.

Size per token (both K and V, every layer):
    MHA / GQA / MQA: 2 * n_layers * kv_heads * head_dim * bytes_per_element
    MLA:             (d_c + d_rope) * n_layers * bytes_per_element   (one latent, shared by K and V)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvedge.errors import KvedgeError
from kvedge.models.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "int8": 1, "fp8": 1, "int4": 0.5}


def dtype_bytes(dtype: str | torch.dtype) -> float:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise KvedgeError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}") from None


def kv_bytes_per_token(n_layers: int, kv_heads: int, head_dim: int, dtype: str | torch.dtype = "fp16") -> int:
    """Bytes of K and V for one token across all layers (MHA, GQA and MQA alike)."""
    return int(2 * n_layers * kv_heads * head_dim * dtype_bytes(dtype))


def mla_bytes_per_token(n_layers: int, d_c: int, d_rope: int, dtype: str | torch.dtype = "fp16") -> int:
    """Bytes for one token of an MLA cache: the compressed latent d_c plus the decoupled RoPE key d_rope."""
    return int((d_c + d_rope) * n_layers * dtype_bytes(dtype))


def kv_cache_bytes(cfg: ModelConfig, tokens: int, batch: int = 1, dtype: str | torch.dtype = "fp16") -> int:
    """Bytes of a cache holding `tokens` positions for `batch` sequences of this model."""
    return kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype) * tokens * batch


@dataclass
class KVCache:
    """The preallocated per-layer caches. `for_batch(b)` gives views of the first b rows (no copy)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_batch: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> KVCache:
        if max_batch < 1 or max_seq_len < 1:
            raise KvedgeError(f"cache needs max_batch >= 1 and max_seq_len >= 1, got {max_batch}, {max_seq_len}")
        shape = (max_batch, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)])

    @property
    def max_batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def for_batch(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not 1 <= batch <= self.max_batch:
            raise KvedgeError(f"batch {batch} does not fit the cache, allocated for max_batch={self.max_batch}")
        return [(k[:batch], v[:batch]) for k, v in zip(self.keys, self.values)]

    def zero_(self) -> None:
        for t in self.keys + self.values:
            t.zero_()
