"""The torch backend: the reference Decoder over a preallocated KVCache, on CPU or CUDA.

On CUDA with triton installed, attention runs through kvedge's fused Triton kernels
(torch.ops.kvedge.triton_attention); fused_attention=False (kvedge.load's too) keeps the reference op.
kv_dtype="int8": the reference int8 cache (kvedge.models.attention), with kv_scales (per-layer k, v scales)
or scales calibrated on the built-in text as `kvedge export --kv-dtype int8` does; kv_dtype="fp16" under a
float32 model: a float16 cache (K and V rounded on write, read as float32). Both always run the reference op."""

from __future__ import annotations

from pathlib import Path

import torch

from kvedge.dtypes import TORCH
from kvedge.errors import KvedgeError
from kvedge.models import KVCache, is_checkpoint, load_decoder
from kvedge.models.attention import attention
from kvedge.runtime.backend import check_rows


def attention_op_for(device: torch.device, fused_attention: bool, kv_dtype: str | None):
    """The Decoder's attention op: the Triton kernels on CUDA when triton is installed, fused_attention holds
    and the cache is the model's dtype; else the reference op (kvedge.models.attention), which a parity
    reference must run (fused_attention=False) so that another backend is not compared with the kernels."""
    if device.type == "cuda" and fused_attention and kv_dtype is None:
        try:
            from kvedge.kernels.op import attention_op
        except ImportError:  # triton missing: the reference op still runs on CUDA
            pass
        else:
            return attention_op
    return attention


class TorchBackend:
    name = "torch"

    def __init__(self, model_dir: str | Path, max_batch: int = 4, max_seq_len: int = 2048,
                 dtype: str | None = None, device: str | None = None, threads: int = 0,
                 fused_attention: bool = True, kv_dtype: str | None = None, kv_scales=None):
        if not is_checkpoint(model_dir):
            raise KvedgeError(f"{model_dir}: the torch backend needs the Hugging Face checkpoint (config.json + "
                              f"safetensors); an export folder holds only the ONNX graph")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise KvedgeError(f"device {device!r} asked for, but torch sees no CUDA GPU here")
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.model = load_decoder(model_dir, dtype=dtype, device=self.device)
        self.cfg = self.model.cfg
        if self.cfg.positions == "learned" and max_seq_len > self.cfg.max_position_embeddings:
            max_seq_len = self.cfg.max_position_embeddings
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        param = next(self.model.parameters())
        cache_dtype = param.dtype
        if kv_dtype == "int8":
            if kv_scales is None:
                from kvedge.runtime.calibration import builtin_kv_scales

                kv_scales = builtin_kv_scales(self.model, model_dir)
            cache_dtype = torch.int8
        elif kv_dtype == "fp16" and cache_dtype == torch.float32:  # a float16 cache under a float32 model
            cache_dtype = torch.float16
        elif kv_dtype is not None and TORCH.get(kv_dtype) != cache_dtype:
            raise KvedgeError(f"kv_dtype {kv_dtype!r}: the torch backend's cache is the model's dtype, float16 "
                              f"under a float32 model, or int8")
        self.cache = KVCache.allocate(self.cfg, max_batch, max_seq_len, dtype=cache_dtype, device=self.device,
                                      scales=kv_scales)
        # the Triton kernels take one head width for q, k and v: MLA's latent attention runs the reference op
        self.model.attention_op = attention_op_for(self.device, fused_attention and not self.cfg.mla, kv_dtype)
        self.fused = self.model.attention_op is not attention

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, logits_index, first_row: int = 0):
        d, b = self.device, input_ids.shape[0]
        check_rows(self, first_row, b)
        caches = [(k[first_row:], v[first_row:], *scales) for k, v, *scales in self.cache.for_batch(first_row + b)]
        return self.model(input_ids.to(d), position_ids.to(d), caches, logit_index=logits_index.to(d)).float()

    def reset(self) -> None:
        self.cache.zero_()

    def cache_tensors(self) -> list[torch.Tensor]:
        return self.cache.keys + self.cache.values

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def open_backend(path: Path, o, export: Path | None = None) -> TorchBackend:
    """The runtime's entry point (kvedge.runtime.backends): the reference Decoder on a checkpoint."""
    return TorchBackend(path, max_batch=o.max_batch or 4, max_seq_len=o.max_seq_len, dtype=o.dtype, device=o.device,
                        threads=o.threads, kv_dtype=o.kv_dtype, fused_attention=o.fused_attention)
