"""Export time for a 135M-parameter Llama-shaped model (SmolLM2-135M's config, random weights).

    python benchmarks/export_time.py [--attention decomposed,onnx,ort] [--threads 2]

Prints wall time per lowering, verification included, next to the time to load the checkpoint into
PyTorch measured in the same run (the floor any exporter pays). Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kvedge.export import ExportOptions, export
from kvedge.models import load_decoder
from kvedge.models.demo import write_demo_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", default="decomposed,onnx,ort")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=2048)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    work = Path(tempfile.mkdtemp(prefix="kvedge-bench-"))
    ckpt = write_demo_checkpoint(work / "smollm2-135m", "smollm2-135m")
    t = time.perf_counter()
    n = sum(x.numel() for x in load_decoder(ckpt).parameters())
    load_s = time.perf_counter() - t
    print(f"model: SmolLM2-135M shape, {n / 1e6:.1f}M parameters; load into PyTorch: {load_s:.1f} s")
    print(f"{'lowering':>12} {'export+verify s':>16} {'x load':>8} {'max abs err':>12} {'greedy':>7}")
    for low in a.attention.split(","):
        t = time.perf_counter()
        sc = export(ckpt, work / f"out-{low}", ExportOptions(attention=low, max_seq_len=a.max_seq_len, force=True))
        s = time.perf_counter() - t
        v = sc.verification
        print(f"{low:>12} {s:16.1f} {s / load_s:8.1f} {v['max_abs_error']:12.2e} {v['greedy_agreement']:7.0%}")


if __name__ == "__main__":
    main()
