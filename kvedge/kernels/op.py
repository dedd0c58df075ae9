"""`torch.ops.kvedge.triton_attention`: the Triton kernels as a PyTorch custom op (CUDA).

It mutates the two caches in place and returns the attention output, with the semantics of
kvedge.models.attention.attention; the torch backend uses it on CUDA when triton is installed.
RoPE happens inside the kernels: K is rotated by the cache-write kernel as it is written, Q by the
decode/prefill kernels as they load it (cos/sin: the tables [S_table, rotary_dim / 2], or None).
"""

from __future__ import annotations

import torch

from kvedge.kernels import triton_attention as tk


@torch.library.custom_op("kvedge::triton_attention", mutates_args=("k_cache", "v_cache"))
def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, positions: torch.Tensor, scale: float, window: int,
                     softcap: float, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    return tk.attention(q, k, v, k_cache, v_cache, positions, scale=scale, window=window or None,
                        softcap=softcap or None, rope=None if cos is None else (cos, sin))


@triton_attention.register_fake
def _(q, k, v, k_cache, v_cache, positions, scale, window, softcap, cos=None, sin=None):
    return torch.empty_like(q)


def attention_op(q, k, v, k_cache, v_cache, positions, *, scale, window=None, softcap=None, rope=None):
    """The Decoder's attention_op signature, over the custom op (RoPE fused into the kernels)."""
    cos, sin = rope if rope is not None else (None, None)
    return torch.ops.kvedge.triton_attention(q, k, v, k_cache, v_cache, positions, float(scale),
                                             int(window or 0), float(softcap or 0.0), cos, sin)
