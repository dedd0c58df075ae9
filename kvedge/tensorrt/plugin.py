"""The kvedge fused-attention TensorRT plugin: `kvedge::gqa_attention` (plugin_version "1"), schema 2.

One node does what kvedge::cached_attention does: rotate q and k by the RoPE tables, write the new
K/V into the caches at each row's position and attend over them (kvedge's Triton kernels). Its two
cache outputs alias the cache inputs (TensorDesc.aliased()), so TensorRT updates the cache in place.

Inputs:  q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D], k_cache [B, Hkv, S, D], v_cache [B, Hkv, S, D],
         positions [B, L] int64 (or int32), cos [S_table, R], sin [S_table, R] (R = rotary_dim / 2;
         R = 0, e.g. [1, 0], for a model without RoPE: nothing is rotated and the tables are never read)
Outputs: out [B, Hq, L, D] (q's dtype), present_key (aliases k_cache), present_value (aliases v_cache)
Attributes: scale (float), window (int, 0 = none), softcap (float, 0 = none), schema (int: kvedge's version of
         this node; TensorRT's plugin_version is always "1" for a tensorrt.plugin creator)
Schema 1 had no cos/sin inputs (the lowering rotated q and k with plain ONNX ops before the node). Exports from
before the `schema` attribute wrote kvedge's schema as plugin_version "2", which no TensorRT finds: re-export.

Registration uses TensorRT's Python plugin API, `tensorrt.plugin` (quickly deployable plugins):
- TensorRT >= 10.9: ahead of time (`trtp.aot_impl`). At build time the fused one-launch Triton kernel
  (triton_attention._prefill with FUSED: cache write, RoPE and attention) is compiled to PTX for the
  node's dtypes and static sizes (heads, head_dim, cache length, rotary width; scale, window and
  softcap are compiled in, as AOT attributes are not serialized into the engine); TensorRT embeds the
  PTX and launches it itself, no Python at run time. Kernel arguments in the documented order: the
  input tensors, the extra scalar L (SymInt32), then the output tensors. Decode runs the same tiled
  kernel (no split-K: one kernel per plugin launch).
- TensorRT 10.6-10.8: just in time (`trtp.impl`): Python launches kvedge's kernels (cache-write,
  split-K decode, tiled prefill) on TensorRT's stream. Not for bfloat16: the JIT path hands the kernels
  `trtp.Tensor`s through `__cuda_array_interface__`, which refuses BF16 (tensorrt/plugin/_tensor.py, every
  release 10.6-11.1); `refusals()` says so and `kvedge check` (so `kvedge build`) refuses it.
No `from __future__ import annotations` here: tensorrt.plugin validates each registered function with
`inspect.signature(fn)` and `issubclass(param.annotation, TensorDesc)` (tensorrt/plugin/_validate.py, 10.6-11.1,
no eval_str), so the annotations must be the classes themselves, not strings.
The gating, the shape/dtype rules, the AOT kernel signature and launch grid are plain Python, tested
without TensorRT; the AOT compile itself needs only triton (it is tested on the CPU too).
"""

import re

from kvedge.artifact import PLUGIN_ID, PLUGIN_NAMESPACE, PLUGIN_OP, PLUGIN_SCHEMA, PLUGIN_VERSION, Sidecar
from kvedge.dtypes import GRAPH, TRITON
from kvedge.errors import KvedgeError
from kvedge.tensorrt.versions import parse_version

NAMESPACE, NAME, VERSION, SCHEMA = PLUGIN_NAMESPACE, PLUGIN_OP, PLUGIN_VERSION, PLUGIN_SCHEMA  # what `trt` writes
MIN_TENSORRT = (10, 6)  # tensorrt.plugin (trtp.register / trtp.impl) and the ONNX parser's QDP nodes (Changelog 10.6)
AOT_TENSORRT = (10, 9)  # trtp.aot_impl: "Ahead-of-Time Compilable Python Plugins" (TensorRT 10.9.0 release notes)
DTYPES = tuple(GRAPH.values())  # float32, float16, bfloat16
INPUTS = ("q", "k", "v", "k_cache", "v_cache", "positions", "cos", "sin")
ALIASES = {1: 3, 2: 4}  # output index -> the input index it aliases
NUM_WARPS = 4


def implementation(trt_version: str) -> str:
    """"aot" or "jit": which implementation register() gives TensorRT `trt_version`."""
    v = parse_version(trt_version)
    if v < MIN_TENSORRT:
        raise KvedgeError(f"the kvedge plugin needs TensorRT >= {MIN_TENSORRT[0]}.{MIN_TENSORRT[1]} "
                          f"(tensorrt.plugin), found {trt_version}")
    return "aot" if v >= AOT_TENSORRT else "jit"


def refusals(trt_version: str, dtype: str) -> list[str]:
    """Why TensorRT `trt_version` cannot run the plugin on `dtype` (graph element type) tensors; [] if it can."""
    if parse_version(trt_version) < MIN_TENSORRT:
        return [f"needs TensorRT >= {MIN_TENSORRT[0]}.{MIN_TENSORRT[1]} (tensorrt.plugin)"]
    if dtype == "bfloat16" and implementation(trt_version) == "jit":
        return [f"cannot run bfloat16 on TensorRT {trt_version}: its just-in-time path passes tensors through "
                f"__cuda_array_interface__, which tensorrt.plugin refuses for BF16; TensorRT >= "
                f"{AOT_TENSORRT[0]}.{AOT_TENSORRT[1]} runs it ahead of time, or export with --dtype fp16"]
    return []


def output_shapes(q, k, v, k_cache, v_cache, positions, cos, sin) -> list[tuple]:
    """Shapes of (out, present_key, present_value); raises ValueError on inconsistent inputs."""
    if not all(len(s) == 4 for s in (q, k, v, k_cache, v_cache)) or not all(len(s) == 2 for s in (positions, cos, sin)):
        raise ValueError("q, k, v and the caches must be rank 4, positions and the RoPE tables rank 2")
    b, hq, l, d = q
    if k != v or k[0] != b or k[2] != l or k[3] != d:
        raise ValueError(f"k {k} and v {v} must be [B, Hkv, L, D] matching q {q}")
    if k_cache != v_cache or k_cache[0] != b or k_cache[1] != k[1] or k_cache[3] != d:
        raise ValueError(f"caches {k_cache}, {v_cache} must be [B, Hkv, S, D] matching k {k}")
    if hq % k[1]:
        raise ValueError(f"{hq} query heads are not a multiple of {k[1]} KV heads")
    if d > 256:
        raise ValueError(f"head_dim {d} > 256 is not supported by the kernels")
    if tuple(positions) != (b, l):
        raise ValueError(f"positions {positions} must be [B, L] = {(b, l)}")
    if cos != sin or 2 * cos[1] > d:
        raise ValueError(f"RoPE tables cos {cos}, sin {sin} must be one [S_table, rotary_dim / 2] shape "
                         f"with rotary_dim <= head_dim {d}")
    return [tuple(q), tuple(k_cache), tuple(v_cache)]


def output_dtypes(q, k, v, k_cache, v_cache, positions, cos, sin) -> list[str]:
    if q not in DTYPES or len({q, k, v, k_cache, v_cache}) != 1:
        raise ValueError(f"q, k, v and the caches must share one of {DTYPES}; got {q}, {k}, {v}, {k_cache}, {v_cache}")
    if positions not in ("int64", "int32"):
        raise ValueError(f"positions must be int32 or int64, got {positions}")
    if cos not in DTYPES or sin != cos:
        raise ValueError(f"the RoPE tables must share one of {DTYPES}; got {cos}, {sin}")
    return [q, k_cache, v_cache]


def aot_signature(dtype: str, positions: str, tables: str) -> dict[str, str]:
    """The AOT kernel's runtime parameters with their Triton types, in launch order: the plugin's
    inputs, the scalar L, then its outputs (out, present_key, present_value)."""
    t, p, c = TRITON[dtype], TRITON[positions], TRITON[tables]
    return {"q": f"*{t}", "k": f"*{t}", "v": f"*{t}", "kc": f"*{t}", "vc": f"*{t}", "positions": f"*{p}",
            "cos": f"*{c}", "sin": f"*{c}", "L": "i32", "out": f"*{t}", "kc_out": f"*{t}", "vc_out": f"*{t}"}


def aot_grid(batch, q_heads: int, length):
    """(grid_x, grid_y, grid_z) of the AOT kernel; batch and length may be TensorRT shape expressions."""
    from kvedge.kernels.triton_attention import PREFILL_BLOCKS

    bm = PREFILL_BLOCKS["BLOCK_M"]
    return batch, q_heads, (length + (bm - 1)) // bm


def _trim_entry(ptx: str, name: str, keep: int) -> str:
    """Drop the entry parameters past the first `keep` (Triton >= 3.3 appends global/profile scratch
    pointers that TensorRT does not pass); refuses if the kernel body reads one of them."""
    head, sep, rest = ptx.partition(f".entry {name}(")
    params, close, body = rest.partition(")")
    lines = [x for x in params.split(",") if x.strip()]
    for extra in lines[keep:]:
        pname = extra.split()[-1]
        if re.search(rf"\[{re.escape(pname)}\]", body):
            raise KvedgeError(f"the AOT kernel {name} reads its scratch parameter {pname}: TensorRT cannot pass it")
    return head + sep + ",".join(lines[:keep]) + "\n" + close + body


def aot_compile(q_shape, k_cache_shape, rotary_half: int, dtype: str, positions: str, tables: str,
                scale: float, window: int, softcap: float, target=None) -> tuple[str, str, int, int]:
    """Compile the fused kernel to PTX for these static sizes: (kernel name, PTX, threads per block,
    shared memory bytes). q_shape's batch and length may be anything (they stay runtime values);
    target: a triton GPUTarget, the current device's by default."""
    import triton

    from kvedge.kernels import triton_attention as tk

    _, hq, _, d = q_shape
    _, hkv, s_max, _ = k_cache_shape
    signature = aot_signature(dtype, positions, tables)
    consts = tk.constexprs(scale, window, softcap, hq, hkv, s_max, d, rotary_half, fused=True)
    src = triton.compiler.ASTSource(tk._prefill, {**signature, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    kernel = triton.compile(src, target=target, options={"num_warps": NUM_WARPS})
    meta = kernel.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise KvedgeError(f"the AOT kernel {meta.name} needs scratch memory, which TensorRT does not provide")
    ptx = _trim_entry(kernel.asm["ptx"], meta.name, len(signature))
    return meta.name, ptx, meta.num_warps * 32, meta.shared


_registered: str | None = None


def register() -> str:
    """Register the plugin with TensorRT (call before building or deserializing an engine that uses it).
    Returns the implementation registered: "aot" or "jit" (see implementation())."""
    global _registered
    if _registered:
        return _registered
    import tensorrt as trt
    import tensorrt.plugin as trtp

    mode = implementation(trt.__version__)
    names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16", trt.int32: "int32",
             trt.int64: "int64"}

    @trtp.register(PLUGIN_ID)
    def _desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_cache: trtp.TensorDesc,
              v_cache: trtp.TensorDesc, positions: trtp.TensorDesc, cos: trtp.TensorDesc, sin: trtp.TensorDesc,
              scale: float, window: int, softcap: float, schema: int
              ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        if schema != PLUGIN_SCHEMA:
            raise ValueError(f"a {PLUGIN_ID} node of schema {schema}; this kvedge's plugin is schema {PLUGIN_SCHEMA}: "
                             "re-export with --attention trt")
        output_dtypes(*(names.get(t.dtype, str(t.dtype)) for t in (q, k, v, k_cache, v_cache, positions, cos, sin)))
        return q.like(), k_cache.aliased(), v_cache.aliased()

    if mode == "aot":
        def static(desc, i):
            e = desc.shape_expr[i]
            if not e.is_constant:
                raise KvedgeError(f"the kvedge plugin's AOT kernel needs axis {i} of {list(desc.shape_expr)} "
                                  "static (heads, head_dim, max_seq_len and the RoPE width are)")
            return e.constant_value()

        @trtp.aot_impl(PLUGIN_ID)
        def _aot(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                 v_cache: trtp.TensorDesc, positions: trtp.TensorDesc, cos: trtp.TensorDesc, sin: trtp.TensorDesc,
                 scale: float, window: int, softcap: float, outputs: tuple[trtp.TensorDesc], tactic: int
                 ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymExprs]:
            hq = static(q, 1)
            name, ptx, threads, shared = aot_compile(
                (None, hq, None, static(q, 3)), (None, static(k_cache, 1), static(k_cache, 2), None),
                static(cos, 1), names[q.dtype], names[positions.dtype], names[cos.dtype], scale, window, softcap)
            launch = trtp.KernelLaunchParams()
            launch.grid_x, launch.grid_y, launch.grid_z = aot_grid(q.shape_expr[0], hq, q.shape_expr[2])
            launch.block_x, launch.shared_mem = threads, shared
            extra = trtp.SymIntExprs(1)
            extra[0] = trtp.SymInt32(q.shape_expr[2])  # L, between the input and the output pointers
            return name, ptx, launch, extra
    else:
        import torch

        @trtp.impl(PLUGIN_ID)
        def _impl(q: trtp.Tensor, k: trtp.Tensor, v: trtp.Tensor, k_cache: trtp.Tensor, v_cache: trtp.Tensor,
                  positions: trtp.Tensor, cos: trtp.Tensor, sin: trtp.Tensor, scale: float, window: int,
                  softcap: float, outputs: tuple[trtp.Tensor], stream: int) -> None:
            from kvedge.kernels import triton_attention as tk

            t = [torch.as_tensor(x, device="cuda") for x in (q, k, v, k_cache, v_cache, positions)]
            rope = None if cos.shape[1] == 0 else (torch.as_tensor(cos, device="cuda"),
                                                   torch.as_tensor(sin, device="cuda"))
            out = torch.as_tensor(outputs[0], device="cuda")
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                out.copy_(tk.attention(*t[:5], t[5].long(), scale=scale, window=window or None,
                                       softcap=softcap or None, rope=rope))
    _registered = mode
    return mode


def register_plugins(sc: Sidecar) -> None:
    """Register every plugin the export's graph names (its sidecar's "plugins") before TensorRT parses or
    deserializes it; refuses one kvedge does not provide."""
    for op in sc.plugins:
        if op != PLUGIN_ID:
            raise KvedgeError(f"the export needs the TensorRT plugin {op!r}, which kvedge does not provide")
        register()
