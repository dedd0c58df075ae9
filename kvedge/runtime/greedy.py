"""A minimal greedy loop over the torch Decoder and a preallocated cache (the torch reference path)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvedge.errors import KvedgeError
from kvedge.models import Decoder, KVCache


@dataclass
class GreedyResult:
    tokens: list[int]
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.tokens) - 1, 0)  # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 else float("nan")


@torch.inference_mode()
def greedy(model: Decoder, prompt: list[int], max_new_tokens: int, cache: KVCache,
           eos_token_id: int | None = None, on_token=None) -> GreedyResult:
    """Prefill `prompt`, then decode greedily until eos or max_new_tokens, writing the cache in place."""
    if not prompt:
        raise KvedgeError("prompt is empty: give at least one token")
    if len(prompt) + max_new_tokens > cache.max_seq_len:
        raise KvedgeError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the cache's "
                          f"max_seq_len ({cache.max_seq_len})")
    layers = cache.for_batch(1)
    t0 = time.perf_counter()
    ids = torch.tensor([prompt])
    logits = model(ids, torch.arange(len(prompt))[None], layers, logit_index=torch.tensor([len(prompt) - 1]))
    t1 = time.perf_counter()
    tokens: list[int] = []
    pos = torch.tensor([[len(prompt)]])
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        tokens.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if nxt == eos_token_id or len(tokens) == max_new_tokens:
            break
        logits = model(torch.tensor([[nxt]]), pos, layers)
        pos += 1
    return GreedyResult(tokens, t1 - t0, time.perf_counter() - t1)
