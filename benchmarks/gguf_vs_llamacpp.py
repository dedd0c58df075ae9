"""One GGUF file on kvedge and on llama.cpp: decode tokens/s and prefill time, interleaved, in one run, and
perplexity on the same token ids.

    python benchmarks/gguf_vs_llamacpp.py --gguf FILE --llamacpp-python PY [--repeat 5] [--threads 2]
                                          [--prompt 128] [--gen 128] [--export DIR] [--requantize Q4_0]
                                          [--activations int8,int16] [--native-kv fp32,fp16]
                                          [--perplexity-tokens 2048]

PY is a Python with llama-cpp-python installed (never a kvedge dependency: it compiles llama.cpp; install it
in a venv of its own). Runtimes: llama.cpp (llama_cpp.Llama on the file), kvedge `native` (the file's weights
as they are) and kvedge `onnxruntime` (an `ort` export of the file, kept integers; made once with
`kvedge export` unless --export names one). Greedy, EOS ignored, batch 1, the same token ids and thread
count for all. Each measurement is a fresh process after a warm-up generation; the runtimes take turns
run by run, so a drift of the shared machine's speed falls on all of them alike. Figures are medians of
--repeat runs; ratios are against llama.cpp in the same run. docs/benchmarks.md keeps the dated results.

--requantize TYPE first re-quantizes the file with llama.cpp's own quantizer (llama_model_quantize, requantizing
allowed) and measures that file. --activations: the native engine's projection inputs, one row each; --native-kv:
its cache dtypes, one row each (fp32 by default; fp16 is llama.cpp's own default cache, f16).
Perplexity: kvedge's built-in held-out text tokenized once by kvedge (the file's tokenizer), the same rows of
ids fed to every runtime (llama.cpp with logits for every position), each token predicted from its row's
previous ones; 0 tokens skips it.
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
    s = load(path, backend, max_batch=1, max_seq_len=prompt_len + gen_len + 8, threads=threads,
             activations=sys.argv[6], kv_dtype=None if sys.argv[7] == "fp32" else sys.argv[7])
    prompt = list(range(3, 3 + prompt_len))
    s.generate(prompt, max_new_tokens=8, eos_token_id=None)  # warm-up
    r = s.generate(prompt, max_new_tokens=gen_len, eos_token_id=None)
    print(json.dumps({"prefill_s": r.prefill_s, "decode_tps": r.decode_tokens_per_s}))
""")

LLAMACPP_RUNNER = textwrap.dedent("""
    import json, sys, time
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama
    path, prompt_len, gen_len, threads = sys.argv[1], *map(int, sys.argv[2:5])
    llm = Llama(model_path=path, n_ctx=prompt_len + gen_len + 8, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    prompt = list(range(3, 3 + prompt_len))
    def greedy():  # the last position's logits (llm.scores holds them only with logits_all, which costs time)
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))
    def once(n):
        llm.reset()
        t0 = time.perf_counter(); llm.eval(prompt); t1 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([greedy()])
        t2 = time.perf_counter()
        return t1 - t0, (n - 1) / (t2 - t1)
    once(8)  # warm-up
    prefill, tps = once(gen_len)
    print(json.dumps({"prefill_s": prefill, "decode_tps": tps}))
""")

LLAMACPP_PERPLEXITY = textwrap.dedent("""
    import json, math, sys
    import numpy as np
    from llama_cpp import Llama
    path, rows_file, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rows = json.load(open(rows_file))
    llm = Llama(model_path=path, n_ctx=max(map(len, rows)) + 8, n_batch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    nll, n = 0.0, 0
    for row in rows:
        llm.reset()
        llm.eval(row)
        logits = np.asarray(llm.scores[:len(row) - 1], dtype=np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nll -= float(logp[np.arange(len(row) - 1), row[1:]].sum())
        n += len(row) - 1
    print(json.dumps({"perplexity": math.exp(nll / n), "tokens": n}))
""")

KVEDGE_PERPLEXITY = textwrap.dedent("""
    import json, sys
    import torch
    from kvedge.bench.eval import evaluate
    from kvedge.runtime import load
    path, backend, rows_file, acts, kv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5], sys.argv[6]
    threads = int(sys.argv[4])
    rows = torch.tensor(json.load(open(rows_file)))
    s = load(path, backend, max_batch=None if backend == "onnxruntime" else 4, max_seq_len=rows.shape[1] + 8,
             threads=threads, activations=acts, kv_dtype=None if kv == "fp32" else kv)  # an export's batch is its own
    rep = evaluate(s, rows, {"source": rows_file})
    print(json.dumps({"perplexity": rep.perplexity, "tokens": rep.predicted_tokens}))
""")


def requantize(llamacpp_python: str, src: str, kind: str, out: Path) -> str:
    """src re-quantized to `kind` by llama.cpp's own quantizer (llama_model_quantize) into out."""
    script = textwrap.dedent(f"""
        import ctypes, llama_cpp
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.allow_requantize, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_{kind}, True, 2
        raise SystemExit(llama_cpp.llama_model_quantize({src!r}.encode(), {str(out)!r}.encode(), ctypes.byref(p)))
    """)
    subprocess.run([llamacpp_python, "-c", script], check=True, capture_output=True)
    return str(out)


def run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} ...: failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--llamacpp-python", required=True)
    p.add_argument("--export", help="an existing `kvedge export` of the file (default: made now)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--requantize", metavar="TYPE", help="measure the file re-quantized by llama.cpp to TYPE (Q4_0, ...)")
    p.add_argument("--activations", default="int8,int16", help="native engine rows (default int8,int16)")
    p.add_argument("--native-kv", default="fp32", help="native engine cache dtypes, fp32 and / or fp16 (default fp32)")
    p.add_argument("--perplexity-tokens", type=int, default=2048, help="held-out tokens for perplexity (0: none)")
    a = p.parse_args(argv)
    if not Path(a.gguf).is_file():
        p.error(f"--gguf {a.gguf}: no such file (`make model` fetches the demo's SmolLM2)")
    tmp = Path(tempfile.mkdtemp())
    if a.requantize:
        a.gguf = requantize(a.llamacpp_python, a.gguf, a.requantize, tmp / f"{Path(a.gguf).stem}.{a.requantize}.gguf")
    export = Path(a.export) if a.export else tmp / "onnx"
    if not a.export:
        subprocess.run([sys.executable, "-m", "kvedge.cli", "export", a.gguf, "-o", str(export), "--quiet",
                        "--max-seq-len", str(max(a.prompt + a.gen + 8, 512)), "--max-batch", "1"],
                       check=True)  # long enough for the perplexity rows too
    (tmp / "kvedge_runner.py").write_text(KVEDGE_RUNNER)
    (tmp / "llamacpp_runner.py").write_text(LLAMACPP_RUNNER)
    sizes = [str(a.prompt), str(a.gen), str(a.threads)]
    acts = native_rows(a)
    cmds = {
        "llama.cpp": [a.llamacpp_python, str(tmp / "llamacpp_runner.py"), a.gguf, *sizes],
        **{name: [sys.executable, str(tmp / "kvedge_runner.py"), a.gguf, "native", *sizes, *args]
           for name, args in acts.items()},
        "kvedge onnxruntime": [sys.executable, str(tmp / "kvedge_runner.py"), str(export), "onnxruntime", *sizes,
                               "int8", "fp32"],
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
    ppl = perplexities(a, tmp, export, acts) if a.perplexity_tokens else {}
    print("| runtime | prefill ms | decode tokens/s | decode x llama.cpp | prefill speed x llama.cpp | perplexity |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, m in med.items():
        perplexity = f"{ppl[name]['perplexity']:.4f}" if name in ppl else "-"
        print(f"| {name} | {m['prefill_s'] * 1e3:.1f} | {m['decode_tps']:.1f} | "
              f"{m['decode_tps'] / base['decode_tps']:.2f} | {base['prefill_s'] / m['prefill_s']:.2f} | {perplexity} |")
    if ppl:
        print(f"perplexity: {ppl['llama.cpp']['tokens']} predicted tokens of kvedge's held-out text, same ids for all")
    return 0


def native_rows(a) -> dict[str, list[str]]:
    """The native engine's rows: name -> (activations, cache dtype), every pair of --activations and --native-kv."""
    return {f"kvedge native {x}" + ("" if kv == "fp32" else f" {kv} cache"): [x, kv]
            for x in a.activations.split(",") for kv in a.native_kv.split(",")}


def perplexities(a, tmp: Path, export: Path, acts: dict[str, list[str]]) -> dict:
    """Perplexity of each runtime on the same held-out token rows (once: it is deterministic)."""
    import torch

    from kvedge.models import load_config
    from kvedge.runtime.calibration import heldout_rows

    rows, _ = heldout_rows(Path(a.gguf), load_config(a.gguf), None, a.perplexity_tokens)
    rows_file = tmp / "rows.json"
    rows_file.write_text(json.dumps(torch.as_tensor(rows).tolist()))
    (tmp / "llamacpp_ppl.py").write_text(LLAMACPP_PERPLEXITY)
    (tmp / "kvedge_ppl.py").write_text(KVEDGE_PERPLEXITY)
    threads, rf = str(a.threads), str(rows_file)
    cmds = {"llama.cpp": [a.llamacpp_python, str(tmp / "llamacpp_ppl.py"), a.gguf, rf, threads],
            **{name: [sys.executable, str(tmp / "kvedge_ppl.py"), a.gguf, "native", rf, threads, *args]
               for name, args in acts.items()},
            "kvedge onnxruntime": [sys.executable, str(tmp / "kvedge_ppl.py"), str(export), "onnxruntime", rf,
                                   threads, "int8", "fp32"]}
    out = {}
    for name, cmd in cmds.items():
        out[name] = run(cmd)
        print(f"perplexity {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
