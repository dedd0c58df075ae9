"""Session: one backend, its caches, the positions of each row, and the generation loop.

    s = kvedge.load("out/")                       # an export folder (onnxruntime) or a checkpoint (torch)
    print(s.generate("Once upon a time", max_new_tokens=32).texts[0])
    logits = s.prefill([[1, 2, 3]]); logits = s.decode([7])

Every input is checked before any state changes, so after an error the session is as it was.
The cache never overflows: a request that would not fit is refused up front (or, with
truncate=True, the prompt's oldest tokens are dropped to make room).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from kvedge.errors import KvedgeError
from kvedge.runtime.backend import Backend
from kvedge.runtime.sampling import SamplingParams, TokenSampler
from kvedge.runtime.tokenizer import Output, Tokenizer, eos_ids

Ids = Sequence[int] | Sequence[Sequence[int]] | torch.Tensor


def check_ids(row: list, vocab_size: int, what: str) -> None:
    """Raise KvedgeError unless `row` (`what`, for the message) is a non-empty list of token ids: ints, not
    bools, in [0, vocab_size). Session's inputs and kvedge serve's prompts alike."""
    if not row:
        raise KvedgeError(f"{what} is empty")
    for i, t in enumerate(row):
        if not isinstance(t, int) or isinstance(t, bool):
            raise KvedgeError(f"{t!r} at position {i} of {what} is not a token id (an int)")
        if not 0 <= t < vocab_size:
            raise KvedgeError(f"token id {t} at position {i} of {what} is outside the vocabulary [0, {vocab_size})")


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per row (prompt excluded)
    texts: list[str]  # decoded text per row ("" without a tokenizer)
    finish_reasons: list[str]  # "eos" | "stop" | "length"
    prompt_tokens: list[int]
    prefill_s: float
    decode_s: float
    decode_steps: int
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second per row over the decode steps (the first token comes from the prefill)."""
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        return sum(self.prompt_tokens) / self.prefill_s if self.prefill_s > 0 else float("nan")


class Session:
    def __init__(self, backend: Backend, tokenizer: Tokenizer | None = None, chunk_size: int = 512):
        if chunk_size < 1:
            raise KvedgeError(f"chunk_size must be >= 1, got {chunk_size}")
        self.backend, self.tokenizer, self.chunk_size = backend, tokenizer, chunk_size
        self.cfg = backend.cfg
        self.lengths = torch.zeros(backend.max_batch, dtype=torch.long)  # tokens held per row
        self.batch = 0
        self._zero_index = torch.zeros(backend.max_batch, dtype=torch.long)

    @property
    def max_seq_len(self) -> int:
        return self.backend.max_seq_len

    def reset(self) -> None:
        self.lengths.zero_()
        self.batch = 0

    # -- input checks (no state is touched before they pass) -------------------------------
    def _rows(self, ids: Ids) -> list[list[int]]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = list(ids)
        if not ids:
            raise KvedgeError("no input ids given")
        rows = [list(r) for r in ids] if isinstance(ids[0], (list, tuple)) else [list(ids)]
        if len(rows) > self.backend.max_batch:
            raise KvedgeError(f"batch {len(rows)} exceeds this session's max_batch {self.backend.max_batch}")
        for r, row in enumerate(rows):
            check_ids(row, self.cfg.vocab_size, f"row {r} of the input")
        return rows

    def _fit(self, rows: list[list[int]], reserve: int, truncate: bool) -> list[list[int]]:
        room = self.max_seq_len - reserve
        for r, row in enumerate(rows):
            if len(row) > room:
                if not truncate or room < 1:
                    raise KvedgeError(
                        f"row {r}: {len(row)} prompt tokens + {reserve} to generate exceed the cache's "
                        f"max_seq_len {self.max_seq_len}; shorten the prompt, lower max_new_tokens, export with a "
                        f"larger --max-seq-len, or drop the oldest prompt tokens (truncate=True; kvedge generate --truncate)")
                rows[r] = row[-room:]
        return rows

    # -- the two steps -----------------------------------------------------------------------
    def prefill(self, ids: Ids, truncate: bool = False, reserve: int = 0) -> torch.Tensor:
        """Start new sequences: run their prompts in chunks. Returns the last token's logits [B, V]."""
        rows = self._fit(self._rows(ids), reserve, truncate)
        self.reset()
        b = len(rows)
        self.batch = b
        lens = torch.tensor([len(r) for r in rows])
        longest = int(lens.max())
        out = torch.empty(b, self.cfg.vocab_size)
        padded = torch.zeros(b, longest, dtype=torch.long)
        for r, row in enumerate(rows):
            padded[r, :len(row)] = torch.tensor(row)
        chunk_size = self.chunk_size
        for start in range(0, longest, chunk_size):
            end = min(start + chunk_size, longest)
            chunk = padded[:, start:end]
            # A row shorter than this chunk is right-padded: its padding lands in slots past its
            # last token, invisible to it and overwritten by its decode steps; its logits are ignored.
            pos = torch.arange(start, end).expand(b, -1).contiguous()
            last = (lens - 1 - start).clamp(0, end - start - 1)
            logits = self.backend.forward(chunk, pos, last)[:, 0]
            here = (lens - 1 >= start) & (lens - 1 < end)
            out[here] = logits[here].float()
        self.lengths[:b] = lens
        return out

    def decode(self, next_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append one token per row; returns the next logits [B, V]."""
        if self.batch == 0:
            raise KvedgeError("decode before prefill: call prefill (or generate) first")
        t = torch.as_tensor(next_ids)
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:  # 2.7 or True would pass as 2 or 1
            raise KvedgeError(f"decode takes integer token ids, got {t.dtype}")
        t = t.to(torch.long).reshape(-1)
        if t.numel() != self.batch:
            raise KvedgeError(f"decode got {t.numel()} tokens for a batch of {self.batch}")
        v = self.cfg.vocab_size
        if bool((t < 0).any() | (t >= v).any()):
            raise KvedgeError(f"decode token ids {t.tolist()} are outside the vocabulary [0, {v})")
        if int(self.lengths[:self.batch].max()) >= self.max_seq_len:
            raise KvedgeError(f"the cache is full (max_seq_len {self.max_seq_len}); reset() or start a new prefill")
        return self._step(t)

    def _step(self, t: torch.Tensor) -> torch.Tensor:
        """decode without its checks: t [B] int64 ids in the vocabulary, and room in the cache (generate's own
        tokens, sampled from the logits, for a prompt _fit left room for)."""
        lengths = self.lengths[:self.batch]
        logits = self.backend.forward(t[:, None], lengths[:, None], self._zero_index[:self.batch])[:, 0]
        lengths += 1
        return logits

    # -- generation ----------------------------------------------------------------------------
    def _encode_prompts(self, prompt, chat: bool) -> list[list[int]]:
        if isinstance(prompt, torch.Tensor) or (isinstance(prompt, (list, tuple)) and prompt
                                                 and not isinstance(prompt[0], str)):
            return self._rows(prompt)
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if self.tokenizer is None:
            raise KvedgeError("text prompts need a tokenizer (tokenizer.json in the model folder); pass token ids")
        if chat:
            texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
            return self._rows([self.tokenizer.encode(t, add_special_tokens=False) for t in texts])
        return self._rows([self.tokenizer.encode(t) for t in texts])

    def stream(self, prompt, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
               stop: Sequence[str] = (), eos_token_id: int | Sequence[int] | None = -1, chat: bool = False,
               truncate: bool = False) -> Iterator[tuple[int, int, str]]:
        """Yield (row, token id, new text) as tokens are produced; see `generate` for the arguments."""
        result: list[GenerationResult] = []
        yield from self._run(prompt, max_new_tokens, sampling, stop, eos_token_id, chat, truncate, result)

    def generate(self, prompt, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                 stop: Sequence[str] = (), eos_token_id: int | Sequence[int] | None = -1, chat: bool = False,
                 truncate: bool = False, on_token: Callable[[int, int, str], None] | None = None) -> GenerationResult:
        """Generate for one prompt or a batch (text or ids). eos_token_id=-1 uses the model's; None disables.
        `on_token(row, token, new_text)` streams; `stop` strings end a row and are cut from its text."""
        result: list[GenerationResult] = []
        for event in self._run(prompt, max_new_tokens, sampling, stop, eos_token_id, chat, truncate, result):
            if on_token is not None:
                on_token(*event)
        return result[0]

    def _run(self, prompt, max_new_tokens, sampling, stop, eos_token_id, chat, truncate, result):
        sampling = sampling or SamplingParams()
        if max_new_tokens < 1:
            raise KvedgeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        rows = self._fit(self._encode_prompts(prompt, chat), max_new_tokens, truncate)
        eos = self._eos_ids(eos_token_id)
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        sample = TokenSampler(sampling, rows, self.cfg.vocab_size, gen)
        outs = [Output(self.tokenizer, stop, eos, max_new_tokens) for _ in rows]

        t0 = time.perf_counter()
        logits = self.prefill(rows)
        t1 = time.perf_counter()
        steps = 0
        while True:
            tokens = sample(logits)
            ids = tokens.tolist()
            for r, out in enumerate(outs):
                if out.finish is None:
                    new = out.add(ids[r])
                    if new or (self.tokenizer is None and out.finish != "eos"):  # ids alone: each but the EOS
                        yield r, ids[r], new
            if all(out.finish is not None for out in outs):
                break
            logits = self._step(tokens)  # checked already: sampled ids, and the room _fit kept
            steps += 1
        t2 = time.perf_counter()
        result.append(GenerationResult([o.tokens for o in outs], [o.text.text if o.text else "" for o in outs],
                                       [o.finish for o in outs], [len(r) for r in rows], t1 - t0, t2 - t1, steps))

    def _eos_ids(self, eos_token_id) -> frozenset[int]:
        if eos_token_id is None:
            return frozenset()
        if eos_token_id == -1:
            return eos_ids(self.cfg, self.tokenizer)
        return frozenset(int(i) for i in (eos_token_id if isinstance(eos_token_id, (list, tuple, set))
                                          else [eos_token_id]))
