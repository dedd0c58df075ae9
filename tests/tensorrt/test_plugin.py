"""The kvedge TensorRT plugin without TensorRT: its shape/dtype/alias rules, the AOT/JIT choice per
TensorRT version, the AOT kernel's signature, grid and PTX (compiled by triton, no GPU needed), and
its ONNX node."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import onnx
import pytest

from kvedge.errors import KvedgeError
from kvedge.tensorrt import plugin as trt_plugin
from kvedge.tensorrt.check import check


def test_output_shapes_and_dtypes():
    q, k, kc, pos, tab = (2, 8, 5, 64), (2, 2, 5, 64), (2, 2, 96, 64), (2, 5), (96, 16)
    assert trt_plugin.output_shapes(q, k, k, kc, kc, pos, tab, tab) == [q, kc, kc]
    assert trt_plugin.output_shapes(q, k, k, kc, kc, pos, (1, 0), (1, 0)) == [q, kc, kc]  # no RoPE
    assert trt_plugin.output_dtypes("float16", "float16", "float16", "float16", "float16", "int64", "float16",
                                    "float16") == ["float16", "float16", "float16"]
    assert trt_plugin.ALIASES == {1: 3, 2: 4}  # present_key aliases k_cache, present_value aliases v_cache
    with pytest.raises(ValueError, match="not a multiple"):
        trt_plugin.output_shapes((2, 7, 5, 64), (2, 2, 5, 64), (2, 2, 5, 64), kc, kc, pos, tab, tab)
    with pytest.raises(ValueError, match="positions"):
        trt_plugin.output_shapes(q, k, k, kc, kc, (2, 4), tab, tab)
    with pytest.raises(ValueError, match="rotary_dim <= head_dim 64"):
        trt_plugin.output_shapes(q, k, k, kc, kc, pos, (96, 33), (96, 33))
    with pytest.raises(ValueError, match="head_dim 320"):
        trt_plugin.output_shapes((1, 2, 1, 320), (1, 1, 1, 320), (1, 1, 1, 320), (1, 1, 8, 320), (1, 1, 8, 320),
                                 (1, 1), tab, tab)
    with pytest.raises(ValueError, match="share one of"):
        trt_plugin.output_dtypes("float16", "float32", "float16", "float16", "float16", "int64", "float16", "float16")
    with pytest.raises(ValueError, match="RoPE tables"):
        trt_plugin.output_dtypes(*["float16"] * 5, "int64", "float16", "float32")


@pytest.mark.parametrize("version,mode", [("10.7", "jit"), ("10.8.0.43", "jit"), ("10.9", "aot"),
                                          ("10.15.1", "aot"), ("11.0", "aot")])
def test_aot_where_tensorrt_has_aot_impl_else_jit(version, mode):
    assert trt_plugin.implementation(version) == mode
    with pytest.raises(KvedgeError, match="needs TensorRT >= 10.7"):
        trt_plugin.implementation("10.3")


def test_aot_signature_follows_the_kernel_and_the_documented_argument_order():
    triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    from kvedge.kernels import triton_attention as tk

    sig = trt_plugin.aot_signature("bfloat16", "int64", "float32")
    # inputs, then the extra scalar L, then the outputs (aot_impl: extra args sit between them)
    assert list(sig) == [*trt_plugin.INPUTS[:3], "kc", "vc", "positions", "cos", "sin", "L", "out", "kc_out",
                         "vc_out"]
    assert sig["q"] == "*bf16" and sig["positions"] == "*i64" and sig["cos"] == "*fp32" and sig["L"] == "i32"
    params = inspect.signature(tk._prefill.fn).parameters.values()  # .fn: jitted or interpreted alike
    assert [p.name for p in params if "constexpr" not in str(p.annotation)] == list(sig)
    assert {p.name for p in params} - set(sig) == set(tk.constexprs(1.0, 0, 0, 8, 2, 64, 64, 16, True))
    assert trt_plugin.aot_grid(3, 8, 1) == (3, 8, 1) and trt_plugin.aot_grid(2, 8, 33) == (2, 8, 3)
    assert triton.cdiv(33, tk.PREFILL_BLOCKS["BLOCK_M"]) == 3


AOT_COMPILE = """
import json
from triton.backends.compiler import GPUTarget
from kvedge.tensorrt import plugin as trt_plugin
name, ptx, threads, shared = trt_plugin.aot_compile(
    (None, 8, None, 80), (None, 2, 256, None), 20, "float16", "int64", "float16", 0.11, 16, 0.0,
    target=GPUTarget("cuda", 80, 32))
print(json.dumps(dict(name=name, ptx=ptx, threads=threads, shared=shared)))
"""


def test_aot_compile_gives_ptx_with_exactly_the_arguments_tensorrt_passes():
    """Compiles for sm_80 on any machine (triton's own LLVM and ptxas), in a fresh process: under
    TRITON_INTERPRET=1 (how CI runs the kernel tests) triton.jit functions cannot be compiled."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-c", AOT_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    name, ptx, threads = got["name"], got["ptx"], got["threads"]
    entry = ptx[ptx.index(f".entry {name}("):]
    params = entry[:entry.index(")")].count(".param")
    assert params == len(trt_plugin.aot_signature("float16", "int64", "float16"))  # no scratch pointers
    assert threads == trt_plugin.NUM_WARPS * 32 and f".reqntid {threads}" in ptx and 0 < got["shared"] <= 48 * 1024
    assert "mma.sync" in ptx  # fp16 dots on tensor cores


def test_trt_lowering_passes_the_rope_tables_to_one_plugin_node_per_layer(exported):
    out, sidecar = exported("llama-gqa4-llama3rope", "trt")
    assert "runs only inside TensorRT" in sidecar.verification["skipped"]
    model = onnx.load(str(out / "model.onnx"))
    nodes = [n for n in model.graph.node if n.op_type == trt_plugin.NAME]
    assert len(nodes) == sidecar.model.num_layers
    n = nodes[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
    assert n.domain == "kvedge" and attrs["plugin_namespace"] == b"kvedge" and attrs["plugin_version"] == b"2"
    assert attrs["scale"] == pytest.approx(sidecar.model.attn_scale) and attrs["window"] == 0
    assert len(n.input) == 8 and len(n.output) == 3
    assert "past_key.0" in n.input and "present_key.0" in n.output  # cache in, aliased cache out
    producers = {o: p for p in model.graph.node for o in p.output}
    assert producers[n.input[0]].op_type != "Concat"  # q arrives unrotated (a rotation ends in a Concat)
    assert all(nd.input[6:8] == n.input[6:8] for nd in nodes)  # one cos/sin pair shared by every layer
    rep = check(out / "model.onnx", "10.15")
    assert rep.buildable and any("ahead of time" in f.message for f in rep.findings)
    rep = check(out / "model.onnx", "10.8")
    assert rep.buildable and any("just in time" in f.message for f in rep.findings)
    rep = check(out / "model.onnx", "10.3")
    assert not rep.buildable and any("needs TensorRT >= 10.7" in f.message for f in rep.findings)
    for a in n.attribute:  # an export from before the RoPE inputs
        if a.name == "plugin_version":
            a.s = b"1"
    onnx.save(model, str(out / "v1.onnx"))
    rep = check(out / "v1.onnx", "10.15")
    assert not rep.buildable and any("plugin_version '1'" in f.message for f in rep.findings)


def test_trt_lowering_without_rope_passes_zero_width_tables(exported):
    out, _ = exported("gpt2", "trt")
    model = onnx.load(str(out / "model.onnx"))
    n = next(n for n in model.graph.node if n.op_type == trt_plugin.NAME)
    producers = {o: p for p in model.graph.node for o in p.output}
    table = producers[n.input[6]]
    assert n.input[6] == n.input[7] and table.op_type == "ConstantOfShape"
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    shape = inits.get(table.input[0])
    if shape is None:  # a Constant node
        shape = onnx.numpy_helper.to_array(producers[table.input[0]].attribute[0].t)
    assert shape.tolist() == [1, 0]
