"""`kvedge serve` under load: 1, 2, 4 and 8 concurrent streams on the native and onnxruntime backends.

    python benchmarks/serve_load.py [--backends native,onnxruntime] [--streams 1,2,4,8] [--rounds 3]
                                    [--prompt 32] [--gen 128] [--threads 2] [--gguf FILE] [--work DIR]
                                    [--prefill-chunk N] [--native-kv fp16]

Model: SmolLM2-135M's shape with random weights, int4: the native engine quantizes the checkpoint (symmetric
groups of 32, the lm_head too) and the onnxruntime backend runs the same as an `ort` export (--quantize int4
--symmetric --quantize-lm-head, --accuracy-level 4: int8 activations, as the native engine's). --gguf FILE runs
a real GGUF file instead (both backends keep its integers). One server per backend (`kvedge serve` in a
subprocess, --max-batch 8, so every run has the same server), warmed up with one round of every stream count.

A run of N streams: N clients start together, each streams one completion on its own prompt (--prompt tokens
of kvedge's held-out text), --gen tokens, greedy, EOS ignored; --rounds times. The server sends one chunk a
token, so a chunk's arrival time is its token's. Per N:
- aggregate decode tokens/s: the tokens all streams receive while all N are decoding (from the last stream's
  first token to the first stream's last), over that window;
- aggregate tokens/s: all tokens over the wall time from the requests' start to the last token (prefills in);
- time to first token p50 / p99 over the requests; inter-token latency p50 / p99 over every gap between a
  stream's consecutive tokens (those of a stream decoding while another's prompt is prefilled included), and
  "steady" p99 over the gaps inside the window where all N are decoding (no prefill then: the batched step);
- the ratios of the aggregate decode rate and of the ITL p99s to the 1-stream run of the same backend, measured
  in this invocation. Rounds of different N take turns, so a drift of the machine's speed falls on all alike.
Figures only; nothing is asserted. Run it on a quiet machine: the engine's OpenMP threads stall whenever
another process takes a core.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvedge.bench.latency import percentile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(path: Path, backend: str, a) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvedge.cli", "serve", str(path), "--backend", backend, "--port", str(port),
           "--max-batch", str(max(a.streams)), "--max-queue", "0", "--max-seq-len", str(a.prompt + a.gen),
           "--threads", str(a.threads), "--model-name", "bench", "--quiet"]
    if a.prefill_chunk:
        cmd += ["--prefill-chunk", str(a.prefill_chunk)]
    if a.native_kv and backend == "native":
        cmd += ["--kv-dtype", a.native_kv]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 600
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"kvedge serve ({backend}) did not start: {' '.join(cmd)}")
        time.sleep(0.5)


def stream(port: int, prompt: list[int], gen: int, start: threading.Barrier,
           prefix: str = "") -> tuple[float, list[float]]:
    """One streamed completion (POST {prefix}/v1/completions): (the time it was sent, each token's arrival time)."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start.wait()
    sent = time.perf_counter()
    conn.request("POST", f"{prefix}/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise SystemExit(f"the server answered {r.status}: {r.read()[:300]!r}")
    times = []
    for line in iter(r.readline, b""):
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                times.append(time.perf_counter())
    return sent, times


def one_round(port: int, prompts: list[list[int]], gen: int, prefix: str = "") -> list[tuple[float, list[float]]]:
    start = threading.Barrier(len(prompts))
    out: list = [None] * len(prompts)

    def run(i):
        try:
            out[i] = stream(port, prompts[i], gen, start, prefix)
        except BaseException as e:  # noqa: BLE001 - raised in the main thread below (a thread's would be lost)
            out[i] = e
            start.abort()  # the others waiting to start give up too

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in out if isinstance(r, BaseException) and not isinstance(r, threading.BrokenBarrierError)]
    if failed:
        raise SystemExit(f"a stream failed: {failed[0]}")
    return out


def summarize(rounds) -> dict:
    decode_rates, totals, ttft, itl, steady = [], [], [], [], []
    for streams in rounds:
        sent = min(s for s, _ in streams)
        lo, hi = max(t[0] for _, t in streams), min(t[-1] for _, t in streams)  # all N decoding
        gaps = [(a, b) for _, t in streams for a, b in zip(t, t[1:])]
        inside = [b - a for a, b in gaps if lo <= a and b <= hi]
        if hi > lo:
            decode_rates.append(len(inside) / (hi - lo))
        totals.append(sum(len(t) for _, t in streams) / (max(t[-1] for _, t in streams) - sent))
        ttft += [t[0] - s for s, t in streams]
        itl += [b - a for a, b in gaps]
        steady += inside
    return {"decode_tps": statistics.median(decode_rates) if decode_rates else float("nan"),
            "total_tps": statistics.median(totals), "ttft_p50": percentile(ttft, 0.5),
            "ttft_p99": percentile(ttft, 0.99), "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99),
            "steady_p99": percentile(steady or [float("nan")], 0.99)}


def models(a, work: Path) -> tuple[Path, dict[str, Path]]:
    """The model (a checkpoint or a GGUF file), and backend -> what its server loads."""
    from kvedge.export import ExportOptions, export
    from kvedge.models.demo import write_demo_checkpoint

    src = Path(a.gguf) if a.gguf else write_demo_checkpoint(work / "smollm2-135m", "smollm2-135m")
    paths = {}
    for backend in a.backends:
        if backend == "onnxruntime":
            out = work / f"ort-{src.stem}-{a.prompt + a.gen}"
            if not (out / "kvedge.json").is_file():
                print(f"exporting {src} to {out} (once)", file=sys.stderr)
                quant = {} if a.gguf else dict(quantize="int4", symmetric=True, quantize_lm_head=True,
                                               allow_degraded=True)
                export(src, out, ExportOptions(max_seq_len=a.prompt + a.gen, max_batch=max(a.streams), force=True,
                                               verify=False, accuracy_level=4, **quant))
            paths[backend] = out
        else:
            paths[backend] = src
    return src, paths


def prompts_for(src: Path, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of `length` token ids from kvedge's held-out text (the model's own tokenizer)."""
    from kvedge import models
    from kvedge.runtime.tokenizer import Tokenizer

    text = (Path(models.__file__).parent / "heldout.txt").read_text()
    ids = Tokenizer(src).encode(text, add_special_tokens=False)
    step = max(1, (len(ids) - length) // max(1, n))
    return [ids[i * step:i * step + length] for i in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="native,onnxruntime")
    p.add_argument("--streams", default="1,2,4,8", help="concurrent stream counts (the first is the baseline)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-chunk", type=int, help="kvedge serve --prefill-chunk (default: the server's)")
    p.add_argument("--native-kv", choices=("fp16", "int8"), help="the native server's cache dtype (default float32)")
    p.add_argument("--gguf", help="a real GGUF file instead of the random-weight SmolLM2-135M shape")
    p.add_argument("--work", help="folder for the checkpoint and the export (default: a temp dir)")
    a = p.parse_args()
    a.backends, a.streams = a.backends.split(","), [int(n) for n in a.streams.split(",")]
    work = Path(a.work or tempfile.mkdtemp(prefix="kvedge-serve-load-"))
    work.mkdir(parents=True, exist_ok=True)
    src, paths = models(a, work)
    prompts = prompts_for(src, max(a.streams), a.prompt)
    model = Path(a.gguf).name if a.gguf else "SmolLM2-135M shape (random weights), int4"
    print(f"{model}; prompt {a.prompt}, gen {a.gen}, greedy, EOS ignored; {a.threads} threads; "
          f"--max-batch {max(a.streams)}; native cache {a.native_kv or 'fp32'}; median of {a.rounds} rounds (tokens/s), "
          f"percentiles over all rounds")
    for backend in a.backends:
        proc, port = start_server(paths[backend], backend, a)
        try:
            for n in a.streams:  # warm-up: every shape once
                one_round(port, prompts[:n], min(a.gen, 16))
            runs = {n: [] for n in a.streams}
            for _ in range(a.rounds):
                for n in a.streams:
                    runs[n].append(one_round(port, prompts[:n], a.gen))
        finally:
            proc.terminate()
            proc.wait(30)
        base = summarize(runs[a.streams[0]])
        print(f"\n{backend}")
        print(f"{'streams':>7} {'decode tok/s':>12} {'x':>6} {'all tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'x':>6} {'steady p99':>10} {'x':>6}")
        for n in a.streams:
            s = summarize(runs[n])
            print(f"{n:>7} {s['decode_tps']:>12.1f} {s['decode_tps'] / base['decode_tps']:>5.2f}x "
                  f"{s['total_tps']:>10.1f} {s['ttft_p50'] * 1e3:>7.0f}ms {s['ttft_p99'] * 1e3:>7.0f}ms "
                  f"{s['itl_p50'] * 1e3:>6.1f}ms {s['itl_p99'] * 1e3:>6.1f}ms {s['itl_p99'] / base['itl_p99']:>5.2f}x "
                  f"{s['steady_p99'] * 1e3:>8.1f}ms {s['steady_p99'] / base['steady_p99']:>5.2f}x")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
