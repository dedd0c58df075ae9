"""`torch.ops.kvedge.triton_attention`: the Triton kernels as a PyTorch custom op (CUDA).

It mutates the two caches in place and returns the attention output, with the semantics of
kvedge.models.attention.attention; the torch backend uses it on CUDA when triton is installed.
"""

from __future__ import annotations

import torch

from kvedge.kernels import triton_attention as tk
from kvedge.models.rope import apply_rope


@torch.library.custom_op("kvedge::triton_attention", mutates_args=("k_cache", "v_cache"))
def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, positions: torch.Tensor, scale: float, window: int,
                     softcap: float) -> torch.Tensor:
    return tk.attention(q, k, v, k_cache, v_cache, positions, scale=scale, window=window or None,
                        softcap=softcap or None)


@triton_attention.register_fake
def _(q, k, v, k_cache, v_cache, positions, scale, window, softcap):
    return torch.empty_like(q)


def attention_op(q, k, v, k_cache, v_cache, positions, *, scale, window=None, softcap=None, rope=None):
    """The Decoder's attention_op signature, over the custom op (RoPE applied in torch before it)."""
    if rope is not None:
        q, k = apply_rope(q, *rope, positions), apply_rope(k, *rope, positions)
    return torch.ops.kvedge.triton_attention(q, k, v, k_cache, v_cache, positions, float(scale),
                                             int(window or 0), float(softcap or 0.0))
