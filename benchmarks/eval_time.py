"""kvedge eval's time against one forward pass over the same tokens, per backend, on a real export.

    python benchmarks/eval_time.py EXPORT_DIR [--tokens 512] [--backends onnxruntime,native] [--repeat 3]

EXPORT_DIR is a default `kvedge export` of a checkpoint or GGUF file (the native backend runs the export's
source, as `kvedge eval --backend native` does). Per backend: the eval of --tokens tokens of the built-in
held-out text (kvedge.bench.eval.evaluate: rows of 256, 64 positions a forward call, no reference model), one
forward pass over the same tokens as one row (its median of --repeat after a warm-up), and the loop eval ran
before 2026-12-05 (one decode step per token), with both perplexities. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from kvedge.artifact import Sidecar
from kvedge.bench.eval import evaluate
from kvedge.runtime import load
from kvedge.runtime.calibration import heldout_rows


@torch.inference_mode()
def token_at_a_time(session, rows: torch.Tensor) -> float:
    """The perplexity as eval computed it before 2026-12-05: rows `max_batch` at a time from an empty cache,
    every token one decode step."""
    be, nll, batch = session.backend, 0.0, session.backend.max_batch
    for start in range(0, rows.shape[0], batch):
        part = rows[start:start + batch]
        be.reset()
        b = part.shape[0]
        for t in range(part.shape[1] - 1):
            logits = be.forward(part[:, t:t + 1], torch.full((b, 1), t), torch.zeros(b, dtype=torch.long))
            nll += torch.nn.functional.cross_entropy(logits[:, -1].double(), part[:, t + 1], reduction="sum").item()
    return math.exp(nll / rows[:, 1:].numel())


@torch.inference_mode()
def one_forward(session, ids: torch.Tensor, repeat: int) -> float:
    be, times = session.backend, []
    for _ in range(repeat + 1):
        be.reset()
        t0 = time.perf_counter()
        be.forward(ids[None], torch.arange(ids.numel())[None], torch.tensor([ids.numel() - 1]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first is a warm-up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--backends", default="onnxruntime,native")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    source = Sidecar.read(a.export).extra["source_checkpoint"]
    for name in a.backends.split(","):
        path, kw = (a.export, {}) if name == "onnxruntime" else (source, {"max_seq_len": a.tokens})
        session = load(path, name, max_batch=4, threads=a.threads, **kw)  # eval's default --batch
        rows, text = heldout_rows(a.export, session.cfg, None, a.tokens)
        t0 = time.perf_counter()
        rep = evaluate(session, rows, text)
        eval_s = time.perf_counter() - t0
        forward_s = one_forward(load(path, name, max_batch=1, threads=a.threads, **kw), rows.reshape(-1), a.repeat)
        t0 = time.perf_counter()
        stepwise = token_at_a_time(session, rows)
        step_s = time.perf_counter() - t0
        print(f"{name}: {rows.shape[0]} rows of {rows.shape[1]}; eval {eval_s:.2f} s (forward calls "
              f"{rep.seconds:.2f} s), one forward over {rows.numel()} tokens {forward_s:.2f} s: "
              f"{eval_s / forward_s:.2f}x; perplexity {rep.perplexity:.4f}; one token a step {step_s:.1f} s, "
              f"perplexity {stepwise:.4f} (relative difference {abs(rep.perplexity - stepwise) / stepwise:.1e})",
              flush=True)


if __name__ == "__main__":
    main()
