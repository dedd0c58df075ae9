"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty.

Order (as in Hugging Face's logits processors): repetition penalty, temperature, top-k, top-p, then
a draw from the remaining distribution with the session's seeded generator. temperature == 0 is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvedge.errors import KvedgeError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise KvedgeError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise KvedgeError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise KvedgeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise KvedgeError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 64:  # what torch.Generator takes
            raise KvedgeError(f"seed {self.seed} is outside [-2**63, 2**64)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool: tokens already in each row. Positive logits are divided by the
    penalty, negative ones multiplied (CTRL's rule, as transformers applies it)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set everything outside the top-k and the top-p nucleus to -inf. logits [B, V] (temperature applied)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest set reaching top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> each row's largest, its first index on a tie (and a NaN's, as torch.argmax), as int64 [B].
    NumPy's argmax over a vocabulary's row is several times faster than torch's on the CPU (docs/benchmarks.md)."""
    return torch.from_numpy(logits.detach().float().cpu().numpy().argmax(-1).astype("int64"))


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                seen: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] float -> tokens [B] int64."""
    if params.repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return greedy_tokens(logits)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class TokenSampler:
    """The sampling state of a batch of sequences: their parameters, the generator their draws use (None: torch's
    global one) and, with a repetition penalty, the tokens each row holds (prompt and output so far)."""

    def __init__(self, params: SamplingParams, prompts: list[list[int]], vocab_size: int,
                 generator: torch.Generator | None = None):
        self.params, self.generator, self.seen = params, generator, None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool)
            for r, row in enumerate(prompts):
                self.seen[r, row] = True

    @property
    def argmax(self) -> bool:
        """Its next token is the logits' argmax (greedy, no penalty), so a caller may take it from a batch's."""
        return self.params.greedy and self.seen is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> the rows' next tokens [B] (int64), which join what each row holds."""
        # on the CPU, where the generator and the mask are (a CUDA backend's logits too: a [B, V] copy a step)
        tokens = next_tokens(logits.float().cpu(), self.params, self.generator, self.seen)
        if self.seen is not None:
            self.seen[torch.arange(len(tokens)), tokens] = True
        return tokens
