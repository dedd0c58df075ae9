"""Shared fixtures: tiny random-weight Hugging Face checkpoints, written with save_pretrained.

transformers is a test-only dependency: it is the independent reference kvedge is compared to.
"""

from __future__ import annotations

import os

import pytest
import torch

MAX_SEQ = 64  # cache length of the exports the tests share

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=160, max_position_embeddings=128, initializer_range=0.1,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (model_type, overrides). Together they cover MHA, GQA 2 and 4, MQA and each quirk.
ARCH_CASES: dict[str, tuple[str, dict]] = {
    "llama-mha": ("llama", dict(num_key_value_heads=8)),
    "llama-gqa2-bias": ("llama", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    # head_dim 8 has 4 frequencies; theta 100 puts their wavelengths (6.3, 19.9, 63, 199) on every branch of
    # llama3 scaling with original length 32: kept (< 32 / 4), interpolated (8 .. 32), divided (> 32).
    # (theta 5e5 gives 6.3, 167, ...: nothing in the band, so the interpolation would go untested.)
    "llama-gqa4-llama3rope": ("llama", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                              high_freq_factor=4.0,
                                                              original_max_position_embeddings=32),
                                            rope_theta=100.0)),
    "llama-mqa-linearrope": ("llama", dict(num_key_value_heads=1,
                                           rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=4)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=16)),
    "gemma": ("gemma", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32)),
    "gemma2": ("gemma2", dict(num_attention_heads=4, head_dim=16, sliding_window=8, attn_logit_softcapping=5.0,
                              final_logit_softcapping=10.0, query_pre_attn_scalar=24, num_hidden_layers=3)),
    "phi3-partialrope": ("phi3", dict(num_key_value_heads=4, sliding_window=10,
                                      rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                           partial_rotary_factor=0.5))),
    # Phi-3.5 / Phi-4-mini's longrope: per-frequency short and long factors, cos/sin times sqrt(1 + ln 4 / ln 16);
    # the parity tests' 16-token prompt stays on the short set and their decode steps cross onto the long one
    "phi3-longrope": ("phi3", dict(num_attention_heads=4, max_position_embeddings=64,
                                   original_max_position_embeddings=16,
                                   rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                        short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                                                        long_factor=[1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0, 24.0]))),
    "granite-multipliers": ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                            attention_multiplier=0.2, logits_scaling=4.0)),
    # norms after each sublayer only, q/k norms over the whole projection
    "olmo2-postnorm": ("olmo2", dict(num_key_value_heads=4)),
    "smollm3-nope": ("smollm3", dict(no_rope_layers=[1, 0])),  # 1: RoPE, 0: none (NoPE), per layer
    # a sliding layer with its own RoPE base (100 vs 10000: every frequency differs), then a full one
    "gemma3-localrope": ("gemma3_text", dict(num_attention_heads=4, head_dim=16, sliding_window=8,
                                             query_pre_attn_scalar=24,
                                             layer_types=["sliding_attention", "full_attention"],
                                             rope_parameters={"sliding_attention": dict(rope_type="default",
                                                                                        rope_theta=100.0),
                                                              "full_attention": dict(rope_type="default",
                                                                                     rope_theta=10000.0)})),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=160, n_positions=128,
                          initializer_range=0.1, bos_token_id=1, eos_token_id=2)),
    # multi-head latent attention, dense layers (first_k_dense_replace = layers: no routed experts). deepseek_v2: the
    # seeds' shape (d_c = kv_lora_rank = 4 x 16, d_R = qk_rope_head_dim = 16 / 2), a query rank, interleaved RoPE
    "deepseek_v2-mla": ("deepseek_v2", dict(num_key_value_heads=8, first_k_dense_replace=2, q_lora_rank=32,
                                            kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
    # no query rank (one q projection), rope_interleave, values wider than the keys' non-RoPE part
    "deepseek_v3-mla-noqlora": ("deepseek_v3", dict(num_key_value_heads=8, first_k_dense_replace=2, q_lora_rank=None,
                                                    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                                    v_head_dim=24)),
    # half-split RoPE, scaled embeddings, residual branches and logits, v_head_dim = hidden / heads by default
    "minicpm3-mla": ("minicpm3", dict(num_key_value_heads=8, q_lora_rank=24, kv_lora_rank=48, qk_nope_head_dim=8,
                                      qk_rope_head_dim=4, scale_emb=3.0, scale_depth=1.4, dim_model_base=16)),
}
MLA_CASES = [c for c, (model_type, _) in ARCH_CASES.items() if model_type in ("deepseek_v2", "deepseek_v3", "minicpm3")]

# Export matrices are the slow ones (one export per case and lowering). These cases' quirks live in the model and
# the config reader, not in any lowering's graph, and each passed every lowering when added; to keep CI time, the
# parity matrix (tests/export/test_export_parity.py) runs each on one lowering only (together: all three; a layer
# without RoPE on onnx, a local RoPE table through ort's fused rotation), and the
# generation matrix (tests/runtime/test_generation.py) leaves them out. HF parity and the native engine run them
# all. The matrix's refusal check (test_the_lowerings_refuse_exactly_the_expected_pairs) still covers every pair.
EXPORT_SUBSET: dict[str, tuple[str, ...]] = {
    "phi3-longrope": ("ort",),  # the table switch is a Where in the graph, ahead of any lowering; ort rotates in GQA
    "granite-multipliers": ("decomposed",),
    "olmo2-postnorm": ("ort",),
    "smollm3-nope": ("onnx",),
    "gemma3-localrope": ("ort",),
    # MLA's attention is in the graph, the same in the three cases (their differences are in the loader and the
    # config reader): together both lowerings that express it, with and without a query rank; ort refuses it
    # (test_export_parity's REFUSED). test_export_parity's ragged batches and tests/models/test_mla.py's cache contract
    # run on these.
    "deepseek_v2-mla": ("onnx",),
    "deepseek_v3-mla-noqlora": ("decomposed",),
    "minicpm3-mla": ("decomposed",),
}
MLA_EXPORTS = [(c, low) for c in MLA_CASES for low in EXPORT_SUBSET[c] if low != "ort"]  # ort refuses MLA


def hf_config(model_type: str, **overrides):
    from transformers import AutoConfig

    kw = {} if model_type == "gpt2" else dict(_BASE)
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def save_hf_model(path, model_type: str, seed: int = 0, **overrides):
    """Build a random-weight transformers model from a config and save it; returns the model (eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(model_type, **overrides), attn_implementation="eager")
    model = model.eval().requires_grad_(False)
    model.save_pretrained(path)
    return model


def transformers_logits(hf, prompt: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers model's logits for a prompt [b, n] and the decode that followed it (tokens [b, steps], as
    tests/models/test_hf_parity.py's greedy returns them): the prompt's [b, n, vocab] and each step's
    [b, steps, vocab] (step s: after the prompt and tokens[:, :s]). Teacher-forced on the whole sequence, except
    where the model's own config makes transformers pick its RoPE frequencies per forward call from the call's
    largest position: longrope, the long set once a position reaches original_max_position_embeddings. If the
    sequence crosses that length after the prompt, a recompute would run on the long set throughout, which is not
    what the prompt and then one token a call through a cache give (the prompt's keys keep the short set): then the
    reference runs as that decode does, through transformers' own cache, one call per token."""
    n, steps = prompt.shape[1], tokens.shape[1]
    rope = getattr(hf.config, "rope_parameters", None) or {}
    if not (rope.get("rope_type") == "longrope" and n <= rope["original_max_position_embeddings"] < n + steps):
        full = hf(torch.cat([prompt, tokens], 1)).logits
        return full[:, :n], full[:, n - 1:n - 1 + steps]
    out = hf(prompt, use_cache=True)
    prefill, step = out.logits, [out.logits[:, -1]]
    for s in range(steps - 1):
        out = hf(tokens[:, s:s + 1], past_key_values=out.past_key_values, use_cache=True)
        step.append(out.logits[:, -1])
    return prefill, torch.stack(step, 1)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(case) -> (checkpoint dir, transformers model), one per case per session."""
    made: dict[str, tuple] = {}

    def get(case: str):
        if case not in made:
            model_type, overrides = ARCH_CASES[case]
            path = tmp_path_factory.mktemp(case)
            made[case] = (path, save_hf_model(path, model_type, **overrides))
        return made[case]

    return get


@pytest.fixture(scope="session")
def exported(tmp_path_factory, hf_checkpoint):
    """exported(case, lowering, **options) -> export folder, one per combination per session."""
    made = {}

    def get(case: str, lowering: str, **kw):
        key = (case, lowering, tuple(sorted(kw.items())))
        if key not in made:
            path, _ = hf_checkpoint(case)
            out = tmp_path_factory.mktemp(f"{case}-{lowering}")
            from kvedge.export import ExportOptions, export

            opts = ExportOptions(attention=lowering, max_seq_len=MAX_SEQ, max_batch=3, force=True, **kw)
            made[key] = (out, export(path, out, opts))
        return made[key]

    return get


@pytest.fixture(scope="session")
def demo_export(tmp_path_factory):
    """demo_export(max_seq_len, max_batch) -> (demo checkpoint, its default export), one per shape."""
    made = {}

    def get(max_seq_len: int, max_batch: int):
        if (max_seq_len, max_batch) not in made:
            from kvedge.export import ExportOptions, export
            from kvedge.models.demo import write_demo_checkpoint

            root = tmp_path_factory.mktemp(f"demo-{max_seq_len}-{max_batch}")
            ckpt = write_demo_checkpoint(root / "ckpt")
            export(ckpt, root / "onnx", ExportOptions(max_seq_len=max_seq_len, max_batch=max_batch))
            made[(max_seq_len, max_batch)] = (ckpt, root / "onnx")
        return made[(max_seq_len, max_batch)]

    return get
