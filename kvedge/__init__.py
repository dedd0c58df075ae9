"""kvedge: decoder-only transformers to ONNX and TensorRT with explicit KV caches, for edge GPUs."""

__version__ = "0.1.0"

from kvedge.errors import KvedgeError  # noqa: E402



def load(path, backend: str = "auto", **options):
    """Open a generation session over an export folder or a checkpoint: see kvedge.runtime.load."""
    from kvedge.runtime import load as _load

    return _load(path, backend, **options)


__all__ = ["KvedgeError", "__version__", "load"]
