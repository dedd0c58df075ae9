"""The graph contract and its sidecar, `kvedge.json`.

Every lowering's graph has the same inputs and outputs:

    input_ids       [batch, seq]                               int64
    position_ids    [batch, seq]                               int64  absolute, contiguous per row
    logits_index    [batch]                                    int64  which chunk position's logits to return
    past_key.{i}    [batch, kv_heads, max_seq_len, head_dim]   cache dtype   (one pair per layer; int8: the
                                                               graph holds the scales, sidecar "cache")
    past_value.{i}  [batch, kv_heads, max_seq_len, head_dim]
  ->
    logits          [batch, 1, vocab]                          float32 or the model dtype
    present_key.{i} [batch, kv_heads, max_seq_len, head_dim]   the updated cache: bind it to past's buffer
    present_value.{i}

The runtime and the engine builder read names, shapes and dtypes from the sidecar; they never guess.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvedge import __version__
from kvedge.errors import KvedgeError
from kvedge.models.config import ModelConfig

SIDECAR = "kvedge.json"
FORMAT = 1
ONNX_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def input_names(num_layers: int) -> list[str]:
    return ["input_ids", "position_ids", "logits_index"] + [
        f"past_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]


def output_names(num_layers: int) -> list[str]:
    return ["logits"] + [f"present_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]


def io_spec(cfg: ModelConfig, dtype: str, max_seq_len: int, logits_dtype: str,
            kv_dtype: str | None = None) -> tuple[list, list]:
    """(inputs, outputs) as [{"name", "dtype", "shape"}], dynamic axes named 'batch' and 'seq'. The cache has
    the model's dtype, or kv_dtype "int8"."""
    cache = {"dtype": "int8" if kv_dtype == "int8" else ONNX_DTYPES[dtype],
             "shape": ["batch", cfg.num_kv_heads, max_seq_len, cfg.head_dim]}
    inputs = [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["batch", "seq"]},
        {"name": "logits_index", "dtype": "int64", "shape": ["batch"]},
    ] + [{"name": n, **cache} for n in input_names(cfg.num_layers)[3:]]
    outputs = [{"name": "logits", "dtype": logits_dtype, "shape": ["batch", 1, cfg.vocab_size]}] + [
        {"name": n, **cache} for n in output_names(cfg.num_layers)[1:]]
    return inputs, outputs


def compatible(version: str) -> bool:
    """Same major version (and, before 1.0, the same minor): the contract may change between them."""
    try:
        theirs = [int(x) for x in version.split(".")[:2]]
    except ValueError:
        return False
    ours = [int(x) for x in __version__.split(".")[:2]]
    return len(theirs) == 2 and (theirs == ours if ours[0] == 0 else theirs[0] == ours[0])


@dataclass
class Sidecar:
    model: ModelConfig
    lowering: str
    dtype: str
    opset: int
    max_seq_len: int
    max_batch: int
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    onnx_file: str = "model.onnx"
    external_data: str | None = None
    verification: dict[str, Any] | None = None
    kvedge_version: str = __version__
    format: int = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)  # the cache's dtype and, for int8, its scales

    @property
    def cache_dtype(self) -> str:
        """The past/present tensors' dtype as the graph declares it ("float32", "float16", "int8", ...)."""
        return self.inputs[3]["dtype"]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format, "kvedge_version": self.kvedge_version, "lowering": self.lowering,
            "dtype": self.dtype, "opset": self.opset, "max_seq_len": self.max_seq_len,
            "max_batch": self.max_batch, "onnx_file": self.onnx_file, "external_data": self.external_data,
            "cache": {"layout": "[batch, kv_heads, max_seq_len, head_dim]", "present_aliases_past": True,
                      **self.cache},
            "inputs": self.inputs, "outputs": self.outputs, "verification": self.verification,
            "model": self.model.to_dict(), **self.extra,
        }

    def write(self, out_dir: str | Path) -> Path:
        """Atomically: a temporary file renamed into place, so a reader sees all or nothing."""
        path = Path(out_dir) / SIDECAR
        fd, tmp = tempfile.mkstemp(prefix=".kvedge-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=2)
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, out_dir: str | Path) -> Sidecar:
        path = Path(out_dir)
        path = path / SIDECAR if path.is_dir() else path
        if not path.is_file():
            raise KvedgeError(f"{path}: no {SIDECAR}; is this a complete `kvedge export` folder?")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise KvedgeError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
        if d.get("format") != FORMAT:
            raise KvedgeError(f"{path}: sidecar format {d.get('format')!r}, this kvedge reads format {FORMAT}; "
                              f"re-export with kvedge {__version__}")
        if not compatible(str(d.get("kvedge_version", ""))):
            raise KvedgeError(f"{path}: written by kvedge {d.get('kvedge_version')!r}, which this kvedge "
                              f"({__version__}) cannot read; re-export with kvedge {__version__}")
        known = {"format", "kvedge_version", "lowering", "dtype", "opset", "max_seq_len", "max_batch",
                 "onnx_file", "external_data", "inputs", "outputs", "verification", "model", "cache"}
        return cls(model=ModelConfig.from_dict(d["model"]), lowering=d["lowering"], dtype=d["dtype"],
                   opset=d["opset"], max_seq_len=d["max_seq_len"], max_batch=d["max_batch"],
                   inputs=d["inputs"], outputs=d["outputs"], onnx_file=d["onnx_file"],
                   external_data=d.get("external_data"), verification=d.get("verification"),
                   kvedge_version=d["kvedge_version"], format=d["format"],
                   extra={k: v for k, v in d.items() if k not in known},
                   cache={k: v for k, v in d.get("cache", {}).items() if k not in ("layout", "present_aliases_past")})
