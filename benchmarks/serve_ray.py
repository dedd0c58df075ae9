"""`kvedge serve --ray` on this machine: 2 replicas x 1 thread against 1 replica x 2 threads, and what Ray's
path adds per token against the single-process server.

    python benchmarks/serve_ray.py [--streams 1,2,4,8] [--rounds 3] [--prompt 32] [--gen 128] [--gguf FILE]

Three servers of the same model on the native backend, all up for the whole run (an idle one costs nothing but
Ray's health checks), each with --max-batch max(streams) per replica:
- plain x2, plain x1: `kvedge serve --threads 2` and `--threads 1` in subprocesses, no Ray;
- ray 1x2: one Ray Serve replica with 2 threads; ray 2x1: two replicas with 1 thread each; both applications of
  one local Ray instance, behind its one proxy (route prefixes /r1x2 and /r2x1).
A round of N streams is benchmarks/serve_load.py's: N clients start together, each streams --gen tokens of its
own prompt, greedy, EOS ignored. Rounds take turns over the servers and stream counts, --rounds times; figures
are medians (tokens/s) and percentiles over all rounds. Per N: the aggregate decode tokens/s while all N decode,
time to first token and inter-token latency p50; then 2x1 against 1x2, and ray 1x2 against plain at one stream:
and ray 2x1 against plain x1 (one thread each: a core is left for the proxy): the per-token latency Ray's
proxy and actor calls add. Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import free_port, models, one_round, prompts_for, start_server, summarize  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="1,2,4,8", help="concurrent stream counts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    p.add_argument("--gguf", help="a real GGUF file instead of the random-weight SmolLM2-135M shape")
    p.add_argument("--work", help="folder for the checkpoint (default: a temp dir)")
    a = p.parse_args()
    a.streams, a.backends, a.threads, a.prefill_chunk, a.native_kv = [int(n) for n in a.streams.split(",")], \
        ["native"], 2, None, None
    import ray

    from kvedge.serve import cluster

    work = Path(a.work or tempfile.mkdtemp(prefix="kvedge-serve-ray-"))
    work.mkdir(parents=True, exist_ok=True)
    src, paths = models(a, work)
    prompts = prompts_for(src, max(a.streams), a.prompt)
    rows = max(a.streams)
    procs, servers = [], {}
    for a.threads in (2, 1):
        proc, plain_port = start_server(paths["native"], "native", a)
        procs.append(proc)
        servers[f"plain x{a.threads}"] = (plain_port, "")
    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    port = free_port()
    try:
        for name, replicas, threads in (("r1x2", 1, 2), ("r2x1", 2, 1)):
            cluster.start(str(paths["native"]), {"backend": "native", "max_batch": rows, "threads": threads,
                                                 "max_seq_len": a.prompt + a.gen},
                          {"model_name": "bench"}, port=port, placement=cluster.Placement(cpus=threads),
                          scaling=cluster.Scaling(replicas=replicas), max_queue=0, name=name,
                          route_prefix=f"/{name}")
            servers[f"ray {replicas}x{threads}"] = (port, f"/{name}")
        for server_port, prefix in servers.values():  # warm-up: every shape once
            for n in a.streams:
                one_round(server_port, prompts[:n], min(a.gen, 16), prefix)
        runs = {(s, n): [] for s in servers for n in a.streams}
        for _ in range(a.rounds):
            for n in a.streams:
                for s, (server_port, prefix) in servers.items():
                    runs[s, n].append(one_round(server_port, prompts[:n], a.gen, prefix))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        ray.shutdown()
    model = Path(a.gguf).name if a.gguf else "SmolLM2-135M shape (random weights), int4"
    print(f"{model}, native backend; prompt {a.prompt}, gen {a.gen}, greedy, EOS ignored; --max-batch {rows} per "
          f"replica; median of {a.rounds} rounds (tokens/s), percentiles over all rounds; {os.cpu_count()} cores")
    print(f"{'server':>9} {'streams':>7} {'decode tok/s':>12} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8}")
    stats = {k: summarize(v) for k, v in runs.items()}
    for s in servers:
        for n in a.streams:
            t = stats[s, n]
            print(f"{s:>9} {n:>7} {t['decode_tps']:>12.1f} {t['ttft_p50'] * 1e3:>7.0f}ms {t['itl_p50'] * 1e3:>6.1f}ms "
                  f"{t['itl_p99'] * 1e3:>6.1f}ms")
    print("\n2 replicas x 1 thread against 1 replica x 2 threads (aggregate decode tokens/s):")
    for n in a.streams:
        print(f"  {n} streams: {stats['ray 2x1', n]['decode_tps'] / stats['ray 1x2', n]['decode_tps']:.2f}x")
    one = a.streams[0]
    for ray_server, plain in (("ray 1x2", "plain x2"), ("ray 2x1", "plain x1")):
        r, q = stats[ray_server, one], stats[plain, one]
        print(f"{ray_server} against {plain} at {one} stream(s): ITL p50 {r['itl_p50'] * 1e3:.2f} against "
              f"{q['itl_p50'] * 1e3:.2f} ms, +{(r['itl_p50'] - q['itl_p50']) * 1e3:.2f} ms a token "
              f"({r['itl_p50'] / q['itl_p50']:.2f}x); TTFT p50 {r['ttft_p50'] * 1e3:.0f} against "
              f"{q['ttft_p50'] * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
