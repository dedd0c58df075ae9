"""kvedge: decoder-only transformers to ONNX and TensorRT with explicit KV caches, for edge GPUs."""

__version__ = "0.1.0"

from kvedge.errors import KvedgeError  # noqa: E402

__all__ = ["KvedgeError", "__version__"]
