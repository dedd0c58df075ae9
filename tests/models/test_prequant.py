"""Pre-quantized AWQ / GPTQ checkpoints: the test packs its own integers from the public format specs
(numpy, independent of kvedge's unpacking), and the reference is transformers with the test's own
dequantized weights w = (q - z) * s."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvedge.errors import KvedgeError
from kvedge.export import ExportOptions, export
from kvedge.models import KVCache, load_decoder
from kvedge.models.prequant import awq_unpack, gptq_unpack_qweight, gptq_unpack_qzeros, parse_spec
from kvedge.models.quant import QuantLinear
from tests.conftest import save_hf_model

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ GEMM: value j of a word holds column ORDER[j] of its 8
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
MODEL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             attention_bias=True)
GROUP = 32
# name -> (quant_method, bits, format)
CASES = {"awq": ("awq", 4, "gemm"), "gptq": ("gptq", 4, "gptq"), "gptq_v2": ("gptq", 4, "gptq_v2"),
         "gptq-8bit": ("gptq", 8, "gptq")}


def pack_last(vals: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[..., M] unsigned ints -> int32 [..., M / (32 / bits)]; value j of a word at bits j*bits upward,
    holding element order[j] of its run (in order when order is None)."""
    pf = 32 // bits
    v = vals.astype(np.uint32).reshape(*vals.shape[:-1], vals.shape[-1] // pf, pf)
    if order is not None:
        v = v[..., order]
    words = np.zeros(v.shape[:-1], dtype=np.uint32)
    for j in range(pf):
        words |= v[..., j] << np.uint32(bits * j)
    return words.view(np.int32)


def pack_checkpoint_linear(method: str, bits: int, fmt: str, q: np.ndarray, z: np.ndarray, s: np.ndarray,
                           group: int) -> dict[str, torch.Tensor]:
    """q [N, K], z and s [N, K / group] -> the format's tensors (qweight, qzeros, scales[, g_idx])."""
    k = q.shape[1]
    if method == "awq":  # packed along the output dimension, AWQ's order
        t = {"qweight": pack_last(q.T, 4, AWQ_ORDER), "qzeros": pack_last(z.T, 4, AWQ_ORDER)}
    else:  # qweight packed along the input dimension, qzeros along the output dimension; v1 stores zero - 1
        stored = z.T - (1 if fmt == "gptq" else 0)
        t = {"qweight": pack_last(q, bits).T.copy(),  # q [N, K]: words along K, then [K / pf, N]
             "qzeros": pack_last(stored, bits), "g_idx": (np.arange(k) // group).astype(np.int32)}
    t["scales"] = s.T.astype(np.float16)
    return {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in t.items()}


def write_quantized(path, case: str, groups: dict[str, int] | None = None, seed: int = 0):
    """A tiny Llama (GQA 4/2, 2 layers) whose projections are random integers packed in `case`'s format.
    Returns the transformers model holding the dequantized weights (the reference)."""
    method, bits, fmt = CASES[case]
    hf = save_hf_model(path, "llama", seed=seed, **MODEL)
    state = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(seed)
    top = 2**bits - 1
    for i in range(MODEL["num_hidden_layers"]):
        for proj in PROJ:
            name = f"model.layers.{i}.{proj}"
            g = (groups or {}).get(proj.rsplit(".", 1)[-1], GROUP)
            n, k = state.pop(name + ".weight").shape
            q = rng.integers(0, top + 1, (n, k))
            z = rng.integers(1 if fmt == "gptq" else 0, top + 1, (n, k // g))  # v1 cannot store a zero of 0
            s = (rng.uniform(0.005, 0.02, (n, k // g)) / 2 ** (bits - 4)).astype(np.float16)  # |w| <~ 0.3
            state.update({f"{name}.{t}": v for t, v in pack_checkpoint_linear(method, bits, fmt, q, z, s, g).items()})
            w = (q - np.repeat(z, g, axis=1)) * np.repeat(s.astype(np.float32), g, axis=1)
            hf.get_submodule(name).weight.copy_(torch.from_numpy(w.astype(np.float32)))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    qc = {"quant_method": method, "bits": bits, "group_size": GROUP}
    qc.update({"version": "gemm", "zero_point": True} if method == "awq" else
              {"checkpoint_format": fmt, "desc_act": False, "sym": False})
    set_quant_config(path, qc)
    return hf


def set_quant_config(path, qc: dict) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    made = {}

    def get(case: str):
        if case not in made:
            path = tmp_path_factory.mktemp(case)
            made[case] = (path, write_quantized(path, case))
        return made[case]

    return get


# -- round trips: the test's packers against kvedge's unpackers ----------------------------------
def test_awq_round_trip_keeps_the_interleaved_order():
    q = np.random.default_rng(0).integers(0, 16, (6, 40))
    packed = torch.from_numpy(pack_last(q, 4, AWQ_ORDER))
    assert torch.equal(awq_unpack(packed), torch.from_numpy(q).int())
    # the order matters: column 1 of each 8 sits in the fifth nibble (bits 16..19), column 2 in the second
    assert (int(packed[0, 0]) >> 16 & 0xF, int(packed[0, 0]) >> 4 & 0xF) == (q[0, 1], q[0, 2])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_round_trip_with_the_v1_zero_offset(bits, fmt):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, (64, 24))  # [K, N]
    assert torch.equal(gptq_unpack_qweight(torch.from_numpy(pack_last(q.T, bits).T.copy()), bits),
                       torch.from_numpy(q).int())
    z = rng.integers(1, 2**bits, (2, 24))
    offset = 1 if fmt == "gptq" else 0
    packed = torch.from_numpy(pack_last(z - offset, bits))
    assert torch.equal(gptq_unpack_qzeros(packed, bits, offset), torch.from_numpy(z).int())


# -- the model: logits against transformers with the dequantized weights -----------------------
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_the_dequantized_reference(case, quantized):
    path, hf = quantized(case)
    model = load_decoder(path)
    for layer in model.layers:
        for name in ("qkv", "o", "up", "down"):
            assert isinstance(getattr(layer, name), QuantLinear) and getattr(layer, name).bits == CASES[case][1]
    assert not any("weight" in n for n, _ in model.layers.named_parameters() if ".qkv." in n or ".up." in n)
    ids = torch.randint(3, 160, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits
    got = model(ids, torch.arange(12).expand(2, 12), KVCache.allocate(model.cfg, 2, 32).for_batch(2))
    err = (got - ref).abs().max().item()
    print(f"{case}: max abs logit difference {err:.2e} (largest |logit| {ref.abs().max().item():.2f})")
    assert err < 1e-4
    assert model.prequantized["method"] == CASES[case][0] and model.prequantized["linears"] == 8


@pytest.mark.parametrize("case", ["awq", "gptq"])
def test_ort_export_agrees_with_the_quantized_torch_model(case, quantized, tmp_path):
    path, _ = quantized(case)
    sc = export(path, tmp_path / "out", ExportOptions(attention="ort", max_seq_len=40, verify_prompt_len=8,
                                                     verify_steps=8))
    v = sc.verification
    print(f"{case} export: max abs {v['max_abs_error']:.2e}, cosine {v['min_cosine']:.7f}")
    assert v["passed"] and v["max_abs_error"] < 1e-4 and "vs_unquantized" not in v
    rec = sc.extra["quantization"]
    assert rec["method"] == CASES[case][0] and rec["bits"] == 4 and rec["group_size"] == GROUP
    graph = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert sum(n.op_type == "MatMulNBits" for n in graph.graph.node) == 4 * MODEL["num_hidden_layers"]


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes"}, r"quant_method = 'bitsandbytes' is not supported; kvedge accepts 'awq'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, r"version = 'gemv'.*accepts 'gemm'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "marlin"}, r"version = 'marlin'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 32}, r"bits = 8 .* accepts 4 for AWQ"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False}, r"zero_point = False"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, r"bits = 3 .* accepts 4 or 8 for GPTQ"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     r"checkpoint_format = 'marlin'.*'gptq' \(v1\) or 'gptq_v2'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "is_marlin_format": True}, r"is_marlin_format = True"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "lm_head": True}, r"lm_head = True.*quantized lm_head"),
])
def test_unsupported_configs_are_refused(qc, match):
    with pytest.raises(KvedgeError, match=match) as e:
        parse_spec(qc, "ckpt/config.json")
    assert "ckpt/config.json: quantization_config." in str(e.value)


def _copy(src, dst, edit=None):
    """A copy of checkpoint src at dst; edit(state) changes its tensors in place."""
    import shutil

    shutil.copytree(src, dst)
    if edit is not None:
        state = load_file(str(dst / "model.safetensors"))
        edit(state)
        save_file(state, str(dst / "model.safetensors"))
    return dst


def test_unsupported_config_refused_on_load(quantized, tmp_path):
    path = _copy(quantized("awq")[0], tmp_path / "c")
    set_quant_config(path, {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "exllama"})
    with pytest.raises(KvedgeError, match=r"config.json: quantization_config.version = 'exllama'"):
        load_decoder(path)


def test_act_order_g_idx_is_refused(quantized, tmp_path):
    name = "model.layers.1.self_attn.k_proj.g_idx"
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    path = _copy(quantized("gptq")[0], tmp_path / "c", lambda st: st.update({name: st[name][perm].contiguous()}))
    with pytest.raises(KvedgeError, match=rf"tensor {name} is not k // group_size.*desc_act.*re-quantize"):
        load_decoder(path)


def test_mixed_group_sizes_in_a_fused_group_are_refused(tmp_path):
    write_quantized(tmp_path, "gptq", groups={"k_proj": 64})
    with pytest.raises(KvedgeError, match=r"mixed group sizes in kvedge's fused layers.0.qkv: q_proj 32, k_proj 64"):
        load_decoder(tmp_path)


def test_gptq_v1_zero_of_16_is_refused(quantized, tmp_path):
    name = "model.layers.0.mlp.down_proj.qzeros"  # every stored value 15 (all bits set): zero 16
    path = _copy(quantized("gptq")[0], tmp_path / "c", lambda st: st.update({name: torch.full_like(st[name], -1)}))
    with pytest.raises(KvedgeError, match=rf"tensor {name} holds a zero point of 16 .* 0..15"):
        load_decoder(path)


def test_quantized_lm_head_tensor_is_refused(quantized, tmp_path):
    def edit(state):
        state.pop("lm_head.weight")
        state["lm_head.qweight"] = torch.zeros(64, 20, dtype=torch.int32)

    path = _copy(quantized("awq")[0], tmp_path / "c", edit)
    with pytest.raises(KvedgeError, match=r"tensor 'lm_head.qweight' is quantized.*lm_head and embeddings must be"):
        load_decoder(path)


def test_export_refusals(quantized, tmp_path):
    path, _ = quantized("gptq")
    with pytest.raises(KvedgeError, match=r"already quantized \(gptq, 4 bits, .*drop --quantize"):
        export(path, tmp_path / "a", ExportOptions(quantize="int8"))
    # the decomposed lowering carries its 4-bit groups as DequantizeLinear (issue 31), exactly: it verifies
    assert export(path, tmp_path / "b", ExportOptions(attention="decomposed", max_seq_len=32)).verification["passed"]
