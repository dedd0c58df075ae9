"""The backend registry: every backend that `kvedge.load`, the CLI (choices and dispatch), `kvedge bench`,
`kvedge parity` and `kvedge doctor` know, in one table.

Adding a backend (docs/adding-a-backend.md): a module with a class implementing
kvedge.runtime.backend.Backend and a function `open_backend(path, options, export=None)`, one
`BackendInfo` line in BACKENDS below, and its tests. Nothing else names backends.

A backend's module is imported only when it is opened, so `import kvedge.runtime` stays light (the
TensorRT backend lives in kvedge.tensorrt and is reached through its module path).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvedge.artifact import SIDECAR
from kvedge.errors import KvedgeError
from kvedge.runtime.backend import Backend


@dataclass(frozen=True)
class LoadOptions:
    """What a caller may ask of any backend; each takes the fields that apply to it."""

    max_batch: int | None = None  # None: the backend's default (the export's max_batch, torch 4, native 1)
    max_seq_len: int = 2048  # checkpoint backends' cache length (an export's is fixed at export)
    threads: int = 0  # 0: the runtime's choice
    providers: list[str] | None = None  # onnxruntime execution providers
    device: str | None = None  # torch device
    dtype: str | None = None  # torch: the model's dtype (default: the checkpoint's)
    quantize: str | None = "int4"  # native: int4, int8 or None (float32)
    kv_dtype: str | None = None  # checkpoint backends: "fp16" (under a float32 model) or "int8" caches
    fused_attention: bool = True  # torch on CUDA: the Triton kernels if installed; False keeps the reference op
    activations: str = "int8"  # native: a quantized projection's input, int8 (fast) or int16 (torch's figures)


@dataclass(frozen=True)
class BackendInfo:
    name: str
    module: str  # defines open_backend(path, options, export=None)
    reads: str  # "export" (a kvedge export folder) or "checkpoint" (a Hugging Face checkpoint folder)
    feature: str  # doctor's feature line
    needs: str  # doctor: what makes it available where it is not
    available: Callable[[dict], bool]  # doctor: from kvedge.doctor.facts()

    def open(self, path: str | Path, options: LoadOptions = LoadOptions(), export: Path | None = None) -> Backend:
        """Open the backend on `path` (what it reads). export: an export folder a checkpoint backend should
        match (the native engine quantizes as that export was), for `kvedge bench` and `kvedge parity`."""
        path = Path(path)
        if not path.exists():  # said as such, not as "the torch backend needs a checkpoint"
            raise KvedgeError(f"no such file or directory: {path}")
        if options.kv_dtype is not None and self.reads == "export":
            raise KvedgeError(f"kv_dtype {options.kv_dtype!r}: an export's cache dtype is fixed when it is exported "
                              f"(kvedge export --kv-dtype); the torch and native backends take one here")
        if self.reads == "export" and not (path / SIDECAR).is_file():
            hint = " (this is a checkpoint: run `kvedge export` first, or use backend='torch')" \
                if (path / "config.json").is_file() else ""
            raise KvedgeError(f"{path}: no {SIDECAR}; the {self.name} backend runs an export folder{hint}")
        return importlib.import_module(self.module).open_backend(path, options, export)


BACKENDS: dict[str, BackendInfo] = {b.name: b for b in (
    BackendInfo("onnxruntime", "kvedge.runtime.ort_backend", "export", "onnxruntime backend (CPU)",
                "pip install onnxruntime", lambda f: "CPUExecutionProvider" in f["onnxruntime_providers"]),
    BackendInfo("torch", "kvedge.runtime.torch_backend", "checkpoint", "torch backend (CUDA)",
                "an NVIDIA GPU and a CUDA build of torch", lambda f: f["cuda_available"]),
    BackendInfo("tensorrt", "kvedge.tensorrt.backend", "export", "TensorRT engines",
                "TensorRT's Python bindings and a GPU (JetPack ships them on a Jetson); kvedge's TensorRT build "
                "and backend are written but have not run on TensorRT yet",
                lambda f: bool(f["tensorrt"]) and f["cuda_available"]),
    BackendInfo("native", "kvedge.runtime.native_backend", "checkpoint", "native backend (CPU, kvedge's C engine)",
                "a C compiler with OpenMP on PATH (cc / gcc, or set CC): e.g. apt install gcc",
                lambda f: bool(f["c_compiler"])),
)}


def get(name: str) -> BackendInfo:
    try:
        return BACKENDS[name]
    except KeyError:
        raise KvedgeError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}") from None


def for_path(path: str | Path) -> BackendInfo:
    """backend="auto": onnxruntime for an export folder, torch for a checkpoint."""
    return BACKENDS["onnxruntime" if (Path(path) / SIDECAR).is_file() else "torch"]
