"""Comparing logits with a reference: the one comparison and tolerance table of export verification
(kvedge.export.verify) and `kvedge parity` (kvedge.bench.parity)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# dtype: max |logit error| relative to the largest |logit| (at least 1; None: not checked), minimum cosine
TOLERANCES = {
    "fp32": {"max_rel": 1e-3, "min_cosine": 0.9999},
    "fp16": {"max_rel": 2e-2, "min_cosine": 0.999},
    "bf16": {"max_rel": 5e-2, "min_cosine": 0.995},
}


def tolerance(dtype: str, override: dict | None = None) -> dict:
    """The dtype's preset with `override`'s keys (max_rel, min_cosine) replacing its own."""
    return {**TOLERANCES[dtype], **(override or {})}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@dataclass
class Step:
    """One step's figures: `got` against `ref`, logits [B, L, V] of the last position per row."""

    max_abs: float
    max_rel: float  # max_abs / max(1, largest |ref logit|)
    scale: float  # max(1, largest |ref logit|)
    cosine: float
    top1_agree: bool

    def ok(self, tol: dict) -> bool:
        return (tol["max_rel"] is None or self.max_rel <= tol["max_rel"]) and self.cosine >= tol["min_cosine"]


def step(got: torch.Tensor, ref: torch.Tensor) -> Step:
    got, ref = got.float(), ref.float()
    err = (got - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    return Step(err, err / scale, scale, cosine(got, ref), bool((got[..., -1, :].argmax(-1) ==
                                                                 ref[..., -1, :].argmax(-1)).all()))
