"""One GGUF file on kvedge and on llama.cpp: decode tokens/s and prefill time, interleaved, in one run.

    python benchmarks/gguf_vs_llamacpp.py --gguf FILE --llamacpp-python PY [--repeat 5] [--threads 2]
                                          [--prompt 128] [--gen 128] [--export DIR]

PY is a Python with llama-cpp-python installed (never a kvedge dependency: it compiles llama.cpp; install it
in a venv of its own). Runtimes: llama.cpp (llama_cpp.Llama on the file), kvedge `native` (the file's weights
as they are) and kvedge `onnxruntime` (an `ort` export of the file, kept integers; made once with
`kvedge export` unless --export names one). Greedy, EOS ignored, batch 1, the same token ids and thread
count for all. Each measurement is a fresh process after a warm-up generation; the runtimes take turns
run by run, so a drift of the shared machine's speed falls on all of them alike. Figures are medians of
--repeat runs; ratios are against llama.cpp in the same run. docs/benchmarks.md keeps the dated results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

KVEDGE_RUNNER = textwrap.dedent("""
    import json, sys
    from kvedge.runtime import load
    path, backend, prompt_len, gen_len, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    s = load(path, backend, max_batch=1, max_seq_len=prompt_len + gen_len + 8, threads=threads)
    prompt = list(range(3, 3 + prompt_len))
    s.generate(prompt, max_new_tokens=8, eos_token_id=None)  # warm-up
    r = s.generate(prompt, max_new_tokens=gen_len, eos_token_id=None)
    print(json.dumps({"prefill_s": r.prefill_s, "decode_tps": r.decode_tokens_per_s}))
""")

LLAMACPP_RUNNER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from llama_cpp import Llama
    path, prompt_len, gen_len, threads = sys.argv[1], *map(int, sys.argv[2:5])
    llm = Llama(model_path=path, n_ctx=prompt_len + gen_len + 8, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    prompt = list(range(3, 3 + prompt_len))
    def once(n):
        llm.reset()
        t0 = time.perf_counter(); llm.eval(prompt); t1 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        t2 = time.perf_counter()
        return t1 - t0, (n - 1) / (t2 - t1)
    once(8)  # warm-up
    prefill, tps = once(gen_len)
    print(json.dumps({"prefill_s": prefill, "decode_tps": tps}))
""")


def run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} ...: failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--llamacpp-python", required=True)
    p.add_argument("--export", help="an existing `kvedge export` of the file (default: made now)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    export = Path(a.export) if a.export else tmp / "onnx"
    if not a.export:
        subprocess.run([sys.executable, "-m", "kvedge.cli", "export", a.gguf, "-o", str(export), "--quiet",
                        "--max-seq-len", str(a.prompt + a.gen + 8), "--max-batch", "1"], check=True)
    (tmp / "kvedge_runner.py").write_text(KVEDGE_RUNNER)
    (tmp / "llamacpp_runner.py").write_text(LLAMACPP_RUNNER)
    sizes = [str(a.prompt), str(a.gen), str(a.threads)]
    cmds = {
        "llama.cpp": [a.llamacpp_python, str(tmp / "llamacpp_runner.py"), a.gguf, *sizes],
        "kvedge native": [sys.executable, str(tmp / "kvedge_runner.py"), a.gguf, "native", *sizes],
        "kvedge onnxruntime": [sys.executable, str(tmp / "kvedge_runner.py"), str(export), "onnxruntime", *sizes],
    }
    runs: dict[str, list[dict]] = {name: [] for name in cmds}
    for i in range(a.repeat):
        for name, cmd in cmds.items():
            runs[name].append(run(cmd))
            print(f"run {i + 1}/{a.repeat} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("prefill_s", "decode_tps")}
           for name, rs in runs.items()}
    base = med["llama.cpp"]
    print(f"{Path(a.gguf).name}: prompt {a.prompt}, generate {a.gen}, {a.threads} threads, median of {a.repeat}")
    print(f"| runtime | prefill ms | decode tokens/s | decode x llama.cpp | prefill speed x llama.cpp |")
    print("| --- | --- | --- | --- | --- |")
    for name, m in med.items():
        print(f"| {name} | {m['prefill_s'] * 1e3:.1f} | {m['decode_tps']:.1f} | "
              f"{m['decode_tps'] / base['decode_tps']:.2f} | {base['prefill_s'] / m['prefill_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
