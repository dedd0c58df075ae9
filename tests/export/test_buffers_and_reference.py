"""In-place binding equals separate buffers; the `onnx` lowering's nodes agree with onnx.reference."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx.reference import ReferenceEvaluator

from kvedge.export.graph import cached_attention
from kvedge.export.lowerings import LOWERINGS
from kvedge.models.attention import attention
from kvedge.runtime.ort_backend import OrtBackend
from tests.conftest import MAX_SEQ


@pytest.mark.parametrize("lowering", ["onnx", "decomposed"])
def test_present_bound_to_past_equals_separate_buffers(lowering, exported):
    out, sidecar = exported("llama-gqa4-llama3rope", lowering)
    cfg = sidecar.model
    shared = OrtBackend(out, max_batch=1)
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()][3:]
    past = {n: np.zeros((1, cfg.num_kv_heads, MAX_SEQ, cfg.head_dim), np.float32) for n in names}
    ids = np.arange(3, 15, dtype=np.int64)[None]
    pos = np.arange(12, dtype=np.int64)[None]
    last = np.array([[11]])  # logits_index [batch, logits]: one position a row
    for step in range(6):
        sep = sess.run(None, {"input_ids": ids, "position_ids": pos, "logits_index": last, **past})
        got = shared.forward(torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(last)).numpy()
        np.testing.assert_array_equal(sep[0], got)
        for name, present in zip(names, sep[1:]):  # separate buffers: feed present back as past
            past[name] = present
            np.testing.assert_array_equal(present, shared.caches[names.index(name)].numpy())
        nxt = int(sep[0][0, -1].argmax())
        ids, pos, last = np.array([[nxt]]), np.array([[12 + step]]), np.array([[0]])


def attention_only_graph(lowering: str, q, k, v, kc, vc, pos, scale, window, softcap):
    """Export just kvedge::cached_attention through a lowering: its cache-update and attention nodes."""

    class Only(torch.nn.Module):
        def forward(self, q, k, v, kc, vc, pos):
            return cached_attention(q, k, v, kc, vc, pos, scale, window, softcap)

    low = LOWERINGS[lowering]
    prog = torch.onnx.export(Only(), (q, k, v, kc, vc, pos), dynamo=True, opset_version=max(low.opset, 18),
                             input_names=["q", "k", "v", "k_cache", "v_cache", "positions"],
                             output_names=["out", "present_key", "present_value"],
                             custom_translation_table={torch.ops.kvedge.cached_attention.default: low.translate})
    return prog.model_proto


@pytest.mark.parametrize("lowering", ["onnx", "decomposed"])
@pytest.mark.parametrize("hq,hkv,l,starts,window", [(4, 2, 3, [5, 9], 0), (8, 1, 1, [12, 0], 0),
                                                     (6, 6, 4, [0, 7], 5), (8, 2, 2, [3, 3], 0)])
def test_attention_nodes_agree_with_onnx_reference(lowering, hq, hkv, l, starts, window):
    g = torch.Generator().manual_seed(hq * 10 + l)
    b, d, s = 2, 16, 24
    q, k, v = (torch.randn(b, h, l, d, generator=g) for h in (hq, hkv, hkv))
    kc, vc = (torch.randn(b, hkv, s, d, generator=g) for _ in range(2))
    pos = torch.tensor(starts)[:, None] + torch.arange(l)
    scale = d**-0.5
    model = attention_only_graph(lowering, q, k, v, kc, vc, pos, scale, window, 0.0)
    if lowering == "onnx":
        assert {"Attention", "TensorScatter"} <= {n.op_type for n in model.graph.node}
    feeds = {n: t.numpy() for n, t in zip(["q", "k", "v", "k_cache", "v_cache", "positions"],
                                          (q, k, v, kc, vc, pos))}
    y, pk, pv = ReferenceEvaluator(model).run(None, feeds)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = attention(q, k, v, kc_ref, vc_ref, pos, scale=scale, window=window or None)
    np.testing.assert_allclose(y, ref.numpy(), atol=1e-5)
    np.testing.assert_array_equal(pk, kc_ref.numpy())
    np.testing.assert_array_equal(pv, vc_ref.numpy())
