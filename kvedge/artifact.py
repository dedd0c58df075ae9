"""The artifact contract: what an export folder holds and what every later stage reads, `kvedge.json`.

Every lowering's graph has the same inputs and outputs:

    input_ids       [batch, seq]                               int64
    position_ids    [batch, seq]                               int64  absolute, contiguous per row
    logits_index    [batch, logits]                            int64  which chunk positions' logits to return
                                                               (generation: 1, the last; kvedge eval: every one)
    past_key.{i}    [batch, kv_heads, max_seq_len, head_dim]   cache dtype   (one pair per layer; int8: the
                                                               graph holds the scales, sidecar "cache")
    past_value.{i}  [batch, kv_heads, max_seq_len, head_dim]   (MLA: past_key [batch, 1, max_seq_len, d_R], the
                                                               decoupled RoPE key; past_value [.., d_c], the latent)
  ->
    logits          [batch, logits, vocab]                     float32 or the model dtype
    present_key.{i} [batch, kv_heads, max_seq_len, head_dim]   the updated cache: bind it to past's buffer
    present_value.{i}

The runtime and the engine builder read names, shapes and dtypes from the sidecar; they never guess.
This module sits between the model and everything that writes or reads an export (export, runtime,
tensorrt): it imports kvedge.models' config only.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvedge import __version__
from kvedge.dtypes import graph_name
from kvedge.errors import KvedgeError
from kvedge.models.config import ModelConfig

SIDECAR = "kvedge.json"
FORMAT = 1
TOKEN_INPUTS = ("input_ids", "position_ids", "logits_index")  # every graph's first inputs, in this order
# The most positions one call returns logits for: kvedge eval's chunk (logits for every position of it, teacher
# forced), and what TensorRT's prefill profile admits on logits_index's second axis ("logits"). Generation asks 1.
LOGITS_CHUNK = 64
# The kvedge fused-attention plugin op the `trt` lowering writes and TensorRT's registry must hold. TensorRT finds
# a node's plugin by (op type, plugin_version, plugin_namespace), and a tensorrt.plugin creator is always version
# "1" (NVIDIA/TensorRT tensorrt/plugin/_lib.py, every release 10.6-11.1); kvedge's own schema of the node (its
# inputs and attributes) is the `schema` attribute, which the registered plugin checks.
PLUGIN_NAMESPACE, PLUGIN_OP, PLUGIN_VERSION, PLUGIN_SCHEMA = "kvedge", "gqa_attention", "1", 2
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_OP}"
LAYOUT = {False: "[batch, kv_heads, max_seq_len, head_dim]",  # the sidecar's cache layout, by ModelConfig.mla
          True: "MLA: past_key [batch, 1, max_seq_len, d_R] holds k_rope (after RoPE), past_value [batch, 1, "
                "max_seq_len, d_c] the latent c_kv (after kv_a_layernorm), shared by all heads"}


def cache_pairs(num_layers: int) -> list[tuple[str, str]]:
    """(past input, present output) per cache tensor, in graph order: k0, v0, k1, v1, ..."""
    return [(f"past_{kind}.{i}", f"present_{kind}.{i}") for i in range(num_layers) for kind in ("key", "value")]


def input_names(num_layers: int) -> list[str]:
    return list(TOKEN_INPUTS) + [past for past, _ in cache_pairs(num_layers)]


def output_names(num_layers: int) -> list[str]:
    return ["logits"] + [present for _, present in cache_pairs(num_layers)]


def logits_dtype(dtype: str) -> str:
    """The logits' graph dtype for a model of `dtype`: float32 stays float32, else the model's own."""
    return graph_name(dtype)


def io_spec(cfg: ModelConfig, dtype: str, max_seq_len: int, kv_dtype: str | None = None) -> tuple[list, list]:
    """(inputs, outputs) as [{"name", "dtype", "shape"}], dynamic axes named 'batch' and 'seq'. The cache has
    the model's dtype, or kv_dtype "int8"."""
    cache_dtype = "int8" if kv_dtype == "int8" else graph_name(dtype)
    pairs = cache_pairs(cfg.num_layers)
    shapes = [["batch", *shape[1:]] for shape in cfg.cache_shapes(1, max_seq_len)] * cfg.num_layers  # k0, v0, k1, ..
    inputs = [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["batch", "seq"]},
        {"name": "logits_index", "dtype": "int64", "shape": ["batch", "logits"]},
    ] + [{"name": past, "dtype": cache_dtype, "shape": shape} for (past, _), shape in zip(pairs, shapes)]
    outputs = [{"name": "logits", "dtype": logits_dtype(dtype), "shape": ["batch", "logits", cfg.vocab_size]}] + [
        {"name": present, "dtype": cache_dtype, "shape": shape} for (_, present), shape in zip(pairs, shapes)]
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
    plugins: list[str] = field(default_factory=list)  # custom ops a runtime registers before it parses the graph
    requires: dict[str, str] = field(default_factory=dict)  # package -> the oldest version that runs the graph

    @property
    def cache_dtype(self) -> str:
        """The past/present tensors' dtype as the graph declares it ("float32", "float16", "int8", ...)."""
        return self.inputs[len(TOKEN_INPUTS)]["dtype"]

    @property
    def logits_dtype(self) -> str:
        return self.outputs[0]["dtype"]

    @property
    def logits_per_call(self) -> bool:
        """Whether the graph returns several positions' logits a call (logits_index [batch, logits]); exports
        of kvedge before 2026-12-05 take one position a row (logits_index [batch])."""
        return len(self.inputs[TOKEN_INPUTS.index("logits_index")]["shape"]) == 2

    @property
    def cache_pairs(self) -> list[tuple[str, str]]:
        return cache_pairs(self.model.num_layers)

    def cache_shapes(self, batch: int) -> list[tuple[int, ...]]:
        """The shape of each cache tensor for `batch` rows, in cache_pairs order, as the graph's inputs declare."""
        n = len(TOKEN_INPUTS)
        return [(batch, *spec["shape"][1:]) for spec in self.inputs[n:n + len(self.cache_pairs)]]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format, "kvedge_version": self.kvedge_version, "lowering": self.lowering,
            "dtype": self.dtype, "opset": self.opset, "max_seq_len": self.max_seq_len,
            "max_batch": self.max_batch, "onnx_file": self.onnx_file, "external_data": self.external_data,
            "cache": {"layout": LAYOUT[self.model.mla], "present_aliases_past": True,
                      "elements_per_token": self.model.cache_elements_per_token, **self.cache},
            "inputs": self.inputs, "outputs": self.outputs, "plugins": self.plugins, "requires": self.requires,
            "verification": self.verification, "model": self.model.to_dict(), **self.extra,
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
                 "onnx_file", "external_data", "inputs", "outputs", "verification", "model", "cache", "plugins",
                 "requires"}
        return cls(model=ModelConfig.from_dict(d["model"]), lowering=d["lowering"], dtype=d["dtype"],
                   opset=d["opset"], max_seq_len=d["max_seq_len"], max_batch=d["max_batch"],
                   inputs=d["inputs"], outputs=d["outputs"], onnx_file=d["onnx_file"],
                   external_data=d.get("external_data"), verification=d.get("verification"),
                   kvedge_version=d["kvedge_version"], format=d["format"], plugins=list(d.get("plugins", [])),
                   requires=dict(d.get("requires", {})),
                   extra={k: v for k, v in d.items() if k not in known},
                   cache={k: v for k, v in d.get("cache", {}).items()
                          if k not in ("layout", "present_aliases_past", "elements_per_token")})


def older(version: str, than: str) -> bool:
    """Whether MAJOR.MINOR of `version` is before `than`'s."""
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:2])

    return key(version) < key(than)


def onnx_weight_bytes(export_dir: str | Path, sc: Sidecar) -> int:
    """Bytes of the graph's initializers (the weights an ONNX runtime loads)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(Path(export_dir) / sc.onnx_file), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        total += n * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total
