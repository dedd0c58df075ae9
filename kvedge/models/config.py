"""ModelConfig: the one normalized description of a decoder, built from a Hugging Face config.json.

Every architecture kvedge supports is the same `Decoder` with different options; this module is
where each architecture's quirks become those options.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvedge.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2",
                           "granite", "olmo2", "smollm3", "deepseek_v2", "deepseek_v3", "minicpm3")
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3", "minicpm3")  # multi-head latent attention
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}


@dataclass
class ModelConfig:
    """Options of the one Decoder. Field names are kvedge's, not any one architecture's."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-6
    norm_unit_offset: bool = False  # gemma: RMSNorm scales by (1 + weight)
    post_norms: bool = False  # gemma2: norms after attention and after the MLP as well
    pre_norms: bool = True  # olmo2: False, the sublayers' inputs are not normed (post_norms only)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k, before RoPE
    qk_norm_scope: str = "head"  # "head": over each head's head_dim | "all": over the whole projection (olmo2)
    mlp: str = "glu"  # "glu" (gate * act, fused gate_up) | "plain" (up, act, down)
    act: str = "silu"  # "silu" | "gelu" | "gelu_tanh"
    positions: str = "rope"  # "rope" | "learned"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3"|"longrope", ...}
    partial_rotary_factor: float = 1.0
    rope_local_theta: float | None = None  # gemma3: the RoPE base of sliding-window layers (unscaled)
    layer_rope: list[bool] = field(default_factory=list)  # per layer: RoPE applied (smollm3 has layers without)
    attn_scale: float = 0.0  # 0 means head_dim ** -0.5
    layer_windows: list[int | None] = field(default_factory=list)  # per layer sliding window
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float = 1.0  # gemma: sqrt(hidden_size); granite: embedding_multiplier
    residual_scale: float = 1.0  # granite: each sublayer's output times this before the residual add
    logits_divisor: float = 1.0  # granite: logits divided by logits_scaling
    tie_embeddings: bool = False
    # multi-head latent attention (MLA; deepseek_v2/v3, minicpm3), when kv_lora_rank > 0. Each token's cache is one
    # KV head shared by every query head (num_kv_heads = 1): the key cache holds the decoupled RoPE key k_rope,
    # head_dim = d_R wide (qk_rope_head_dim; transformers sets head_dim so too), the value cache the latent c_kv,
    # d_c = kv_lora_rank wide. Keys and values per head are never stored: kv_b (W_uk; W_uv) is absorbed into the
    # query and after attention (kvedge.models.decoder.Block).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # MLA: the query through a low rank (q_a, q_a_norm, q_b); 0: one projection
    qk_nope_head_dim: int = 0  # MLA: each head's key width without RoPE, reconstructed from c_kv by W_uk
    v_head_dim: int = 0  # MLA: each head's value width, reconstructed from c_kv by W_uv
    rope_interleaved: bool = False  # the checkpoint's rotary channels are pairs (x0, x1), (x2, x3), ... (deepseek);
    # the loader reorders those rows of the projections into halves (x0, x2, ...; x1, x3, ...): same scores
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: str = "float32"  # the checkpoint's dtype

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = [None] * self.num_layers
        if not self.layer_rope:
            self.layer_rope = [True] * self.num_layers
        if not self.attn_scale:
            self.attn_scale = self.head_dim**-0.5
        self.validate()

    # -- derived figures ------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Query heads per KV head: 1 is MHA, num_heads is MQA, anything between is GQA."""
        return self.num_heads // self.num_kv_heads

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_kind(self) -> str:
        if self.mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qkv_size(self) -> int:
        """Rows of the fused projection of the block's input: [q; k; v], or MLA's [q (or q_a); c_kv; k_rope]."""
        if self.mla:
            return (self.q_lora_rank or self.num_heads * self.qk_head_dim) + self.kv_lora_rank + self.head_dim
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """One query head's width: head_dim, or MLA's qk_nope_head_dim + d_R."""
        return self.qk_nope_head_dim + self.head_dim

    @property
    def value_dim(self) -> int:
        """The value cache's last dim: head_dim, or MLA's latent d_c (kv_lora_rank)."""
        return self.kv_lora_rank or self.head_dim

    @property
    def out_head_dim(self) -> int:
        """One query head's attention output, the o projection's input per head: head_dim, or MLA's v_head_dim."""
        return self.v_head_dim if self.mla else self.head_dim

    def cache_shapes(self, batch: int, seq: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One layer's (key cache, value cache) shapes: [batch, num_kv_heads, seq, head_dim] and [..., value_dim];
        MLA: [batch, 1, seq, d_R] (k_rope) and [batch, 1, seq, d_c] (c_kv)."""
        return (batch, self.num_kv_heads, seq, self.head_dim), (batch, self.num_kv_heads, seq, self.value_dim)

    @property
    def cache_elements_per_token(self) -> int:
        """Cache elements of one token over every layer: 2 * layers * kv_heads * head_dim, or MLA's
        (d_c + d_R) * layers."""
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.value_dim)

    def validate(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{self.arch} config: {msg}")

        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise bad(f"{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise bad(
                f"num_attention_heads ({self.num_heads}) is not divisible by num_key_value_heads "
                f"({self.num_kv_heads}); each KV head must serve a whole group of query heads"
            )
        if self.positions == "rope" and self.rotary_dim % 2:
            raise bad(f"the rotary dimension ({self.rotary_dim}) must be even")
        if len(self.layer_windows) != self.num_layers:
            raise bad(f"{len(self.layer_windows)} layer window entries for {self.num_layers} layers")
        if self.norm not in ("rms", "layer") or self.mlp not in ("glu", "plain"):
            raise bad(f"unknown norm {self.norm!r} or mlp {self.mlp!r}")
        if self.act not in set(_ACTIVATIONS.values()):
            raise bad(f"unknown activation {self.act!r}")
        if len(self.layer_rope) != self.num_layers:
            raise bad(f"{len(self.layer_rope)} layer_rope entries for {self.num_layers} layers")
        if self.qk_norm_scope not in ("head", "all"):
            raise bad(f"unknown qk_norm_scope {self.qk_norm_scope!r}")
        if not self.pre_norms and not self.post_norms:
            raise bad("a block without pre_norms needs post_norms")
        if not self.logits_divisor:
            raise bad("logits_divisor must not be 0")
        if self.mla and (self.num_kv_heads != 1 or self.qk_nope_head_dim <= 0 or self.v_head_dim <= 0
                         or self.rotary_dim != self.head_dim or self.positions != "rope" or self.qk_norm):
            raise bad("MLA needs num_kv_heads 1 (the latent), positive qk_nope_head_dim and v_head_dim, RoPE over "
                      "the whole head_dim (d_R) and no q/k norm")

    # -- (de)serialization for the kvedge.json sidecar ------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"model config has unknown fields {unknown}; was it written by a newer kvedge?")
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from the dict of a Hugging Face config.json (transformers 4.x and 5.x layouts)."""
        return _from_hf(hf, source)


def is_checkpoint(path: str | Path) -> bool:
    """A model kvedge loads weights from: a Hugging Face folder (config.json) or a GGUF file."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" and path.is_file() or (path / "config.json").is_file()


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or a path to a config file), or a GGUF file's metadata."""
    path = Path(model_dir)
    if path.suffix.lower() == ".gguf":
        from kvedge.models import gguf

        return gguf.load_config(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json here; a Hugging Face checkpoint directory has one")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    return ModelConfig.from_hf(hf, str(path))


# ------------------------------------------------------------------------------------------
def _from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    arch = hf.get("model_type")
    if arch is None:
        raise ConfigError(f"{source}: has no 'model_type'; expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{source}: unknown model_type {arch!r}; kvedge supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(*keys: str) -> Any:
        for k in keys:
            if hf.get(k) is not None:
                return hf[k]
        raise ConfigError(f"{source}: missing required key {keys[0]!r} for model_type {arch!r}")

    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    common = dict(
        arch=arch,
        vocab_size=need("vocab_size"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        dtype=dtype,
    )
    if arch == "gpt2":
        return _gpt2(hf, source, need, common)

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim")
    if not head_dim:
        if hidden % heads:
            raise ConfigError(
                f"{source}: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) "
                f"and no head_dim is given"
            )
        head_dim = hidden // heads
    layers = need("num_hidden_layers")
    act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act_name not in _ACTIVATIONS:
        raise ConfigError(f"{source}: unsupported activation {act_name!r}; supported: {sorted(_ACTIVATIONS)}")
    local_theta = None
    by_type = hf.get("rope_parameters") or {}
    if "full_attention" in by_type or "sliding_attention" in by_type:  # per layer type (gemma3, transformers 5)
        local = dict(by_type.get("sliding_attention") or {})
        if (local.get("rope_type") or "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.sliding_attention rope_type {local['rope_type']!r}: "
                              "only unscaled RoPE is supported on sliding-window layers")
        local_theta = float(local.get("rope_theta", 10000.0))
        hf = {**hf, "rope_parameters": dict(by_type.get("full_attention") or {})}
    elif arch == "gemma3_text":  # transformers 4.x keys
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    theta, scaling, partial = _rope(hf, source)

    opts: dict[str, Any] = dict(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=need("intermediate_size"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        act=_ACTIVATIONS[act_name],
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        tie_embeddings=bool(hf.get("tie_word_embeddings", arch in ("gemma", "gemma2", "gemma3_text", "minicpm3"))),
        layer_windows=_layer_windows(hf, arch, layers),
    )
    if arch in ("llama", "qwen3", "granite", "smollm3"):
        bias = bool(hf.get("attention_bias", False))
        opts.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))
    if arch == "qwen2":
        opts.update(qkv_bias=True)
    if arch == "qwen3":
        opts.update(qk_norm=True)
    if arch in ("gemma", "gemma2", "gemma3_text"):
        opts.update(norm_unit_offset=True, embed_scale=float(hidden) ** 0.5,
                    qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)))
    if arch == "gemma3_text":
        if hf.get("use_bidirectional_attention"):
            raise ConfigError(f"{source}: use_bidirectional_attention=true is not a causal decoder")
        if not hf.get("sliding_window"):  # the local RoPE base goes with the window (rope_kind in the Decoder)
            raise ConfigError(f"{source}: gemma3 without a sliding_window is not supported")
        opts.update(qk_norm=True, rope_local_theta=local_theta)
    if arch == "granite":
        opts.update(embed_scale=float(hf.get("embedding_multiplier", 1.0)),
                    residual_scale=float(hf.get("residual_multiplier", 1.0)),
                    attn_scale=float(need("attention_multiplier")),
                    logits_divisor=float(hf.get("logits_scaling", 1.0)))
    if arch == "olmo2":
        bias = bool(hf.get("attention_bias", False))
        opts.update(pre_norms=False, post_norms=True, qk_norm=True, qk_norm_scope="all", qkv_bias=bias, o_bias=bias)
    if arch == "smollm3":
        flags = _smollm3_rope_flags(hf, layers)
        if len(flags) != layers:
            raise ConfigError(f"{source}: no_rope_layers has {len(flags)} entries for {layers} layers")
        opts.update(layer_rope=[bool(f) for f in flags])
    if arch in MLA_ARCHITECTURES:
        opts.update(_mla(hf, source, need, arch, heads, kv_heads, layers))
    if arch == "minicpm3":  # scaled embeddings and residual branches, hidden / (hidden / base) at the head (defaults:
        depth = hf.get("scale_depth", 1.4)  # transformers' MiniCPM3Config)
        opts.update(embed_scale=float(hf.get("scale_emb", 12)),
                    residual_scale=(layers ** 0.5 if depth is None else float(depth)) / layers ** 0.5,
                    logits_divisor=hidden / float(hf.get("dim_model_base", 256) or hidden))
    if arch in ("gemma2", "gemma3_text"):
        opts.update(
            post_norms=True,
            attn_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            attn_softcap=hf.get("attn_logit_softcapping"),
            final_softcap=hf.get("final_logit_softcapping"),
        )
    return ModelConfig(**common, **opts)


def _mla(hf: dict[str, Any], source: str, need, arch: str, heads: int, kv_heads: int, layers: int) -> dict[str, Any]:
    """The MLA options of deepseek_v2 / deepseek_v3 (dense layers only) and minicpm3, as transformers reads them."""
    dense = layers if arch == "minicpm3" else int(hf.get("first_k_dense_replace") or 0)
    if dense < layers:  # transformers: layer i has routed experts iff i >= first_k_dense_replace
        raise ConfigError(f"{source}: {arch} with mixture-of-experts layers (routed experts in layers {dense}.."
                          f"{layers - 1}: first_k_dense_replace {dense} < num_hidden_layers {layers}) is not "
                          f"supported; kvedge runs dense MLA checkpoints only (first_k_dense_replace >= "
                          f"num_hidden_layers)")
    if kv_heads != heads:
        raise ConfigError(f"{source}: num_key_value_heads ({kv_heads}) != num_attention_heads ({heads}): MLA "
                          f"reconstructs one key and value per query head")
    if hf.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias=true with MLA is not supported")
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if params.get("mscale_all_dim") and (params.get("rope_type") or params.get("type")) not in (None, "default"):
        raise ConfigError(f"{source}: rope mscale_all_dim (a softmax scale from yarn's mscale) is not supported")
    rope_dim, nope = int(need("qk_rope_head_dim")), int(need("qk_nope_head_dim"))
    interleaved = arch == "deepseek_v2" or arch == "deepseek_v3" and bool(hf.get("rope_interleave", True))
    return dict(num_kv_heads=1, head_dim=rope_dim, partial_rotary_factor=1.0, attn_scale=(nope + rope_dim) ** -0.5,
                kv_lora_rank=int(need("kv_lora_rank")), q_lora_rank=int(hf.get("q_lora_rank") or 0),
                qk_nope_head_dim=nope, v_head_dim=int(hf.get("v_head_dim") or need("hidden_size") // heads),
                rope_interleaved=interleaved)


def _gpt2(hf: dict[str, Any], source: str, need, common: dict[str, Any]) -> ModelConfig:
    hidden = need("n_embd", "hidden_size")
    heads = need("n_head", "num_attention_heads")
    if hidden % heads:
        raise ConfigError(f"{source}: n_embd ({hidden}) is not divisible by n_head ({heads})")
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise ConfigError(f"{source}: scale_attn_by_inverse_layer_idx=true is not supported")
    if hf.get("add_cross_attention"):
        raise ConfigError(f"{source}: add_cross_attention=true is not a decoder-only model")
    act_name = hf.get("activation_function", "gelu_new")
    if act_name not in _ACTIVATIONS:
        raise ConfigError(f"{source}: unsupported activation {act_name!r}; supported: {sorted(_ACTIVATIONS)}")
    head_dim = hidden // heads
    return ModelConfig(
        **common,
        hidden_size=hidden,
        num_layers=need("n_layer", "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        norm="layer",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        mlp="plain",
        act=_ACTIVATIONS[act_name],
        positions="learned",
        max_position_embeddings=need("n_positions", "max_position_embeddings"),
        attn_scale=head_dim**-0.5 if hf.get("scale_attn_weights", True) else 1.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling, partial_rotary_factor) from either the 4.x keys or 5.x `rope_parameters`."""
    params = dict(hf.get("rope_parameters") or {})
    if "rope_theta" in params and isinstance(params.get("rope_theta"), dict):
        raise ConfigError(f"{source}: per-layer-type rope_parameters are not supported")
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rtype = params.get("rope_type") or params.get("type") or "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope type {rtype!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rtype == "default":
        return theta, None, partial
    if rtype == "longrope":
        return theta, _longrope(hf, params, source), partial
    if "factor" not in params:
        raise ConfigError(f"{source}: rope scaling {rtype!r} needs a 'factor'")
    scaling: dict[str, Any] = {"rope_type": rtype, "factor": float(params["factor"])}
    if rtype == "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            if k not in params:
                raise ConfigError(f"{source}: llama3 rope scaling needs {k!r}")
            scaling[k] = float(params[k])
        scaling["original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 8192)
        )
    return theta, scaling, partial


def longrope_attention_factor(factor: float, original: int) -> float:
    """LongRoPE's default attention factor (transformers, llama.cpp's converter): sqrt(1 + ln factor / ln
    original), 1 without extension."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope(hf: dict[str, Any], params: dict[str, Any], source: str) -> dict[str, Any]:
    """phi3's longrope (Phi-3.5, Phi-4-mini), as transformers reads it: per-frequency short and long factors
    (the long ones once a forward reaches past original_max_position_embeddings), and cos/sin scaled by
    attention_factor (default sqrt(1 + ln factor / ln original), factor = max / original positions)."""
    for k in ("short_factor", "long_factor"):
        if not isinstance(params.get(k), (list, tuple)):
            raise ConfigError(f"{source}: longrope rope scaling needs a list {k!r}")
    if len(params["short_factor"]) != len(params["long_factor"]):
        raise ConfigError(f"{source}: longrope's short_factor and long_factor differ in length")
    original = int(hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or hf.get("max_position_embeddings", 2048))
    factor = float(params.get("factor") or int(hf.get("max_position_embeddings", 2048)) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = longrope_attention_factor(factor, original)
    return {"rope_type": "longrope", "factor": factor, "original_max_position_embeddings": original,
            "short_factor": [float(f) for f in params["short_factor"]],
            "long_factor": [float(f) for f in params["long_factor"]], "attention_factor": float(attention)}


def _smollm3_rope_flags(hf: dict[str, Any], layers: int) -> list[int]:
    """smollm3's no_rope_layers: [i] 1 = layer i uses RoPE, 0 = it does not (NoPE); absent, every
    no_rope_layer_interval-th layer has none (transformers' SmolLM3Config default)."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        every = int(hf.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % every != 0) for i in range(layers)]
    return list(flags)


def _layer_windows(hf: dict[str, Any], arch: str, layers: int) -> list[int | None]:
    """Per-layer sliding window, following each architecture's rule in transformers."""
    window = hf.get("sliding_window")
    if not window:
        return [None] * layers
    types = hf.get("layer_types")
    if types is None:
        if arch == "gemma2":  # alternating, first layer sliding
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        elif arch == "gemma3_text":  # every sliding_window_pattern-th layer full, the rest sliding
            every = int(hf.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
        elif arch == "smollm3":  # the layers without RoPE slide, when use_sliding_window
            types = ["sliding_attention" if hf.get("use_sliding_window") and not f else "full_attention"
                     for f in _smollm3_rope_flags(hf, layers)]
        elif arch in ("qwen2", "qwen3"):
            start = hf.get("max_window_layers", layers) if hf.get("use_sliding_window") else layers
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
        else:  # mistral, phi3: every layer
            types = ["sliding_attention"] * layers
    elif arch in ("qwen2", "qwen3", "smollm3") and not hf.get("use_sliding_window", False):
        types = ["full_attention"] * layers
    if len(types) != layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    return [int(window) if t == "sliding_attention" else None for t in types]
