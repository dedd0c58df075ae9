"""`kvedge bench`: latency and memory per backend and configuration, with reports and plots.

Every figure says what it is:
- ttft_ms: prompt in -> first token chosen (prefill + sampling), per run;
- prefill_tokens_per_s: batch * prompt_len / prefill time;
- decode ms/token p50/p90/p99: each decode step timed alone (one token for every row);
  decode_tokens_per_s = 1000 / mean ms per step (per sequence), decode_tokens_per_s_total = that x batch;
- weights_bytes: parameter bytes (torch), initializer bytes in the ONNX file (onnxruntime), or what the
  native engine reads besides its caches (native);
- kv_formula_bytes (2 * layers * kv_heads * head_dim * bytes * max_seq_len * max_batch) and
  kv_allocated_bytes (the backend's cache tensors): they must agree; kv_max_seq_len and kv_max_batch, the
  cache's size (an export's is fixed at export, a checkpoint backend's is what the run needs);
- peak_rss_bytes: the process's peak resident set while this backend loaded and ran (Linux: VmHWM,
  reset before each backend through /proc/self/clear_refs); peak_gpu_bytes when a GPU is used.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from kvedge.models.cache import kv_cache_bytes


@dataclass
class Result:
    backend: str
    prompt_len: int
    batch: int
    gen_len: int
    ttft_ms: float
    prefill_tokens_per_s: float
    decode_ms_p50: float
    decode_ms_p90: float
    decode_ms_p99: float
    decode_ms_mean: float
    decode_tokens_per_s: float
    decode_tokens_per_s_total: float
    weights_bytes: int
    kv_formula_bytes: int
    kv_allocated_bytes: int
    peak_rss_bytes: int
    peak_gpu_bytes: int | None
    kv_max_seq_len: int = 0  # the cache's tokens a row and rows: backends of one run may differ (see plots)
    kv_max_batch: int = 0


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile of xs (q in [0, 1]), interpolated linearly between the two nearest ranks."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(session, prompt_len: int, batch: int, gen_len: int, warmup: int, repeat: int) -> dict:
    """Time prefill and each decode step; the median run (by total time) is reported."""
    vocab = session.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()
    runs = []
    for r in range(warmup + repeat):
        t0 = time.perf_counter()
        logits = session.prefill(prompts)
        nxt = logits.argmax(-1)
        ttft = time.perf_counter() - t0
        steps = []
        for _ in range(gen_len - 1):
            t = time.perf_counter()
            logits = session.decode(nxt)
            nxt = logits.argmax(-1)
            steps.append((time.perf_counter() - t) * 1e3)
        if r >= warmup:
            runs.append((ttft, steps))
    runs.sort(key=lambda x: x[0] + sum(x[1]) / 1e3)
    ttft, steps = runs[len(runs) // 2]
    mean = statistics.fmean(steps) if steps else float("nan")
    return dict(ttft_ms=ttft * 1e3, prefill_tokens_per_s=batch * prompt_len / ttft,
                decode_ms_p50=percentile(steps, 0.5), decode_ms_p90=percentile(steps, 0.9),
                decode_ms_p99=percentile(steps, 0.99), decode_ms_mean=mean,
                decode_tokens_per_s=1e3 / mean, decode_tokens_per_s_total=batch * 1e3 / mean)


def run(sessions: dict[str, Callable], prompt_lens: list[int], batches: list[int], gen_len: int,
        warmup: int = 1, repeat: int = 3, progress: Callable[[str], None] | None = None) -> list[Result]:
    """sessions: backend name -> a function opening that backend's Session (called once per backend)."""
    results = []
    total = len(sessions) * len(prompt_lens) * len(batches)
    done = 0
    for name, open_session in sessions.items():
        reset_peak_rss()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        session = open_session()
        be = session.backend
        kv_alloc = sum(t.numel() * t.element_size() for t in be.cache_tensors())
        cache_dtype = be.cache_tensors()[0].dtype
        kv_formula = kv_cache_bytes(session.cfg, be.max_seq_len, be.max_batch, cache_dtype)
        w = be.weights_bytes()
        for pl in prompt_lens:
            for b in batches:
                done += 1
                if progress:
                    bar = "#" * (20 * done // total)
                    progress(f"[{bar:<20}] {done}/{total} {name} prompt {pl} batch {b} gen {gen_len}")
                m = measure(session, pl, b, gen_len, warmup, repeat)
                gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
                results.append(Result(name, pl, b, gen_len, **m, weights_bytes=w, kv_formula_bytes=kv_formula,
                                      kv_allocated_bytes=kv_alloc, peak_rss_bytes=peak_rss(), peak_gpu_bytes=gpu,
                                      kv_max_seq_len=be.max_seq_len, kv_max_batch=be.max_batch))
        del session
    return results


# -- reports -----------------------------------------------------------------------------------
COLUMNS = [("backend", "{}"), ("prompt_len", "{}"), ("batch", "{}"), ("ttft_ms", "{:.1f}"),
           ("prefill_tokens_per_s", "{:.0f}"), ("decode_ms_p50", "{:.2f}"), ("decode_ms_p90", "{:.2f}"),
           ("decode_ms_p99", "{:.2f}"), ("decode_tokens_per_s", "{:.1f}"), ("peak_rss_bytes", "{}")]


def table(results: list[Result]) -> str:
    def fmt(r, key, f):
        v = getattr(r, key)
        return f"{v / 2**20:.0f} MiB" if key == "peak_rss_bytes" else f.format(v)

    rows = [[k.replace("_bytes", "").replace("_", " ") for k, _ in COLUMNS]]
    rows += [[fmt(r, k, f) for k, f in COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def write_reports(results: list[Result], out: Path, context: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) for r in results]
    paths = [out / "bench.json", out / "bench.csv", out / "bench.md"]
    paths[0].write_text(json.dumps({"context": context, "results": rows}, indent=2))
    with paths[1].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    md = ["# kvedge bench", "", "Context: " + ", ".join(f"{k}={v}" for k, v in context.items()), "",
          "```", table(results), "```", "", "Memory (MiB; bytes in bench.json):", "",
          "| backend | KV cache size | weights | KV (formula) | KV (allocated) | peak RSS | peak GPU |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in _first_per_backend(results):
        gpu = f"{r.peak_gpu_bytes / 2**20:.1f}" if r.peak_gpu_bytes is not None else "no GPU"
        md.append(f"| {r.backend} | {_cache_size(r)} | {r.weights_bytes / 2**20:.1f} | "
                  f"{r.kv_formula_bytes / 2**20:.1f} | {r.kv_allocated_bytes / 2**20:.1f} | "
                  f"{r.peak_rss_bytes / 2**20:.1f} | {gpu} |")
    md += ["", "TTFT: prefill plus choosing the first token. Decode latency: one step for every row, timed "
           "alone; tokens/s = 1000 / mean ms per step, per sequence. Peak RSS: this process while the backend "
           "loaded and ran (VmHWM)."]
    paths[2].write_text("\n".join(md) + "\n")
    paths += plots(results, out)
    return paths


def _first_per_backend(results: list[Result]) -> list[Result]:
    """One result per backend, in the order they ran (memory figures are the backend's, whatever the run)."""
    return list({r.backend: r for r in reversed(results)}.values())[::-1]


def _cache_size(r: Result) -> str:
    return f"{r.kv_max_seq_len} tokens x {r.kv_max_batch} rows"


def plots(results: list[Result], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvedge bench: matplotlib is not installed; no plots (pip install 'kvedge[bench]')", file=sys.stderr)
        return []
    backends = sorted({r.backend for r in results})
    # one colour per backend in every plot; in the latency plot the line style tells decode from TTFT
    colour = {be: f"C{i}" for i, be in enumerate(backends)}
    paths: list[Path] = []

    def save(fig, ax, name: str, ylabel: str, title: str, legend: bool = True) -> None:
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if legend:
            ax.legend()
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    smallest = min(x.batch for x in results)
    for be in backends:
        rs = sorted((r for r in results if r.backend == be and r.batch == smallest), key=lambda r: r.prompt_len)
        ax.plot([r.prompt_len for r in rs], [r.decode_ms_p50 for r in rs], marker="o", color=colour[be],
                label=f"{be} decode p50")
        ax.plot([r.prompt_len for r in rs], [r.ttft_ms for r in rs], marker="s", ls="--", color=colour[be],
                label=f"{be} TTFT")
    ax.set_xlabel("context (prompt tokens)")
    save(fig, ax, "latency_vs_context.png", "ms", f"latency against context length (batch {smallest})")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(len(results)), [r.decode_tokens_per_s_total for r in results],
           color=[colour[r.backend] for r in results])
    ax.set_xticks(range(len(results)), [f"{r.backend}\np{r.prompt_len} b{r.batch}" for r in results], fontsize=7)
    save(fig, ax, "tokens_per_s.png", "decode tokens/s (all rows)", "decode throughput per backend", legend=False)

    fig, ax = plt.subplots(figsize=(6, 4))
    first = {r.backend: r for r in reversed(results)}
    w = [first[b].weights_bytes / 2**20 for b in backends]
    kv = [first[b].kv_allocated_bytes / 2**20 for b in backends]
    other = [max(first[b].peak_rss_bytes / 2**20 - wi - ki, 0) for b, wi, ki in zip(backends, w, kv)]
    # the parts are told apart by hatching, the backends by their colour, as in the other plots; each bar says
    # how large its cache is: an export's is fixed at export, a checkpoint backend's is sized to the run
    x = range(len(backends))
    ax.bar(x, w, color=[colour[b] for b in backends], label="weights")
    ax.bar(x, kv, bottom=w, color=[colour[b] for b in backends], alpha=0.6, hatch="//", label="KV cache (allocated)")
    ax.bar(x, other, bottom=[a + b for a, b in zip(w, kv)], color=[colour[b] for b in backends], alpha=0.3,
           hatch="..", label="rest of peak RSS")
    ax.set_xticks(list(x), [f"{b}\nKV {first[b].kv_max_seq_len} tok x {first[b].kv_max_batch}" for b in backends],
                  fontsize=8)
    sizes = {(first[b].kv_max_seq_len, first[b].kv_max_batch) for b in backends}
    save(fig, ax, "memory.png", "MiB", "memory breakdown" + ("" if len(sizes) == 1 else
                                                             " (KV caches differ in size: see each bar)"))
    return paths
