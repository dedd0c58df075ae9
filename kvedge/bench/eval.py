"""`kvedge eval`: a model's quality on text, through any backend: perplexity, and top-1 agreement and mean
cosine of its logits against a reference model's, each position teacher-forced on the text.

The text is kvedge's built-in held-out text (never the calibration text: GPTQ and the int8 cache's scales
are fitted to that one), or a file. It is cut into rows of at most 256 tokens, each read from position 0
through the backend's cache, in chunks of up to LOGITS_CHUNK tokens: one forward per chunk, which returns the
logits of every position of it (the graph contract's logits_index [batch, logits]). Teacher forcing needs no
token the model chose, so a row costs a few prefill calls, not one decode step per token, on every backend
alike; the figures are those of the cache-driven path the runtime serves.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from kvedge.artifact import LOGITS_CHUNK
from kvedge.runtime.session import Session


@dataclass
class EvalReport:
    backend: str
    text: dict  # what the rows are (kvedge.runtime.calibration.text_rows)
    predicted_tokens: int
    perplexity: float
    reference: str | None = None
    reference_perplexity: float | None = None
    top1_agreement: float | None = None  # share of positions where both models' argmax agree
    mean_cosine: float | None = None  # of the two models' logits, over positions
    seconds: float | None = None  # in the backend's forward calls
    reference_seconds: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def teacher_forced(session: Session, rows: torch.Tensor, batch: int, chunk: int = LOGITS_CHUNK):
    """Yield (row indices, first position t, logits [B, n, V] float64 of positions t .. t + n - 1, each predicting
    the token after it, seconds the forward took), rows `batch` at a time, each batch from an empty cache and fed
    `chunk` tokens a call. A row's last token is never fed: nothing follows it to predict."""
    be = session.backend
    for start in range(0, rows.shape[0], batch):
        part = rows[start:start + batch]
        be.reset()
        b = part.shape[0]
        for t in range(0, part.shape[1] - 1, chunk):
            n = min(chunk, part.shape[1] - 1 - t)
            t0 = time.perf_counter()
            logits = be.forward(part[:, t:t + n], torch.arange(t, t + n).expand(b, n),
                                torch.arange(n).expand(b, n))
            seconds = time.perf_counter() - t0
            yield range(start, start + b), t, logits.double(), seconds


def fit_rows(rows: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Rows no longer than a cache of max_seq_len (cut into more, shorter rows)."""
    if rows.shape[1] <= max_seq_len:
        return rows
    flat = rows.reshape(-1)
    n = flat.numel() // max_seq_len
    return flat[:n * max_seq_len].reshape(n, max_seq_len)


@torch.inference_mode()
def evaluate(session: Session, rows: torch.Tensor, text: dict, reference: Session | None = None,
             progress: Callable[[int, int, float], None] | None = None) -> EvalReport:
    """Perplexity of `session` on token rows [R, L] (exp of the mean next-token negative log-likelihood over
    every row's predicted tokens, as transformers' loss with labels = input_ids), and against `reference`.
    progress(tokens scored, of how many, running perplexity) after each chunk."""
    sessions = [session] + ([reference] if reference is not None else [])
    rows = fit_rows(rows, min(x.backend.max_seq_len for x in sessions))
    batch = min(x.backend.max_batch for x in sessions)  # both walk the same rows in step, a chunk at a time
    steps = zip(*(teacher_forced(x, rows, batch) for x in sessions))
    n = rows[:, 1:].numel()
    nll, ref_nll, agree, cos, done, seconds, ref_seconds = 0.0, 0.0, 0, 0.0, 0, 0.0, 0.0
    for (idx, t, logits, s), *ref in steps:
        target = rows[list(idx), t + 1:t + 1 + logits.shape[1]]
        flat = logits.reshape(-1, logits.shape[-1])
        nll += torch.nn.functional.cross_entropy(flat, target.reshape(-1), reduction="sum").item()
        seconds += s
        if ref:
            r = ref[0][2].reshape(flat.shape)
            ref_seconds += ref[0][3]
            ref_nll += torch.nn.functional.cross_entropy(r, target.reshape(-1), reduction="sum").item()
            agree += int((flat.argmax(-1) == r.argmax(-1)).sum())
            cos += torch.nn.functional.cosine_similarity(flat, r, dim=-1).sum().item()
        done += target.numel()
        if progress is not None:
            progress(done, n, math.exp(nll / done))
    rep = EvalReport(session.backend.name, {**text, "rows": rows.shape[0], "row_length": rows.shape[1]}, n,
                     math.exp(nll / n), seconds=seconds)
    if reference is not None:
        rep.reference, rep.reference_perplexity = reference.backend.name, math.exp(ref_nll / n)
        rep.top1_agreement, rep.mean_cosine, rep.reference_seconds = agree / n, cos / n, ref_seconds
    return rep
