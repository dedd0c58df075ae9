"""`kvedge build`: an export folder -> model.engine, with TensorRT's Python API. Needs TensorRT and a GPU.

Thin by design: the version gate, the profiles and the pre-flight come from kvedge.tensorrt.versions,
buffers and check (tested in CI); this module only makes the TensorRT calls, per the documented API:
- Builder / OnnxParser.parse_from_file (external data resolved next to the file);
- 8.x: create_network(1 << EXPLICIT_BATCH); 10.x: create_network(0), STRONGLY_TYPED for quantized weights;
  11.x: STRONGLY_TYPED;
- BuilderConfig.set_memory_pool_limit(MemoryPoolType.WORKSPACE, ...), builder_optimization_level,
  set_flag / set_preview_feature as kvedge.tensorrt.versions.builder_settings says (BuilderFlag.FP16 / BF16
  only before 11, BF16 not on 8.6; PreviewFeature.ALIASED_PLUGIN_IO_10_03 for a plugin graph);
- create_optimization_profile().set_shape(name, min, opt, max), two profiles (prefill, decode);
- create_timing_cache / set_timing_cache / get_timing_cache().serialize();
- build_serialized_network; IProgressMonitor (10.0+) for progress.
NOT YET RUN on real TensorRT: no machine kvedge has been developed on has TensorRT.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from kvedge.artifact import Sidecar
from kvedge.errors import KvedgeError, require
from kvedge.tensorrt.buffers import in_place_cache, profiles
from kvedge.tensorrt.check import check
from kvedge.tensorrt.plugin import register_plugins
from kvedge.tensorrt.versions import TrtPath, builder_settings, select_path


def _progress_monitor(trt, say):
    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            say(f"  {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            pass

    return Monitor()


def build(export_dir: str | Path, precision: str = "fp16", max_batch: int | None = None,
          max_prefill_len: int | None = None, workspace_gb: float = 4.0, timing_cache: str | Path | None = None,
          opt_level: int = 3, progress: Callable[[str], None] | None = None) -> dict:
    trt = require("tensorrt", "tensorrt", "kvedge build")
    say = progress or (lambda m: None)
    export_dir = Path(export_dir)
    sc = Sidecar.read(export_dir)
    path: TrtPath = select_path(trt.__version__)
    # the pre-flight is the one gate: `kvedge check` says what builds (a decomposed graph builds on 10.15+ too,
    # double-buffered; Attention / TensorScatter need 10.15; ONNX Runtime's contrib ops build nowhere)
    pre = check(export_dir / sc.onnx_file, ".".join(map(str, path.version)))
    if not pre.buildable:
        raise KvedgeError("kvedge check found blocking issues:\n" + "\n".join(f"  - {f.message}" for f in pre.findings))
    settings = builder_settings(path, precision, sc.dtype, bool(sc.plugins),
                                quantized_weights=bool(sc.extra.get("quantization")))

    register_plugins(sc)  # a plugin must be in TensorRT's registry before the parser meets its node
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if path.explicit_batch_flag:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    if settings["strongly_typed"]:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    say(f"parsing {export_dir / sc.onnx_file}")
    if not parser.parse_from_file(str(export_dir / sc.onnx_file)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise KvedgeError("TensorRT's ONNX parser failed:\n" + "\n".join(f"  - {e}" for e in errors))

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * 2**30))
    config.builder_optimization_level = opt_level
    for flag in settings["flags"]:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    for feature in settings["preview_features"]:
        config.set_preview_feature(getattr(trt.PreviewFeature, feature), True)
    for prof in profiles(sc, max_batch, max_prefill_len):
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in prof.shapes.items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
    cache_bytes = Path(timing_cache).read_bytes() if timing_cache and Path(timing_cache).is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    if path.progress_monitor:
        config.progress_monitor = _progress_monitor(trt, say)

    say(f"building (TensorRT {trt.__version__}, {precision}, profiles prefill + decode)")
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise KvedgeError("TensorRT failed to build the engine (see its log above)")
    seconds = time.perf_counter() - t0
    engine_path = export_dir / "model.engine"
    tmp = engine_path.with_suffix(".engine.partial")
    tmp.write_bytes(bytes(serialized))
    os.replace(tmp, engine_path)
    if timing_cache:
        Path(timing_cache).write_bytes(bytes(config.get_timing_cache().serialize()))

    engine = trt.Runtime(logger).deserialize_cuda_engine(bytes(serialized))
    per_profile = {}
    for i, prof in enumerate(("prefill", "decode")):  # per-profile sizes from 10.0, their _v2 from 10.1
        if path.user_managed_memory == "v2":
            per_profile[prof] = int(engine.get_device_memory_size_for_profile_v2(i))
        elif path.user_managed_memory == "property":
            per_profile[prof] = int(engine.get_device_memory_size_for_profile(i))
        else:
            per_profile[prof] = int(engine.device_memory_size)
    report = {"tensorrt": trt.__version__, "precision": precision, "seconds": round(seconds, 1),
              "engine_bytes": engine_path.stat().st_size, "device_memory_bytes_per_profile": per_profile,
              "in_place_cache": in_place_cache(sc, path), "lowering": sc.lowering}
    sc.extra["engine"] = report
    sc.write(export_dir)
    return report
