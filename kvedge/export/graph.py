"""The export graph: the one Decoder, with its attention op swapped for a functional custom op.

`kvedge::cached_attention` has the semantics of `kvedge.models.attention.attention` but returns the
updated caches instead of writing them, so the exported graph has them as outputs. Each lowering
(kvedge.export.lowerings) translates this one op into its target's ONNX nodes.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from kvedge.models import Decoder
from kvedge.models.attention import attention


@torch.library.custom_op("kvedge::cached_attention", mutates_args=())
def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, positions: torch.Tensor, scale: float, window: int,
                     softcap: float, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, present_key, present_value). window <= 0 and softcap <= 0 mean none; cos/sin are the
    RoPE tables [S, rotary_dim / 2] (None: no rotation); k_scale/v_scale those of an int8 cache."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    quant = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    out = attention(q, k, v, k_cache, v_cache, positions, scale=scale,
                    window=window if window > 0 else None, softcap=softcap if softcap > 0 else None,
                    rope=None if cos is None else (cos, sin), **quant)
    return out, k_cache, v_cache


@cached_attention.register_fake
def _(q, k, v, k_cache, v_cache, positions, scale, window, softcap, cos=None, sin=None, k_scale=None, v_scale=None):
    out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])  # the value's width (MLA: the latent's, not q's)
    return out, torch.empty_like(k_cache), torch.empty_like(v_cache)


class ExportGraph(nn.Module):
    """forward(input_ids, position_ids, logits_index, past_key.0, past_value.0, ...) ->
    (logits [B, K, V], present_key.0, present_value.0, ...), logits_index [B, K] (kvedge.artifact's contract).

    kv_scales (k_scales, v_scales), per layer: an int8 cache's scales, kept as buffers k_scale_{i} and
    v_scale_{i}, so they become initializers of the graph."""

    def __init__(self, decoder: Decoder, kv_scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None):
        super().__init__()
        self.decoder = decoder
        self._presents: list[torch.Tensor] = []
        self.n_scales = 0
        for kind, side in zip(("k", "v"), kv_scales or ()):
            for i, t in enumerate(side):
                self.register_buffer(f"{kind}_scale_{i}", t.float().clone())
            self.n_scales = len(side)

    def _op(self, q, k, v, k_cache, v_cache, positions, *, scale, window, softcap, rope=None, k_scale=None,
            v_scale=None):
        cos, sin = rope if rope is not None else (None, None)
        out, pk, pv = torch.ops.kvedge.cached_attention(q, k, v, k_cache, v_cache, positions, float(scale),
                                                        int(window or 0), float(softcap or 0.0), cos, sin,
                                                        k_scale, v_scale)
        self._presents += [pk, pv]
        return out

    def forward(self, input_ids, position_ids, logits_index, *past: torch.Tensor):
        self._presents = []
        original = self.decoder.attention_op
        self.decoder.attention_op = self._op
        try:
            caches: Sequence = list(zip(past[0::2], past[1::2]))
            if self.n_scales:
                caches = [(k, v, getattr(self, f"k_scale_{i}"), getattr(self, f"v_scale_{i}"))
                          for i, (k, v) in enumerate(caches)]
            logits = self.decoder(input_ids, position_ids, caches, logit_index=logits_index)
        finally:
            self.decoder.attention_op = original
        return (logits, *self._presents)
