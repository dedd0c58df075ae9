"""Edge-sized models against llama.cpp on the same files: decode tokens/s and its share of the read bandwidth
measured in the same run, prefill time, peak resident memory and time to model ready.

    python benchmarks/edge_models.py --llamacpp-python PY [--preset smollm2-1.7b,llama3.2-3b-shape]
        [--quant Q4_0,Q4_K_M] [--repeat 3] [--threads 2] [--prompt 128] [--gen 64] [--work .cache/edge]

Files: a random-weight GGUF of each preset's shape (kvedge.models.demo.write_random_gguf: F16, the real SmolLM2
file's tokenizer), quantized by llama.cpp's own quantizer (llama_model_quantize) into each --quant type, made
once under --work (several GB: never in the repository or CI). PY is a Python with llama-cpp-python (its own
venv, never a kvedge dependency).

--export also times `kvedge export FILE -o DIR` (ONNX Runtime's `ort` lowering, the file's integers, verified
against PyTorch as every export is) once per file in a fresh process: wall time and peak resident memory.

Each measurement is a fresh process per runtime, interleaved (llama.cpp, kvedge, llama.cpp, ...), --repeat
rounds, medians. Both run the same prompt ids with the same context (prompt + gen + 8) and a float16 KV cache
(llama.cpp's default; kvedge kv_dtype fp16), greedy, --threads threads. "ready" is from the runner's first line
to the model loaded, imports counted apart. Read bandwidth: a torch sum over a buffer of the file's size on
--threads threads, median of 5, between the rounds; "of bw" is decode tokens/s x the file's tensor bytes (each
weight read once a token; the cache reads at this context are left out) / that bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_vs_llamacpp import requantize  # noqa: E402  (llama.cpp's own quantizer)

COMMON = textwrap.dedent("""
    import time
    T0 = time.perf_counter()
    import json, sys
    def peak_mb():  # VmHWM (as kvedge.bench.latency.peak_rss): ru_maxrss survives exec, a child reports its parent's
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
""")

KVEDGE = COMMON + textwrap.dedent("""
    import torch
    from kvedge.runtime import load
    path, prompt_len, gen_len, threads = sys.argv[1], *map(int, sys.argv[2:5])
    t1 = time.perf_counter()
    s = load(path, "native", max_batch=1, max_seq_len=prompt_len + gen_len + 8, threads=threads, kv_dtype="fp16")
    t2 = time.perf_counter()
    prompt = list(range(3, 3 + prompt_len))
    r = s.generate(prompt, max_new_tokens=gen_len, eos_token_id=None)
    print(json.dumps({"imports_s": t1 - T0, "ready_s": t2 - t1, "prefill_s": r.prefill_s,
                      "decode_tps": r.decode_tokens_per_s,
                      "peak_mb": peak_mb()}))
""")

EXPORT = COMMON + textwrap.dedent("""
    from kvedge.cli import main
    rc = main(["export", sys.argv[1], "-o", sys.argv[2]])
    print(json.dumps({"rc": rc, "export_s": time.perf_counter() - T0, "peak_mb": peak_mb()}))
""")

LLAMACPP = COMMON + textwrap.dedent("""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama
    path, prompt_len, gen_len, threads = sys.argv[1], *map(int, sys.argv[2:5])
    t1 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=prompt_len + gen_len + 8, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    t2 = time.perf_counter()
    prompt = list(range(3, 3 + prompt_len))
    def greedy():
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))
    t3 = time.perf_counter(); llm.eval(prompt); t4 = time.perf_counter()
    for _ in range(gen_len - 1):
        llm.eval([greedy()])
    t5 = time.perf_counter()
    print(json.dumps({"imports_s": t1 - T0, "ready_s": t2 - t1, "prefill_s": t4 - t3,
                      "decode_tps": (gen_len - 1) / (t5 - t4),
                      "peak_mb": peak_mb()}))
""")


def read_bandwidth(nbytes: int, threads: int) -> float:
    """Bytes/s of a torch sum over a buffer of nbytes (read-bound), median of 5."""
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(nbytes // 4)
    buf.sum()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def tensor_bytes(path: Path) -> int:
    from kvedge.models.gguf import open_gguf

    return sum(t.n_bytes for t in open_gguf(path).tensors.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llamacpp-python", required=True)
    p.add_argument("--preset", default="smollm2-1.7b,llama3.2-3b-shape")
    p.add_argument("--quant", default="Q4_0,Q4_K_M")
    p.add_argument("--tokenizer-from", default=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--work", default=".cache/edge")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--export", action="store_true", help="also time kvedge export of each file (slow: minutes, GBs)")
    a = p.parse_args()
    from kvedge.models.demo import write_random_gguf

    work = Path(a.work)
    files = []
    for preset in a.preset.split(","):
        f16 = work / f"{preset}.F16.gguf"
        if not f16.is_file():
            print(f"writing {f16}", file=sys.stderr)
            write_random_gguf(f16.with_suffix(".tmp"), preset, "F16", tokenizer_from=a.tokenizer_from).rename(f16)
        for q in a.quant.split(","):
            out = work / f"{preset}.{q}.gguf"
            if not out.is_file():
                print(f"quantizing {out} with llama.cpp", file=sys.stderr)
                requantize(a.llamacpp_python, str(f16), q, out)
            files.append((preset, q, out))
    (work / "kvedge_runner.py").write_text(KVEDGE)
    (work / "llamacpp_runner.py").write_text(LLAMACPP)
    (work / "export_runner.py").write_text(EXPORT)
    args = [str(a.prompt), str(a.gen), str(a.threads)]
    print(f"prompt {a.prompt}, generate {a.gen}, {a.threads} threads, float16 caches, median of {a.repeat} "
          f"interleaved fresh processes")
    print("| file | MB | runtime | decode tok/s | of bw | x llama.cpp | prefill ms | x llama.cpp | peak MB | "
          "x llama.cpp | imports s | ready s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for preset, q, path in files:
        runs: dict[str, list[dict]] = {"llama.cpp": [], "kvedge": []}
        bws = []
        nbytes = tensor_bytes(path)
        for _ in range(a.repeat):
            bws.append(read_bandwidth(nbytes, a.threads))
            for name, cmd in (("llama.cpp", [a.llamacpp_python, str(work / "llamacpp_runner.py")]),
                              ("kvedge", [sys.executable, str(work / "kvedge_runner.py")])):
                r = subprocess.run([*cmd, str(path), *args], capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"{name} on {path} failed:\n{r.stderr[-3000:]}")
                runs[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
        bw = statistics.median(bws)
        med = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in runs.items()}
        base = med["llama.cpp"]
        for name, m in med.items():
            print(f"| {preset} {q} | {path.stat().st_size / 1e6:.0f} | {name} | {m['decode_tps']:.2f} | "
                  f"{m['decode_tps'] * nbytes / bw:.0%} | {m['decode_tps'] / base['decode_tps']:.2f}x | "
                  f"{m['prefill_s'] * 1e3:.0f} | {base['prefill_s'] / m['prefill_s']:.2f}x | {m['peak_mb']:.0f} | "
                  f"{m['peak_mb'] / base['peak_mb']:.2f}x | {m['imports_s']:.2f} | {m['ready_s']:.2f} |")
        print(f"read bandwidth {bw / 1e9:.1f} GB/s (rounds: {', '.join(f'{b / 1e9:.1f}' for b in bws)}), "
              f"tensor bytes {nbytes / 1e6:.0f} MB", flush=True)
        if a.export:
            import shutil

            out = work / f"{path.stem}.onnx"
            shutil.rmtree(out, ignore_errors=True)
            r = subprocess.run([sys.executable, str(work / "export_runner.py"), str(path), str(out)], capture_output=True,
                               text=True)
            e = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {"rc": r.returncode}
            print(f"export of {path.name}: exit {e['rc']}, {e.get('export_s', 0):.0f} s, peak "
                  f"{e.get('peak_mb', 0):.0f} MB ({e.get('peak_mb', 0) * 1e6 / nbytes:.1f}x the tensor bytes)"
                  + (f"\n{r.stderr[-1500:]}" if e["rc"] else ""), flush=True)
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
