"""The planner and the cache arithmetic with an int8 KV cache, against figures worked out by hand."""

from __future__ import annotations

import json

import pytest

from kvedge.bench.plan import plan
from kvedge.cli import main
from kvedge.models import ModelConfig, kv_bytes_per_token, kv_cache_bytes
from tests.bench.test_plan import LLAMA3_8B


def test_llama3_8b_int8_kv_is_half_of_fp16_plus_its_scales():
    cfg = ModelConfig(**LLAMA3_8B)
    # per token, K and V, every layer: 2 * 32 layers * 8 KV heads * 128 head_dim = 65,536 elements
    assert kv_bytes_per_token(32, 8, 128, "int8") == 65_536  # 1 byte each
    assert kv_bytes_per_token(32, 8, 128, "fp16") == 131_072  # 2 bytes each
    # scales, once: 2 (K, V) * 32 layers * 8 heads * 128 channels * 4 bytes (float32) = 262,144
    assert kv_cache_bytes(cfg, 8192, 1, "int8") == 65_536 * 8192 + 262_144  # 512 MiB + 256 KiB
    assert kv_cache_bytes(cfg, 8192, 1, "fp16") == 131_072 * 8192  # 1 GiB, no scales
    p16 = plan(cfg, seq_len=8192, batch=2, dtype="fp16", memory_gb=24)
    p8 = plan(cfg, seq_len=8192, batch=2, dtype="fp16", kv_dtype="int8", memory_gb=24)
    assert p8.kv_bytes == 65_536 * 8192 * 2 + 262_144 and p16.kv_bytes == 131_072 * 8192 * 2
    assert p8.weights_bytes == p16.weights_bytes == 16_060_522_496
    assert p8.kv_by_attention["GQA (this model)"] == 64 * 1024
    # largest context at batch 2 in 24 GiB = 25,769,803,776 bytes, activations 46,650,368 + 32,768 n * 2 (batch 2):
    # 16,060,522,496 + 262,144 + 2 * 65,536 n + 93,300,736 + 2 * 32,768 n <= 25,769,803,776
    #   -> 196,608 n <= 9,615,718,400  ->  n <= 48,908.07 (48,909 without the scales)
    assert p8.memory_max_context == 48_908


def test_plan_cli_shows_the_int8_cache(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "max_position_embeddings": 131072}))
    assert main(["plan", str(tmp_path), "--seq-len", "1024", "--kv-dtype", "int8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_bytes"] == 65_536 * 1024 + 262_144
    with pytest.raises(SystemExit):
        main(["plan", str(tmp_path), "--kv-dtype", "int3"])
