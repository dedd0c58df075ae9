"""Running models: backends (torch, onnxruntime) behind one protocol, sessions and generation."""

from __future__ import annotations

from pathlib import Path

from kvedge.errors import KvedgeError
from kvedge.runtime.backend import Backend
from kvedge.runtime.sampling import SamplingParams
from kvedge.runtime.session import GenerationResult, Session

BACKENDS = ("onnxruntime", "torch", "tensorrt", "native")


def load(path: str | Path, backend: str = "auto", *, max_batch: int | None = None, max_seq_len: int = 2048,
         threads: int = 0, providers: list[str] | None = None, device: str | None = None,
         dtype: str | None = None, chunk_size: int = 512, quantize: str | None = "int4",
         kv_dtype: str | None = None) -> Session:
    """Open a session. `path` is an export folder (kvedge.json; backend onnxruntime) or a Hugging Face
    checkpoint (config.json; backend torch, or native). backend="auto" picks by what the folder holds.
    quantize: the native backend's weights (int4, int8, or None for float32; see NativeBackend).
    kv_dtype: "int8" for an int8 cache calibrated on the built-in text (torch and native backends; an
    export's cache dtype is fixed at export)."""
    from kvedge.export.contract import SIDECAR
    from kvedge.runtime.tokenizer import Tokenizer

    path = Path(path)
    if backend == "auto":
        backend = "onnxruntime" if (path / SIDECAR).is_file() else "torch"
    if kv_dtype is not None and backend in ("onnxruntime", "tensorrt"):
        raise KvedgeError(f"kv_dtype {kv_dtype!r}: an export's cache dtype is fixed when it is exported "
                          f"(kvedge export --kv-dtype); the torch and native backends take one here")
    if backend == "onnxruntime":
        if not (path / SIDECAR).is_file():
            hint = " (this is a checkpoint: run `kvedge export` first, or use backend='torch')" \
                if (path / "config.json").is_file() else ""
            raise KvedgeError(f"{path}: no {SIDECAR}; the onnxruntime backend runs an export folder{hint}")
        from kvedge.runtime.ort_backend import OrtBackend

        be: Backend = OrtBackend(path, providers=providers, threads=threads, max_batch=max_batch)
    elif backend == "tensorrt":
        from kvedge.runtime.trt_backend import TrtBackend

        be = TrtBackend(path)
    elif backend == "native":
        from kvedge.runtime.native_backend import NativeBackend

        be = NativeBackend(path, max_batch=max_batch or 1, max_seq_len=max_seq_len, threads=threads, quantize=quantize,
                           kv_dtype=kv_dtype)
    elif backend == "torch":
        from kvedge.runtime.torch_backend import TorchBackend

        be = TorchBackend(path, max_batch=max_batch or 4, max_seq_len=max_seq_len, dtype=dtype, device=device,
                          threads=threads, kv_dtype=kv_dtype)
    else:
        raise KvedgeError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    tokenizer = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
    return Session(be, tokenizer, chunk_size=chunk_size)


__all__ = ["BACKENDS", "Backend", "GenerationResult", "SamplingParams", "Session", "load"]
