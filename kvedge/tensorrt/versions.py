"""Which TensorRT path a version takes: pure Python, tested in CI without TensorRT.

kvedge.tensorrt.build and kvedge.tensorrt.backend are the thin layers that hand these choices to TensorRT.

Version gating (sources: the TensorRT docs for each release):
- >= 10.15: the ONNX parser maps `Attention` to TensorRT's fused attention layer and `TensorScatter`
  to IKVCacheUpdateLayer, whose output "must be a network output and shares the same device memory
  address with the cache input" (TensorRT operators reference, KVCacheUpdate). -> lowering `onnx`,
  caches updated in place: present aliases past.
- 8.6 - 10.14 (JetPack 5: 8.5/8.6; JetPack 6: 8.6 / 10.3): no attention layer, no in-place cache
  update; a network output never aliases an input. -> lowering `decomposed` (opset 17); present is a
  second buffer and the runtime swaps past/present each step (double buffering, never a per-step
  allocation). The graph's ScatterElements writes the whole cache into present.
- 11.x: strongly typed networks only: precision comes from the graph's dtypes (export with --dtype),
  the FP16/BF16 builder flags are gone; the v3 execution API (set_tensor_address / execute_async_v3)
  and name-based I/O, as in 10.x.

API facts per release, from NVIDIA/TensorRT's own sources (release/X.Y branches):
- BuilderFlag.BF16: absent from 8.6 (include/NvInfer.h, python/src/infer/pyCore.cpp), present from 9.0.
- Shared device memory (pyCore.cpp): 8.6 create_execution_context_without_device_memory + the write-only
  `device_memory` property; 10.0 create_execution_context(USER_MANAGED) + `device_memory`; from 10.1
  set_device_memory(ptr, size) and device_memory_size_v2 (11.0 drops the older calls).
- PreviewFeature.ALIASED_PLUGIN_IO_10_03 (from 10.3): a plugin's aliased outputs "will only be called and have an
  effect when PreviewFeature::kALIASED_PLUGIN_IO_10_03 is turned on" (include/NvInferRuntime.h,
  IPluginV3OneBuildV2::getAliasedInput; NVIDIA's samples/python/quickly_deployable_plugins/qdp_runner.py sets it).
- INT64 graph inputs are INT32 engine tensors on 8.6, whose DataType has no INT64 (NvInferRuntimeBase.h); the
  parser keeps INT64 from 9.0 (onnx-tensorrt docs/Changelog.md, 9.0 EA: "ONNX models with INT64 I/O require INT64
  bindings. Note that prior to this release, such models required INT32 bindings").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvedge.errors import KvedgeError

NATIVE_ATTENTION = (10, 15)
MIN_SUPPORTED = (8, 6)
INT4 = (10, 0)  # INT4 DequantizeLinear (onnx-tensorrt docs/operators.md 10.0: "DequantizeLinear | Y | INT8, FP8, INT4")
INT4_BLOCKS = (128, 64)  # NVIDIA's documented INT4 block sizes, the preferred first (Model-Optimizer's default 128)


def parse_version(v: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in v.split(".")[:2])
    except ValueError:
        raise KvedgeError(f"TensorRT version {v!r}: expected MAJOR.MINOR such as 10.3") from None
    return major, minor


@dataclass(frozen=True)
class TrtPath:
    version: tuple[int, int]
    lowering: str  # the export lowering this TensorRT wants
    in_place_cache: bool  # present aliases past (else: double buffers swapped by the runtime)
    strongly_typed: bool  # precision from the graph; no FP16/BF16 builder flags
    precision_flags: bool  # BuilderFlag.FP16 / BF16 exist and apply
    progress_monitor: bool  # trt.IProgressMonitor exists (10.0+)
    explicit_batch_flag: bool  # NetworkDefinitionCreationFlag.EXPLICIT_BATCH must be passed (8.x)
    # how contexts share one device-memory block: "v2" (>= 10.1: USER_MANAGED, set_device_memory(ptr, size),
    # *_v2 sizes), "property" (10.0: USER_MANAGED, context.device_memory = ptr) or "legacy" (8.x:
    # create_execution_context_without_device_memory, context.device_memory = ptr)
    user_managed_memory: str
    bf16_flag: bool  # BuilderFlag.BF16 exists (9.0+; not in 8.6)
    aliased_plugin_io: bool  # PreviewFeature.ALIASED_PLUGIN_IO_10_03 exists (10.3+)
    index_dtype: str  # the engine's dtype of the int64 graph inputs (ids, positions): int32 on 8.x


def select_path(version: str) -> TrtPath:
    v = parse_version(version)
    if v < MIN_SUPPORTED:
        raise KvedgeError(f"TensorRT {version} is older than kvedge supports ({MIN_SUPPORTED[0]}.{MIN_SUPPORTED[1]})")
    native = v >= NATIVE_ATTENTION
    return TrtPath(
        version=v,
        lowering="onnx" if native else "decomposed",
        in_place_cache=native,
        strongly_typed=v[0] >= 11,
        precision_flags=v[0] < 11,
        progress_monitor=v[0] >= 10,
        explicit_batch_flag=v[0] < 10,
        user_managed_memory="v2" if v >= (10, 1) else "property" if v[0] >= 10 else "legacy",
        bf16_flag=v >= (9, 0),
        aliased_plugin_io=v >= (10, 3),
        index_dtype="int64" if v >= (9, 0) else "int32",
    )


def builder_settings(path: TrtPath, precision: str, export_dtype: str, plugins: bool,
                     quantized_weights: bool = False) -> dict:
    """The BuilderFlag and PreviewFeature names `kvedge build` sets and whether the network is strongly typed, or a
    KvedgeError saying why this TensorRT cannot build `precision` ("fp32" | "fp16" | "bf16") for an export of
    `export_dtype`. Quantized weights (DequantizeLinear) build strongly typed from 10.0, whose
    NetworkDefinitionCreationFlag has kSTRONGLY_TYPED (NVIDIA/TensorRT include/NvInfer.h, release/10.0): "Use
    explicit quantization with Strong Typing. Precision-control build flags are not required and should not be
    specified" (TensorRT docs, Explicit Quantization)."""
    version = ".".join(map(str, path.version))
    strongly_typed = path.strongly_typed or (quantized_weights and path.version >= INT4)
    if strongly_typed:
        if precision != export_dtype:
            why = "builds strongly typed networks" if path.strongly_typed else \
                "builds quantized weights as a strongly typed network"
            raise KvedgeError(f"TensorRT {version} {why}: precision comes from the graph ({export_dtype}); "
                              f"re-export with --dtype {precision}, or build with --precision {export_dtype}")
        flags = []
    elif precision == "bf16" and not path.bf16_flag:
        raise KvedgeError(f"--precision bf16: TensorRT {version} has no BuilderFlag.BF16 (it arrived in 9.0); "
                          "build with --precision fp16 or fp32")
    else:
        flags = {"fp16": ["FP16"], "bf16": ["BF16"]}.get(precision, [])
    if plugins and not path.aliased_plugin_io:
        raise KvedgeError(f"TensorRT {version} has no PreviewFeature.ALIASED_PLUGIN_IO_10_03, which the plugin's "
                          "in-place cache outputs need")
    # without the preview feature TensorRT ignores TensorDesc.aliased(): the plugin would write a cache it never reads
    return {"flags": flags, "preview_features": ["ALIASED_PLUGIN_IO_10_03"] if plugins else [],
            "strongly_typed": strongly_typed}


def export_recipe(version: str, quantize: str | None, in_features: set[int], attention: str | None = None) -> dict:
    """The `kvedge export` options whose graph TensorRT `version` builds: the attention lowering (`attention`, if
    given, is kept unless no TensorRT builds it) and the weight form: INT4 blocks of 128 (64 where a linear's input
    size is no multiple of 128) from 10.0, per-channel INT8 on every release (blocked INT8 builds on none), both
    symmetric; `requantize` for a model that came quantized in another form (a GGUF file's 8-bit blocks). Raises
    KvedgeError with the reason where nothing builds."""
    path = select_path(version)
    attention = attention or path.lowering
    if attention == "ort":
        raise KvedgeError(f"--attention ort writes ONNX Runtime's contrib ops (GroupQueryAttention, MatMulNBits), "
                          f"which no TensorRT builds: leave --attention out for TensorRT {version}'s "
                          f"{path.lowering!r}")
    if attention == "onnx" and path.version < NATIVE_ATTENTION:
        raise KvedgeError(f"--attention onnx needs TensorRT >= 10.15 (Attention, TensorScatter); TensorRT {version} "
                          "builds --attention decomposed")
    int4 = path.version >= INT4
    if quantize == "int4" and not int4:
        raise KvedgeError(f"--quantize int4: TensorRT {version} has no INT4 weights (from 10.0); use --quantize "
                          "int8 (per channel), which it builds")
    scheme = quantize or ("int4" if int4 else "int8")
    group = 0  # per channel
    if scheme == "int4":
        group = next((b for b in INT4_BLOCKS if all(k % b == 0 for k in in_features)), None)
        if group is None:
            raise KvedgeError(f"no INT4 block size TensorRT documents ({' or '.join(map(str, INT4_BLOCKS))}) divides "
                              f"every linear's input size ({', '.join(map(str, sorted(in_features)))}); use "
                              "--quantize int8")
    recipe = {"attention": attention, "group_size": group, "symmetric": True}
    return {**recipe, "quantize": quantize} if quantize else {**recipe, "requantize": scheme}
