"""ONNX Runtime backend: one session over an export folder, caches allocated once and bound in place.

The caches are torch tensors [max_batch, kv_heads, max_seq_len, head_dim] allocated at load; every
step binds past_* and present_* to the *same* buffer (IO binding by address), so the graph updates
the cache in place and no cache-sized allocation happens per token. Logits land in a preallocated
buffer too (grown once to the most positions a call has asked for). An int8 cache (`--kv-dtype int8`) is allocated and bound as int8; its scales live in the graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvedge.artifact import TOKEN_INPUTS, Sidecar, older, onnx_weight_bytes
from kvedge.dtypes import NUMPY, to_torch
from kvedge.errors import KvedgeError, MissingDependencyError
from kvedge.runtime.backend import CacheList, check_rows, int64_inputs

if TYPE_CHECKING:
    import onnxruntime as ort


class OrtBackend(CacheList):
    name = "onnxruntime"

    def __init__(self, export_dir: str | Path, providers: list[str] | None = None, threads: int = 0,
                 max_batch: int | None = None, sidecar: Sidecar | None = None):
        try:
            import onnxruntime as ort
        except ImportError:
            raise MissingDependencyError("the onnxruntime backend needs 'onnxruntime': pip install onnxruntime") from None
        self.dir = Path(export_dir)
        self.sidecar = sc = sidecar or Sidecar.read(self.dir)
        self.cfg = sc.model
        need = sc.requires.get("onnxruntime")
        if need and older(ort.__version__, need):
            raise KvedgeError(f"{self.dir}: graphs of the {sc.lowering!r} lowering need onnxruntime >= "
                              f"{need}; this is {ort.__version__}. Upgrade onnxruntime, "
                              f"or export with --attention onnx")
        available = ort.get_available_providers()
        providers = providers or ["CPUExecutionProvider"]
        missing = [p for p in providers if p not in available]
        if missing:
            raise KvedgeError(f"ONNX Runtime provider(s) {missing} are not available here; available: {available}")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        # ORT fuses the onnx lowering's blocked DequantizeLinear + MatMul into MatMulNBits and then computes
        # with int8 activations (its default accuracy level 4) unless told: keep the export's level.
        level = (sc.extra.get("quantization") or {}).get("accuracy_level", 0)
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
        self.session = ort.InferenceSession(str(self.dir / sc.onnx_file), opts, providers=providers)
        self._check_graph()
        self.max_batch = max_batch or sc.max_batch
        self.max_seq_len = sc.max_seq_len
        self.dtype = to_torch(sc.dtype)
        if self.dtype not in NUMPY:
            raise KvedgeError(f"the onnxruntime backend cannot bind {sc.dtype} caches from Python; "
                              f"export with --dtype fp32 or fp16")
        self.cache_dtype = to_torch(sc.cache_dtype)  # the model's dtype, or int8
        self.caches = [torch.zeros(shape, dtype=self.cache_dtype)  # k0, v0, k1, v1, ... as the graph declares them
                       for shape in sc.cache_shapes(self.max_batch)]
        # one flat buffer: [batch, n, vocab] of any batch and n is a contiguous view of its start
        self.logits = torch.empty(self.max_batch * self.cfg.vocab_size, dtype=to_torch(sc.logits_dtype))
        self._bindings: dict[tuple[int, int, int], ort.IOBinding] = {}  # (first_row, batch, n) -> caches, logits
        self.binding = self._binding(0, self.max_batch, 1)  # the last call's

    def _check_graph(self) -> None:
        sc = self.sidecar
        for spec, arg in zip(sc.inputs, self.session.get_inputs()):
            want = [d if isinstance(d, int) else None for d in spec["shape"]]
            got = [d if isinstance(d, int) else None for d in arg.shape]
            if spec["name"] == arg.name and want != got:
                raise KvedgeError(f"{self.dir}: input {arg.name!r} has shape {arg.shape} in the graph but "
                                  f"{spec['shape']} in kvedge.json; re-export")
        got_in = [i.name for i in self.session.get_inputs()]
        got_out = [o.name for o in self.session.get_outputs()]
        want_in, want_out = [i["name"] for i in self.sidecar.inputs], [o["name"] for o in self.sidecar.outputs]
        if got_in != want_in or got_out != want_out:
            raise KvedgeError(f"{self.dir}: the graph and {self.dir / 'kvedge.json'} disagree: graph inputs "
                              f"{got_in[:4]}..., outputs {got_out[:3]}...; sidecar {want_in[:4]}..., "
                              f"{want_out[:3]}...; re-export")

    def _binding(self, first_row: int, batch: int, n: int) -> ort.IOBinding:
        """The binding of these cache rows and n positions' logits a row: caches (past and present to one buffer)
        and logits, bound once (kvedge serve alternates between a prompt's row and the decoding rows every step)."""
        b = self._bindings.get((first_row, batch, n))
        if b is not None:
            return b
        if batch * n * self.cfg.vocab_size > self.logits.numel():  # the bindings so far point at the old buffer
            self.logits = torch.empty(batch * n * self.cfg.vocab_size, dtype=self.logits.dtype)
            self._bindings.clear()
        b = self._bindings[(first_row, batch, n)] = self.session.io_binding()
        for (name, out), t in zip(self.sidecar.cache_pairs, self.caches):
            view = t[first_row:first_row + batch]  # rows of a C-contiguous tensor: contiguous, same storage
            shape = list(view.shape)
            b.bind_input(name, "cpu", 0, NUMPY[t.dtype], shape, view.data_ptr())
            b.bind_output(out, "cpu", 0, NUMPY[t.dtype], shape, view.data_ptr())
        lg = self._logits_view(batch, n)
        b.bind_output("logits", "cpu", 0, NUMPY[lg.dtype], list(lg.shape), lg.data_ptr())
        return b

    def _logits_view(self, batch: int, n: int) -> torch.Tensor:
        return self.logits[:batch * n * self.cfg.vocab_size].view(batch, n, self.cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                logits_index: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Run one chunk on cache rows first_row..; returns a view of the preallocated logits [B, n, V] for
        logits_index [B, n] ([B, 1, V] for [B]), valid until the next call."""
        batch = input_ids.shape[0]
        check_rows(self, first_row, batch)
        index = logits_index if logits_index.dim() == 2 else logits_index[:, None]
        n = index.shape[1]
        if not self.sidecar.logits_per_call:  # an export from before the contract's [batch, logits]
            if n != 1:
                raise KvedgeError(f"{self.dir}: this export returns one position's logits a call (logits_index "
                                  f"[batch]: exported by an older kvedge); re-export it to score every position")
            index = index[:, 0]
        self.binding = self._binding(first_row, batch, n)
        keep = int64_inputs(input_ids, position_ids, index)
        for name, t in zip(TOKEN_INPUTS, keep):  # `keep` holds the buffers alive through the run
            self.binding.bind_input(name, "cpu", 0, np.int64, list(t.shape), t.data_ptr())
        self.session.run_with_iobinding(self.binding)
        return self._logits_view(batch, n)

    def weights_bytes(self) -> int:
        return onnx_weight_bytes(self.dir, self.sidecar)


def open_backend(path: Path, o, export: Path | None = None) -> OrtBackend:
    """The runtime's entry point (kvedge.runtime.backends): an export folder on ONNX Runtime."""
    return OrtBackend(path, providers=o.providers, threads=o.threads, max_batch=o.max_batch)
