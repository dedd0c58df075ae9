"""The built-in demo checkpoint: a deterministic Llama-style GQA model in Hugging Face format.

Written on demand (no download): config.json, model.safetensors with seeded random weights, and a
byte-level tokenizer.json. Its weights are random, so its text is not meant to read well; it exists
so that every stage (load, export, run, parity, bench) can run end to end on any machine.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from kvedge.errors import KvedgeError

DEMO_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 259,  # 3 special tokens + 256 bytes
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,  # GQA, 4 query heads per KV head
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}
# SmolLM2-135M's public shape (config only; the weights here are random): the benchmarks' model.
SMOLLM2_135M_CONFIG = {
    **DEMO_CONFIG,
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rope_theta": 100000.0, "tie_word_embeddings": True,
}
# Edge-sized shapes (random weights): SmolLM2-1.7B's, and Llama-3.2-3B's with SmolLM2's vocabulary.
SMOLLM2_1_7B_CONFIG = {
    **SMOLLM2_135M_CONFIG,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 64, "rope_theta": 130000.0,
}
LLAMA32_3B_SHAPE_CONFIG = {
    **SMOLLM2_135M_CONFIG,
    "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
    "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
}
PRESETS = {"demo": DEMO_CONFIG, "smollm2-135m": SMOLLM2_135M_CONFIG, "smollm2-1.7b": SMOLLM2_1_7B_CONFIG,
           "llama3.2-3b-shape": LLAMA32_3B_SHAPE_CONFIG}
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
SEED = 1234


def demo_weights(cfg: dict = DEMO_CONFIG, seed: int = SEED, std: float = 0.08) -> dict[str, torch.Tensor]:
    """Seeded random weights under the Hugging Face Llama tensor names."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    w = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h) * 10, "model.norm.weight": torch.ones(h)}
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = rnd(cfg["vocab_size"], h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
            p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
            p + "mlp.down_proj.weight": rnd(h, i),
        })
    return w


def byte_chars() -> list[str]:
    """The printable stand-in character of each byte 0..255, as byte-level BPE (GPT-2) defines them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is a token, so any text encodes.
    Encoding prepends <s>; the chat template is a minimal role-tagged one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: n for n, t in enumerate(SPECIAL_TOKENS)}
    for byte, ch in enumerate(byte_chars()):  # token id = byte value + 3
        vocab[ch] = len(SPECIAL_TOKENS) + byte
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0)])  # BOS, as Llama's
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    }, indent=2))


def write_demo_checkpoint(out_dir: str | Path, preset: str = "demo") -> Path:
    """Write a preset's checkpoint into out_dir (created); returns the path. Idempotent and atomic.

    Presets: "demo" (the built-in 3M-parameter model) and "smollm2-135m" (that model's shape, random
    weights; the tokenizer stays byte-level, so only its first 259 ids are ever produced by text)."""
    if preset not in PRESETS:
        raise KvedgeError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    from safetensors.torch import save_file

    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kvedge-demo-", dir=out.parent))
    save_file(demo_weights(cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(tmp)
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}, indent=2))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))  # last: marks it complete
    if out.exists():
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
        tmp.rmdir()
    else:
        os.replace(tmp, out)
    return out


def write_random_gguf(path: str | Path, preset: str, kind: str = "F16", embed_kind: str | None = None,
                      tokenizer_from: str | Path | None = None, seed: int = SEED, std: float = 0.02) -> Path:
    """A llama GGUF file of a preset's shape with seeded random weights, streamed a tensor at a time (a 3B
    shape is 6 GB as F16): what the edge benchmarks quantize with llama.cpp's own quantizer, and what the memory
    tests load. kind / embed_kind (default kind): F16, F32, or Q8_0 / Q4_0 as random blocks (random integers,
    each block's scale `std` / 8 as float16), which need no quantizer. tokenizer_from: a GGUF file whose
    `tokenizer.*` metadata (vocabulary, merges, chat template) is copied, so the file takes text."""
    import gguf
    import numpy as np

    from kvedge.models.gguf import open_gguf

    cfg = PRESETS[preset]
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["output.weight"] = (vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (h,), b + "attn_q.weight": (heads * d, h),
                       b + "attn_k.weight": (kv * d, h), b + "attn_v.weight": (kv * d, h),
                       b + "attn_output.weight": (h, heads * d), b + "ffn_norm.weight": (h,),
                       b + "ffn_gate.weight": (inter, h), b + "ffn_up.weight": (inter, h),
                       b + "ffn_down.weight": (h, inter)})
    types = {n: "F32" if len(shape) == 1 else embed_kind or kind if n == "token_embd.weight" else kind
             for n, shape in shapes.items()}
    rng = np.random.default_rng(seed)

    def data(name: str) -> np.ndarray:
        shape, t = shapes[name], types[name]
        if len(shape) == 1:
            return np.ones(shape, dtype=np.float32)
        if t in ("F16", "F32"):
            return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16 if t == "F16" else np.float32)
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]]
        blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
        blocks[..., :2] = np.frombuffer(np.float16(std / 8).tobytes(), dtype=np.uint8)  # each block's scale d
        return blocks.reshape(shape[0], -1)

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"kvedge random {preset}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(vocab)
    w.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}[kind])
    if tokenizer_from is not None:
        src = open_gguf(tokenizer_from)
        for key, v in src.reader.fields.items():
            if not key.startswith("tokenizer."):
                continue
            if isinstance(v, list):
                w.add_array(key, v)
            elif isinstance(v, bool):
                w.add_bool(key, v)
            elif isinstance(v, int):
                w.add_uint32(key, v)
            else:
                w.add_string(key, v)
    for name, shape in shapes.items():
        t = gguf.GGMLQuantizationType[types[name]]
        block, size = gguf.GGML_QUANT_SIZES[t]
        nbytes = int(np.prod(shape)) // block * size
        dtype = {"F32": np.float32, "F16": np.float16}.get(types[name], np.uint8)
        w.add_tensor_info(name, shape if dtype is not np.uint8 else (shape[0], shape[1] // block * size),
                          np.dtype(dtype), nbytes, raw_dtype=None if dtype is not np.uint8 else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name in shapes:
        w.write_tensor_data(data(name))
    w.close()
    return out
