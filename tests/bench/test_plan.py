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
    p4 = plan(cfg, seq_len=2048, dtype="int4", kv_dtype="fp16", device="orin-nano-8gb")  # = quantize="int4", fp16
    # projections 32 * (4 * 4096^2 + 3 * 4096 * 11008) = 6,476,005,376 params: 0.5 B each = 3,238,002,688, one fp16
    # scale and half a byte of zero point per 32 = 404,750,336 + 101,187,584; the rest (embed, lm_head, norms)
    # 262,410,240 params in fp16 = 524,820,480. Total 4,268,761,088
    assert p4.weights_bytes == 4_268_761_088
    assert p4.kv_bytes == 2048 * 512 * 1024  # MHA: 512 KiB per token in fp16 -> 1 GiB at 2048
    assert p4.fits
    # 5.5 GiB = 5,905,580,032 - 4,268,761,088 weights - activations 39,449,600 + 32,768 n - KV 524,288 n >= 0
    # -> n <= 1,597,369,344 / 557,056 = 2867.5: memory, not the model's 4096 positions, is the limit
    assert p4.max_context == p4.memory_max_context == 2867


def _llama3_config(folder):
    """A Llama-3-8B config.json (the HF keys) in folder."""
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "max_position_embeddings": 131072}))


def test_plan_cli(tmp_path, capsys):
    _llama3_config(tmp_path)
    assert main(["plan", str(tmp_path), "--memory-gb", "24", "--seq-len", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_context_at_batch"] == 58_976 and out["weights_bytes"] == 16_060_522_496
    assert main(["plan", str(tmp_path), "--memory-gb", "8", "--seq-len", "8192"]) == 1  # does not fit
    with pytest.raises(KvedgeError, match="unknown device 'jetson-tx9'"):
        plan(ModelConfig(**LLAMA3_8B), 128, device="jetson-tx9")


# Llama-3-8B projections per layer (out x in): qkv 6144 x 4096, o 4096 x 4096, gate+up 28672 x 4096, down 4096 x 14336
# = 218,103,808 params; x 32 layers = 6,979,321,856. Everything else (embed and lm_head 2 x 128256 x 4096, norms
# 32 x 8192 + 4096) = 1,050,939,392 params, in fp16 = 2,101,878,784 bytes. Groups of 32: 218,103,808 (every
# input size, 4096 and 14336, is a multiple of 32 and gives an even group count per row).
@pytest.mark.parametrize("scheme,group,lm_head,expected", [
    # 6,979,321,856 / 2 = 3,489,660,928 + fp16 scales 2 x 218,103,808 = 436,207,616 + int4 zeros 218,103,808 / 2
    # = 109,051,904 -> 4,034,920,448; + 2,101,878,784 fp
    ("int4", 32, False, 6_136_799_232),
    # 6,979,321,856 + 436,207,616 + one byte of zero point per group 218,103,808 + 2,101,878,784
    ("int8", 32, False, 9_735_512_064),
    # groups of 128: 54,525,952 -> scales 109,051,904, zeros 27,262,976; 3,489,660,928 + those + 2,101,878,784
    ("int4", 128, False, 5_727_854_592),
    # lm_head 128256 x 4096 = 525,336,576 params quantized too: 262,668,288 + scales 32,833,536 + zeros 8,208,384
    # = 303,710,208; fp params drop to 525,602,816 (1,051,205,632 bytes); 4,034,920,448 + 303,710,208 + that
    ("int4", 32, True, 5_389_836_288),
])
def test_quantized_weight_bytes_llama3_8b(scheme, group, lm_head, expected):
    p = plan(ModelConfig(**LLAMA3_8B), seq_len=8192, quantize=scheme, group=group, quantize_lm_head=lm_head)
    assert p.weights_bytes == expected
    assert p.kv_bytes == 1 * GiB  # the cache stays fp16: 128 KiB per token
    assert p.activation_bytes == 46_650_368 + 32_768 * 8192  # fp16 compute, as unquantized


def test_tied_lm_head_is_a_quantized_copy_and_the_embedding_stays():
    tied = ModelConfig(**{**LLAMA3_8B, "tie_embeddings": True})
    base = plan(tied, 128, quantize="int4").weights_bytes
    # the embedding (525,336,576 params, fp16) stays; the lm_head adds its quantized copy (303,710,208 bytes)
    assert base == 6_136_799_232 - 2 * 525_336_576
    assert plan(tied, 128, quantize="int4", quantize_lm_head=True).weights_bytes == base + 303_710_208
    with pytest.raises(KvedgeError, match="not a multiple of the group size 96"):
        plan(tied, 128, quantize="int4", group=96)  # 4096 % 96


def test_plan_cli_quantize(tmp_path, capsys):
    _llama3_config(tmp_path)
    assert main(["plan", str(tmp_path), "--quantize", "int4", "--quantize-lm-head", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_bytes"] == 5_389_836_288
