"""What README and docs/quantization.md promise of `kvedge export`, proved on the tiny checkpoints: the top-1 quality
gates (int4 and int8 weights, int8 cache) fail an export unless --allow-degraded; --accuracy-level 4 puts int8 activations in every MatMulNBits and is
verified by cosine only; fp16 on the default ort lowering, fp16 with --quantize and --kv-dtype int8 with --quantize
export, verify and carry the dtypes the graph contract gives them (docs/export.md)."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kvedge.artifact import SIDECAR, Sidecar
from kvedge.cli import main
from kvedge.runtime.ort_backend import OrtBackend
from tests.conftest import MAX_SEQ

CASE = "llama-gqa4-llama3rope"  # 2 layers, 8 query / 2 KV heads of 8, vocab 160
FAST = dict(verify_steps=4, calibration_tokens=128)  # a short verification and quality report


def against_transformers(out, hf_model, prompt_len: int = 16, steps: int = 16) -> tuple[float, float, float]:
    """(top-1 agreement, lowest cosine, max |error| / max(1, largest |logit|)) of the exported graph's logits on ONNX
    Runtime against the transformers model's, both teacher-forced on the same random tokens: the graph prefills the
    prompt, then takes one token a step."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, hf_model.config.vocab_size, (1, prompt_len + steps), generator=g)
    with torch.inference_mode():
        ref = hf_model(ids).logits[0, prompt_len - 1:].double()  # each position's next-token logits
    backend = OrtBackend(out, max_batch=1)
    got = [backend.forward(ids[:, :prompt_len], torch.arange(prompt_len)[None], torch.tensor([prompt_len - 1]))
           .double().reshape(1, -1)]  # a copy: the backend's logits are overwritten by its next call
    for p in range(prompt_len, prompt_len + steps):
        got.append(backend.forward(ids[:, [p]], torch.tensor([[p]]), torch.tensor([0])).double().reshape(1, -1))
    got = torch.cat(got)
    top1 = (got.argmax(-1) == ref.argmax(-1)).double().mean().item()
    cosine = torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item()
    return top1, cosine, ((got - ref).abs().max() / ref.abs().max().clamp(min=1)).item()


@pytest.fixture(scope="module")
def int4_args(hf_checkpoint):
    ckpt = hf_checkpoint(CASE)[0]
    return ["export", str(ckpt), "--quantize", "int4", "--accuracy-level", "4", "--kv-dtype", "int8", "--max-seq-len",
            str(MAX_SEQ), "--verify-steps", str(FAST["verify_steps"]), "--calibration-tokens",
            str(FAST["calibration_tokens"]), "--quiet"]


@pytest.fixture(scope="module")
def degraded(int4_args, tmp_path_factory):
    """int4 weights at accuracy level 4 over an int8 cache, kept with --allow-degraded."""
    out = tmp_path_factory.mktemp("int4-kept")
    assert main([*int4_args, "-o", str(out), "--allow-degraded"]) == 0
    return out


def test_the_int4_top1_gate_fails_the_export_unless_allow_degraded(int4_args, degraded, hf_checkpoint, tmp_path,
                                                                    capsys):
    # independently: the kept graph on ONNX Runtime against the transformers model agrees on too few tokens
    top1, _, _ = against_transformers(degraded, hf_checkpoint(CASE)[1])
    assert top1 < 0.85
    v = Sidecar.read(degraded).verification
    assert v["passed"] and v["vs_unquantized"]["top1_agreement"] < v["vs_unquantized"]["threshold_top1"] == 0.85

    assert main([*int4_args, "-o", str(tmp_path / "gated")]) == 2
    err = capsys.readouterr().err
    assert f"int4 weights: top-1 agreement with the unquantized model {v['vs_unquantized']['top1_agreement']:.0%} " \
           "< 85% (" in err and "--allow-degraded keeps it" in err
    assert not (tmp_path / "gated" / SIDECAR).exists()


def test_accuracy_level_4_reaches_every_matmulnbits_and_is_verified_by_cosine_only(degraded):
    graph = onnx.load(str(degraded / "model.onnx")).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * 4  # per layer: qkv, o, gate-up, down
    assert all({a.name: helper.get_attribute_value(a) for a in n.attribute}["accuracy_level"] == 4 for n in nbits)
    v = Sidecar.read(degraded).verification
    assert v["tolerance"] == {"max_rel": None, "min_cosine": 0.999}
    assert v["max_rel_error"] > 1e-3  # fp32's max rel rule (docs/export.md) would have failed it
    assert v["passed"] and v["min_cosine"] >= 0.999


F16, F32, I8, I64 = TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT64
EXPORTS = {  # name: export options, the cache's dtype, the float dtype of the logits and weights
    "fp16": (dict(dtype="fp16"), F16, F16),
    "fp16-int4": (dict(dtype="fp16", quantize="int4", allow_degraded=True), F16, F16),
    "int4-int8cache": (None, I8, F32),  # the int4 export above: --kv-dtype int8 with --quantize
}


@pytest.mark.parametrize("name", EXPORTS)
def test_export_verifies_and_the_graph_carries_the_promised_dtypes(name, exported, hf_checkpoint, request):
    options, cache, floats = EXPORTS[name]
    out = request.getfixturevalue("degraded") if options is None else exported(CASE, "ort", **options, **FAST)[0]
    assert Sidecar.read(out).verification["passed"]
    graph = onnx.load(str(out / "model.onnx")).graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.output)}
    assert [types[n] for n in ("input_ids", "position_ids", "logits_index")] == [I64] * 3
    assert types["logits"] == floats  # float32 stays float32, else the model's dtype
    caches = [t for n, t in types.items() if n.startswith(("past_", "present_"))]
    assert len(caches) == 2 * 2 * 2 and set(caches) == {cache}
    weights = {t.name: t for t in graph.initializer}
    assert {t.data_type for n, t in weights.items() if n.startswith("decoder.") and
            t.data_type in (F16, F32)} == {floats}  # embeddings, norms, lm_head, quantization scales
    if "int4" in name:
        nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
        assert len(nbits) == 8 and {weights[n.input[1]].data_type for n in nbits} == {TensorProto.UINT8}
    if cache == I8:  # per layer, KV head and channel, float32 (docs/quantization.md)
        scales = [weights[f"{kv}_scale_{i}"] for kv in "kv" for i in range(2)]
        assert all(t.data_type == F32 and list(t.dims) == [1, 2, 1, 8] for t in scales)
    if name == "fp16":  # independently: within fp16's parity tolerance of the transformers model
        _, cosine, max_rel = against_transformers(out, hf_checkpoint(CASE)[1])
        assert cosine >= 0.999 and max_rel <= 2e-2


def test_the_int8_cache_gate_fails_an_export_calibrated_on_too_little_text(hf_checkpoint, tmp_path, capsys):
    """The int8 cache's 90% top-1 gate, tripped by a real miscalibration: scales taken from a few tokens of one
    repeated character clip the K/V values of other text. Without --allow-degraded: exit 2 with the gate's
    message and nothing written."""
    text = tmp_path / "calibration.txt"
    text.write_text("a" * 8)
    args = ["export", str(hf_checkpoint(CASE)[0]), "--kv-dtype", "int8", "--calibration-text", str(text),
            "--max-seq-len", str(MAX_SEQ), "--verify-steps", "8", "--calibration-tokens", "128", "--quiet"]
    assert main([*args, "-o", str(tmp_path / "gated")]) == 2
    err = capsys.readouterr().err
    assert "int8 KV cache: top-1 agreement with a float KV cache" in err and "< 90% (" in err
    assert "--allow-degraded keeps it" in err
    assert not (tmp_path / "gated" / SIDECAR).exists()


def test_the_int8_weight_gate_fails_an_export_of_a_model_with_outlier_weights(tmp_path, capsys):
    """The int8 weights' 95% top-1 gate, tripped by what breaks round-to-nearest in real models: outlier weights
    (30x the projection's largest) on an input channel the norms switch off. The float model never sees them,
    but they stretch their group's int8 scale until the other weights of the group round to a few steps."""
    from tests.conftest import ARCH_CASES, save_hf_model

    model_type, overrides = ARCH_CASES[CASE]
    model = save_hf_model(tmp_path / "ckpt", model_type, **overrides)
    for layer in model.model.layers:
        layer.input_layernorm.weight[0] = layer.post_attention_layernorm.weight[0] = 0  # channel 0: dead
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):  # they read channel 0
            proj.weight[:, 0] = 30 * proj.weight.abs().max()
    model.save_pretrained(tmp_path / "ckpt")
    args = ["export", str(tmp_path / "ckpt"), "--quantize", "int8", "--max-seq-len", str(MAX_SEQ), "--verify-steps",
            "8", "--calibration-tokens", "128", "--quiet"]
    assert main([*args, "-o", str(tmp_path / "gated")]) == 2
    err = capsys.readouterr().err
    assert "int8 weights: top-1 agreement with the unquantized model" in err and "< 95% (" in err
    assert "--allow-degraded keeps it" in err
    assert not (tmp_path / "gated" / SIDECAR).exists()
