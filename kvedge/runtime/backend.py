"""The Backend protocol: what the generation loop and `kvedge bench` need from every backend.

A backend owns its caches, allocated once at load for (max_batch, max_seq_len) and updated in place.
`forward` runs one chunk with the graph contract's inputs and returns the logits of one position per
row, [B, 1, V], as a view of a buffer the backend may reuse on the next call (copy to keep it).
Positions are the runtime's business, not the backend's: it only writes where it is told.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from kvedge.models.config import ModelConfig


@runtime_checkable
class Backend(Protocol):
    name: str
    cfg: ModelConfig
    max_batch: int
    max_seq_len: int

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                logits_index: torch.Tensor) -> torch.Tensor: ...

    def reset(self) -> None: ...

    def cache_tensors(self) -> list[torch.Tensor]: ...

    def weights_bytes(self) -> int:
        """Bytes of what the backend holds besides its caches: parameters (torch), the graph's initializers
        (onnxruntime, tensorrt), or all the native engine reads (native)."""
        ...


class CacheList:
    """reset / cache_tensors for a backend holding its caches as one list of tensors in `self.caches`."""

    caches: list[torch.Tensor]

    def reset(self) -> None:
        for t in self.caches:
            t.zero_()

    def cache_tensors(self) -> list[torch.Tensor]:
        return self.caches
