"""Multi-head latent attention (deepseek_v2 / deepseek_v3 with dense layers, minicpm3), beyond the architecture matrix
(logits against transformers on torch and on the lowerings: tests/models/test_hf_parity.py,
tests/export/test_export_parity.py): what the cache holds, the absorbed decode against transformers' reconstructing
form in float64, the export's cache contract, `kvedge plan` on the seeds' example, int8 caches and weights, and the
refusals. (Ragged batches on every lowering that expresses MLA: test_export_parity's
test_batch_with_different_prompt_lengths.)"""

from __future__ import annotations

import copy
import json

import onnx
import pytest
import torch

from kvedge.bench.plan import parameter_count
from kvedge.cli import main
from kvedge.errors import ConfigError, KvedgeError
from kvedge.export import ExportOptions, export
from kvedge.models import KVCache, ModelConfig, kv_cache_bytes, load_decoder
from kvedge.models.quant import QuantLinear, quantize_decoder
from kvedge.runtime.ort_backend import OrtBackend
from kvedge.runtime.torch_backend import TorchBackend
from tests.conftest import (ARCH_CASES, MAX_SEQ, MLA_CASES, MLA_EXPORTS, hf_config, save_hf_model,
                            transformers_logits)
from tests.models.test_hf_parity import greedy

SEEDS = "deepseek_v2-mla"  # the seeds' shape: d_c = 4 d_h, d_R = d_h / 2 (d_h = 16)


def sizes(case: str) -> tuple[int, int, int]:
    """(d_c, d_R, layers) of a case, from its transformers config (not from kvedge's reading of it)."""
    hf = hf_config(ARCH_CASES[case][0], **ARCH_CASES[case][1])
    return hf.kv_lora_rank, hf.qk_rope_head_dim, hf.num_hidden_layers


@pytest.mark.parametrize("case", MLA_CASES)
def test_cache_holds_the_latent_and_the_rope_key_and_absorbed_decode_equals_reconstruction(case, hf_checkpoint):
    """In float64, against transformers (which caches the same two tensors, then reconstructs each head's key and
    value from them): after the prompt kvedge's value cache is the normed latent c_kv and its key cache the rotated
    k_rope, nothing else; then 32 greedy steps, attending over the latent with W_uk absorbed into the query and W_uv
    after attention, give transformers' logits (reconstructed K and V per head) within 1e-5. (Both compute their
    RMSNorms in float32, and kvedge its softmax: they agree to about 1e-6, not to float64's rounding.)"""
    path, hf = hf_checkpoint(case)
    hf = hf.double()
    try:
        model = load_decoder(path).double()
        d_c, d_r, layers = sizes(case)
        prompt = torch.randint(3, model.cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(7))
        cache = KVCache.allocate(model.cfg, 1, 64, dtype=torch.float64)
        shapes = [tuple(t.shape) for t in cache.keys + cache.values]
        assert shapes == [(1, 1, 64, d_r)] * layers + [(1, 1, 64, d_c)] * layers
        model(prompt, torch.arange(16)[None], cache.for_batch(1))
        theirs = hf(prompt, use_cache=True).cache.layers
        for i, layer in enumerate(theirs):  # transformers' layer cache: keys c_kv [1, 1, 16, d_c], values k_pe
            k_pe = layer.values
            if ARCH_CASES[case][0] == "deepseek_v2":  # its complex RoPE leaves pairs interleaved; kvedge: halves
                k_pe = torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), -1)
            torch.testing.assert_close(cache.values[i][:, :, :16], layer.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(cache.keys[i][:, :, :16], k_pe, rtol=0, atol=1e-5)
            assert not cache.keys[i][:, :, 16:].any() and not cache.values[i][:, :, 16:].any()

        tokens, step_logits = greedy(model, prompt, 32, KVCache.allocate(model.cfg, 1, 64, dtype=torch.float64))
        ref = hf(torch.cat([prompt, tokens], 1)).logits[:, 15:47]
        assert (step_logits - ref).abs().max().item() < 1e-5
    finally:
        hf.float()  # the session's shared model


def test_deepseek_v3_without_interleaved_rope(tmp_path):
    """rope_interleave=false: the rotary channels are halves already, and no rows are reordered."""
    overrides = {**ARCH_CASES["deepseek_v3-mla-noqlora"][1], "rope_interleave": False, "q_lora_rank": 24}
    hf = save_hf_model(tmp_path, "deepseek_v3", **overrides)
    model = load_decoder(tmp_path)
    assert not model.cfg.rope_interleaved and model.cfg.q_lora_rank == 24
    prompt = torch.randint(3, 160, (1, 16), generator=torch.Generator().manual_seed(8))
    tokens, step_logits = greedy(model, prompt, 8, KVCache.allocate(model.cfg, 1, 32))
    assert (step_logits - hf(torch.cat([prompt, tokens], 1)).logits[:, 15:23]).abs().max().item() < 1e-4


@pytest.mark.parametrize("case,lowering", MLA_EXPORTS)
def test_the_exported_cache_holds_d_c_plus_d_r_elements_per_token_and_layer(case, lowering, exported, capsys):
    out, sidecar = exported(case, lowering)
    d_c, d_r, layers = sizes(case)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    for values in (graph.input, graph.output):
        caches = [[d.dim_value for d in v.type.tensor_type.shape.dim][1:] for v in values
                  if v.name.startswith(("past_", "present_"))]
        assert caches == [[1, MAX_SEQ, d_r], [1, MAX_SEQ, d_c]] * layers  # k_rope, c_kv of each layer: nothing more
    meta = json.loads((out / "kvedge.json").read_text())
    assert meta["cache"]["elements_per_token"] == (d_c + d_r) * layers and meta["cache"]["layout"].startswith("MLA")
    # what the runtime allocates, the memory report's formula, and `kvedge info`
    backend = OrtBackend(out)
    allocated = sum(t.numel() * t.element_size() for t in backend.cache_tensors())
    assert allocated == kv_cache_bytes(sidecar.model, MAX_SEQ, backend.max_batch, "fp32")
    assert allocated == (d_c + d_r) * layers * 4 * MAX_SEQ * backend.max_batch
    assert main(["info", str(sidecar.extra["source_checkpoint"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["attention"] == "MLA" and info["kv_bytes_per_token"] == (d_c + d_r) * layers * 2  # fp16


def test_plan_on_the_seeds_example_is_a_gqa_cache_of_2_25_kv_heads(hf_checkpoint, tmp_path, capsys):
    """d_c = 4 d_h and d_R = d_h / 2: (4 + 1/2) d_h a token and layer, where GQA holds 2 h_kv d_h: h_kv = 2.25."""
    path, hf = hf_checkpoint(SEEDS)
    d_h, layers = hf.config.v_head_dim, hf.config.num_hidden_layers
    assert (hf.config.kv_lora_rank, hf.config.qk_rope_head_dim) == (4 * d_h, d_h // 2)
    assert main(["plan", str(path), "--seq-len", "1024", "--json"]) == 0
    mla = json.loads(capsys.readouterr().out)
    per_token = (4 * d_h + d_h // 2) * layers * 2  # fp16
    assert mla["kv_bytes_per_token_by_attention"]["MLA (this model)"] == per_token
    assert mla["kv_bytes"] == per_token * 1024 and mla["gqa_equivalent_kv_heads"] == 2.25
    # and its weights are transformers' count of the model's parameters (kv_b and the latent norms included)
    assert mla["weights_bytes"] == 2 * parameter_count(load_decoder(path).cfg) == 2 * hf.num_parameters()
    # the same bytes as a GQA model of head_dim d_h would need with 2.25 KV heads: its own plan's MLA row
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 160, "hidden_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": d_h, "intermediate_size": 96}))
    assert main(["plan", str(tmp_path), "--seq-len", "1024", "--json"]) == 0
    gqa = json.loads(capsys.readouterr().out)
    by = gqa["kv_bytes_per_token_by_attention"]
    assert by["MLA (d_c = 4 head_dim, d_rope = head_dim / 2)"] == per_token == by["GQA (this model)"] * 2.25 / 2
    assert gqa["gqa_equivalent_kv_heads"] == 2


def test_int8_cache_and_int8_weights_on_torch(hf_checkpoint):
    """The reference int8 cache quantizes the latent and the RoPE key per channel; weight quantization replaces
    the projections (q_b among them) and keeps kv_b in float (decode multiplies by its weight). Both stay close to
    the float model."""
    path, _ = hf_checkpoint(SEEDS)
    d_c, d_r, layers = sizes(SEEDS)
    ids = torch.randint(3, 160, (2, 24), generator=torch.Generator().manual_seed(9))
    pos, last = torch.arange(24).expand(2, 24), torch.full((2,), 23)
    ref = TorchBackend(path, max_batch=2, max_seq_len=32, device="cpu").forward(ids, pos, last).clone()
    int8 = TorchBackend(path, max_batch=2, max_seq_len=32, device="cpu", kv_dtype="int8")
    assert {t.dtype for t in int8.cache_tensors()} == {torch.int8}
    assert [s.shape for s in int8.cache.scales[0] + int8.cache.scales[1]] == [(1, 1, 1, d_r)] * layers + [
        (1, 1, 1, d_c)] * layers
    got = int8.forward(ids, pos, last)
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.999
    model = load_decoder(path)
    assert quantize_decoder(model, 8, 32) == layers * 5  # qkv, q_b, o, up, down
    assert all(isinstance(b.q_b, QuantLinear) and not isinstance(b.kv_b, QuantLinear) for b in model.layers)
    got = model(ids, pos, KVCache.allocate(model.cfg, 2, 32).for_batch(2), logit_index=last)
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.999


def rtn_int8(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """w [N, K] rounded to int8 and back as kvedge.models.quant's module doc states, written out here: per row and
    group of 32 inputs, scale = (max - min) / 255 over the group's range widened to include 0, rounded up to a
    float16 value; zero = round(-min / scale); q = clamp(round(w / scale) + zero, 0, 255); w' = (q - zero) scale."""
    wg = w.reshape(w.shape[0], -1, group)
    lo, hi = wg.amin(-1, keepdim=True).clamp(max=0), wg.amax(-1, keepdim=True).clamp(min=0)
    exact = (hi - lo) / 255
    half = exact.half()
    up = torch.nextafter(half, torch.tensor(float("inf"), dtype=torch.float16))
    scale = torch.where(half.float() < exact, up, half).float()
    zero = torch.round(-lo / scale)
    return ((torch.clamp(torch.round(wg / scale) + zero, 0, 255) - zero) * scale).reshape(w.shape)


def test_int8_weights_export_through_the_onnx_lowering(exported, hf_checkpoint):
    """q_b is quantized with the other projections (blocked DequantizeLinear), kv_b stays float; the export verifies
    the graph against the quantized PyTorch model and compares it with the float one. And against transformers,
    independently of that verification: the graph's logits over a prompt and its greedy decode are those of the
    transformers model with every linear but kv_b and the lm_head rounded by rtn_int8, and near the float model's."""
    out, sidecar = exported(SEEDS, "onnx", quantize="int8", calibration_tokens=256)  # less text: CI time
    v, layers = sidecar.verification, sidecar.model.num_layers
    assert v["passed"] and v["greedy_agreement"] == 1.0 and v["max_rel_error"] < 1e-4
    assert v["vs_unquantized"]["min_cosine"] > 0.99  # against the float model
    assert sidecar.extra["quantization"]["linears"] == 5 * layers  # qkv, q_b, o, up, down
    nodes = onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
    assert sum(n.op_type == "DequantizeLinear" for n in nodes) == 5 * layers

    _, hf = hf_checkpoint(SEEDS)
    rounded = copy.deepcopy(hf)
    linears = [(n, m) for n, m in rounded.named_modules() if isinstance(m, torch.nn.Linear)
               and not n.endswith(("kv_b_proj", "lm_head"))]
    assert len(linears) == 7 * layers  # q_a, q_b, kv_a, o, gate, up, down
    for _, m in linears:
        m.weight.copy_(rtn_int8(m.weight))
    ort = OrtBackend(out)

    def graph(ids, pos, rows, logit_index=torch.zeros(1, dtype=torch.long)):  # greedy's model: the exported graph
        return ort.forward(ids, pos, logit_index).clone()

    prompt = torch.randint(3, 160, (1, 16), generator=torch.Generator().manual_seed(12))
    tokens, got = greedy(graph, prompt, 24, KVCache.allocate(sidecar.model, 1, 1))  # (the graph holds its cache)
    _, want = transformers_logits(rounded, prompt, tokens)
    # Both sides compute with the same float32 weights (DequantizeLinear's (q - zero) * scale is exact in float32,
    # as rtn_int8's is), so they differ only by float32 rounding: summation orders, and attention over the absorbed
    # latent here, over reconstructed heads in transformers (measured: 3e-6 at most, on logits up to 3). 1e-4 is the parity
    # tests' tolerance, and far below what rounding otherwise moves them: scales not rounded up to float16 values
    # (2^-11 relative) already move them by 0.017, and the float model is 0.04-0.07 away.
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(want.argmax(-1), tokens)
    # and the float model: int8 weights move each step's logits by a few percent of the largest (cosine >= 0.9993
    # measured); 0.99 is the bound the export's own verification applies against the unquantized model
    _, fp = transformers_logits(hf, prompt, tokens)
    assert torch.nn.functional.cosine_similarity(got, fp, dim=-1).min().item() > 0.99


def test_refusals(hf_checkpoint, tmp_path):
    for model_type, layers, dense in (("deepseek_v2", 2, 1), ("deepseek_v3", 4, None)):  # v3's default: 3 dense
        kw = {} if dense is None else {"first_k_dense_replace": dense}
        hf = hf_config(model_type, num_key_value_heads=8, num_hidden_layers=layers, **kw).to_dict()
        with pytest.raises(ConfigError, match=rf"{model_type} with mixture-of-experts layers \(routed experts in "
                                              rf"layers {dense or 3}..{layers - 1}: first_k_dense_replace"):
            ModelConfig.from_hf(hf)
    with pytest.raises(ConfigError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_hf(hf_config("minicpm3", num_key_value_heads=8, rope_parameters=dict(
            rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=32)).to_dict())
    path, _ = hf_checkpoint(SEEDS)
    for lowering in ("ort", "trt"):
        with pytest.raises(KvedgeError, match=rf"^the '{lowering}' lowering cannot express this deepseek_v2 model: "
                                              r"multi-head latent attention \(MLA\).* Use --attention decomposed$"):
            export(path, tmp_path / lowering, ExportOptions(attention=lowering))
    with pytest.raises(KvedgeError, match="MLA's latent cache .* is int8 in the torch backend only"):
        export(path, tmp_path / "int8", ExportOptions(attention="onnx", kv_dtype="int8"))
    assert not any(tmp_path.glob("*/kvedge.json"))


def test_minicpm3_defaults_as_transformers_reads_them():
    hf = dict(model_type="minicpm3", vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4)
    cfg = ModelConfig.from_hf(hf)  # v_head_dim: hidden / heads; scale_emb 12, scale_depth 1.4, dim_model_base 256
    assert (cfg.v_head_dim, cfg.embed_scale, cfg.residual_scale, cfg.logits_divisor) == (8, 12.0, 0.7, 0.25)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.attention_kind, cfg.tie_embeddings) == (1, 4, "MLA", True)
    assert ModelConfig.from_hf({**hf, "scale_depth": None}).residual_scale == 1.0  # sqrt(layers) / sqrt(layers)
