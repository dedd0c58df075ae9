"""The kvedge TensorRT plugin without TensorRT: its shape/dtype/alias rules, the AOT/JIT choice per
TensorRT version, the AOT kernel's signature, grid and PTX (compiled by triton, no GPU needed), its
registration as tensorrt.plugin validates it (TensorRT's checks reproduced here), and its ONNX node."""

from __future__ import annotations

import __future__
import ast
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import types
import typing

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


@pytest.mark.parametrize("version,mode", [("10.6", "jit"), ("10.8.0.43", "jit"), ("10.9", "aot"),
                                          ("10.15.1", "aot"), ("11.0", "aot")])
def test_aot_where_tensorrt_has_aot_impl_else_jit(version, mode):
    """tensorrt.plugin (register, impl, TensorDesc.aliased) is in NVIDIA/TensorRT release/10.6's
    python/packaging/bindings_wheel/tensorrt/plugin/, and onnx-tensorrt's docs/Changelog.md 10.6 GA "Added support
    for parsing nodes with Quickly Deployable Plugins"; aot_impl first appears in release/10.9's _lib.py."""
    assert trt_plugin.implementation(version) == mode
    with pytest.raises(KvedgeError, match="needs TensorRT >= 10.6"):
        trt_plugin.implementation("10.5")


# tensorrt.plugin's checks of a registration, reproduced (TensorRT is not installed here), from NVIDIA/TensorRT
# python/packaging/bindings_wheel/tensorrt/plugin/_validate.py at release/10.9 (the same lines in release/10.6
# through release/11.1): _parse_register_inputs, _parse_register_return, _validate_impl and _validate_aot_impl.
# They read `inspect.signature(fn)` (no eval_str) and test each annotation with issubclass(), which raises
# TypeError on a string annotation. The classes below only stand where tensorrt.plugin's classes are the
# issubclass() targets; nothing here behaves like TensorRT.
class TensorDesc: ...
class Tensor: ...
class KernelLaunchParams: ...
class SymExprs: ...
class SymIntExprs(SymExprs): ...


ANNOTATION_TARGETS = types.SimpleNamespace(TensorDesc=TensorDesc, Tensor=Tensor, KernelLaunchParams=KernelLaunchParams,
                                           SymExprs=SymExprs, SymIntExprs=SymIntExprs)
SERIALIZABLE_BUILTIN_TYPES = (int, float, bytes, bool, str)  # _validate.py


def registered_functions() -> dict[str, typing.Callable]:
    """register()'s functions decorated with trtp.register / trtp.aot_impl / trtp.impl, their bodies dropped, compiled
    with the __future__ flags kvedge.tensorrt.plugin is compiled with: {decorator: function}."""
    future = 0
    for feature in __future__.all_feature_names:
        future |= getattr(__future__, feature).compiler_flag
    flags = trt_plugin.register.__code__.co_flags & future
    found = {}
    for fn in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(trt_plugin.register)))):
        deco = fn.decorator_list[0] if isinstance(fn, ast.FunctionDef) and fn.decorator_list else None
        if isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute):
            fn.decorator_list, fn.body = [], [ast.Pass()]
            module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
            scope = {"trtp": ANNOTATION_TARGETS}
            exec(compile(module, trt_plugin.__file__, "exec", flags=flags, dont_inherit=True), scope)
            found[deco.func.attr] = scope[fn.name]
    return found


def tensorrt_registers(fn) -> tuple[list[str], dict]:
    """_parse_register_inputs and _parse_register_return: (tensor names, attribute annotations)."""
    sig = inspect.signature(fn)
    tensors, attrs = [], {}
    for i, (name, p) in enumerate(sig.parameters.items()):
        assert p.annotation is not inspect.Parameter.empty and p.default is inspect.Parameter.empty
        if issubclass(p.annotation, TensorDesc):
            assert not attrs, "TensorDescs args and attribute args cannot be interspersed"
            tensors.append(name)
        else:
            assert i > 0 and p.annotation in SERIALIZABLE_BUILTIN_TYPES, (name, p.annotation)
            attrs[name] = p.annotation
    ret = sig.return_annotation
    assert typing.get_origin(ret) is tuple and all(issubclass(a, TensorDesc) for a in typing.get_args(ret))
    return tensors, attrs


def tensorrt_accepts_impl(fn, tensors: list[str], attrs: dict, tensor_type: type, last: str) -> None:
    """_validate_impl (tensor_type Tensor, last "stream") and _validate_aot_impl (TensorDesc, "tactic")."""
    sig = inspect.signature(fn)
    for name, p in sig.parameters.items():
        if name == "outputs":
            assert typing.get_origin(p.annotation) is tuple
            assert all(issubclass(a, tensor_type) for a in typing.get_args(p.annotation))
        elif name in ("stream", "tactic"):
            assert issubclass(p.annotation, int)
        elif issubclass(p.annotation, tensor_type):
            assert name in tensors
        else:
            assert p.annotation == attrs[name], name
    assert list(sig.parameters) == [*tensors, *(a for a in attrs if a in sig.parameters), "outputs", last]


def test_the_registration_passes_tensorrt_plugins_own_validation():
    """Issue 17, item 1: under `from __future__ import annotations` every annotation is a string and TensorRT's
    issubclass(param.annotation, TensorDesc) raises TypeError: no build or engine load could register the plugin."""
    fns = registered_functions()
    assert set(fns) == {"register", "aot_impl", "impl"}
    tensors, attrs = tensorrt_registers(fns["register"])
    assert tensors == list(trt_plugin.INPUTS) and attrs == {"scale": float, "window": int, "softcap": float,
                                                            "schema": int}
    tensorrt_accepts_impl(fns["impl"], tensors, attrs, Tensor, "stream")
    assert inspect.signature(fns["impl"]).return_annotation is None  # _validate_impl: None or none given
    tensorrt_accepts_impl(fns["aot_impl"], tensors, attrs, TensorDesc, "tactic")
    ret = typing.get_args(inspect.signature(fns["aot_impl"]).return_annotation)  # _validate_aot_impl's return rule
    assert len(ret) == 4 and all(set(typing.get_args(a)) == {str, bytes} for a in ret[:2])
    assert all(typing.get_origin(a) in (typing.Union, types.UnionType) for a in ret[:2])
    assert issubclass(ret[2], KernelLaunchParams) and issubclass(ret[3], SymExprs)


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
import triton
from triton.backends.compiler import GPUTarget
from kvedge.tensorrt import plugin as trt_plugin
seen = {}
compile_, trim = triton.compile, trt_plugin._trim_entry
def spy_compile(*a, **kw):
    seen["kernel"] = compile_(*a, **kw)
    return seen["kernel"]
def spy_trim(ptx, name, keep):
    seen["raw"] = ptx
    return trim(ptx, name, keep)
triton.compile, trt_plugin._trim_entry = spy_compile, spy_trim
name, ptx, threads, shared = trt_plugin.aot_compile(
    (None, 8, None, 80), (None, 2, 256, None), 20, "float16", "int64", "float16", 0.11, 16, 0.0,
    target=GPUTarget("cuda", 80, 32))
kernel = seen["kernel"]
scratch = [f for f in kernel.metadata._fields if f.endswith("_scratch_size")]
print(json.dumps(dict(name=name, ptx=ptx, threads=threads, shared=shared, raw=seen["raw"], ttgir=kernel.asm["ttgir"],
                      scratch=scratch)))
"""


def entry_params(ptx: str, name: str) -> list[tuple[str, str]]:
    """The PTX entry's parameters as (type, name): ".param .u64 .ptr .global .align 1 x" -> (".u64 .ptr", "x")."""
    entry = ptx[ptx.index(f".entry {name}("):]
    params = [p.split() for p in entry[len(f".entry {name}("):entry.index(")")].split(",") if p.strip()]
    assert all(p[0] == ".param" for p in params), params
    return [(" ".join(t for t in p[1:-1] if t in (".u64", ".u32", ".ptr")), p[-1]) for p in params]


def test_aot_compile_gives_ptx_with_the_arguments_tensorrt_passes_in_order():
    """Compiles for sm_80 on any machine (triton's own LLVM and ptxas), in a fresh process: under
    TRITON_INTERPRET=1 (how CI runs the kernel tests) triton.jit functions cannot be compiled.
    TensorRT launches an aot_impl kernel with the input tensors' pointers, then the extra args ("scalar inputs to
    the kernel, located after the tensor inputs and before the tensor outputs": NVIDIA/TensorRT
    tensorrt/plugin/_lib.py, aot_impl's docstring, from release/10.9), then the output tensors' pointers: here 8
    pointers, the int32 L, 3 pointers. aot_compile trims the entry to that count, so the count proves nothing: the
    types must fall in that order, the kernel's arguments must be these names in this order (triton's TTGIR keeps
    them), and what was trimmed must be only the scratch pointers triton appends (one per `*_scratch_size` field
    of its metadata), never read."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-c", AOT_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.splitlines()[-1])
    name, ptx, raw, threads = got["name"], got["ptx"], got["raw"], got["threads"]
    pointer, i32 = ".u64 .ptr", ".u32"
    kept = entry_params(ptx, name)
    assert [t for t, _ in kept] == [pointer] * 8 + [i32] + [pointer] * 3
    func = got["ttgir"][got["ttgir"].index(f"tt.func public @{name}("):]
    args = re.findall(r"%(\w+): (!tt\.ptr<\w+>|i32)", func[:func.index("{")])
    assert args == [("q", "!tt.ptr<f16>"), ("k", "!tt.ptr<f16>"), ("v", "!tt.ptr<f16>"), ("kc", "!tt.ptr<f16>"),
                    ("vc", "!tt.ptr<f16>"), ("positions", "!tt.ptr<i64>"), ("cos", "!tt.ptr<f16>"),
                    ("sin", "!tt.ptr<f16>"), ("L", "i32"), ("out", "!tt.ptr<f16>"), ("kc_out", "!tt.ptr<f16>"),
                    ("vc_out", "!tt.ptr<f16>")]
    full = entry_params(raw, name)
    assert full[:len(kept)] == kept and len(full) - len(kept) == len(got["scratch"]) > 0
    body = raw[raw.index(f".entry {name}("):]
    assert all(f"[{p}]" in body for _, p in kept)  # every kept argument is read: the kernel's own
    assert all(t == pointer and f"[{p}]" not in body for t, p in full[len(kept):])  # scratch, never read
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
    assert n.domain == "kvedge" and attrs["plugin_namespace"] == b"kvedge"
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
    assert not rep.buildable and any("needs TensorRT >= 10.6" in f.message for f in rep.findings)


def test_the_plugin_node_is_the_one_tensorrt_looks_up(exported):
    """Issue 17, item 2. TensorRT's ONNX parser finds a custom node's creator by (op type, `plugin_version`,
    `plugin_namespace`), plugin_version "1" by default (onnx-tensorrt onnxOpImporters.cpp, FallbackPluginImporter:
    attrs.get<std::string>("plugin_version", "1"); "Plugin not found" otherwise), and tensorrt.plugin registers
    every creator as version "1" (NVIDIA/TensorRT tensorrt/plugin/_lib.py, `plugin_version = "1"` and
    get_creator(name, "1", namespace), release/10.6 through release/11.1). kvedge's node schema is its `schema`
    attribute, which the parser hands to the plugin as a field (loadFields: one per registered attribute)."""
    from kvedge.artifact import PLUGIN_SCHEMA

    out, _ = exported("llama-gqa4-llama3rope", "trt")
    model = onnx.load(str(out / "model.onnx"))
    nodes = [n for n in model.graph.node if n.op_type == trt_plugin.NAME]
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert (n.domain, attrs["plugin_namespace"], attrs["plugin_version"]) == ("kvedge", b"kvedge", b"1")
        assert attrs["schema"] == PLUGIN_SCHEMA == 2
    assert check(out / "model.onnx", "10.15").buildable

    def edited(name, value, file):  # the first node's attribute changed, as an older export wrote it
        attr = next(a for a in nodes[0].attribute if a.name == name)
        old = onnx.helper.get_attribute_value(attr)
        attr.CopyFrom(onnx.helper.make_attribute(name, value))
        onnx.save(model, str(out / file))
        attr.CopyFrom(onnx.helper.make_attribute(name, old))
        return [f.message for f in check(out / file, "10.15").findings if f.blocking]

    assert any("plugin_version '2': TensorRT looks the plugin up as version '1'" in m
               for m in edited("plugin_version", "2", "v2.onnx"))
    assert any("is schema 1; this kvedge's plugin is schema 2" in m for m in edited("schema", 1, "schema1.onnx"))


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


def test_bfloat16_plugin_graphs_run_ahead_of_time_only(exported):
    """Issue 17, item 6. On the just-in-time path (10.6-10.8) kvedge's kernels get the plugin's tensors through
    trtp.Tensor.__cuda_array_interface__, which raises "Handling DataType.BF16 via '__cuda_array_interface__' is
    not supported" (NVIDIA/TensorRT python/packaging/bindings_wheel/tensorrt/plugin/_tensor.py, release/10.6
    through release/11.1); the ahead-of-time path (10.9+) hands TensorRT PTX and never builds a trtp.Tensor."""
    assert trt_plugin.refusals("10.8", "bfloat16") and not trt_plugin.refusals("10.9", "bfloat16")
    assert not trt_plugin.refusals("10.6", "float16")
    out, _ = exported("llama-gqa4-llama3rope", "trt", dtype="bf16")
    rep = check(out / "model.onnx", "10.8")
    assert not rep.buildable and any("cannot run bfloat16 on TensorRT 10.8" in f.message for f in rep.findings)
    assert check(out / "model.onnx", "10.9").buildable
