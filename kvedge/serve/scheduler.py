"""The scheduler of `kvedge serve`: one thread owns the backend and steps every request in flight together.

Continuous batching over the backend's cache rows (its max_batch):
- Admission: at each step boundary, waiting requests take free rows, oldest first. At most `max_queue`
  requests wait; past that, `submit` raises QueueFull at once (the server's 429).
- Prefill: a prompt goes in in chunks cut at fixed offsets 0, C, 2C, ... (C = chunk_size). A step runs chunks
  of the oldest prefilling requests, at least one and at most C tokens in all, then one decode step, so rows
  already decoding keep getting a token per step while a long prompt goes in. The step's chunks on consecutive
  rows run as one forward over those rows (Backend.forward's first_row), each right-padded to the longest,
  while padding takes at most a fifth of the forward's slots and the forward at most C; others run on their row
  alone. A burst of new requests then reads the weights once and gets its first tokens at one step. A row's
  padding lands past its chunk, where its own next chunk or token overwrites it before anything reads it.
- Decode: one forward over the cache rows lo..hi spanning every decoding row. A row in that span that is
  not decoding gets a padding token at its next free slot (a free row: at slot 0); it lands past the
  row's last token, where nothing reads it before that row's own next chunk or token overwrites it.
- A row is freed when its request ends (max_tokens, an end-of-sequence token, a stop string) or is
  cancelled (its client went away); the next waiting request takes it at the next step boundary.

Batching does not change results: a request's chunks are the same whatever else runs, a backend computes a
row from that row's inputs and cache only (tests/serve/test_rows: bitwise on onnxruntime and native, padded
or not), and each request samples with its own generator (tests/serve check the tokens alone and among others
against a plain Session).
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvedge.errors import KvedgeError
from kvedge.runtime.backend import Backend
from kvedge.runtime.sampling import SamplingParams, TokenSampler, greedy_tokens
from kvedge.runtime.session import check_ids
from kvedge.runtime.tokenizer import Output, Tokenizer

# Prompt tokens a step prefills (kvedge serve --prefill-chunk): enough for a burst of short prompts to go in at one
# step, so a decoding row waits once for all of them rather than once per chunk of 64 (docs/serve.md)
PREFILL_CHUNK = 256


log = logging.getLogger("kvedge.serve")


class QueueFull(KvedgeError):
    """Every cache row is busy and the waiting queue is full."""


@dataclass
class Event:
    """What a request gets from the scheduler, in order: one event a token with the text it made certain (empty
    while a character is incomplete or a stop string may be starting), then one with finish set ("stop",
    "length" or "error", with the error's message)."""

    text: str = ""
    finish: str | None = None
    error: str = ""
    completion_tokens: int = 0


@dataclass(eq=False)
class Job:
    """One request. `emit` is called on the scheduler's thread with each Event (the last has finish set)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    eos: frozenset[int] = frozenset()
    emit: Callable[[Event], None] = lambda event: None
    cancelled: bool = False  # set by any thread (Scheduler.cancel); the scheduler frees the row
    # the scheduler's own state
    row: int = -1
    filled: int = 0  # prompt tokens in the cache
    out: Output | None = None  # its tokens and text so far, and why it ended
    finish: str | None = None  # "stop" (an EOS or a stop string), "length", "error" or "cancelled"
    order: int = 0
    sample: TokenSampler | None = None
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: float = 0.0


class Scheduler:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, *, max_queue: int = 16,
                 chunk_size: int = PREFILL_CHUNK, metrics=None):
        if max_queue < 0 or chunk_size < 1:
            raise KvedgeError(f"max_queue must be >= 0 and chunk_size >= 1, got {max_queue} and {chunk_size}")
        if not getattr(backend, "in_place", True):  # kvedge.runtime.backend: rows outside a call would go stale
            raise KvedgeError(f"the {backend.name} backend double-buffers its cache, so a call must cover every row "
                              f"that holds a request; kvedge serve runs rows independently and needs an in-place "
                              f"cache (TensorRT's own KV-cache update, or the plugin lowering)")
        self.backend, self.tokenizer, self.metrics = backend, tokenizer, metrics
        self.max_queue, self.chunk_size = max_queue, chunk_size
        self.rows: list[Job | None] = [None] * backend.max_batch
        self.waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        if metrics is not None:
            metrics.watch(self)

    @property
    def max_seq_len(self) -> int:
        return self.backend.max_seq_len

    @property
    def alive(self) -> bool:
        """The scheduler's thread is running (a replica's health check)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def running(self) -> int:
        return sum(job is not None for job in self.rows)

    # -- called from any thread ----------------------------------------------------------------------------
    def check(self, job: Job) -> None:
        """Raise KvedgeError (the server's 400) unless the job can run: ids in the vocabulary, prompt +
        max_tokens within the cache."""
        n = len(job.prompt)
        check_ids(job.prompt, self.backend.cfg.vocab_size, "the prompt")
        if job.max_tokens < 1:
            raise KvedgeError(f"max_tokens must be >= 1, got {job.max_tokens}")
        if n + job.max_tokens > self.max_seq_len:
            raise KvedgeError(f"the prompt's {n} tokens + max_tokens {job.max_tokens} exceed the context length "
                              f"{self.max_seq_len}; shorten the prompt or lower max_tokens")

    def submit(self, job: Job) -> None:
        """Check a job and queue it; QueueFull when max_queue jobs already wait (past the free rows)."""
        self.check(job)
        seed = job.sampling.seed
        generator = torch.Generator().manual_seed(seed if seed is not None else random.randrange(2 ** 63))
        job.sample = TokenSampler(job.sampling, [job.prompt], self.backend.cfg.vocab_size, generator)
        job.out = Output(self.tokenizer, job.stop, job.eos, job.max_tokens)
        with self._cond:
            if self._closed:
                raise KvedgeError("the server is shutting down")
            if len(self.waiting) >= self.max_queue + self.rows.count(None):  # free rows take some at the next step
                raise QueueFull(f"all {len(self.rows)} rows are busy and {self.max_queue} requests are waiting "
                                f"(--max-queue); retry later")
            job.order = next(self._order)
            self.waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The job's client went away: a waiting job leaves the queue now (its place is free for the next
        request), a running one frees its row at the next step boundary (no more events). A job that has
        finished is left as it is."""
        if job.finish is not None:
            return
        job.cancelled = True
        with self._cond:
            if job in self.waiting:
                self.waiting.remove(job)
                self._end(job, "cancelled")
            self._cond.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvedge-scheduler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; every job still queued or running ends with an error event."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        for job in [*self.waiting, *(j for j in self.rows if j is not None)]:
            self._end(job, "error", "the server is shutting down")
        self.waiting.clear()

    # -- the scheduler's thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self.waiting and not any(self.rows):
                    self._cond.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a bug here must not stop the server: end what runs, go on
                log.exception("kvedge serve: the scheduler's step failed")
                for job in self.rows:
                    if job is not None:
                        self._end(job, "error", f"{type(e).__name__}: {e}")

    def admit(self) -> None:
        """Give free rows to waiting jobs, oldest first (a step boundary)."""
        with self._cond:
            for r in range(len(self.rows)):
                while self.rows[r] is None and self.waiting:
                    job = self.waiting.popleft()
                    if job.cancelled:
                        self._end(job, "cancelled")
                        continue
                    job.row, self.rows[r] = r, job

    def step(self) -> None:
        """One step: free cancelled rows, admit, prefill chunks (up to chunk_size tokens), one decode step. A
        backend failure ends the jobs of that forward with an error; the others go on."""
        for job in self.rows:
            if job is not None and job.cancelled:
                self._end(job, "cancelled")
        self.admit()
        chunks, used = [], 0
        for job in sorted((j for j in self.rows if j is not None and j.filled < len(j.prompt)),
                          key=lambda j: j.order):
            n = min(self.chunk_size, len(job.prompt) - job.filled)
            if used and used + n > self.chunk_size:
                break
            used += n
            chunks.append((job, n))
        for run in self._forwards(chunks):
            self._guard([job for job, _ in run], self._prefill, run)
        decoding = [j for j in self.rows if j is not None and j.filled == len(j.prompt) and j.out.tokens]
        if decoding:
            self._guard(decoding, self._decode, decoding)

    def _guard(self, jobs: list[Job], fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported to the requests it hit; the server goes on
            for job in jobs:
                if job.finish is None:
                    self._end(job, "error", f"{type(e).__name__}: {e}")

    def _forwards(self, chunks: list[tuple[Job, int]]) -> list[list[tuple[Job, int]]]:
        """A step's prefill chunks (job, tokens) as forwards, oldest first: runs of consecutive rows, each chunk
        padded to the run's longest, joined while padding takes at most a fifth of the run's slots, the run at most
        chunk_size slots, and every padded position lies within the cache."""
        runs: list[list[tuple[Job, int]]] = []
        for job, n in sorted(chunks, key=lambda c: c[0].row):
            run = runs[-1] if runs and runs[-1][-1][0].row + 1 == job.row else None
            if run is not None:
                joined = [*run, (job, n)]
                longest, tokens = max(m for _, m in joined), sum(m for _, m in joined)
                if (len(joined) * longest <= min(self.chunk_size, tokens * 5 // 4)
                        and all(j.filled + longest <= self.max_seq_len for j, _ in joined)):
                    run.append((job, n))
                    continue
            runs.append([(job, n)])
        return sorted(runs, key=lambda run: min(job.order for job, _ in run))

    def _prefill(self, run: list[tuple[Job, int]]) -> None:
        """One forward over the chunks of consecutive rows, right-padded to the longest; a job whose prompt is then
        all in gets its first token."""
        longest = max(n for _, n in run)
        ids, pos = torch.zeros(len(run), longest, dtype=torch.long), torch.empty(len(run), longest, dtype=torch.long)
        for r, (job, n) in enumerate(run):
            ids[r, :n] = torch.tensor(job.prompt[job.filled:job.filled + n])
            pos[r] = torch.arange(job.filled, job.filled + longest)
        logits = self.backend.forward(ids, pos, torch.tensor([n - 1 for _, n in run]), first_row=run[0][0].row)
        for r, (job, n) in enumerate(run):
            job.filled += n
            if job.filled == len(job.prompt):
                self._add(job, int(job.sample(logits[r:r + 1, 0])[0]))

    def _decode(self, jobs: list[Job]) -> None:
        lo, hi = min(j.row for j in jobs), max(j.row for j in jobs) + 1
        ids, pos = [0] * (hi - lo), [0] * (hi - lo)
        for r, job in enumerate(self.rows[lo:hi]):
            if job is None:
                continue
            if job.out.tokens:  # decoding: its last token goes in at the slot after the ones it holds
                ids[r], pos[r] = job.out.tokens[-1], len(job.prompt) + len(job.out.tokens) - 1
            else:  # prefilling: padding at its next free slot, overwritten by its next chunk
                pos[r] = job.filled
        # built from lists, not with torch.zeros, which releases the GIL (kvedge.runtime.backend.int64_inputs)
        logits = self.backend.forward(torch.tensor(ids)[:, None], torch.tensor(pos)[:, None],
                                      torch.tensor([0] * (hi - lo)), first_row=lo)[:, 0]
        best = greedy_tokens(logits).tolist() if any(j.sample.argmax for j in jobs) else None  # greedy rows' tokens
        for job in jobs:
            r = job.row - lo
            self._add(job, best[r] if job.sample.argmax else int(job.sample(logits[r:r + 1])[0]))

    def _add(self, job: Job, token: int) -> None:
        """The job's next token: one text event (possibly empty), then its end if it is the last."""
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.token(now - (job.last_token_at or job.arrived), first=not job.out.tokens)
        job.last_token_at = now
        self._emit(job, Event(job.out.add(token)))
        if job.out.finish is not None:  # OpenAI's finish reasons: an EOS token is a "stop"
            self._end(job, "length" if job.out.finish == "length" else "stop")

    def _end(self, job: Job, finish: str, error: str = "") -> None:
        """The job's last event (none to a cancelled job's client, who is gone); its row is free from now on."""
        job.finish = finish
        if 0 <= job.row < len(self.rows) and self.rows[job.row] is job:
            self.rows[job.row] = None
        if self.metrics is not None:
            self.metrics.finished(job, finish)
        if finish != "cancelled":
            self._emit(job, Event(finish=finish, error=error, completion_tokens=len(job.out.tokens) if job.out else 0))

    def _emit(self, job: Job, event: Event) -> None:
        try:
            job.emit(event)
        except Exception:  # noqa: BLE001 - its listener is gone (the server's loop closed): stop the job
            job.cancelled = True
