"""Running models: backends behind one protocol (the registry: kvedge.runtime.backends), sessions and
generation. Never imports kvedge.export or kvedge.tensorrt (docs/design.md)."""

from __future__ import annotations

from pathlib import Path

from kvedge.runtime import backends
from kvedge.runtime.backend import Backend
from kvedge.runtime.backends import BACKENDS, LoadOptions
from kvedge.runtime.sampling import SamplingParams
from kvedge.runtime.session import GenerationResult, Session


def load(path: str | Path, backend: str = "auto", *, max_batch: int | None = None, max_seq_len: int = 2048,
         threads: int = 0, providers: list[str] | None = None, device: str | None = None,
         dtype: str | None = None, chunk_size: int = 512, quantize: str | None = "int4",
         kv_dtype: str | None = None, activations: str = "int8", fused_attention: bool = True) -> Session:
    """Open a session. `path` is an export folder (kvedge.json; backend onnxruntime or tensorrt), a Hugging
    Face checkpoint (config.json) or a GGUF file (backend torch, or native). backend="auto" picks by what the folder holds.
    quantize: the native backend's weights (int4, int8, or None for float32; see NativeBackend).
    kv_dtype: "fp16" for a float16 cache under a float32 model, "int8" for an int8 cache calibrated on the
    built-in text (torch and native backends; an export's cache dtype is fixed at export).
    activations: the native backend's projection inputs, "int8" (fast) or "int16" (within float rounding of
    the torch model; see NativeBackend).
    fused_attention=False: the torch backend on CUDA keeps the reference attention op instead of the Triton
    kernels, so that it can stand as the reference another backend (TensorRT) is compared to."""
    import gc

    # loading allocates a few hundred thousand objects that live as long as the session (a vocabulary, the
    # weights' wrappers): the collector's passes over them find nothing and hold the GIL for a tenth of a second
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _open(Path(path), backend, backends.LoadOptions(
            max_batch=max_batch, max_seq_len=max_seq_len, threads=threads, providers=providers, device=device,
            dtype=dtype, quantize=quantize, kv_dtype=kv_dtype, activations=activations,
            fused_attention=fused_attention), chunk_size)
    finally:
        if collecting:
            gc.enable()


def _open(path: Path, backend: str, opts: LoadOptions, chunk_size: int) -> Session:
    from concurrent.futures import ThreadPoolExecutor

    from kvedge.runtime.tokenizer import Tokenizer

    info = backends.for_path(path) if backend == "auto" else backends.get(backend)
    if path.suffix == ".gguf":  # parsed once here, before two threads would each parse it (open_gguf keeps it)
        from kvedge.models.gguf import open_gguf

        open_gguf(path)
    # the tokenizer is built beside the backend: a GGUF vocabulary takes a few tenths of a second of Python,
    # while the native backend's packing runs in C without the GIL
    with ThreadPoolExecutor(max_workers=1) as pool:
        tok = pool.submit(Tokenizer, path) if path.suffix == ".gguf" or (path / "tokenizer.json").is_file() else None
        be = info.open(path, opts)
        tokenizer = None if tok is None else tok.result()
    return Session(be, tokenizer, chunk_size=chunk_size)


__all__ = ["BACKENDS", "Backend", "GenerationResult", "LoadOptions", "SamplingParams", "Session", "load"]
