"""Tiny GGUF files for the tests, written as llama.cpp's convert_hf_to_gguf.py writes them.

`write_gguf` reads a Hugging Face checkpoint folder (config.json + model.safetensors, as conftest's
save_hf_model writes it) and follows the converter: its metadata keys per architecture (TextModel's, plus
LlamaModel's, GemmaModel's, Gemma2Model's, Gemma3Model's, GraniteModel's, Phi3MiniModel's own; SmolLM3Model and
Olmo2Model (without a window) add none), its tensor names (gguf's own TensorNameMap), the Q/K row permutation
of LlamaModel and its subclasses (granite, smollm3), Gemma's `norm.weight + 1`, no lm_head where the model ties
it (and never for gemma), Llama 3 rope scaling as a `rope_freqs` tensor, phi3's LongRoPE as rope_factors_short
/ rope_factors_long tensors and an attn factor, 1-D tensors in F32. Where the converter's classes moved to
ggml-org/llama.cpp's conversion/ package (base.py TextModel, llama.py, gemma.py, granite.py, olmo.py, phi.py),
this follows those.

Weight types: F32, F16 as numpy writes them; BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 quantized with
gguf.quants.quantize; the K-quants (Q4_K, Q5_K, Q6_K), which gguf-py cannot quantize, are random blocks
packed from their published layouts (see gguf.quants' dequantize_blocks), scaled so that |w| stays below
about 0.15. A K-quant needs rows of a multiple of 256 values.

The one key the converter does not write and a test needs: `llama.attention.sliding_window` for a
mistral-style window (llama.cpp's LlamaModel ignores Mistral's window); kvedge reads it where present.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "olmo2": "olmo2", "granite": "granite",
             "smollm3": "smollm3"}
PERMUTED_QK = ("llama", "granite", "smollm3")  # LlamaModel and its subclasses with undo_permute
NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
QUANTIZED_BY_GGUF = ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
               "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1",
               "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K"}


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of q_proj / k_proj, weights and biases)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """The inverse, as transformers' LlamaTensorProcessor writes it."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def save_hf_checkpoint(path: str | Path, model_type: str, seed: int = 0, **overrides):
    """conftest.save_hf_model, then every norm weight and bias made non-trivial (transformers initializes them
    to ones and zeros, which would hide a wrong bias permutation or norm offset), saved again. Returns the
    transformers model (eval)."""
    import torch

    from tests.conftest import save_hf_model

    model = save_hf_model(path, model_type, seed=seed, **overrides)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model


def _rope_params(hp: dict) -> dict:
    params = dict(hp.get("rope_scaling") or {})
    params.update(hp.get("rope_parameters") or {})
    return params


def _metadata(w, arch: str, hp: dict) -> None:
    rp = _rope_params(hp)
    local_theta = rp.get("sliding_attention", {}).get("rope_theta")
    rp = rp.get("full_attention", rp)  # per layer type (gemma3): the global layers' parameters
    theta = rp.get("rope_theta", hp.get("rope_theta"))
    heads, hidden = hp["num_attention_heads"], hp["hidden_size"]
    kv = hp.get("num_key_value_heads")
    if arch in ("gemma", "gemma2"):  # GemmaModel / Gemma2Model.set_gguf_parameters
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_block_count(hp["num_hidden_layers"])
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count(heads)
        w.add_head_count_kv(kv if kv is not None else heads)
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
            w.add_sliding_window(hp["sliding_window"])
        return
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        rot_pct = rp.get("partial_rotary_factor", hp.get("partial_rotary_factor", 1.0))
        w.add_context_length(hp["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(hp["original_max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_block_count(hp["num_hidden_layers"])
        w.add_head_count(heads)
        w.add_head_count_kv(kv)
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_rope_dimension_count(int(rot_pct * hidden) // heads)
        w.add_rope_freq_base(theta)
        w.add_sliding_window(hp.get("sliding_window") or 0)
        return
    import gguf

    if arch == "granite":  # GraniteModel.set_gguf_parameters: "Ignoring head_dim ... for Granite"
        hp = {k: v for k, v in hp.items() if k != "head_dim"}
    # TextModel.set_gguf_parameters
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    if kv is not None:
        w.add_head_count_kv(kv)
    if rp.get("rope_type") == "linear" and rp.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    if theta is not None:
        w.add_rope_freq_base(theta)
    if local_theta is not None:
        w.add_rope_freq_base_swa(local_theta)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    if arch in PERMUTED_QK:  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hidden // heads)
        if hp["model_type"] == "mistral" and hp.get("sliding_window"):
            w.add_sliding_window(hp["sliding_window"])
    if arch == "granite":  # GraniteModel.set_gguf_parameters: the multipliers as *_scale keys, where truthy
        for hf_key, add in (("attention_multiplier", w.add_attention_scale), ("embedding_multiplier",
                            w.add_embedding_scale), ("residual_multiplier", w.add_residual_scale),
                            ("logits_scaling", w.add_logit_scale)):
            if hp.get(hf_key):
                add(hp[hf_key])
    if arch == "gemma3":  # Gemma3Model.set_gguf_parameters (its other keys repeat TextModel's values)
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        if hp.get("sliding_window_pattern") != 1:
            w.add_sliding_window(hp["sliding_window"])


def _llama3_rope_freqs(hp: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the per-frequency factors of Llama 3 rope scaling."""
    import torch

    rp = _rope_params(hp)
    base = rp.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rp.get("factor", 8.0), rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = hp.get("original_max_position_embeddings", 8192)  # the converter's top-level read: 8192 for HF 5.x configs
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _phi3_longrope(w, hp: dict, drop: tuple[str, ...]) -> None:
    """Phi3MiniModel.generate_extra_tensors: the attn factor sqrt(1 + ln s / ln original) (s = context / original
    context, 1 where s <= 1) and the long / short factors as F32 tensors."""
    rp = _rope_params(hp)
    length = hp["max_position_embeddings"]
    original = rp.get("original_max_position_embeddings", hp.get("original_max_position_embeddings"))
    scale = length / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    for which in ("long", "short"):
        if f"rope_factors_{which}.weight" not in drop:
            w.add_tensor(f"rope_factors_{which}.weight", np.array(rp[f"{which}_factor"], dtype=np.float32))


def random_kquant_blocks(kind: str, n_blocks: int, rng: np.random.Generator, amp: float = 0.15) -> np.ndarray:
    """n_blocks random blocks of a K-quant [n_blocks, type_size] uint8, from the published layouts:
    Q4_K: d f16, dmin f16, 12 bytes of 6-bit scales / mins, 128 bytes of 4-bit q       (144)
    Q5_K: d f16, dmin f16, 12 bytes of scales / mins, 32 bytes of fifth bits, 128 of q   (176)
    Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d f16              (210)"""
    def f16(scale):
        return (rng.uniform(0.5, 1.0, (n_blocks, 1)) * scale).astype(np.float16).view(np.uint8)

    def raw(n):
        return rng.integers(0, 256, (n_blocks, n), dtype=np.uint8)

    if kind == "Q4_K":
        return np.concatenate([f16(amp / (63 * 15)), f16(amp / 2 / 63), raw(12), raw(128)], axis=1)
    if kind == "Q5_K":
        return np.concatenate([f16(amp / (63 * 31)), f16(amp / 2 / 63), raw(12), raw(32), raw(128)], axis=1)
    if kind == "Q6_K":
        return np.concatenate([raw(128), raw(64), raw(16), f16(amp / (128 * 32))], axis=1)
    raise ValueError(kind)


def encode(data: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, object | None]:
    """A float32 [N, K] tensor in GGUF type `kind` -> (array for GGUFWriter.add_tensor, raw_dtype)."""
    import gguf

    qt = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return data.astype(np.float32), None
    if kind == "F16":
        return data.astype(np.float16), None
    if kind in QUANTIZED_BY_GGUF:
        return gguf.quants.quantize(data.astype(np.float32), qt), qt
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n, k = data.shape
    if k % block:
        raise ValueError(f"{kind} needs rows of a multiple of {block} values, got {k}")
    if kind in K_QUANTS:
        blocks = random_kquant_blocks(kind, n * k // block, rng)
    else:  # any other type: random bytes (the tests only check that it is refused)
        blocks = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    return blocks.reshape(n, k // block * size), qt


def tiny_vocab(n: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of n >= 8 tokens: single characters of GPT-2's byte alphabet (printable
    ASCII first), then four merged ones. (tokens, merges)"""
    alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    merged, merges = ["ab", "cd", "abcd", "ba"], ["a b", "c d", "ab cd", "b a"]
    return alphabet[: n - len(merged)] + merged, merges


def write_gguf(path: str | Path, hf_dir: str | Path, qtype: str = "F32", *, types: dict[str, str] | None = None,
               seed: int = 0, arch: str | None = None, drop: tuple[str, ...] = (),
               extra: Callable[[object], None] | None = None) -> Path:
    """Write a GGUF file of the checkpoint in hf_dir, its 2-D weights in `qtype`.

    types: GGUF tensor name (or a suffix of it, e.g. "attn_v.weight") -> type, overriding qtype for those
    tensors. arch: write under another general.architecture (for the refusal tests). drop: GGUF tensor names
    left out. extra: called with the GGUFWriter to add further metadata (e.g. a tokenizer)."""
    import gguf
    from safetensors.numpy import load_file

    hp = json.loads((Path(hf_dir) / "config.json").read_text())
    weights = load_file(str(Path(hf_dir) / "model.safetensors"))
    model_type = hp["model_type"]
    gguf_arch = GGUF_ARCH[model_type]
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == gguf_arch)
    names = gguf.get_tensor_name_map(arch_enum, hp["num_hidden_layers"])
    heads, kv = hp["num_attention_heads"], hp.get("num_key_value_heads")
    rng = np.random.default_rng(seed)
    types = types or {}

    w = gguf.GGUFWriter(str(path), arch or gguf_arch)
    w.add_name(f"tiny {model_type}")  # (a name of exactly "mistral" would make transformers' reader look for a
    # "mistral" architecture in gguf-py, which has none: real Mistral files are named "Mistral 7B ...")
    _metadata(w, gguf_arch, hp)
    w.add_file_type(gguf.LlamaFileType[_FILE_TYPES.get(qtype, "GUESSED")])
    tokens, merges = tiny_vocab(hp["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges(merges)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        if hp.get(key) is not None:
            add(hp[key])
    if extra is not None:
        extra(w)

    tied = hp.get("tie_word_embeddings", False) or gguf_arch in ("gemma", "gemma2")
    for hf_name, data in weights.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        data = data.astype(np.float32)
        if gguf_arch in PERMUTED_QK:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = llama_permute(data, heads, heads)
            if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = llama_permute(data, heads, kv)
        if gguf_arch in NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            data = data + 1
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        if name in drop:
            continue
        kind = next((t for key, t in types.items() if name == key or name.endswith("." + key)),
                    qtype if data.ndim == 2 else "F32")
        array, raw = encode(data, kind, rng)
        w.add_tensor(name, array, raw_dtype=raw)
    if gguf_arch == "llama" and _rope_params(hp).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(hp))
    if gguf_arch == "phi3" and _rope_params(hp).get("long_factor"):
        _phi3_longrope(w, hp, drop)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# -- references ----------------------------------------------------------------------------------------
def transformers_reference(gguf_path: str | Path, hf_config):
    """The transformers model of architecture `hf_config` (the checkpoint the file was written from) with the
    weights transformers' own GGUF loader reads from the file: gguf.quants.dequantize, its tensor name map,
    its reverse Q/K permutation (load_gguf_checkpoint, as from_pretrained(..., gguf_file=...) does; that path
    also needs `accelerate`, which this environment lacks). The architecture comes from the original config
    because transformers' GGUF config reader drops keys this file carries (biases, rope scaling, sliding
    windows, partial rotary, head_dim of qwen3, gemma2's softcaps); kvedge's reading of those keys is
    checked against the original config separately."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path)
    read_cfg = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers maps the file's tensor names onto the keys of this model's state dict (biases included);
    # a model type gguf-py does not know (mistral: llama.cpp writes it as llama) maps through transformers' own
    names_from = AutoModelForCausalLM.from_config(hf_config if hf_config.model_type == read_cfg.model_type
                                                  else read_cfg)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=names_from)["tensors"]
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval().requires_grad_(False).to(torch.float32)


def gguf_state_dict(gguf_path: str | Path, hf_dir: str | Path) -> dict:
    """The checkpoint's state dict as the test reads the GGUF file itself (for the architectures transformers' GGUF
    reader does not read: gemma, olmo2, granite, smollm3): gguf.quants.dequantize, gguf's TensorNameMap, the
    inverse Q/K permutation, gemma's - 1."""
    import gguf
    import torch
    from safetensors.numpy import load_file

    hp = json.loads((Path(hf_dir) / "config.json").read_text())
    gguf_arch = GGUF_ARCH[hp["model_type"]]
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == gguf_arch)
    names = gguf.get_tensor_name_map(arch_enum, hp["num_hidden_layers"])
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    heads, kv = hp["num_attention_heads"], hp.get("num_key_value_heads")
    state = {}
    for hf_name in load_file(str(Path(hf_dir) / "model.safetensors")):
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        if name not in tensors:
            continue
        t = tensors[name]
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        if gguf_arch in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = llama_unpermute(w, heads, heads)
        if gguf_arch in PERMUTED_QK and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = llama_unpermute(w, heads, kv)
        if gguf_arch in NORM_PLUS_ONE and hf_name.endswith("norm.weight"):
            w = w - 1
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(w))
    return state
