"""The native engine's decode step called from the main thread and from another thread, in one process.

    python benchmarks/engine_thread.py [--rows 1,8] [--steps 60] [--rounds 5] [--threads 2] [--gguf FILE]

A server calls the engine from its scheduler thread while the main thread keeps the OpenMP team that torch
made there (loading the model runs torch on every core). libgomp then counts more OpenMP threads than cores and
its own barriers sleep in the kernel at once, which is why the engine synchronizes with its own barrier
(kvedge_cpu.c: sync_team). This measures both callers: decode steps at positions 32.. of --rows rows, on the
main thread and on a fresh thread, --rounds times in turn; median step time of each. Model: SmolLM2-135M's shape
with random weights, int4 (the native engine's default), or --gguf FILE. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvedge.models.demo import write_demo_checkpoint
from kvedge.runtime import load


def steps(backend, rows: int, n: int) -> float:
    """Median seconds of n decode steps of `rows` rows."""
    times = []
    for i in range(n):
        ids, pos = torch.full((rows, 1), 5), torch.full((rows, 1), 32 + i)
        t = time.perf_counter()
        backend.forward(ids, pos, torch.zeros(rows, dtype=torch.long))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def on_a_thread(fn, *args) -> float:
    out = []
    worker = threading.Thread(target=lambda: out.append(fn(*args)))
    worker.start()
    worker.join()
    return out[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gguf", help="a GGUF file instead of the random-weight SmolLM2-135M shape")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    path = Path(a.gguf) if a.gguf else write_demo_checkpoint(Path(tempfile.mkdtemp()) / "m", "smollm2-135m")
    backend = load(path, "native", max_batch=max(rows), max_seq_len=32 + a.steps + 1, threads=a.threads).backend
    torch.ones(1 << 20).sum()  # torch's team on the main thread, as after a model load
    model = path.name if a.gguf else "SmolLM2-135M shape (random weights), int4"
    print(f"{model}: decode step, median of {a.steps} steps, median of {a.rounds} rounds; {a.threads} threads")
    print(f"{'rows':>4} {'main thread ms':>15} {'another thread ms':>18} {'ratio':>6}")
    for r in rows:
        main_s, other_s = [], []
        for _ in range(a.rounds):
            main_s.append(steps(backend, r, a.steps))
            other_s.append(on_a_thread(steps, backend, r, a.steps))
        m, o = statistics.median(main_s), statistics.median(other_s)
        print(f"{r:>4} {m * 1e3:>15.2f} {o * 1e3:>18.2f} {o / m:>6.2f}")


if __name__ == "__main__":
    main()
