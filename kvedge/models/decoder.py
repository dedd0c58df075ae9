"""The one PyTorch definition of every supported decoder-only transformer.

Parameter layout is kvedge's own and fused: one `qkv` projection ([q; k; v] rows; MLA: [q or q_a; c_kv; k_rope])
and, for GLU MLPs, one `up` projection holding [gate; up]. The loader maps each checkpoint format onto it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvedge.models import rope
from kvedge.models.attention import attention
from kvedge.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        # x / sqrt(mean(x^2) + eps), written with Div so ONNX Runtime fuses it into one
        # SimplifiedLayerNormalization kernel after export (rsqrt exports as Sqrt + Reciprocal).
        xf = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # gemma: scale by (1 + w), computed in float32
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "layer":
        return nn.LayerNorm(dim, eps=cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps, cfg.norm_unit_offset)


LATENT_NORM_EPS = 1e-6  # MLA's q_a / kv_a norms: transformers builds them with RMSNorm's default eps, not the config's


_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg = cfg
        self.window = cfg.layer_windows[index]
        h, d = cfg.hidden_size, cfg.head_dim
        self.rope_kind = rope.layer_kind(cfg, index)  # which RoPE table the layer rotates with
        if cfg.pre_norms:
            self.attn_norm = make_norm(cfg, h)
        self.qkv = nn.Linear(h, cfg.qkv_size, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.num_heads * cfg.out_head_dim, h, bias=cfg.o_bias)
        if cfg.mla:  # the latent's norm and its up-projection [W_uk; W_uv] per head; the query's low rank
            self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, cfg.norm_unit_offset)
            self.kv_b = nn.Linear(cfg.kv_lora_rank, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
            if cfg.q_lora_rank:
                self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, cfg.norm_unit_offset)
                self.q_b = nn.Linear(cfg.q_lora_rank, cfg.num_heads * cfg.qk_head_dim, bias=False)
        if cfg.qk_norm:  # over head_dim, or over the whole projection (qk_norm_scope "all")
            wide = cfg.qk_norm_scope == "all"
            self.q_norm = RMSNorm(cfg.num_heads * d if wide else d, cfg.norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.num_kv_heads * d if wide else d, cfg.norm_eps, cfg.norm_unit_offset)
        if cfg.pre_norms:
            self.mlp_norm = make_norm(cfg, h)
        if cfg.post_norms:
            self.post_attn_norm = make_norm(cfg, h)
            self.post_mlp_norm = make_norm(cfg, h)
        up = 2 * cfg.intermediate_size if cfg.mlp == "glu" else cfg.intermediate_size
        self.up = nn.Linear(h, up, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.act = _ACT[cfg.act]

    def forward(self, x, positions, rope_tables, k_cache, v_cache, attention_op, kv_scales=()):
        """rope_tables: {"global": (cos, sin)[, "local": ...]}, the layer takes its rope_kind's (none: {}).
        kv_scales: (k_scale, v_scale) of an int8 cache, passed on to the attention op; () otherwise."""
        cfg = self.cfg
        b, l, _ = x.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv(self.attn_norm(x) if cfg.pre_norms else x)
        if cfg.mla:
            q, k, v = self._latent_qkv(qkv)
        else:
            q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
            if cfg.qk_norm and cfg.qk_norm_scope == "all":
                q, k = self.q_norm(q), self.k_norm(k)
            q = q.view(b, l, hq, d).transpose(1, 2)
            k = k.view(b, l, hkv, d).transpose(1, 2)
            v = v.view(b, l, hkv, d).transpose(1, 2)
            if cfg.qk_norm and cfg.qk_norm_scope == "head":
                q, k = self.q_norm(q), self.k_norm(k)
        quant = dict(zip(("k_scale", "v_scale"), kv_scales))  # only an int8 cache's op gets them
        a = attention_op(q, k, v, k_cache, v_cache, positions, scale=cfg.attn_scale, window=self.window,
                         softcap=cfg.attn_softcap, rope=rope_tables.get(self.rope_kind), **quant)
        if cfg.mla:  # W_uv after attention: each head's latent output [B, H, L, d_c] -> its value, v_head_dim
            a = a @ self.latent_up()[1].transpose(1, 2)
        a = self.o(a.transpose(1, 2).reshape(b, l, hq * cfg.out_head_dim))
        if cfg.post_norms:
            a = self.post_attn_norm(a)
        if cfg.residual_scale != 1.0:
            a = a * cfg.residual_scale
        x = x + a
        hidden = self.mlp_norm(x) if cfg.pre_norms else x
        if cfg.mlp == "glu":
            gate, up = self.up(hidden).split(cfg.intermediate_size, dim=-1)
            m = self.down(self.act(gate) * up)
        else:
            m = self.down(self.act(self.up(hidden)))
        if cfg.post_norms:
            m = self.post_mlp_norm(m)
        if cfg.residual_scale != 1.0:
            m = m * cfg.residual_scale
        return x + m

    def latent_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA: kv_b's weight as (W_uk [H, qk_nope_head_dim, d_c], W_uv [H, v_head_dim, d_c]): the latent c_kv up to
        each head's key (without RoPE) and value."""
        cfg = self.cfg
        w = self.kv_b.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, :cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]  # slices: export folds them to constants

    def _latent_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLA, absorbed: the query [B, H, L, d_R + d_c] = [q_rope, q_nope @ W_uk] (its RoPE part first, where the
        op rotates), the new RoPE key [B, 1, L, d_R] and latent c_kv [B, 1, L, d_c]: attention over the latent is
        one KV head whose key is [k_rope, c_kv] and value c_kv (kvedge.models.attention). Per head, q_nope @ W_uk
        . c_kv = q_nope . (W_uk c_kv), the key transformers reconstructs; nothing per head is cached."""
        cfg = self.cfg
        b, l, _ = qkv.shape
        dn, dr, dc = cfg.qk_nope_head_dim, cfg.head_dim, cfg.kv_lora_rank
        q, c_kv, k_rope = qkv.split((cfg.qkv_size - dc - dr, dc, dr), dim=-1)
        if cfg.q_lora_rank:
            q = self.q_b(self.q_a_norm(q))
        q_nope, q_rope = q.view(b, l, cfg.num_heads, dn + dr).transpose(1, 2).split((dn, dr), dim=-1)
        q = torch.cat((q_rope, q_nope @ self.latent_up()[0]), dim=-1)
        return q, k_rope[:, None], self.kv_a_norm(c_kv)[:, None]


class Decoder(nn.Module):
    """forward(input_ids [B, L], positions [B, L], caches, logit_index=None) -> logits.

    `caches` is a sequence of (k_cache, v_cache) per layer, each [B, Hkv, S_max, D], updated in place;
    an int8 cache's entries are (k_cache, v_cache, k_scale, v_scale) (KVCache.for_batch).
    `logit_index` [B] int64 selects one position per row ([B, 1, V] back), [B, K] K positions per row ([B, K,
    V]), so only the logits a caller needs are computed (generation: the last real token of each row; kvedge eval:
    every position of its chunk); without it every position's logits come back.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.positions == "learned":
            self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.set_rope_buffers()
        self.attention_op: Callable[..., torch.Tensor] = attention
        self._tables: tuple | None = None

    def set_rope_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the frequency buffers, inv_freq[, _local (gemma3), _long (longrope)]: the loaders build the
        model on the meta device and call this on the real one."""
        for name, freq in rope.buffers(self.cfg).items():
            self.register_buffer(name, freq.to(device), persistent=False)

    def rope_tables(self, length: int, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{"global": cos/sin tables [length, rotary_dim / 2] (kvedge.models.rope.tables)[, "local": those of
        rope_local_theta]}, kept between calls. Under torch.export they are recomputed in the graph
        (constant-folded there) and not kept."""
        key = (length, dtype, self.inv_freq.device)
        if self._tables is not None and self._tables[0] == key:
            return self._tables[1]
        freqs = {n: b for n, b in self.named_buffers(recurse=False) if n.startswith("inv_freq")}
        tables = rope.all_tables(self.cfg, freqs, length, dtype)
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            self._tables = (key, tables)
        return tables

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        x = self.embed(input_ids)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        tables = {}
        if cfg.positions == "learned":
            x = x + self.pos_embed(positions)
        else:  # the tables of one cache length, shared by the layers (each takes its rope_kind's)
            tables = self.rope_tables(caches[0][0].shape[2], x.dtype)
            switch = rope.long_switch(cfg)
            if switch is not None:  # longrope: a forward reaching the original length runs on the long set
                far = positions.max() >= switch
                if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # a Where in the graph
                    long = tuple(torch.where(far, lg, sh) for lg, sh in zip(tables["long"], tables["global"]))
                else:  # eager: pick the table, no copy of both per token
                    long = tables["long"] if bool(far) else tables["global"]
                tables = {**tables, "global": long}
        for layer, (k_cache, v_cache, *kv_scales) in zip(self.layers, caches, strict=True):
            x = layer(x, positions, tables, k_cache, v_cache, self.attention_op, kv_scales)
        if logit_index is not None:
            index = logit_index if logit_index.dim() == 2 else logit_index[:, None]
            x = x[torch.arange(x.shape[0], device=x.device)[:, None], index]
        h = self.norm(x)
        # tied embeddings share the embedding matrix (a quantized one: its own integers), unless a separate (e.g.
        # quantized) lm_head was set
        if hasattr(self, "lm_head"):
            logits = self.lm_head(h)
        else:
            logits = self.embed.linear(h) if hasattr(self.embed, "linear") else F.linear(h, self.embed.weight)
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits
