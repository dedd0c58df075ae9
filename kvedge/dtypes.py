"""One home for dtype names.

kvedge speaks of a dtype in two spellings: the short one of the CLI and the sidecar's "dtype" (fp32, fp16,
bf16) and the graph's element-type name of ONNX and the sidecar's I/O specs (float32, float16, bfloat16,
int8, int64, ...). Every other module looks names, torch / numpy types and sizes up here.
"""

from __future__ import annotations

import numpy as np
import torch

from kvedge.errors import KvedgeError

FLOATS = ("fp32", "fp16", "bf16")  # a model's (and an export's) dtype
KV_DTYPES = FLOATS + ("int8",)  # a cache's: the model's float dtype, or int8 with scales
GRAPH = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # short name -> graph element type

TORCH = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
}
BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
         "int8": 1, "fp8": 1, "int4": 0.5}
NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int8: np.int8}
# onnx.TensorProto.DataType -> graph element type (the ones decoder graphs use)
ONNX_ENUM = {1: "float32", 10: "float16", 6: "int32", 7: "int64", 9: "bool", 2: "uint8", 3: "int8", 16: "bfloat16",
             17: "float8e4m3", 22: "int4", 11: "float64", 21: "uint4"}
TRITON = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64"}


def graph_name(dtype: str) -> str:
    """The graph's element type of a short name ("fp16" -> "float16"); graph names pass through."""
    return GRAPH.get(dtype, dtype)


def to_torch(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return TORCH[dtype]
    except KeyError:
        raise KvedgeError(f"unknown dtype {dtype!r}; expected one of {sorted(TORCH)}") from None


def nbytes(dtype: str | torch.dtype) -> float:
    """Bytes of one element (int4: 0.5)."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    try:
        return BYTES[dtype]
    except KeyError:
        raise KvedgeError(f"unknown dtype {dtype!r}; expected one of {sorted(BYTES)}") from None
