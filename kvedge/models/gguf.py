"""GGUF checkpoints (llama.cpp's single-file format) loaded into the one Decoder, weights kept exactly.

Read with kvedge.models.gguf_reader (the container, over a memory map) and the `gguf` package's types and
dequantizer. The metadata (`{arch}.block_count`,
`{arch}.embedding_length`, ...) becomes a Hugging Face-style config dict that kvedge's one config reader
(`ModelConfig.from_hf`) turns into a ModelConfig, so a GGUF file and a checkpoint folder share one config
path. Tensor names are llama.cpp's (`token_embd`, `blk.N.attn_q`, ...), mapped onto the Hugging Face names of
`loader.tensor_map` and from there onto kvedge's fused layout.

Undone here, as llama.cpp's convert_hf_to_gguf.py did it:
  - llama, granite, smollm3 (its LlamaModel and the subclasses that keep `undo_permute`): the rows of
    attn_q / attn_k (weights and biases) are permuted per head from the Hugging Face half-split RoPE layout
    to the interleaved one; the inverse permutation is applied (an exact row shuffle, of the quantized blocks
    too).
  - gemma, gemma2, gemma3: every `*norm.weight` (gemma3's q / k norms too) was stored as w + 1; 1 is
    subtracted again (as transformers does).

Read as llama.cpp's loader reads them, where the converter writes nothing and llama.cpp hard-codes the value
(ggml-org/llama.cpp src/llama-model.cpp, src/models/<arch>.cpp, src/llama-hparams.cpp):
  - gemma2 / gemma3: queries scaled by 1/sqrt(head_dim), by 1/sqrt(hidden / heads) for the 27B models (46 /
    62 layers); `query_pre_attn_scalar` is not in the file.
  - gemma3: every 6th layer global, the others sliding (`attention.sliding_window_pattern` where present),
    sliding layers on RoPE base `rope.freq_base_swa`, 10000 where absent, unscaled.
  - smollm3: no RoPE in every 4th layer (n_no_rope_layer_step = 4); `no_rope_layers` is not in the file.
  - granite: `attention.scale` absent means 1/sqrt(head_dim); `embedding_scale`, `residual_scale` absent mean 1.
  - phi3 LongRoPE: tensors rope_factors_short / rope_factors_long and `rope.scaling.attn_factor` (1 where
    absent). kvedge switches to the long factors as transformers does (once a forward reaches past the original
    context); llama.cpp instead picks one set for a whole run from its context size.

Weights are never re-rounded:
  - F32 / F16 / BF16 load as floats (every value exact in float32).
  - The quantized projections of a block (and a separate `output.weight`) become kvedge QuantLinears holding
    the file's integers, whose `quant.dequantize` equals `gguf.quants.dequantize` bit for bit (float32):
      Q8_0  w = d * q                    bits 8, group 32, q + 128 stored, zero 128, scale d
      Q4_0  w = d * (q - 8)              bits 4, group 32, zero 8, scale d
      Q5_0  w = d * (q - 16)             bits 8 (5-bit values), group 32, zero 16, scale d
      Q4_1  w = d * q + m                bits 4, group 32, scale d, min m
      Q5_1  w = d * q + m                bits 8 (5-bit values), group 32, scale d, min m
      Q4_K  w = (d * sc) * q - dmin * m  bits 4, group 32, scale d * sc, min -(dmin * m), both float32 as gguf has them
      Q5_K  as Q4_K with 5-bit q         bits 8, group 32
      Q6_K  w = (d * sc) * (q - 32)      bits 8 (6-bit values), group 16, zero 32, scale d * sc
    (q - z) * s equals s * (q - z) and q * s + (-m') equals s * q - m' in IEEE arithmetic, so kvedge's
    dequantization gives gguf's float32 values exactly.
  - A fused projection (q, k, v -> qkv; gate, up -> up) whose parts share one quantized type is one
    QuantLinear; parts of different types (Q4_K_M files keep attn_v in Q6_K) load as floats, gguf's
    dequantized values, and are listed in `decoder.gguf["float_linears"]`.
  - Embeddings and norms load as floats (dequantized exactly where the file quantized them); with
    quantized_embedding (bit widths) a quantized token_embd of those bits becomes a QuantEmbedding over the file's
    integers instead (its rows dequantized as looked up, the same values; a tied head is that same QuantLinear),
    recorded as `decoder.gguf["embedding"]`.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kvedge.errors import CheckpointError, ConfigError, require
from kvedge.models.config import ModelConfig, longrope_attention_factor

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2", "granite",
                               "smollm3")
FLOAT_TYPES = ("F32", "F16", "BF16")
# type -> (bits of kvedge's container, group, affine (w = q * s + min), zero point of a non-affine type)
QUANT_TYPES: dict[str, tuple[int, int, bool, int]] = {
    "Q8_0": (8, 32, False, 128),
    "Q4_0": (4, 32, False, 8),
    "Q5_0": (8, 32, False, 16),
    "Q4_1": (4, 32, True, 0),
    "Q5_1": (8, 32, True, 0),
    "Q4_K": (4, 32, True, 0),
    "Q5_K": (8, 32, True, 0),
    "Q6_K": (8, 16, False, 32),
}
SUPPORTED_TYPES = FLOAT_TYPES + tuple(QUANT_TYPES)
READ_VERSIONS = (2, 3)
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                     "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                     "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # GGUF architecture -> Hugging Face model_type, where they differ
# what the converter did per architecture (module doc): Q/K rows permuted; norms stored as w + 1
_PERMUTED_QK = ("llama", "granite", "smollm3")
_NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")
_POST_ATTENTION_NORM = ("gemma2", "gemma3", "olmo2")  # post_attention_layernorm is post_attention_norm, not ffn_norm
# llama.cpp scales queries by 1/sqrt(head_dim), but those of these architectures' 27B models (by their layer count)
# by 1/sqrt(hidden / heads): src/models/gemma2*.cpp, src/models/gemma3.cpp (after gemma_pytorch's config)
_WIDE_QUERY_SCALE_LAYERS = {"gemma2": 46, "gemma3": 62}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # read into the config
# Hugging Face module names -> llama.cpp's tensor names (gguf's TensorNameMap for these architectures)
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",  # gemma2, gemma3, olmo2: post_attention_norm (see _gguf_name)
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
}
_LINEARS = ("qkv", "o", "up", "down")
_BUFFERS = ("qweight", "scales", "zeros", "mins")  # a QuantLinear's
# llama.cpp's convert_hf_to_gguf.py writes Llama 3.x's rope scaling as this tensor of per-frequency factors
# (computed with these defaults: old context 8192, low / high frequency factors 1 and 4)
_LLAMA3_DEFAULTS = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


# -- the file ---------------------------------------------------------------------------------------
class GGUFFile:
    """A GGUF file, memory-mapped (kvedge.models.gguf_reader): metadata values and tensors by name.
    Any problem with the file itself is one CheckpointError naming the file."""

    def __init__(self, path: str | Path):
        from kvedge.models.gguf_reader import Reader

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        with open(self.path, "rb") as f:
            head = f.read(8)
        if len(head) < 8 or head[:4] != b"GGUF":
            got = f", but with {head[:4]!r})" if len(head) >= 4 else ", it is shorter than a header)"
            raise CheckpointError(f"{self.path}: not a GGUF file (it does not start with the magic 'GGUF'{got}")
        version = int.from_bytes(head[4:8], "little")
        if version & 0xFFFF == 0:
            raise CheckpointError(f"{self.path}: a big-endian GGUF file; kvedge reads little-endian GGUF files only")
        if version not in READ_VERSIONS:
            raise CheckpointError(f"{self.path}: GGUF version {version}; kvedge reads GGUF versions "
                                  f"{', '.join(map(str, READ_VERSIONS))}")
        require("gguf", "gguf", "reading GGUF files")
        try:
            self.reader = Reader(self.path)
        except Exception as e:  # struct / unicode / value errors on a damaged file
            raise CheckpointError(f"{self.path}: not a readable GGUF file, truncated or corrupt "
                                  f"({type(e).__name__}: {e})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise CheckpointError(f"{self.path}: truncated: tensor {t.name} ends at byte "
                                      f"{t.data_offset + t.n_bytes}, the file has {size}")
        self.arch = self.value("general.architecture")

    def value(self, key: str, default: Any = None) -> Any:
        return self.reader.fields.get(key, default)

    def count(self, key: str) -> int | None:
        """The number of entries of an array field, None when absent."""
        v = self.reader.fields.get(key)
        return None if v is None else len(v)

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape, outermost first (numpy / torch order; GGUF stores the innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))


def open_gguf(path: str | Path) -> GGUFFile:
    """GGUFFile(path), kept for the next call while the file is unchanged (same size and modification time):
    gguf's reader parses every metadata entry in Python (seconds for a 50k-token vocabulary), and a command
    typically reads the config, then the weights."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return GGUFFile(p)  # reports the missing file
    return _open_cached(str(p), str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, resolved: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)  # messages name the path as given


# -- config -----------------------------------------------------------------------------------------
def _f32(v: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips through float32 (1e-06, not
    9.99999997e-07): the value the converter was given, as far as float32 can tell."""
    return float(str(np.float32(v)))


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """A Hugging Face-style config dict (the keys `ModelConfig.from_hf` and transformers read) from the metadata."""
    arch = g.arch
    where = str(g.path)
    if not isinstance(arch, str):
        raise ConfigError(f"{where}: the GGUF metadata has no general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ConfigError(f"{where}: GGUF architecture {arch!r} is not imported by kvedge; supported: "
                          f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    missing = object()

    def key(name: str, default: Any = missing) -> Any:
        v = g.value(f"{arch}.{name}", missing)
        if v is missing:
            if default is missing:
                raise ConfigError(f"{where}: the GGUF metadata has no {arch}.{name}, which a {arch} model needs")
            return default
        if isinstance(v, list):  # per-layer values (some architectures): kvedge takes one for all layers
            if not v or len(set(v)) != 1:
                raise ConfigError(f"{where}: {arch}.{name} differs between layers ({v}); kvedge takes one value "
                                  f"for every layer")
            v = v[0]
        return v

    hidden, layers, heads = key("embedding_length"), key("block_count"), key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    head_dim = key("attention.key_length", None)
    value_dim = key("attention.value_length", head_dim)
    if head_dim is not None and value_dim != head_dim:
        raise ConfigError(f"{where}: {arch}.attention.key_length ({head_dim}) differs from value_length "
                          f"({value_dim}); kvedge's attention has one head dimension")
    if head_dim is None:
        head_dim = hidden // heads if heads and hidden % heads == 0 else None
    vocab = key("vocab_size", None) or g.count("tokenizer.ggml.tokens")
    if not vocab and "token_embd.weight" in g.tensors:
        vocab = g.shape("token_embd.weight")[0]
    hf: dict[str, Any] = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": key("feed_forward_length"),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": "float32",
    }
    if head_dim is not None:
        hf["head_dim"] = head_dim
    for tok, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        v = g.value(f"tokenizer.ggml.{tok}_token_id")
        if v is not None:
            hf[hf_key] = int(v)
    rot = key("rope.dimension_count", None)
    if rot and head_dim and rot != head_dim:
        hf["partial_rotary_factor"] = rot / head_dim
    scaling = str(key("rope.scaling.type", "none") or "none")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": _f32(key("rope.scaling.factor"))}
    elif scaling != "none":  # yarn, longrope, ...: the config reader refuses them by name
        hf["rope_scaling"] = {"rope_type": scaling, "factor": _f32(key("rope.scaling.factor", 1.0))}
    if "rope_factors_long.weight" in g.tensors or "rope_factors_short.weight" in g.tensors:
        hf["rope_scaling"] = _longrope_scaling(g, hf, rot or head_dim)
    if "rope_freqs.weight" in g.tensors:
        hf["rope_scaling"] = _llama3_scaling(g, hf, head_dim)

    has = lambda name: name in g.tensors  # noqa: E731
    if arch not in ("qwen2", "phi3"):  # optional biases, where the file has them (qwen2's are always there)
        hf["attention_bias"] = has("blk.0.attn_q.bias")
    if arch in ("llama", "granite", "smollm3"):
        hf["mlp_bias"] = has("blk.0.ffn_up.bias")
    if arch == "llama":
        window = key("attention.sliding_window", 0)
        if window:  # mistral-style: every layer slides
            hf["sliding_window"] = int(window)
            if not (hf["attention_bias"] or hf["mlp_bias"]):
                hf["model_type"] = "mistral"  # what transformers runs with a window; kvedge reads both
    if arch in ("gemma", "gemma2", "gemma3"):
        hf["hidden_activation"] = "gelu_pytorch_tanh"
    if arch in _WIDE_QUERY_SCALE_LAYERS:  # the file has no query_pre_attn_scalar (module doc)
        hf["query_pre_attn_scalar"] = hidden // heads if layers == _WIDE_QUERY_SCALE_LAYERS[arch] else head_dim
    if arch == "gemma2":  # llama.cpp's defaults where the keys are absent (those of Gemma 2 itself)
        hf["attn_logit_softcapping"] = _f32(key("attn_logit_softcapping", 50.0))
        hf["final_logit_softcapping"] = _f32(key("final_logit_softcapping", 30.0))
        hf["sliding_window"] = int(key("attention.sliding_window", 4096))
    if arch == "gemma3":  # src/models/gemma3.cpp load_arch_hparams: no window, no sliding layer; no softcap key, none
        softcap = key("final_logit_softcapping", 0.0)
        hf["final_logit_softcapping"] = _f32(softcap) if softcap else None
        window = int(key("attention.sliding_window", 0))
        if window:  # else every layer is global, which kvedge's gemma3 refuses (config reader)
            hf["sliding_window"] = window
            hf["layer_types"] = _swa_layer_types(g, layers, every=6)
            hf["rope_local_base_freq"] = _f32(key("rope.freq_base_swa", 10000.0))
    if arch == "olmo2" and key("attention.sliding_window", 0):
        raise ConfigError(f"{where}: olmo2.attention.sliding_window is set: an OLMo 3 file (sliding layers on their "
                          f"own RoPE), which kvedge does not import; it imports OLMo 2 files (no window)")
    if arch == "granite":  # GraniteModel writes the multipliers as *_scale keys, and none that is 0 or absent;
        # src/models/granite.cpp: logit_scale required, attention.scale 0 = 1/sqrt(head_dim), the others 0 = none
        if not key("rope.scaling.finetuned", True):
            raise ConfigError(f"{where}: granite.rope.scaling.finetuned is false, which llama.cpp reads as no RoPE "
                              f"in any layer (Granite 4 style); kvedge imports granite files with RoPE")
        hf["embedding_multiplier"] = _f32(key("embedding_scale", 0.0)) or 1.0
        hf["residual_multiplier"] = _f32(key("residual_scale", 0.0)) or 1.0
        hf["attention_multiplier"] = _f32(key("attention.scale", 0.0)) or head_dim ** -0.5
        hf["logits_scaling"] = _f32(key("logit_scale"))
    if arch == "smollm3":  # no_rope_layers is not in the file; src/models/smollm3.cpp: every 4th layer without RoPE
        hf["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(layers)]
    if arch == "phi3":
        window = key("attention.sliding_window", 0)  # 0: none (Phi-4)
        if window:
            hf["sliding_window"] = int(window)
        orig = key("rope.scaling.original_context_length", None)
        if orig:
            hf["original_max_position_embeddings"] = int(orig)
    hf["architectures"] = [_HF_ARCHITECTURES[hf["model_type"]]]
    return hf


def _llama3_scaling(g: GGUFFile, hf: dict[str, Any], head_dim: int | None) -> dict[str, Any]:
    """Llama 3.x rope scaling from llama.cpp's rope_freqs tensor, when the factors are those of the standard
    parameterization (factor = the largest factor; the others llama.cpp's defaults); refused otherwise."""
    where = f"{g.path}: tensor rope_freqs.weight"
    t = g.tensors["rope_freqs.weight"]
    if t.tensor_type.name != "F32" or not head_dim or g.shape("rope_freqs.weight") != (head_dim // 2,):
        raise ConfigError(f"{where} has type {t.tensor_type.name} and shape {list(g.shape('rope_freqs.weight'))}; "
                          f"expected F32 [{(head_dim or 0) // 2}] (Llama 3 RoPE frequency factors)")
    got = np.asarray(t.data, dtype=np.float64).reshape(-1)
    if np.allclose(got, 1.0, rtol=0, atol=1e-7):
        return hf.get("rope_scaling")
    p = dict(_LLAMA3_DEFAULTS, factor=float(got.max()))
    theta = hf["rope_theta"]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)).astype(np.float32)
    old, lo, hi = p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"]
    want = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            want.append(1.0)
        elif wavelen > old / lo:
            want.append(p["factor"])
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            want.append(1 / ((1 - smooth) / p["factor"] + smooth))
    if not np.allclose(got, want, rtol=1e-5, atol=0):
        raise ConfigError(f"{where}: RoPE frequency factors {np.round(got, 4).tolist()} are not those of Llama 3 "
                          f"scaling with factor {p['factor']:g}, low/high frequency factors 1 / 4 and original "
                          f"context 8192; kvedge cannot express them")
    return {"rope_type": "llama3", **{k: float(v) for k, v in p.items()}}


def _swa_layer_types(g: GGUFFile, layers: int, every: int) -> list[str]:
    """Each layer's type as llama.cpp's load_swa_pattern reads it (src/llama-model.cpp, llama-hparams.cpp):
    `{arch}.attention.sliding_window_pattern` as one flag per layer, or as n: layer i slides iff i % n < n - 1
    (every n-th layer global; n = 0: all slide); absent: n = `every`, the architecture's hard-coded default."""
    name = f"{g.arch}.attention.sliding_window_pattern"
    v = g.value(name, every)
    if isinstance(v, list) and len(v) != layers:
        raise ConfigError(f"{g.path}: {name} has {len(v)} entries for {layers} layers")
    slides = [bool(f) for f in v] if isinstance(v, list) else [v == 0 or i % v < v - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _longrope_scaling(g: GGUFFile, hf: dict[str, Any], rot_dim: int | None) -> dict[str, Any]:
    """phi3's LongRoPE as convert_hf_to_gguf.py's Phi3MiniModel writes it: F32 tensors rope_factors_short and
    rope_factors_long [rotary dims / 2], `rope.scaling.attn_factor` (sqrt(1 + ln s / ln original), s = context /
    original context) and `rope.scaling.original_context_length`; llama.cpp's defaults where a key is absent
    (attn factor 1, original context = context length: src/llama-model.cpp)."""
    factors = {}
    for which in ("short", "long"):
        name = f"rope_factors_{which}.weight"
        t = g.tensors.get(name)
        if t is None or t.tensor_type.name != "F32" or g.shape(name) != ((rot_dim or 0) // 2,):
            got = "missing" if t is None else f"{t.tensor_type.name} {list(g.shape(name))}"
            raise ConfigError(f"{g.path}: tensor {name} is {got}; LongRoPE needs rope_factors_short and "
                              f"rope_factors_long, F32 [{(rot_dim or 0) // 2}]")
        factors[f"{which}_factor"] = [_f32(v) for v in np.asarray(t.data).reshape(-1)]
    length = hf["max_position_embeddings"]
    original = int(g.value(f"{g.arch}.rope.scaling.original_context_length") or length)
    stored = g.value(f"{g.arch}.rope.scaling.attn_factor", 1.0)
    computed = longrope_attention_factor(length / original, original)
    attention = computed if np.float32(stored) == np.float32(computed) else _f32(stored)  # the converter's float
    return {"rope_type": "longrope", **factors, "original_max_position_embeddings": original,
            "attention_factor": attention}


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata."""
    g = open_gguf(path)
    return ModelConfig.from_hf(hf_config(g), str(g.path))


# -- tensors ----------------------------------------------------------------------------------------
def _gguf_name(hf_name: str, arch: str) -> str:
    base, _, part = hf_name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{part}"
    _, _, rest = base.partition("model.layers.")
    i, _, module = rest.partition(".")
    if arch in _POST_ATTENTION_NORM and module == "post_attention_layernorm":
        return f"blk.{i}.post_attention_norm.{part}"
    return f"blk.{i}.{_LAYER_NAMES[module]}.{part}"


def tensor_plan(g: GGUFFile, cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple, tuple[str, ...]]]:
    """kvedge parameter -> (GGUF tensor names, their expected shapes, the Hugging Face names), every tensor
    checked (present, expected, right shape, a type kvedge reads) before any weight is read."""
    from kvedge.models.loader import tensor_map

    where = str(g.path)
    plan = {}
    for dst, src in tensor_map(cfg).items():
        plan[dst] = (tuple(_gguf_name(n, g.arch) for n in src.names), src.shapes, src.names)
    wanted = {n: s for names, shapes, _ in plan.values() for n, s in zip(names, shapes)}
    missing = [n for n in wanted if n not in g.tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{where}: missing tensor(s) for {g.arch} with {cfg.num_layers} layers: "
                              f"{', '.join(missing[:5])}{more}")
    extra = sorted(set(g.tensors) - set(wanted) - set(_ROPE_TENSORS))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor(s) for {g.arch} with {cfg.num_layers} layers: "
                              f"{', '.join(extra[:5])}" + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
                              + "; does the metadata match these weights?")
    for name, shape in wanted.items():
        if g.shape(name) != tuple(shape):
            raise CheckpointError(f"{where}: tensor {name} has shape {list(g.shape(name))}, expected {list(shape)} "
                                  f"from the file's metadata")
        kind = g.type_name(name)
        if kind not in SUPPORTED_TYPES:
            raise CheckpointError(f"{where}: GGUF tensor {name} has type {kind}, which kvedge does not import; "
                                  f"supported: {', '.join(SUPPORTED_TYPES)}")
    return plan


def row_order(g: GGUFFile, name: str, cfg: ModelConfig, rows: int) -> np.ndarray | None:
    """The rows' order that undoes llama.cpp's Q/K permutation (llama, granite, smollm3), None where there is none.

    convert_hf_to_gguf.py (LlamaModel.permute) stored w.reshape(h, 2, d/2, ...).swapaxes(1, 2): row (h, j, i)
    of the file is row (h, i, j) of the checkpoint. The inverse, as a row index: file rows taken in the
    order arange(rows).reshape(h, d/2, 2).swapaxes(1, 2)."""
    if g.arch not in _PERMUTED_QK:
        return None
    if ".attn_q." in name:
        heads = cfg.num_heads
    elif ".attn_k." in name:
        heads = cfg.num_kv_heads
    else:
        return None
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def read_float(g: GGUFFile, name: str, cfg: ModelConfig) -> np.ndarray:
    """A tensor as float32, gguf.quants.dequantize's values, in the checkpoint's layout (Q/K rows un-permuted,
    gemma's norm offset removed)."""
    from gguf.quants import dequantize

    t = g.tensors[name]
    w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(g.shape(name))
    order = row_order(g, name, cfg, w.shape[0])
    if order is not None:
        w = w[order]
    if g.arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
        w = w - np.float32(1.0)
    return np.ascontiguousarray(w)


def _half_split(blocks: np.ndarray) -> np.ndarray:
    """[n, w] bytes -> [n, 2w] nibbles: the low nibbles of every byte, then the high ones."""
    return np.concatenate((blocks & 0x0F, blocks >> 4), axis=-1)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> (scales, mins) [n, 8], 6 bits each: bytes 0-3 hold scales 0-3 (low 6 bits) and
    the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scales 4-7
    (low nibble) and of mins 4-7 (high nibble)."""
    p = packed.reshape(-1, 3, 4)
    d, m, md = p[:, 0], p[:, 1], p[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


def unpack_blocks(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks of one quantized type [n, type_size] uint8 -> (q uint8 [n, groups, group], scales float32
    [n, groups], mins float32 [n, groups] or None), in the element order gguf.quants.dequantize uses."""
    n = blocks.shape[0]
    f16 = lambda b: b.copy().view(np.float16).astype(np.float32)  # noqa: E731  [n, 2] bytes -> [n, 1]
    if kind == "Q8_0":
        d, qs = f16(blocks[:, :2]), blocks[:, 2:].copy().view(np.int8)
        return (qs.astype(np.int16) + 128).astype(np.uint8)[:, None], d, None
    if kind in ("Q4_0", "Q4_1"):
        off = 2 if kind == "Q4_0" else 4
        q = _half_split(blocks[:, off:])[:, None]
        return q, f16(blocks[:, :2]), (f16(blocks[:, 2:4]) if kind == "Q4_1" else None)
    if kind in ("Q5_0", "Q5_1"):
        off = 2 if kind == "Q5_0" else 4
        qh = blocks[:, off:off + 4].copy().view("<u4")  # [n, 1]: bit j is the fifth bit of element j
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = (_half_split(blocks[:, off + 4:]) | (high << 4))[:, None]
        return q, f16(blocks[:, :2]), (f16(blocks[:, 2:4]) if kind == "Q5_1" else None)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = f16(blocks[:, :2]), f16(blocks[:, 2:4])
        sc, m = _k_scale_min(blocks[:, 4:16])  # the 6-bit scales and mins of the 8 sub-blocks
        scales = d * sc.astype(np.float32)  # float32, as gguf computes them
        mins = -(dmin * m.astype(np.float32))
        rest = blocks[:, 16:]
        if kind == "Q4_K":
            qs = rest.reshape(n, 4, 32)  # 4 runs of 32 bytes: low nibbles = sub-block 2i, high = 2i + 1
            q = np.stack((qs & 0x0F, qs >> 4), axis=2).reshape(n, 8, 32)
        else:
            qh, qs = rest[:, :32], rest[:, 32:].reshape(n, 4, 32)
            low = np.stack((qs & 0x0F, qs >> 4), axis=2).reshape(n, 8, 32)
            # bit i of byte j: the fifth bit of element 32i + j
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = low | (high << 4)
        return q.astype(np.uint8), scales, mins
    if kind == "Q6_K":
        ql, qh = blocks[:, :128].reshape(n, 2, 64), blocks[:, 128:192].reshape(n, 2, 32)
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        d = f16(blocks[:, 208:210])
        low = np.stack((ql & 0x0F, ql >> 4), axis=2).reshape(n, 2, 4, 32)  # per half: 4 runs of 32
        high = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
        q = (low | (high << 4)).reshape(n, 16, 16)
        return q.astype(np.uint8), d * sc, None
    raise CheckpointError(f"GGUF type {kind} is not a quantized type kvedge imports")


def read_quantized(g: GGUFFile, name: str, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A quantized [N, K] tensor -> (q uint8 [N, K / group, group], scales [N, K / group], mins or None),
    rows in the checkpoint's order."""
    import gguf

    t = g.tensors[name]
    kind = t.tensor_type.name
    n, k = g.shape(name)
    block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    q, s, m = unpack_blocks(kind, np.asarray(t.data).reshape(n * (k // block), size))
    group = QUANT_TYPES[kind][1]
    q, s = q.reshape(n, k // group, group), s.reshape(n, k // group)
    m = None if m is None else m.reshape(n, k // group)
    order = row_order(g, name, cfg, n)
    if order is not None:
        q, s, m = q[order], s[order], (None if m is None else m[order])
    return q, s, m


def _is_linear(dst: str) -> bool:
    parts = dst.split(".")
    return dst == "lm_head.weight" or (len(parts) == 4 and parts[0] == "layers" and parts[2] in _LINEARS
                                       and parts[3] == "weight")


def _quant_linear(g: GGUFFile, names: tuple[str, ...], kind: str, cfg: ModelConfig, bias: bool,
                  dtype: torch.dtype, device, cls=None):
    from kvedge.models.quant import QuantLinear, pack

    bits, group, affine, zero = QUANT_TYPES[kind]
    parts = [read_quantized(g, n, cfg) for n in names]
    q = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    s = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    mins = torch.from_numpy(np.concatenate([p[2] for p in parts])).reshape(-1) if affine else None
    n, groups = s.shape
    zeros = torch.empty((n, 0), dtype=torch.uint8) if affine else torch.full((n, groups), zero, dtype=torch.uint8)
    with torch.device("meta"):  # a shell: shape, dtype and bias; nothing is computed
        shell = nn.Linear(groups * group, n, bias=bias, dtype=dtype)
    linear = (cls or QuantLinear)(shell, bits, group, packed=pack(q, s, zeros, bits), mins=mins)
    for b in _BUFFERS:  # the bias stays a meta shell until the state dict is loaded
        if getattr(linear, b) is not None:
            setattr(linear, b, getattr(linear, b).to(device))
    return linear


def load_decoder(path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu",
                 quantized_embedding: tuple[int, ...] = ()):
    """The Decoder of a GGUF file: float32 unless `dtype` is given (every value the file holds is exact in
    float32). Quantized projections become QuantLinears over the file's integers (module doc).
    quantized_embedding: the bit widths (of QUANT_TYPES: 4, 8) at which a quantized token_embd stays in the file's
    integers too (a QuantEmbedding, which a tied head reads as well) instead of float: what a lowering that can
    gather quantized rows exports."""
    from kvedge.models.decoder import Decoder
    from kvedge.models.loader import torch_dtype
    from kvedge.models.quant import QuantEmbedding

    g = open_gguf(path)
    cfg = ModelConfig.from_hf(hf_config(g), str(g.path))
    want = torch_dtype(dtype) or torch.float32
    plan = tensor_plan(g, cfg)
    state: dict[str, torch.Tensor] = {}
    linears: dict[str, nn.Module] = {}
    record: dict[str, Any] = {"file": g.path.name, "architecture": g.arch, "file_type": _file_type(g),
                              "linears": {}, "float_linears": {}, "dequantized": {}}
    def release(names):  # read: the map's pages of these tensors need not stay resident (a view re-reads them)
        for t in (g.tensors[n] for n in names):
            g.reader.release(t.data_offset, t.data_offset + t.n_bytes)

    for dst, (names, _, _) in plan.items():
        types = [g.type_name(n) for n in names]
        quantized = [t in QUANT_TYPES for t in types]
        if dst == "embed.weight" and all(quantized) and QUANT_TYPES[types[0]][0] in quantized_embedding:
            linears["embed"] = _quant_linear(g, names, types[0], cfg, False, want, device, QuantEmbedding)
            record["embedding"] = types[0]
            release(names)
            continue
        if _is_linear(dst) and all(quantized):
            module = dst[: -len(".weight")]
            if len(set(types)) == 1:
                linears[module] = _quant_linear(g, names, types[0], cfg, f"{module}.bias" in plan, want, device)
                record["linears"][module] = types[0]
                release(names)
                continue
        if _is_linear(dst) and any(quantized):
            record["float_linears"][dst[: -len(".weight")]] = dict(zip(names, types))
        elif any(quantized):
            record["dequantized"].update({n: t for n, t in zip(names, types) if t in QUANT_TYPES})
        parts = [read_float(g, n, cfg) for n in names]
        w = parts[0] if len(parts) == 1 else np.concatenate(parts)
        state[dst] = torch.from_numpy(w).to(device=device, dtype=want)
        release(names)
    with torch.device("meta"):
        model = Decoder(cfg)
    for module, linear in linears.items():
        model.set_submodule(module, linear)
        state.update({f"{module}.{b}": getattr(linear, b) for b in _BUFFERS if getattr(linear, b) is not None})
    model.load_state_dict(state, strict=True, assign=True)
    model.set_rope_buffers(device)
    model.gguf = record
    if record["linears"]:  # export and the native engine take them as they are
        kinds = sorted({t.split()[0] for t in record["linears"].values()})
        model.prequantized = {"method": "gguf", "scheme": record["file_type"] or "+".join(kinds), "types": kinds,
                              "bits": sorted({QUANT_TYPES[t][0] for t in kinds}),
                              "linears": len(record["linears"]), "pre_quantized": True, "gguf": record}
    return model.eval().requires_grad_(False)


def _file_type(g: GGUFFile) -> str | None:
    v = g.value("general.file_type")
    if v is None:
        return None
    import gguf

    try:
        return gguf.LlamaFileType(int(v)).name
    except ValueError:
        return str(v)


# -- a Hugging Face folder --------------------------------------------------------------------------
def write_hf_folder(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face-format checkpoint of a GGUF file: config.json and model.safetensors (Hugging Face
    tensor names, Q/K rows un-permuted; float weights with the file's values: F16 / BF16 tensors as they are,
    everything else float32, quantized tensors dequantized exactly), plus the tokenizer files where
    kvedge.models.gguf_vocab is present. Everything is checked before anything is written."""
    from safetensors.torch import save_file

    g = open_gguf(gguf_path)
    hf = hf_config(g)
    cfg = ModelConfig.from_hf(hf, str(g.path))
    tensors: dict[str, torch.Tensor] = {}
    for names, _, hf_names in tensor_plan(g, cfg).values():
        for name, hf_name in zip(names, hf_names):
            w = torch.from_numpy(read_float(g, name, cfg))
            kind = g.type_name(name)
            tensors[hf_name] = w.to({"F16": torch.float16, "BF16": torch.bfloat16}.get(kind, torch.float32))
    out = Path(out_dir)
    _write_tokenizer(g, out)  # first: it builds the tokenizer (and may refuse it) before writing
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")  # last: marks it complete
    return out


def _write_tokenizer(g: GGUFFile, out_dir: Path) -> bool:
    """The tokenizer files (tokenizer.json, tokenizer_config.json with the chat template) from the
    `tokenizer.ggml.*` metadata: kvedge.models.gguf_vocab's job. False where that module is absent."""
    try:
        from kvedge.models.gguf_vocab import write_tokenizer_files
    except ImportError:
        return False
    write_tokenizer_files(g, out_dir)
    return True
