"""The int8 KV cache: kvedge's attention op against ONNX Runtime's GroupQueryAttention CPU kernel.

Established on onnxruntime 1.32 (one-node graphs like the one below): the kernel quantizes the new k
(after its rotation) and v symmetrically, round-half-even(x * (1 / scale)) clamped to [-128, 127]
(x / scale differs in the last bit at rounding ties), and attends over the dequantized cache
(int8 * scale), the new tokens included, with and without do_rotary and query_seqlens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvedge.errors import KvedgeError
from kvedge.models import KVCache
from kvedge.models.attention import attention, quantize_kv
from kvedge.models.rope import tables

B, HQ, HKV, D, S = 2, 8, 2, 16, 32  # GQA ratio 4


def gqa_session(rotary: bool):
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper as h

    f = TP.FLOAT
    inputs = [h.make_tensor_value_info("q", f, [B, None, HQ * D]), h.make_tensor_value_info("k", f, [B, None, HKV * D]),
              h.make_tensor_value_info("v", f, [B, None, HKV * D]),
              h.make_tensor_value_info("past_k", TP.INT8, [B, HKV, S, D]),
              h.make_tensor_value_info("past_v", TP.INT8, [B, HKV, S, D]),
              h.make_tensor_value_info("seqlens_k", TP.INT32, [B]), h.make_tensor_value_info("total", TP.INT32, []),
              h.make_tensor_value_info("k_scale", f, [1, HKV, 1, D]), h.make_tensor_value_info("v_scale", f, [1, HKV, 1, D]),
              h.make_tensor_value_info("query_seqlens", TP.INT32, [B])]
    if rotary:
        inputs += [h.make_tensor_value_info("cos", f, [S, D // 2]), h.make_tensor_value_info("sin", f, [S, D // 2])]
    node = h.make_node(
        "GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total", "cos" if rotary else "",
                                "sin" if rotary else "", "", "", "", "k_scale", "v_scale", "", "", "query_seqlens"],
        ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=HQ, kv_num_heads=HKV,
        scale=D ** -0.5, do_rotary=int(rotary), k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
        kv_cache_bit_width=8)
    outputs = [h.make_tensor_value_info("out", f, None), h.make_tensor_value_info("present_k", TP.INT8, None),
               h.make_tensor_value_info("present_v", TP.INT8, None)]
    model = h.make_model(h.make_graph([node], "gqa_int8", inputs, outputs),
                         opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def bsh(x):  # [B, H, L, D] -> [B, L, H * D]
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1).numpy()


@pytest.mark.parametrize("rotary", [False, True], ids=["no-rope", "do_rotary"])
def test_gqa_int8_cache_matches_the_attention_op(rotary):
    g = torch.Generator().manual_seed(0)
    session = gqa_session(rotary)
    k_scale = torch.rand(1, HKV, 1, D, generator=g) * 0.03 + 0.01  # |k| up to ~3 sigma saturates some channels
    v_scale = torch.rand(1, HKV, 1, D, generator=g) * 0.03 + 0.01
    cos, sin = tables(1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), S, torch.float32)
    k_cache, v_cache = torch.zeros(B, HKV, S, D, dtype=torch.int8), torch.zeros(B, HKV, S, D, dtype=torch.int8)
    ort_k, ort_v = k_cache.numpy().copy(), v_cache.numpy().copy()
    # a 6-token prefill of both rows, a second chunk at ragged starts (row 1's prompt was 2 tokens: its
    # padding at 2..5 is overwritten), then 4 decode steps at each row's own position
    starts, lengths = [(0, 0), (6, 2)] + [(9 + i, 5 + i) for i in range(4)], [6, 3, 1, 1, 1, 1]
    saturated = 0
    for (s0, s1), n in zip(starts, lengths):
        positions = torch.stack([torch.arange(s0, s0 + n), torch.arange(s1, s1 + n)])
        q = torch.randn(B, HQ, n, D, generator=g)
        k, v = torch.randn(B, HKV, n, D, generator=g), torch.randn(B, HKV, n, D, generator=g)
        saturated += int((quantize_kv(k, k_scale).abs() >= 127).sum())
        ref = attention(q, k, v, k_cache, v_cache, positions, scale=D ** -0.5, rope=(cos, sin) if rotary else None,
                        k_scale=k_scale, v_scale=v_scale)
        feeds = {"q": bsh(q), "k": bsh(k), "v": bsh(v), "seqlens_k": positions[:, -1].int().numpy(),
                 "total": np.array(int(positions.max()) + 1, np.int32), "k_scale": k_scale.numpy(),
                 "v_scale": v_scale.numpy(), "query_seqlens": np.full(B, n, np.int32)}
        if rotary:
            feeds.update(cos=cos.numpy(), sin=sin.numpy())
        binding = session.io_binding()  # as the runtime binds: past and present one buffer, written in place
        for name, value in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for past, present, buf in (("past_k", "present_k", ort_k), ("past_v", "present_v", ort_v)):
            binding.bind_input(past, "cpu", 0, np.int8, list(buf.shape), buf.ctypes.data)
            binding.bind_output(present, "cpu", 0, np.int8, list(buf.shape), buf.ctypes.data)
        binding.bind_output("out")
        session.run_with_iobinding(binding)
        out = binding.copy_outputs_to_cpu()[-1]  # outputs come back in binding order
        assert np.array_equal(ort_k, k_cache.numpy()) and np.array_equal(ort_v, v_cache.numpy())  # same bytes
        got = torch.from_numpy(out).view(B, n, HQ, D).transpose(1, 2)
        assert (got - ref).abs().max().item() < 1e-5
    assert saturated > 0  # the clamp was exercised


def test_quantize_rounds_half_to_even_and_clamps_to_int8():
    scale = torch.tensor([0.5])
    x = torch.tensor([0.25, 0.75, -0.25, -0.75, 63.74, 63.76, -64.0, -70.0, 70.0])  # x / scale: ties, edges
    assert quantize_kv(x, scale).tolist() == [0, 2, 0, -2, 127, 127, -128, -128, 127]


def test_int8_cache_needs_scales_and_reports_its_bytes():
    from kvedge.models.config import ModelConfig

    cfg = ModelConfig.from_hf({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                               "vocab_size": 100, "max_position_embeddings": 64})
    with pytest.raises(KvedgeError, match="needs k/v scales"):
        KVCache.allocate(cfg, 1, 8, dtype=torch.int8)
    with pytest.raises(KvedgeError, match="takes no k/v scales"):
        KVCache.allocate(cfg, 1, 8, scales=([torch.ones(1, 2, 1, 8)] * 2, [torch.ones(1, 2, 1, 8)] * 2))
    scales = ([torch.ones(1, 2, 1, 8)] * 2, [torch.ones(1, 2, 1, 8)] * 2)
    cache = KVCache.allocate(cfg, 3, 10, dtype=torch.int8, scales=scales)
    # 2 layers x (K and V) x [3, 2, 10, 8] int8 = 2 * 2 * 480 = 1920 bytes, + 2 * 2 * (2 * 8) float32 scales = 256
    assert cache.nbytes == 1920 + 256
    assert all(len(entry) == 4 for entry in cache.for_batch(2))
