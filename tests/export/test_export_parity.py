"""Every architecture through every lowering that supports it: ONNX Runtime CPU vs the PyTorch Decoder."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from kvedge.errors import KvedgeError
from kvedge.export import LOWERINGS, ExportOptions, export
from kvedge.export.lowerings import ORT_LOWERINGS
from kvedge.models import KVCache, load_decoder
from kvedge.runtime.ort_backend import OrtBackend
from tests.conftest import ARCH_CASES, EXPORT_SUBSET, MAX_SEQ, MLA_EXPORTS

PROMPT, STEPS, TOL = 16, 16, 1e-4


def supported(case: str, lowering: str) -> bool:
    from kvedge.models.config import ModelConfig
    from tests.conftest import hf_config

    model_type, overrides = ARCH_CASES[case]
    cfg = ModelConfig.from_hf(hf_config(model_type, **overrides).to_dict())
    return not LOWERINGS[lowering].unsupported(cfg)


PAIRS = [pytest.param(c, low, id=f"{c}-{low}") for c in ARCH_CASES for low in ORT_LOWERINGS
         if low in EXPORT_SUBSET.get(c, ORT_LOWERINGS)]  # EXPORT_SUBSET: some cases on some lowerings only (CI time)
# The pairs whose lowering cannot express the architecture, written out here: which cases run parity is not left to
# the code under test, where a new refusal would silently turn a parity case into a pass.
REFUSED = {("onnx", "gemma2"),  # attention logit softcapping (the ONNX Attention softcap/mask order is ambiguous)
           # MLA: GroupQueryAttention has one head size for q, k and v; the latent's keys and values differ
           ("ort", "deepseek_v2-mla"), ("ort", "deepseek_v3-mla-noqlora"), ("ort", "minicpm3-mla")}


def test_the_lowerings_refuse_exactly_the_expected_pairs():
    assert {(low, c) for c in ARCH_CASES for low in ORT_LOWERINGS if not supported(c, low)} == REFUSED


def run_both(model, backend, prompts: list[torch.Tensor], steps: int):
    """Prefill (right-padded, per-row positions) then greedy decode on torch and ORT in lockstep.
    Returns the max abs logit difference and whether every greedy token agreed."""
    b, n = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, n, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = p
    lens = torch.tensor([len(p) for p in prompts])
    pos, last = torch.arange(n).expand(b, n).contiguous(), lens - 1
    cache = KVCache.allocate(model.cfg, b, MAX_SEQ)
    worst, agree = 0.0, True
    for s in range(steps + 1):
        ref = model(ids, pos, cache.for_batch(b), logit_index=last)
        got = backend.forward(ids, pos, last)
        worst = max(worst, (ref - got).abs().max().item())
        agree &= torch.equal(ref.argmax(-1), got.argmax(-1))
        ids = ref[:, -1].argmax(-1, keepdim=True)
        pos, last = (lens + s)[:, None], torch.zeros(b, dtype=torch.long)
    return worst, agree


@pytest.mark.parametrize("case,lowering", PAIRS)
def test_onnxruntime_matches_pytorch(case, lowering, exported, hf_checkpoint):
    if (lowering, case) in REFUSED:
        path, _ = hf_checkpoint(case)
        with pytest.raises(KvedgeError, match=f"the '{lowering}' lowering cannot express"):
            export(path, path.parent / f"refused-{lowering}", ExportOptions(attention=lowering))
        return
    out, sidecar = exported(case, lowering)
    assert sidecar.verification["passed"] and sidecar.verification["greedy_agreement"] == 1.0
    model = load_decoder(hf_checkpoint(case)[0])
    prompt = torch.randint(3, model.cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    worst, agree = run_both(model, OrtBackend(out), [prompt], STEPS)
    assert worst < TOL and agree


# four architectures on the three lowerings, and MLA's cases on those of their lowerings that express it (ort refuses
# it: REFUSED)
RAGGED = [pytest.param(c, low, id=f"{c}-{low}") for c in ("llama-gqa4-llama3rope", "mistral-window", "gpt2",
                                                            "qwen3-qknorm") for low in ("onnx", "decomposed", "ort")]
RAGGED += [pytest.param(c, low, id=f"{c}-{low}") for c, low in MLA_EXPORTS]


@pytest.mark.parametrize("case,lowering", RAGGED)
def test_batch_with_different_prompt_lengths(case, lowering, exported, hf_checkpoint):
    """Right-padded prompts of 16, 7 and 11 tokens (each row its own positions), then greedy decode (the torch side
    of ragged batches: tests/models/test_hf_parity.py)."""
    out, _ = exported(case, lowering)
    model = load_decoder(hf_checkpoint(case)[0])
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, model.cfg.vocab_size, (n,), generator=g) for n in (PROMPT, 7, 11)]
    worst, agree = run_both(model, OrtBackend(out), prompts, 8)
    assert worst < TOL and agree


@pytest.mark.parametrize("lowering", list(LOWERINGS))
def test_gqa_is_preserved_in_the_graph(lowering, exported):
    out, sidecar = exported("llama-gqa4-llama3rope", lowering)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    cfg = sidecar.model
    assert cfg.num_heads == 4 * cfg.num_kv_heads
    caches = [v for v in list(graph.input) + list(graph.output) if v.name.startswith(("past_", "present_"))]
    assert len(caches) == 4 * cfg.num_layers
    for v in caches:
        dims = v.type.tensor_type.shape.dim
        assert dims[0].dim_param == "batch"
        assert [d.dim_value for d in dims[1:]] == [cfg.num_kv_heads, MAX_SEQ, cfg.head_dim], v.name


@pytest.mark.parametrize("case,fused,packed", [("qwen3-qknorm", True, False), ("gemma", True, True),
                                               ("llama-mha", False, False), ("phi3-partialrope", False, False),
                                               ("gpt2", False, True)])
def test_ort_lowering_fuses_rope_and_packs_qkv(case, fused, packed, exported):
    """GroupQueryAttention's do_rotary takes the rotary tables when its kernel can (rotary_dim / 2 a multiple
    of 8: qwen3 and gemma here); narrower rotations stay plain ops. When nothing but views separates q, k
    and v from the fused projection (no q/k norm, no rotation outside GQA), GQA gets it packed. Parity of
    every combination is tested above."""
    out, sidecar = exported(case, "ort")
    gqa = [n for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
           if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == sidecar.model.num_layers
    for n in gqa:
        assert {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}.get("do_rotary", 0) == int(fused)
        assert (len(n.input) > 7 and n.input[7] != "") == fused  # cos_cache wired only when fused
        assert (n.input[1] == n.input[2] == "") == packed


def test_ort_lowering_fuses_residual_add_into_rms_norm(exported):
    """Every RMSNorm that follows a residual Add becomes one SkipSimplifiedLayerNormalization: all but
    the first block's attention norm (it follows the embedding) and the final norm (it follows the
    logit-row gather). Parity of the fused graph is tested above."""
    out, sidecar = exported("llama-gqa2-bias", "ort")
    ops = [n.op_type for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * sidecar.model.num_layers - 1


def test_contract_names_shapes_and_sidecar(exported):
    out, sidecar = exported("qwen2-bias", "onnx")
    meta = json.loads((out / "kvedge.json").read_text())
    graph = onnx.load(str(out / "model.onnx")).graph
    assert [i.name for i in graph.input] == [i["name"] for i in meta["inputs"]]
    assert [o.name for o in graph.output] == [o["name"] for o in meta["outputs"]]
    assert meta["inputs"][:3] == [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["batch", "seq"]},
        {"name": "logits_index", "dtype": "int64", "shape": ["batch", "logits"]}]
    assert meta["outputs"][0]["shape"] == ["batch", "logits", sidecar.model.vocab_size]
    assert [d.dim_param or d.dim_value for d in graph.output[0].type.tensor_type.shape.dim] == \
        ["batch", "logits", sidecar.model.vocab_size]
    assert [d.dim_param for d in graph.input[2].type.tensor_type.shape.dim] == ["batch", "logits"]
    assert meta["lowering"] == "onnx" and meta["opset"] == 24 and meta["max_seq_len"] == MAX_SEQ
    assert meta["model"]["num_kv_heads"] == 4 and meta["kvedge_version"]
    ops = {n.op_type for n in graph.node}
    assert {"Attention", "TensorScatter"} <= ops


@pytest.mark.parametrize("lowering,ops,opset", [
    ("decomposed", {"ScatterElements", "Softmax", "MatMul"}, 17),
    ("ort", {"GroupQueryAttention"}, 21),
])
def test_lowering_graph_ops_and_opset(lowering, ops, opset, exported):
    out, _ = exported("llama-mha", lowering)
    model = onnx.load(str(out / "model.onnx"))
    assert ops <= {n.op_type for n in model.graph.node}
    assert {i.domain: i.version for i in model.opset_import}[""] == opset
    if lowering == "decomposed":
        assert {"Attention", "TensorScatter"}.isdisjoint({n.op_type for n in model.graph.node})
