"""The memory planner against figures computed by hand from public model shapes."""

import json

import pytest

from kvedge.bench.plan import DEVICES, parameter_count, plan
from kvedge.cli import main
from kvedge.errors import KvedgeError
from kvedge.models import ModelConfig

GiB = 1024**3
LLAMA3_8B = dict(arch="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                 head_dim=128, intermediate_size=14336, max_position_embeddings=131072)
LLAMA2_7B = dict(arch="llama", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                 head_dim=128, intermediate_size=11008, max_position_embeddings=4096)


def test_parameter_counts_match_the_published_sizes():
    # Llama-3-8B: embed + lm_head 2 * 128256 * 4096 = 1,050,673,152; per layer q,o 2 * 4096^2, k,v 2 * 4096 * 1024,
    # mlp 3 * 4096 * 14336, norms 2 * 4096 = 218,112,000; * 32 + final norm 4096 = 8,030,261,248
    assert parameter_count(ModelConfig(**LLAMA3_8B)) == 8_030_261_248
    # Llama-2-7B (MHA): 2 * 32000 * 4096 + 32 * (4 * 4096^2 + 3 * 4096 * 11008 + 8192) + 4096 = 6,738,415,616
    assert parameter_count(ModelConfig(**LLAMA2_7B)) == 6_738_415_616


def test_llama3_8b_fp16_figures_and_largest_context():
    cfg = ModelConfig(**LLAMA3_8B)
    p = plan(cfg, seq_len=8192, batch=1, dtype="fp16", memory_gb=24)
    assert p.weights_bytes == 16_060_522_496
    assert p.kv_bytes == 1 * GiB  # 128 KiB per token * 8192
    # activations at n >= 512 tokens: 512 * (4 * 4096 + 2 * 14336 + 32 * n) * 2 + 128256 * 4
    #                                = 46,650,368 + 32,768 n bytes
    assert p.activation_bytes == 46_650_368 + 32_768 * 8192
    # 16,060,522,496 + 131,072 n + 46,650,368 + 32,768 n <= 24 GiB = 25,769,803,776  ->  n <= 58,976.02
    assert p.max_context == p.memory_max_context == 58_976
    assert p.fits
    assert p.kv_by_attention["MHA"] == 512 * 1024 and p.kv_by_attention["GQA (this model)"] == 128 * 1024
    assert p.kv_by_attention["MQA"] == 16 * 1024
    assert p.kv_by_attention["MLA (d_c = 4 head_dim, d_rope = head_dim / 2)"] == (512 + 64) * 32 * 2


def test_mha_7b_on_an_orin_nano_does_not_fit_in_fp16_but_int4_does():
    cfg = ModelConfig(**LLAMA2_7B)
    usable = (DEVICES["orin-nano-8gb"].memory_gb - DEVICES["orin-nano-8gb"].reserve_gb) * GiB
    p16 = plan(cfg, seq_len=2048, dtype="fp16", device="orin-nano-8gb")
    assert p16.usable_bytes == usable and p16.weights_bytes == 2 * 6_738_415_616 and not p16.fits
    assert p16.max_context == 0
    p4 = plan(cfg, seq_len=2048, dtype="int4", kv_dtype="fp16", device="orin-nano-8gb")
    assert p4.weights_bytes == 6_738_415_616 // 2
    assert p4.kv_bytes == 2048 * 512 * 1024  # MHA: 512 KiB per token in fp16 -> 1 GiB at 2048
    assert p4.fits
    assert p4.max_context == 4096 and p4.memory_max_context > 4096  # capped at the model's positions


def test_plan_cli(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "max_position_embeddings": 131072}))
    assert main(["plan", str(tmp_path), "--memory-gb", "24", "--seq-len", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_context_at_batch"] == 58_976 and out["weights_bytes"] == 16_060_522_496
    assert main(["plan", str(tmp_path), "--memory-gb", "8", "--seq-len", "8192"]) == 1  # does not fit
    with pytest.raises(KvedgeError, match="unknown device 'jetson-tx9'"):
        plan(ModelConfig(**LLAMA3_8B), 128, device="jetson-tx9")
