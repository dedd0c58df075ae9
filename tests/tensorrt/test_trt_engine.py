"""On a machine with TensorRT and a GPU: build -> parity (fp16, 1e-2, 32 identical greedy tokens) -> bench.

Skips with a reason elsewhere. Run it with `make tensorrt` on a Jetson or a desktop GPU.
"""

from __future__ import annotations

import pytest
import torch

trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (JetPack or NVIDIA's wheels provide it)")
pytestmark = [pytest.mark.tensorrt,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="TensorRT tests need a CUDA GPU")]


def test_build_parity_bench(tmp_path):
    from kvedge.bench import latency
    from kvedge.bench.parity import compare
    from kvedge.export import ExportOptions, export
    from kvedge.tensorrt.build import build
    from kvedge.tensorrt.versions import select_path
    from kvedge.models.attention import attention
    from kvedge.models.demo import write_demo_checkpoint
    from kvedge.runtime import load

    ckpt = write_demo_checkpoint(tmp_path / "ckpt")
    path = select_path(trt.__version__)
    out = tmp_path / "onnx"
    export(ckpt, out, ExportOptions(attention=path.lowering, dtype="fp16", max_seq_len=256, max_batch=1))
    report = build(out, precision="fp16", max_prefill_len=64)
    assert report["engine_bytes"] > 0
    engine = load(out, "tensorrt")
    # the reference op, not the Triton kernels the torch backend runs on CUDA by default: TensorRT against kvedge's
    # attention semantics, not against another optimized implementation of them
    reference = load(ckpt, "torch", dtype="fp16", max_batch=1, max_seq_len=256, device="cuda", fused_attention=False)
    assert reference.backend.model.attention_op is attention and not reference.backend.fused
    rep = compare(engine, reference, [0] + list(range(3, 19)), steps=32, dtype="fp16",
                  tolerance={"max_rel": 1e-2})
    assert rep.greedy_agree, rep.first_divergent_step  # 32 identical greedy tokens
    assert all(s.max_rel <= 1e-2 for s in rep.steps), rep.markdown()  # logits within 1e-2 (x max(1, |logit|))
    results = latency.run({"tensorrt": lambda: load(out, "tensorrt")}, [64], [1], 32, 1, 2)
    print(latency.table(results))


def test_int4_weights_build_and_match_the_reference(tmp_path):
    """Issue 31 on a device: `--trt-version` of the installed TensorRT with --quantize int4 (INT4 DequantizeLinear
    blocks, fp16, strongly typed) builds, and the engine's logits follow the same graph's on ONNX Runtime."""
    from kvedge.bench.parity import compare
    from kvedge.export import ExportOptions, export
    from kvedge.models.demo import write_demo_checkpoint
    from kvedge.models import load_config
    from kvedge.runtime import load
    from kvedge.tensorrt.build import build
    from kvedge.tensorrt.versions import export_recipe

    ckpt = write_demo_checkpoint(tmp_path / "ckpt")
    cfg = load_config(ckpt)
    recipe = export_recipe(trt.__version__, "int4", {cfg.hidden_size, cfg.intermediate_size,
                                                     cfg.num_heads * cfg.out_head_dim})
    out = tmp_path / "int4"
    export(ckpt, out, ExportOptions(dtype="fp16", max_seq_len=256, max_batch=1, allow_degraded=True, **recipe))
    assert build(out, precision="fp16", max_prefill_len=64)["engine_bytes"] > 0
    engine = load(out, "tensorrt")
    # the same graph on ONNX Runtime's CPU provider, which export verified against the quantized PyTorch model
    reference = load(out, "onnxruntime", max_batch=1, providers=["CPUExecutionProvider"])
    rep = compare(engine, reference, [0] + list(range(3, 19)), steps=16, dtype="fp16", tolerance={"max_rel": 2e-2})
    assert all(s.max_rel <= 2e-2 for s in rep.steps), rep.markdown()
