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
PRESETS = {"demo": DEMO_CONFIG, "smollm2-135m": SMOLLM2_135M_CONFIG}
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
