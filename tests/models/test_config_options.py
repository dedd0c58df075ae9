"""Config keys of granite, olmo2, smollm3 and gemma3 that the tiny parity cases do not spell out: their defaults,
their transformers 4.x forms, and the refusals. (The parity tests prove the options' meaning in the forward pass.)"""

from __future__ import annotations

import pytest

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
