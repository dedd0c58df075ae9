"""The TensorRT backend: model.engine behind the Backend protocol. Needs TensorRT and a GPU.

- One context per optimization profile (prefill, decode), sharing one device-memory block, as
  TrtPath.user_managed_memory says: >= 10.1 create_execution_context(ExecutionContextAllocationStrategy.
  USER_MANAGED) and set_device_memory(ptr, size) with device_memory_size_v2; 10.0 the same context and
  context.device_memory = ptr (set_device_memory arrived in 10.1); 8.x
  create_execution_context_without_device_memory() and context.device_memory = ptr.
- Caches follow kvedge.tensorrt.buffers.buffer_plan: bound once with set_tensor_address; in place on
  TensorRT >= 10.15 and for plugin graphs, otherwise two buffers per cache tensor swapped after each step.
- Each step: set_input_shape, set_tensor_address for the small inputs, cast to the dtype the engine reports for
  each (engine.get_tensor_dtype: int32 on 8.6, int64 later), execute_async_v3(stream) after that stream has
  waited for torch's current one, where the inputs were cast.
- Not done yet: capturing the decode step into a CUDA graph (addresses are stable only on the
  in-place path; with double buffering they alternate every step).
- Device buffers come from a small allocator: torch CUDA tensors (default) or pycuda.
NOT YET RUN on real TensorRT (see docs/tensorrt.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvedge.artifact import LOGITS_CHUNK, TOKEN_INPUTS, Sidecar, onnx_weight_bytes
from kvedge.dtypes import to_torch
from kvedge.errors import KvedgeError, require
from kvedge.runtime.backend import check_rows
from kvedge.tensorrt.buffers import buffer_plan, in_place_cache
from kvedge.tensorrt.plugin import register_plugins
from kvedge.tensorrt.versions import select_path


class TorchAllocator:
    """Device buffers as torch CUDA tensors; the stream is torch's current CUDA stream."""

    name = "torch"

    def __init__(self):
        if not torch.cuda.is_available():
            raise KvedgeError("the TensorRT backend needs a CUDA GPU; torch sees none")
        self.stream = torch.cuda.Stream()

    def empty(self, shape, dtype: torch.dtype):
        t = torch.zeros(shape, dtype=dtype, device="cuda")
        return t, t.data_ptr()

    def stream_handle(self) -> int:
        return self.stream.cuda_stream

    def synchronize(self) -> None:
        self.stream.synchronize()


class PycudaAllocator:
    """Device buffers from pycuda (mem_alloc), for installs without a CUDA build of torch."""

    name = "pycuda"

    def __init__(self):
        cuda = require("pycuda.driver", "pycuda", "the pycuda allocator")
        require("pycuda.autoinit", "pycuda", "the pycuda allocator")
        self.cuda, self.stream = cuda, cuda.Stream()

    def empty(self, shape, dtype: torch.dtype):
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        mem = self.cuda.mem_alloc(max(n, 1))
        self.cuda.memset_d8(mem, 0, max(n, 1))
        return mem, int(mem)

    def stream_handle(self) -> int:
        return self.stream.handle

    def synchronize(self) -> None:
        self.stream.synchronize()


def default_allocator():
    """torch CUDA if present, else pycuda: chosen by what is installed."""
    if torch.cuda.is_available():
        return TorchAllocator()
    return PycudaAllocator()


class TrtBackend:
    name = "tensorrt"

    def __init__(self, export_dir: str | Path, allocator=None):
        trt = require("tensorrt", "tensorrt", "the TensorRT backend")
        self.dir = Path(export_dir)
        self.sidecar = sc = Sidecar.read(self.dir)
        if sc.model.mla:  # its buffers and row strides assume one shape for key and value caches
            raise KvedgeError(f"{self.dir}: a multi-head latent attention (MLA) export, whose key and value caches "
                              f"differ in width (d_R, d_c): the TensorRT backend does not run MLA yet; use the "
                              f"onnxruntime backend")
        engine_path = self.dir / "model.engine"
        if not engine_path.is_file():
            raise KvedgeError(f"{self.dir}: no model.engine; run `kvedge build {self.dir}` on this device first")
        self.cfg = sc.model
        self.path = select_path(trt.__version__)
        build = sc.extra.get("engine", {})
        self.max_batch = build.get("max_batch", sc.max_batch)
        self.max_seq_len = sc.max_seq_len
        self.alloc = allocator or default_allocator()
        register_plugins(sc)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self._logger).deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise KvedgeError(f"{engine_path}: TensorRT could not deserialize it (built by another TensorRT "
                              f"version or GPU?); rebuild with `kvedge build`")
        self.contexts = self._contexts(trt)
        shape = (self.max_batch, self.cfg.num_kv_heads, self.max_seq_len, self.cfg.head_dim)
        self._row_bytes = shape[1] * shape[2] * shape[3] * to_torch(sc.cache_dtype).itemsize  # one cache row
        self._buffers = {}
        for buf in buffer_plan(sc, self.path, self.max_batch):
            if buf.role.startswith("cache"):
                self._buffers[buf.name] = self.alloc.empty(shape, to_torch(sc.cache_dtype))
        self.in_place = in_place_cache(sc, self.path)
        # the ids' dtypes as the engine has them (int32 on 8.6: TrtPath.index_dtype), via trt.nptype (8.6-11.1)
        self._index_dtypes = [torch.from_numpy(np.empty(0, trt.nptype(self.engine.get_tensor_dtype(name)))).dtype
                              for name in TOKEN_INPUTS]
        self._pairs = []  # (past name, present name, [addresses]) ; swapped when double-buffered
        for past, present in sc.cache_pairs:
            if self.in_place:
                a = self._buffers[past][1]
                self._pairs.append([past, present, a, a])
            else:
                self._pairs.append([past, present, self._buffers[f"{past}#A"][1], self._buffers[f"{past}#B"][1]])
        # flat: [B, n, V] for any B and n is a contiguous view of its start (n: at most the prefill profile's)
        self._logits_per_row = LOGITS_CHUNK if sc.logits_per_call else 1
        self.logits = torch.empty(self.max_batch * self._logits_per_row * self.cfg.vocab_size,
                                  dtype=to_torch(sc.logits_dtype), device="cuda")

    def _contexts(self, trt):
        memory = self.path.user_managed_memory
        size = self.engine.device_memory_size_v2 if memory == "v2" else self.engine.device_memory_size
        self._scratch = self.alloc.empty((int(size),), torch.uint8)
        contexts = []
        for profile in range(self.engine.num_optimization_profiles):
            if memory == "legacy":
                ctx = self.engine.create_execution_context_without_device_memory()
            else:
                ctx = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            if memory == "v2":
                ctx.set_device_memory(self._scratch[1], int(size))
            else:
                ctx.device_memory = self._scratch[1]
            ctx.set_optimization_profile_async(profile, self.alloc.stream_handle())
            contexts.append(ctx)
        return contexts  # [prefill, decode]

    def cache_tensors(self) -> list[torch.Tensor]:
        return [b[0] for b in self._buffers.values() if isinstance(b[0], torch.Tensor)]

    def reset(self) -> None:
        for t in self.cache_tensors():
            t.zero_()

    def weights_bytes(self) -> int:
        return onnx_weight_bytes(self.dir, self.sidecar)

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, logits_index, first_row: int = 0):
        b, l = input_ids.shape
        check_rows(self, first_row, b)
        if first_row and not self.in_place:
            raise KvedgeError("this TensorRT path double-buffers the cache (present is another buffer, swapped "
                              "after each step), so it runs cache rows from 0 only; kvedge serve needs an in-place "
                              "cache (TensorRT's own KV-cache update, or the plugin lowering)")
        ctx = self.contexts[1 if l == 1 else 0]
        index = logits_index if logits_index.dim() == 2 else logits_index[:, None]  # [B, n]
        n = index.shape[1]
        if n > self._logits_per_row:
            raise KvedgeError(f"logits of {n} positions a row asked for; this engine returns at most "
                              f"{self._logits_per_row}" + ("" if self.sidecar.logits_per_call else
                                                           " (an export from an older kvedge: re-export it)"))
        if not self.sidecar.logits_per_call:
            index = index[:, 0]
        staged = [t.to("cuda", dt).contiguous() for t, dt in zip((input_ids, position_ids, index),
                                                                  self._index_dtypes)]
        for name, t in zip(TOKEN_INPUTS, staged):
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        for pair in self._pairs:
            past, present, a, bptr = pair
            ctx.set_input_shape(past, (b, self.cfg.num_kv_heads, self.max_seq_len, self.cfg.head_dim))
            ctx.set_tensor_address(past, a + first_row * self._row_bytes)
            ctx.set_tensor_address(present, bptr + first_row * self._row_bytes)
        ctx.set_tensor_address("logits", self.logits.data_ptr())
        stream = self.alloc.stream_handle()
        wait_for_torch(stream)
        if not ctx.execute_async_v3(stream):
            raise KvedgeError("TensorRT execute_async_v3 failed (see its log)")
        self.alloc.synchronize()
        if not self.in_place:
            for pair in self._pairs:  # the present buffer holds the updated cache: it is past next time
                pair[2], pair[3] = pair[3], pair[2]
        return self.logits[:b * n * self.cfg.vocab_size].view(b, n, self.cfg.vocab_size).float().cpu()


def wait_for_torch(stream: int) -> None:
    """Make the CUDA stream `stream` (TensorRT's) wait for the work queued so far on torch's current stream: the
    step's input casts and any cache reset. Without it TensorRT may read those tensors before they are written."""
    torch.cuda.ExternalStream(stream).wait_stream(torch.cuda.current_stream())


def open_backend(path: Path, o, export: Path | None = None) -> TrtBackend:
    """The runtime's entry point (kvedge.runtime.backends): model.engine of the export folder `path`."""
    return TrtBackend(path)
