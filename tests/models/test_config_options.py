"""Config keys of granite, olmo2, smollm3 and gemma3 that the tiny parity cases do not spell out: their defaults,
their transformers 4.x forms, and the refusals. (The parity tests prove the options' meaning in the forward pass.)"""

from __future__ import annotations

import math

import pytest
import torch

from kvedge.errors import ConfigError
from kvedge.models.config import ModelConfig

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=160)


def cfg(model_type: str, **kw) -> ModelConfig:
    return ModelConfig.from_hf({"model_type": model_type, **BASE, **kw})


def test_smollm3_no_rope_layers_lists_the_layers_that_use_rope():
    assert cfg("smollm3", no_rope_layers=[1, 0, 1, 1]).layer_rope == [True, False, True, True]
    # without the list: every no_rope_layer_interval-th layer has no RoPE (transformers' SmolLM3Config)
    assert cfg("smollm3", no_rope_layer_interval=2).layer_rope == [True, False, True, False]
    # the layers without RoPE are the sliding ones, and only with use_sliding_window
    c = cfg("smollm3", no_rope_layers=[1, 0, 1, 0], sliding_window=8, use_sliding_window=True)
    assert c.layer_windows == [None, 8, None, 8]
    assert cfg("smollm3", no_rope_layers=[1, 0, 1, 0], sliding_window=8).layer_windows == [None] * 4


def test_gemma3_transformers4_keys():
    c = cfg("gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=8, sliding_window_pattern=2,
            query_pre_attn_scalar=16)
    assert (c.rope_theta, c.rope_local_theta) == (1e6, 1e4)
    assert c.layer_windows == [8, None, 8, None] and c.attn_scale == 16 ** -0.5 and c.qk_norm and c.post_norms


def test_gemma3_refusals():
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        cfg("gemma3_text", use_bidirectional_attention=True, sliding_window=8)
    with pytest.raises(ConfigError, match="without a sliding_window"):
        cfg("gemma3_text")
    with pytest.raises(ConfigError, match="sliding_attention rope_type 'linear'"):
        cfg("gemma3_text", sliding_window=8, rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                            "full_attention": {"rope_type": "default"}})


def test_granite_needs_its_attention_multiplier_and_olmo2_has_post_norms_only():
    with pytest.raises(ConfigError, match="attention_multiplier"):
        cfg("granite")
    c = cfg("granite", attention_multiplier=0.5, embedding_multiplier=2.0, residual_multiplier=0.25, logits_scaling=3.0)
    assert (c.attn_scale, c.embed_scale, c.residual_scale, c.logits_divisor) == (0.5, 2.0, 0.25, 3.0)
    c = cfg("olmo2")
    assert (c.pre_norms, c.post_norms, c.qk_norm, c.qk_norm_scope) == (False, True, True, "all")


def test_phi3_longrope_reads_as_transformers_does(hf_checkpoint):
    """Factor (max / original positions), attention factor, and both frequency sets against transformers'
    own rotary embedding; the 4.x key form; refusals."""
    from kvedge.models import load_decoder

    path, hf = hf_checkpoint("phi3-longrope")
    model = load_decoder(path)
    rot = hf.model.rotary_emb
    assert model.cfg.rope_scaling["attention_factor"] == pytest.approx(rot.attention_scaling, rel=1e-7)
    assert model.cfg.rope_scaling["factor"] == 4.0  # max_position_embeddings 64 / original 16
    torch.testing.assert_close(model.inv_freq, rot.original_inv_freq, rtol=1e-6, atol=0)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, None, seq_len=17)  # transformers' set past 16
    torch.testing.assert_close(model.inv_freq_long, long_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(model.inv_freq, model.inv_freq_long)
    short, long = [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]
    c = cfg("phi3", max_position_embeddings=4096, original_max_position_embeddings=1024,
            rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})  # transformers 4.x
    assert c.rope_scaling["attention_factor"] == pytest.approx((1 + math.log(4) / math.log(1024)) ** 0.5)
    with pytest.raises(ConfigError, match="needs a list 'long_factor'"):
        cfg("phi3", rope_scaling={"type": "longrope", "short_factor": short})
    with pytest.raises(ConfigError, match="differ in length"):
        cfg("phi3", rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long[:3]})
