"""`kvedge doctor`: what this machine has, and which kvedge features it can run (and what to install)."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys


def _version(module: str, dist: str | None = None) -> str | None:
    try:
        importlib.import_module(module)
    except Exception:
        return None
    try:
        return importlib.metadata.version(dist or module)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules[module], "__version__", "installed")


def facts() -> dict:
    from kvedge.jetson import detect

    f: dict = {"python": platform.python_version(), "platform": f"{platform.system()} {platform.machine()}"}
    f["kvedge"] = importlib.import_module("kvedge").__version__
    f["torch"] = _version("torch")
    f["cuda_available"] = False
    f["gpu"] = None
    if f["torch"]:
        import torch

        f["cuda_available"] = torch.cuda.is_available()
        f["torch_cuda"] = torch.version.cuda
        if f["cuda_available"]:
            p = torch.cuda.get_device_properties(0)
            f["gpu"] = {"name": p.name, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}"}
    f["onnx"] = _version("onnx")
    f["onnxruntime"] = _version("onnxruntime") or _version("onnxruntime", "onnxruntime-gpu")
    f["onnxruntime_providers"] = []
    if f["onnxruntime"]:
        import onnxruntime

        f["onnxruntime_providers"] = onnxruntime.get_available_providers()
    f["tensorrt"] = _version("tensorrt")
    f["pycuda"] = _version("pycuda")
    f["cuda_python"] = _version("cuda", "cuda-python") if _version("cuda.bindings") is None else \
        _version("cuda.bindings", "cuda-bindings")
    f["triton"] = _version("triton")
    f["tokenizers"] = _version("tokenizers")
    f["jinja2"] = _version("jinja2")
    f["matplotlib"] = _version("matplotlib")
    f["jetson"] = detect().to_dict()
    f["c_compiler"] = None  # the native backend compiles its C engine with it at first use (it needs torch)
    if f["torch"]:
        from kvedge.runtime.native_backend import KERNELS, c_compiler, expected_kernels

        f["c_compiler"] = c_compiler()
        f["native_kernels"] = KERNELS[expected_kernels()]  # what -march=native builds, from the CPU's features
    return f


def features(f: dict) -> list[dict]:
    """Each kvedge feature: available here or not, and what would make it so."""
    gpu = f["cuda_available"]
    jet = f["jetson"]["is_jetson"]

    def row(name, ok, fix):
        return {"feature": name, "available": bool(ok), "needs": None if ok else fix}

    from kvedge.runtime.backends import BACKENDS

    return [
        row("export to ONNX", f["torch"] and f["onnx"], "pip install torch onnx"),
        *(row(b.feature, b.available(f), b.needs) for b in BACKENDS.values()),
        row("onnxruntime backend (CUDA)", "CUDAExecutionProvider" in f["onnxruntime_providers"] and gpu,
            "an NVIDIA GPU and onnxruntime-gpu (on a Jetson: the wheel built for its JetPack)"),
        row("Triton fused attention", f["triton"] and gpu,  # installed, it still runs only on a GPU
            "a CUDA GPU (triton is installed)" if f["triton"] else "pip install triton, and a CUDA GPU"),
        row("text prompts", f["tokenizers"], "pip install tokenizers"),
        row("chat templates", f["jinja2"], "pip install jinja2"),
        row("bench plots", f["matplotlib"], "pip install 'kvedge[bench]'"),
        row("Jetson telemetry (tegrastats, nvpmodel)", jet, "a Jetson running JetPack"),
    ]


def table(f: dict) -> str:
    lines = ["environment:"]
    for k in ("kvedge", "python", "platform", "torch", "cuda_available", "onnx", "onnxruntime", "tensorrt", "pycuda",
              "cuda_python", "triton", "tokenizers", "jinja2", "matplotlib", "c_compiler", "native_kernels"):
        v = f.get(k)
        lines.append(f"  {k:<22} {'not installed' if v is None else v}")
    lines.append(f"  {'onnxruntime providers':<22} {', '.join(f['onnxruntime_providers']) or 'none'}")
    g = f["gpu"]
    lines.append(f"  {'gpu':<22} " + (f"{g['name']}, {g['memory_bytes'] / 2**30:.1f} GiB, sm {g['capability']}"
                                     if g else "none (torch sees no CUDA GPU)"))
    j = f["jetson"]
    lines.append(f"  {'jetson':<22} " + (
        f"{j['module']} ({j['model']}), L4T {j['l4t']}, JetPack {j['jetpack']} (CUDA {j['cuda']}, TensorRT "
        f"{j['tensorrt']}), power mode {j['power_mode']}, clocks pinned: {j['clocks_pinned']}"
        if j["is_jetson"] else "not a Jetson"))
    lines.append("features:")
    for r in features(f):
        lines.append(f"  [{'x' if r['available'] else ' '}] {r['feature']:<42}" + ("" if r["available"] else
                                                                                  f" needs: {r['needs']}"))
    return "\n".join(lines)
