"""KV-cache size arithmetic, checked against figures computed by hand."""

from kvedge.models import ModelConfig, kv_bytes_per_token, kv_cache_bytes, mla_bytes_per_token

KiB, GiB = 1024, 1024**3


def test_gqa_llama3_8b_shape_fp16():
    # 2 (K and V) * 32 layers * 8 kv heads * 128 head_dim * 2 bytes = 131072 bytes
    assert kv_bytes_per_token(32, 8, 128, "fp16") == 128 * KiB
    cfg = ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, intermediate_size=14336)
    assert kv_cache_bytes(cfg, tokens=8192, batch=1, dtype="fp16") == 1 * GiB
    assert kv_cache_bytes(cfg, tokens=8192, batch=4, dtype="fp16") == 4 * GiB


def test_mha_with_32_kv_heads_is_four_times_larger():
    assert kv_bytes_per_token(32, 32, 128, "fp16") == 512 * KiB


def test_mqa_and_dtypes():
    assert kv_bytes_per_token(32, 1, 128, "fp16") == 16 * KiB
    assert kv_bytes_per_token(32, 8, 128, "fp32") == 256 * KiB
    assert kv_bytes_per_token(32, 8, 128, "int8") == 64 * KiB


def test_mla_latent_cache():
    # DeepSeek-V2-shaped: d_c = 512, d_rope = 64, 60 layers, bf16: (512 + 64) * 60 * 2 = 69120 bytes
    assert mla_bytes_per_token(60, 512, 64, "bf16") == 69120
