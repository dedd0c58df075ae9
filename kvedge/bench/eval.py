"""`kvedge eval`: a model's quality on text, through any backend: perplexity, and top-1 agreement and mean
cosine of its logits against a reference model's, each position teacher-forced on the text.

The text is kvedge's built-in held-out text (never the calibration text: GPTQ and the int8 cache's scales
are fitted to that one), or a file. It is cut into rows of at most 256 tokens, each read from position 0;
every row's tokens go through the backend one decode step at a time, so the figures are those of the
cache-driven path the runtime serves, on every backend alike.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

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

    def to_json(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def teacher_forced(session: Session, rows: torch.Tensor, batch: int):
    """Yield (row indices, position t, logits [B, V] float64 predicting token t + 1), rows `batch` at a time,
    each batch from an empty cache."""
    be = session.backend
    for start in range(0, rows.shape[0], batch):
        part = rows[start:start + batch]
        be.reset()
        b = part.shape[0]
        for t in range(part.shape[1] - 1):
            logits = be.forward(part[:, t:t + 1], torch.full((b, 1), t), torch.zeros(b, dtype=torch.long))
            yield range(start, start + b), t, logits[:, -1].double()


def fit_rows(rows: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Rows no longer than a cache of max_seq_len (cut into more, shorter rows)."""
    if rows.shape[1] <= max_seq_len:
        return rows
    flat = rows.reshape(-1)
    n = flat.numel() // max_seq_len
    return flat[:n * max_seq_len].reshape(n, max_seq_len)


@torch.inference_mode()
def evaluate(session: Session, rows: torch.Tensor, text: dict, reference: Session | None = None) -> EvalReport:
    """Perplexity of `session` on token rows [R, L] (exp of the mean next-token negative log-likelihood over
    every row's predicted tokens, as transformers' loss with labels = input_ids), and against `reference`."""
    sessions = [session] + ([reference] if reference is not None else [])
    rows = fit_rows(rows, min(x.backend.max_seq_len for x in sessions))
    batch = min(x.backend.max_batch for x in sessions)  # both walk the same rows in step, one position at a time
    steps = zip(*(teacher_forced(x, rows, batch) for x in sessions))
    nll, ref_nll, agree, cos = 0.0, 0.0, 0, 0.0
    for (idx, t, logits), *ref in steps:
        target = rows[list(idx), t + 1]
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        if ref:
            r = ref[0][2]
            ref_nll += torch.nn.functional.cross_entropy(r, target, reduction="sum").item()
            agree += int((logits.argmax(-1) == r.argmax(-1)).sum())
            cos += torch.nn.functional.cosine_similarity(logits, r, dim=-1).sum().item()
    n = rows[:, 1:].numel()
    rep = EvalReport(session.backend.name, {**text, "rows": rows.shape[0], "row_length": rows.shape[1]}, n,
                     math.exp(nll / n))
    if reference is not None:
        rep.reference, rep.reference_perplexity = reference.backend.name, math.exp(ref_nll / n)
        rep.top1_agreement, rep.mean_cosine = agree / n, cos / n
    return rep
