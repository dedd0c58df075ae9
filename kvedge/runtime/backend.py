"""The Backend protocol: what the generation loop and `kvedge bench` need from every backend.

A backend owns its caches, allocated once at load for (max_batch, max_seq_len) and updated in place.
`forward` runs one chunk with the graph contract's inputs and returns the logits of the positions
logits_index names: [B, n, V] for [B, n] (kvedge eval: every position of its chunk), [B, 1, V] for [B] (generation:
one a row), as a view of a buffer the backend may reuse on the next call (copy to keep it).
Positions are the runtime's business, not the backend's: it only writes where it is told.
`first_row` says which cache rows the B input rows are: first_row .. first_row + B - 1 (0 by default),
so that a server can run one row's prompt, or a range of rows, while the other rows' caches stay as
they are (kvedge.serve). A backend whose cache is double-buffered (present in another buffer, swapped after
each call: TensorRT without an in-place cache update) sets `in_place = False`: rows a call leaves out go
stale, so kvedge serve refuses it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from kvedge.errors import KvedgeError
from kvedge.models.config import ModelConfig


@runtime_checkable
class Backend(Protocol):
    name: str
    cfg: ModelConfig
    max_batch: int
    max_seq_len: int

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                logits_index: torch.Tensor, first_row: int = 0) -> torch.Tensor: ...

    def reset(self) -> None: ...

    def cache_tensors(self) -> list[torch.Tensor]: ...

    def weights_bytes(self) -> int:
        """Bytes of what the backend holds besides its caches: parameters (torch), the graph's initializers
        (onnxruntime, tensorrt), or all the native engine reads (native)."""
        ...


def check_rows(backend: Backend, first_row: int, batch: int) -> None:
    """Refuse cache rows first_row .. first_row + batch - 1 outside [0, max_batch)."""
    if first_row < 0 or first_row + batch > backend.max_batch:
        raise KvedgeError(f"rows {first_row}..{first_row + batch - 1} are outside this session's max_batch "
                          f"{backend.max_batch}" if first_row else
                          f"batch {batch} exceeds max_batch {backend.max_batch} of this session")


def int64_inputs(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The token inputs as contiguous int64 tensors, without a torch op when they already are: each op releases the
    GIL, and in a server the event loop, waiting for it, would then run its turn before the backend's call
    starts instead of while it runs (kvedge.serve)."""
    return [t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous() for t in tensors]


class CacheList:
    """reset / cache_tensors for a backend holding its caches as one list of tensors in `self.caches`."""

    caches: list[torch.Tensor]

    def reset(self) -> None:
        for t in self.caches:
            t.zero_()

    def cache_tensors(self) -> list[torch.Tensor]:
        return self.caches
