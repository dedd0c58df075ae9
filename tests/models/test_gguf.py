"""GGUF import: tiny GGUF files written as llama.cpp's converter writes them (tests/gguf_files.py), loaded by
kvedge and compared with transformers' own GGUF loading of the same file (gguf.quants.dequantize, its tensor
name map and reverse Q/K permutation: an independent reader), and with the checkpoint they were written from."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kvedge.errors import CheckpointError, ConfigError
from kvedge.models import KVCache, load_config, load_decoder
from kvedge.models.gguf import QUANT_TYPES, write_hf_folder
from kvedge.models.quant import QuantEmbedding, QuantLinear, dequantize
from tests.conftest import ARCH_CASES, transformers_logits
from tests.gguf_files import (GGUF_ARCH, PERMUTED_QK, gguf_state_dict, llama_unpermute, save_hf_checkpoint,
                              transformers_reference, write_gguf)
from tests.models.test_hf_parity import greedy
from tests.runtime.test_native import BUILDS

TOL = 1e-4
PROMPT, STEPS = 12, 6
# name -> (model_type, overrides): one per architecture llama.cpp writes and kvedge reads, each a model the
# converter round-trips (conftest's llama3 case has original_max_position_embeddings 32, which the converter
# replaces by 8192; llama.cpp scales gemma2's and gemma3's queries by head_dim, so query_pre_attn_scalar =
# head_dim here; llama.cpp hard-codes gemma3's every-6th-layer-global pattern and smollm3's every-4th-layer NoPE,
# so those cases have 6 and 4 layers with transformers' default layer types, which are those patterns)
CASES = {
    "llama-tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-gqa2-bias": ARCH_CASES["llama-gqa2-bias"],
    "llama-mqa-linearrope": ARCH_CASES["llama-mqa-linearrope"],
    "llama-llama3rope": ("llama", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))),
    "mistral-window": ARCH_CASES["mistral-window"],
    "qwen2-bias": ARCH_CASES["qwen2-bias"],
    "qwen3-qknorm": ARCH_CASES["qwen3-qknorm"],
    "gemma": ARCH_CASES["gemma"],
    "gemma2": ("gemma2", {**ARCH_CASES["gemma2"][1], "query_pre_attn_scalar": 16}),
    "phi3-partialrope": ARCH_CASES["phi3-partialrope"],
    "phi3-longrope": ARCH_CASES["phi3-longrope"],
    # sliding layers on RoPE base 100, the global one (layer 5) on 10000 with linear scaling, a final softcap
    "gemma3": ("gemma3_text", dict(num_attention_heads=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                   num_hidden_layers=6, final_logit_softcapping=10.0,
                                   rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                                                    "full_attention": dict(rope_type="linear", factor=2.0,
                                                                           rope_theta=10000.0)})),
    "olmo2": ARCH_CASES["olmo2-postnorm"],
    "granite": ARCH_CASES["granite-multipliers"],
    "smollm3": ("smollm3", dict(num_hidden_layers=4)),  # no_rope_layers [1, 1, 1, 0]
    # rows of 256 values, for the K-quants
    "llama-256": ("llama", dict(hidden_size=256, intermediate_size=512, num_key_value_heads=2, head_dim=32)),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
SMALL_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # blocks of 32: rows of 64 and 96 values
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """hf_model(case) -> (checkpoint dir, transformers model), norms and biases non-trivial."""
    made = {}

    def get(case):
        if case not in made:
            model_type, overrides = CASES[case]
            path = tmp_path_factory.mktemp(f"hf-{case}")
            made[case] = (path, save_hf_checkpoint(path, model_type, **overrides))
        return made[case]

    return get


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory, hf_model):
    """gguf_file(case, qtype, **types) -> the GGUF file of that checkpoint, one per combination."""
    made = {}

    def get(case, qtype="F32", **types):
        key = (case, qtype, tuple(sorted(types.items())))
        if key not in made:
            path, _ = hf_model(case)
            out = tmp_path_factory.mktemp(f"gguf-{case}-{qtype}") / f"{case}-{qtype}.gguf"
            made[key] = write_gguf(out, path, qtype, types=types)
        return made[key]

    return get


def reference(case, path, hf_model):
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    ckpt, hf = hf_model(case)
    if GGUF_ARCH[CASES[case][0]] not in GGUF_CONFIG_MAPPING:  # transformers' GGUF reader refuses gemma, olmo2,
        from transformers import AutoModelForCausalLM  # granite, smollm3: the test reads the file itself

        model = AutoModelForCausalLM.from_config(hf.config, attn_implementation="eager")
        missing, unexpected = model.load_state_dict(gguf_state_dict(path, ckpt), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        return model.eval()
    return transformers_reference(path, hf.config)


def assert_matches(model, ref, vocab, seed=1):
    """Prefill and greedy decode through kvedge's cache against the reference (conftest's transformers_logits:
    teacher-forced, or with longrope through the reference's own cache)."""
    prompt = torch.randint(3, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    tokens, step_logits = greedy(model, prompt, STEPS, KVCache.allocate(model.cfg, 1, PROMPT + STEPS))
    want_prefill, want = transformers_logits(ref, prompt, tokens)
    assert (step_logits - want).abs().max().item() < TOL
    got_prefill = model(prompt, torch.arange(PROMPT)[None], KVCache.allocate(model.cfg, 1, PROMPT).for_batch(1))
    assert (got_prefill - want_prefill).abs().max().item() < TOL


def gguf_parts(cfg, module):
    """The GGUF tensors a kvedge linear is made of, in row order."""
    if module == "lm_head":
        return ["output.weight"]
    _, i, name = module.split(".")
    fused = cfg.arch == "phi3"
    return {"qkv": [f"blk.{i}.attn_qkv.weight"] if fused else [f"blk.{i}.attn_{p}.weight" for p in "qkv"],
            "o": [f"blk.{i}.attn_output.weight"], "down": [f"blk.{i}.ffn_down.weight"],
            "up": [f"blk.{i}.ffn_up.weight"] if fused else [f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"]}[name]


def gguf_values(path, cfg, names):
    """gguf.quants.dequantize of the named tensors, un-permuted (transformers' inverse), rows concatenated."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    out = []
    for name in names:
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if GGUF_ARCH[cfg.arch] in PERMUTED_QK and ".attn_q." in name:
            w = llama_unpermute(w, cfg.num_heads, cfg.num_heads)
        if GGUF_ARCH[cfg.arch] in PERMUTED_QK and ".attn_k." in name:
            w = llama_unpermute(w, cfg.num_heads, cfg.num_kv_heads)
        out.append(torch.from_numpy(np.array(w, dtype=np.float32)))
    return torch.cat(out)


# -- architectures ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in CASES if c != "llama-256"])
def test_config_from_metadata_equals_the_checkpoint_config(case, hf_model, gguf_file):
    ckpt, _ = hf_model(case)
    assert load_config(gguf_file(case)) == load_config(ckpt)


@pytest.mark.parametrize("case", [c for c in CASES if c != "llama-256"])
def test_logits_match_transformers_reading_the_same_file(case, hf_model, gguf_file):
    path = gguf_file(case)
    model = load_decoder(path)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert_matches(model, reference(case, path, hf_model), model.cfg.vocab_size)
    # and the checkpoint the file was written from (the permutation undone, gemma's norm offset removed)
    assert_matches(model, hf_model(case)[1], model.cfg.vocab_size, seed=2)


# -- tensor types -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", FLOAT_TYPES + SMALL_TYPES + K_TYPES)
def test_every_type_loads_exactly_and_matches_transformers(qtype, hf_model, gguf_file):
    case = "llama-256" if qtype in K_TYPES else "llama-gqa2-bias"
    path = gguf_file(case, qtype)
    model = load_decoder(path)
    cfg = model.cfg
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if qtype in QUANT_TYPES:
        bits, group, affine, _ = QUANT_TYPES[qtype]
        assert sorted(linears) == sorted([f"layers.{i}.{p}" for i in range(cfg.num_layers)
                                          for p in ("qkv", "o", "up", "down")] + ["lm_head"])
        for name, m in linears.items():
            assert (m.bits, m.group, m.mins is not None) == (bits, group, affine)
            assert m.scales.dtype == torch.float32
            got = dequantize(m.qweight, m.scales, m.zeros, m.bits, m.in_features, m.mins)
            assert torch.equal(got, gguf_values(path, cfg, gguf_parts(cfg, name))), name
        assert model.gguf["linears"] == {n: qtype for n in linears}
        assert model.gguf["dequantized"] == {"token_embd.weight": qtype}
    else:
        assert not linears
        for name in [f"layers.{i}.{p}" for i in range(cfg.num_layers) for p in ("qkv", "o", "up", "down")]:
            assert torch.equal(model.get_submodule(name).weight, gguf_values(path, cfg, gguf_parts(cfg, name)))
    assert torch.equal(model.embed.weight, gguf_values(path, cfg, ["token_embd.weight"]))
    assert model.gguf["float_linears"] == {}
    assert_matches(model, reference(case, path, hf_model), cfg.vocab_size)


@pytest.mark.parametrize("case,qtype", [("llama-256", q) for q in SMALL_TYPES + K_TYPES]
                         + [("llama-tied", q) for q in SMALL_TYPES] + [("gemma", "Q4_0")])
def test_an_embedding_kept_quantized_looks_up_gguf_values_and_is_the_tied_head(case, qtype, hf_model, gguf_file):
    """quantized_embedding (what export loads for a lowering that gathers quantized rows): token_embd stays in the
    file's integers, no float copy of it exists, every row looked up equals gguf's own dequantizer bit for bit,
    and the model matches transformers reading the same file, a tied head computing from those integers."""
    path = gguf_file(case, qtype)
    model = load_decoder(path, quantized_embedding=(4, 8))
    cfg = model.cfg
    assert isinstance(model.embed, QuantEmbedding) and hasattr(model, "lm_head") != cfg.tie_embeddings
    assert model.gguf["embedding"] == qtype and "token_embd.weight" not in model.gguf["dequantized"]
    want = gguf_values(path, cfg, ["token_embd.weight"])
    assert torch.equal(model.embed(torch.arange(cfg.vocab_size)), want)
    ids = torch.randint(0, cfg.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.embed(ids), want[ids])
    assert not [n for n, t in model.state_dict().items() if t.is_floating_point() and t.shape == want.shape]
    assert_matches(model, reference(case, path, hf_model), cfg.vocab_size)


@pytest.mark.parametrize("case,qtype", [("qwen2-bias", "Q8_0"), ("qwen3-qknorm", "Q5_1"), ("gemma2", "Q4_0"),
                                        ("phi3-partialrope", "Q4_1"), ("mistral-window", "Q5_0"),
                                        ("llama-tied", "Q4_0"), ("phi3-longrope", "Q8_0"), ("gemma3", "Q4_1"),
                                        ("olmo2", "Q5_0"), ("granite", "Q4_0"), ("smollm3", "Q8_0")])
def test_quantized_files_of_each_architecture(case, qtype, hf_model, gguf_file):
    path = gguf_file(case, qtype)
    model = load_decoder(path)
    cfg = model.cfg
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(linears) == 4 * cfg.num_layers + (0 if cfg.tie_embeddings else 1)
    for name, m in linears.items():
        got = dequantize(m.qweight, m.scales, m.zeros, m.bits, m.in_features, m.mins)
        assert torch.equal(got, gguf_values(path, cfg, gguf_parts(cfg, name))), name
    assert_matches(model, reference(case, path, hf_model), cfg.vocab_size)


def test_fused_parts_of_different_types_load_as_float_and_are_recorded(hf_model, gguf_file):
    """A Q4_K_M-like file: attn_v in Q6_K, ffn_gate in Q5_K, the rest Q4_K; the output in Q6_K."""
    path = gguf_file("llama-256", "Q4_K", **{"attn_v.weight": "Q6_K", "ffn_gate.weight": "Q5_K",
                                             "output.weight": "Q6_K"})
    model = load_decoder(path)
    cfg = model.cfg
    rec = model.gguf
    assert rec["file_type"] == "MOSTLY_Q4_K_M" and rec["architecture"] == "llama"
    layers = range(cfg.num_layers)
    assert rec["linears"] == {**{f"layers.{i}.{p}": "Q4_K" for i in layers for p in ("o", "down")}, "lm_head": "Q6_K"}
    assert rec["float_linears"] == {
        **{f"layers.{i}.qkv": {f"blk.{i}.attn_q.weight": "Q4_K", f"blk.{i}.attn_k.weight": "Q4_K",
                               f"blk.{i}.attn_v.weight": "Q6_K"} for i in layers},
        **{f"layers.{i}.up": {f"blk.{i}.ffn_gate.weight": "Q5_K", f"blk.{i}.ffn_up.weight": "Q4_K"} for i in layers}}
    for i in layers:
        for p in ("qkv", "up"):
            m = model.get_submodule(f"layers.{i}.{p}")
            assert isinstance(m, torch.nn.Linear)
            assert torch.equal(m.weight, gguf_values(path, cfg, gguf_parts(cfg, f"layers.{i}.{p}")))
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8 and model.lm_head.group == 16
    assert_matches(model, reference("llama-256", path, hf_model), cfg.vocab_size)


def test_ieee_identities_the_exact_dequantization_rests_on():
    """(q - z) * s == s * (q - z) and q * s + (-m) == s * q - m, elementwise in float32 (the order gguf uses
    is the right-hand side)."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1 << 16, generator=g) * 1e-3
    m = torch.randn(1 << 16, generator=g) * 1e-2
    q = torch.randint(0, 64, (1 << 16,), generator=g).float()
    assert torch.equal((q - 32) * s, s * (q - 32))
    assert torch.equal(q * s + (-m), s * q - m)


# -- a Hugging Face folder ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,qtype", [("llama-gqa2-bias", "Q4_1"), ("gemma2", "F16"), ("phi3-partialrope", "Q8_0"),
                                        ("gemma3", "Q4_1"), ("phi3-longrope", "Q8_0")])
def test_write_hf_folder_holds_the_files_values(case, qtype, gguf_file, tmp_path):
    from transformers import AutoModelForCausalLM

    path = gguf_file(case, qtype)
    out = write_hf_folder(path, tmp_path / "hf")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    if importlib.util.find_spec("kvedge.models.gguf_vocab"):  # the tokenizer half of the import
        assert (out / "tokenizer.json").is_file()
    from_gguf, from_folder = load_decoder(path), load_decoder(out)
    assert load_config(out) == from_gguf.cfg
    for name, p in from_folder.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        if isinstance(from_gguf.get_submodule(mod), QuantLinear) and name.endswith(".weight"):
            q = from_gguf.get_submodule(mod)
            assert torch.equal(p, dequantize(q.qweight, q.scales, q.zeros, q.bits, q.in_features, q.mins))
        else:
            assert torch.equal(p, from_gguf.state_dict()[name]), name
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert_matches(from_gguf, hf, from_gguf.cfg.vocab_size)


# -- bad input ----------------------------------------------------------------------------------------------
def _rewrite(src, dst, edit):
    data = bytearray(src.read_bytes())
    dst.write_bytes(bytes(edit(data)))
    return dst


def _version(v):
    def edit(data):
        data[4:8] = v.to_bytes(4, "little")
        return data
    return edit


@pytest.mark.parametrize("bad,error,match", [
    ("truncated", CheckpointError, r"truncated"),
    ("header-cut", CheckpointError, r"truncated or corrupt"),
    ("not-gguf", CheckpointError, r"not a GGUF file"),
    ("version", CheckpointError, r"GGUF version 7; kvedge reads GGUF versions 2, 3"),
    ("missing-tensor", CheckpointError, r"missing tensor\(s\) for llama with 2 layers: blk\.1\.ffn_down\.weight"),
    ("architecture", ConfigError, r"GGUF architecture 'bloom' is not imported by kvedge; supported: llama, qwen2"),
    ("type", CheckpointError, r"GGUF tensor blk\.0\.attn_q\.weight has type IQ2_XS, which kvedge does not import; "
                              r"supported: F32, F16, BF16, Q8_0"),
    ("no-file", CheckpointError, r"no such GGUF file"),
])
def test_bad_input_gives_one_clear_error_and_writes_nothing(bad, error, match, hf_model, gguf_file, tmp_path):
    good = gguf_file("llama-gqa2-bias")
    ckpt, _ = hf_model("llama-gqa2-bias")
    f = tmp_path / "bad.gguf"
    if bad == "truncated":
        _rewrite(good, f, lambda d: d[: len(d) - 100])
    elif bad == "header-cut":
        _rewrite(good, f, lambda d: d[:200])
    elif bad == "not-gguf":
        _rewrite(good, f, lambda d: b"PK\x03\x04" + d[4:])
    elif bad == "version":
        _rewrite(good, f, _version(7))
    elif bad == "missing-tensor":
        write_gguf(f, ckpt, drop=("blk.1.ffn_down.weight",))
    elif bad == "architecture":
        write_gguf(f, ckpt, arch="bloom")
    elif bad == "type":
        write_gguf(f, hf_model("llama-256")[0], types={"blk.0.attn_q.weight": "IQ2_XS"})
    calls = [lambda: load_decoder(f), lambda: write_hf_folder(f, tmp_path / "out")]
    if bad not in ("missing-tensor", "type"):  # the metadata alone is fine there
        calls.append(lambda: load_config(f))
    for call in calls:
        with pytest.raises(error, match=match):
            call()
    assert not (tmp_path / "out").exists()


def test_rope_frequency_factors_other_than_llama3s_are_refused(hf_model, tmp_path):
    ckpt, _ = hf_model("llama-tied")
    factors = np.array([1.0, 2.0, 3.0, 1.5], dtype=np.float32)
    f = write_gguf(tmp_path / "m.gguf", ckpt, extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    with pytest.raises(ConfigError, match=r"rope_freqs\.weight: RoPE frequency factors .* are not those of Llama 3"):
        load_config(f)


# -- what llama.cpp hard-codes, and what it writes that kvedge refuses ----------------------------------------
def _keys(drop=(), **add):
    """write_gguf's extra: drop metadata keys the converter wrote, then add others ({arch}. is prefixed)."""
    def extra(w):
        for k in drop:
            del w.kv_data[0][f"{w.arch}.{k}"]
        for name, value in add.items():
            getattr(w, f"add_{name}")(value)
    return extra


@pytest.mark.parametrize("extra,want", [
    # ggml-org/llama.cpp src/models/gemma3.cpp load_arch_hparams -> load_swa_pattern (src/llama-model.cpp): the
    # pattern key as one flag per layer, or as n (every n-th layer global); the converter writes neither
    (_keys(sliding_window_pattern=[True, False, True, True, False, True]),
     dict(layer_windows=[8, None, 8, 8, None, 8], rope_local_theta=100.0)),
    (_keys(sliding_window_pattern=3), dict(layer_windows=[8, 8, None, 8, 8, None])),
    # rope.freq_base_swa: written by the converter's TextModel from the sliding layers' rope_theta; absent
    # (files of older converters), llama.cpp's rope_freq_base_train_swa default, 10000 (src/llama-hparams.h)
    (_keys(drop=["rope.freq_base_swa"]), dict(rope_local_theta=10000.0, layer_windows=[8] * 5 + [None])),
    # 27B (62 layers): queries by 1/sqrt(hidden / heads) = 1/sqrt(32), not 1/sqrt(head_dim 16); the default
    # pattern 6 over 62 layers
    (_keys(drop=["block_count", "attention.head_count"], block_count=62, head_count=2),
     dict(attn_scale=32 ** -0.5, layer_windows=[None if i % 6 == 5 else 8 for i in range(62)])),
])
def test_gemma3_metadata_is_read_as_llama_cpp_reads_it(extra, want, hf_model, tmp_path):
    cfg = load_config(write_gguf(tmp_path / "m.gguf", hf_model("gemma3")[0], extra=extra))
    assert {k: getattr(cfg, k) for k in want} == want
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_smollm3_and_gemma3_layer_patterns_are_llama_cpps_hard_coded_ones(hf_model, gguf_file):
    """Neither no_rope_layers nor gemma3's layer types are in the file: llama.cpp runs every 4th smollm3 layer
    without RoPE (src/models/smollm3.cpp, n_no_rope_layer_step = 4) and every 6th gemma3 layer global."""
    assert load_config(gguf_file("smollm3")).layer_rope == [True, True, True, False]
    assert load_config(gguf_file("gemma3")).layer_windows == [8, 8, 8, 8, 8, None]


@pytest.mark.parametrize("case,extra,drop,match", [
    ("olmo2", _keys(sliding_window=8), (), r"olmo2\.attention\.sliding_window is set: an OLMo 3 file"),
    ("granite", _keys(rope_scaling_finetuned=False), (), r"granite\.rope\.scaling\.finetuned is false, which "
                                                          r"llama\.cpp reads as no RoPE in any layer"),
    ("granite", _keys(drop=["logit_scale"]), (), r"the GGUF metadata has no granite\.logit_scale"),
    ("gemma3", _keys(drop=["attention.sliding_window"]), (), r"gemma3 without a sliding_window is not supported"),
    ("phi3-longrope", None, ("rope_factors_short.weight",),
     r"tensor rope_factors_short\.weight is missing; LongRoPE needs rope_factors_short and rope_factors_long"),
])
def test_files_kvedge_cannot_run_faithfully_are_refused_by_name(case, extra, drop, match, hf_model, tmp_path):
    f = write_gguf(tmp_path / "m.gguf", hf_model(case)[0], extra=extra, drop=drop)
    for call in (lambda: load_config(f), lambda: load_decoder(f)):
        with pytest.raises(ConfigError, match=match):
            call()


# -- the native engine on the file's integers ---------------------------------------------------------------
Q4_K_M = {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}  # as llama.cpp's Q4_K_M


@pytest.mark.skipif(importlib.util.find_spec("kvedge.runtime.native_backend") is None
                    or not __import__("kvedge.runtime.native_backend", fromlist=["c_compiler"]).c_compiler(),
                    reason="the native engine needs a C compiler")

@pytest.mark.parametrize("qtype,types,build", [
    *((q, {}, "native") for q in ("Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_1", "Q4_K", "Q5_K", "Q6_K")),
    ("Q4_K", Q4_K_M, "native"), *((q, t, b) for q, t in (("Q6_K", {}), ("Q4_K", Q4_K_M), ("Q4_0", {}))
                                  for b in ("avx2", "portable") if b in BUILDS)])
def test_the_native_engine_runs_the_files_blocks(qtype, types, build, hf_model, gguf_file, capsys):
    """The native engine (int16 activations) on the file's own blocks, every type kept as it is: float16 figures
    (Q8_0, Q4_0, Q5_0, Q4_1, Q5_1), Q4_K / Q5_K's float32 d * sc and dmin * m, Q6_K's integer scales per 16
    channels (bits 6, also mixed into a Q4_K file as Q4_K_M files hold it: a qkv of Q4_K q, k and Q6_K v is the
    engine's qkv and qkv_tail); its logits over a prefill and
    teacher-forced decode steps equal transformers' reading of the same file within 1e-3 of the largest."""
    from kvedge.runtime.native_backend import NativeBackend

    case = "llama-256"
    path = gguf_file(case, qtype, **types)
    native = NativeBackend(path, max_seq_len=PROMPT + STEPS, threads=2, activations="int16", flags=BUILDS[build])
    assert native.float_linears == [] and "float32" not in capsys.readouterr().err
    layers = native.cfg.num_layers
    packed = {f"layers.{i}.{n}": getattr(ly, n) for i, ly in enumerate(native._layers) for n in ("qkv", "o", "up", "down")}
    packed["lm_head"] = native.m.lm_head
    want_bits = {name: 6 if qtype == "Q6_K" or (types and name.endswith(("down", "lm_head"))) else
                 QUANT_TYPES[qtype][0] for name in packed}
    assert {name: lin.bits for name, lin in packed.items()} == want_bits
    k_figures = {name for name, b in want_bits.items() if b != 6} if qtype in ("Q4_K", "Q5_K") else set()
    assert {name for name, lin in packed.items() if lin.ksc} == (k_figures if qtype == "Q4_K" else set())
    assert {name for name, lin in packed.items() if lin.s32} == (k_figures if qtype == "Q5_K" else set())
    assert len(packed) == 4 * layers + 1
    tails = [ly.qkv_tail for ly in native._layers]
    assert [(t.n, t.bits) for t in tails] == [(native.cfg.num_kv_heads * native.cfg.head_dim, 6) if types else (0, 0)
                                              for _ in tails]
    ids = torch.randint(3, native.cfg.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(3))
    want = reference(case, path, hf_model)(ids).logits[0]
    got = [native.forward(ids[:, :PROMPT], torch.arange(PROMPT)[None], torch.tensor([PROMPT - 1]))[0, 0].clone()]
    for p in range(PROMPT, PROMPT + STEPS - 1):
        got.append(native.forward(ids[:, p:p + 1], torch.tensor([[p]]), torch.tensor([0]))[0, 0].clone())
    want = want[PROMPT - 1:PROMPT + STEPS - 1]
    assert (torch.stack(got) - want).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.skipif(importlib.util.find_spec("kvedge.runtime.native_backend") is None
                    or not __import__("kvedge.runtime.native_backend", fromlist=["c_compiler"]).c_compiler(),
                    reason="the native engine needs a C compiler")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_native_engine_looks_up_the_files_embedding_in_its_own_type(qtype, tied, hf_model, gguf_file, tmp_path):
    """The engine keeps token_embd in the file's type and dequantizes a row per token: every row equals gguf's
    own dequantizer bit for bit (times the embedding scale), and a tied head is the same packed bytes."""
    import ctypes

    import gguf

    from kvedge.runtime.native_backend import NativeBackend

    case = "llama-256"
    ckpt, _ = hf_model(case)
    path = gguf_file(case, qtype) if not tied else write_gguf(tmp_path / "tied.gguf", ckpt, qtype,
                                                              drop=("output.weight",))
    native = NativeBackend(path, max_seq_len=8, threads=2)
    t = gguf.GGUFReader(str(path)).tensors
    t = next(x for x in t if x.name == "token_embd.weight")
    want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    want = want.reshape(native.cfg.vocab_size, native.cfg.hidden_size) * native.cfg.embed_scale
    ids = torch.arange(native.cfg.vocab_size)
    got = torch.empty_like(want)
    native.dll.kv_weight_rows(ctypes.byref(native.m.embed), len(ids), ids.data_ptr(), native.cfg.embed_scale,
                              got.data_ptr())
    assert torch.equal(got, want)
    assert native.cfg.tie_embeddings == tied
    if tied:  # the head reads the embedding's bytes
        assert (native.m.lm_head.q, native.m.lm_head.w) == (native.m.embed.q, native.m.embed.w)


@pytest.mark.skipif(importlib.util.find_spec("kvedge.runtime.native_backend") is None
                    or not __import__("kvedge.runtime.native_backend", fromlist=["c_compiler"]).c_compiler(),
                    reason="the native engine needs a C compiler")
@pytest.mark.parametrize("build", [b for b in ("native", "avx2", "portable") if b in BUILDS])
def test_q4_k_tiles_on_the_files_figures_compute_as_on_float32_ones(build, hf_model, gguf_file):
    """Q4_K tiles keep the file's 6-bit scales and mins and d, dmin per 256 (ksc) and compute d * sc and
    -(dmin * m) in the kernel: the logits are bitwise those of the same integers with float32 figures packed
    ahead (kv_pack_affine32, what a Decoder of the file gives the engine)."""
    from kvedge.runtime.native_backend import NativeBackend

    path = gguf_file("llama-256", "Q4_K")
    ids = torch.randint(3, load_config(path).vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    out = []
    for model in (None, load_decoder(path, dtype="float32")):
        b = NativeBackend(path, max_seq_len=PROMPT + 1, threads=2, model=model, flags=BUILDS[build])
        assert bool(b._layers[0].up.ksc) == (model is None) and bool(b._layers[0].up.s32) == (model is not None)
        out.append(b.forward(ids, torch.arange(PROMPT)[None], torch.tensor([PROMPT - 1]))[0, 0].clone())
        out.append(b.forward(ids[:, :1], torch.tensor([[PROMPT]]), torch.tensor([0]))[0, 0].clone())
    assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[3])
