"""Decode tokens/s and prefill time of kvedge's onnxruntime and native backends against CPU peers, in one run.

    python benchmarks/decode_vs_peers.py [--genai-python PATH] [--lowerings decomposed,onnx,ort]
    python benchmarks/decode_vs_peers.py --genai-python PATH --quantize int4|int8   (adds the native backend)
    python benchmarks/decode_vs_peers.py --llamacpp-python PY [--gguf FILE]   (llama.cpp on a real GGUF file:
                                                                  benchmarks/gguf_vs_llamacpp.py)

Model: SmolLM2-135M's shape with random weights, fp32, batch 1, prompt 128, generate 128 (greedy,
EOS ignored), 2 threads. Peers, each measured here, now, on the same checkpoint:
- ONNX Runtime GenAI (its own model builder and generate loop), when --genai-python names a Python
  with onnxruntime-genai installed (it is not a kvedge dependency: its pins may differ from ours);
- Hugging Face transformers `generate` (the PyTorch eager reference).
Figures are medians of --repeat runs, each in a fresh process after a warm-up generation; ratios are
against GenAI in the same run. The runtimes take turns run by run (GenAI, then each kvedge runtime,
then again), so a drift of this shared machine's speed over the minutes of a run falls on all of them
alike, and no runtime's threads or caches are left over from another's turn.

It also measures this machine's ceilings in the same run, so the figures can be read against physics
rather than only against peers: decode reads every weight once per token (the tied embedding in full,
as the lm_head), so tokens/s <= read bandwidth / weight bytes (quantized: the integers and an fp32
scale per group of 32; the bandwidth is measured over a buffer of that size); for fp32, prefill of the
prompt is 2 * weights * tokens FLOPs of matrix products, so its time >= FLOPs / the fp32 GEMM rate
measured on the model's own projection shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

GENAI_RUNNER = textwrap.dedent("""
    import json, sys, time
    import onnxruntime_genai as og
    path, prompt_len, gen_len, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    model = og.Model(path)
    prompt = [0] + list(range(3, 3 + prompt_len - 1))
    def once():
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=prompt_len + gen_len, min_length=prompt_len + gen_len)
        gen = og.Generator(model, params)
        t0 = time.perf_counter(); gen.append_tokens(prompt); t1 = time.perf_counter()
        n = 0
        while not gen.is_done():
            gen.generate_next_token(); n += 1
        t2 = time.perf_counter()
        return t1 - t0, n / (t2 - t1)
    once()
    runs = [once() for _ in range(repeat)]
    print(json.dumps({"prefill_s": sorted(r[0] for r in runs)[len(runs) // 2],
                      "decode_tps": sorted(r[1] for r in runs)[len(runs) // 2]}))
""")


def median(xs):
    return statistics.median(xs)


def ceilings(ckpt: Path, prompt_len: int, bits: int | None = None, group: int = 32):
    """(max decode tokens/s, min prefill seconds or None, the measured rates) for the checkpoint here, its
    projections and lm_head in fp32 or, with bits, as weight-only integers with an fp32 scale per group
    (MatMulNBits, as GenAI and kvedge's ort export read them; the native engine keeps its scales in float16
    and reads fewer bytes: figures["native MB read per token"])."""
    from kvedge.models import load_decoder

    model = load_decoder(ckpt)
    cfg = model.cfg
    shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    linear = sum(n * k for n, k in shapes)
    head = cfg.vocab_size * cfg.hidden_size if cfg.tie_embeddings else 0
    if head:
        shapes.append((cfg.vocab_size, cfg.hidden_size))
    per = 4 if bits is None else bits / 8 + 4 / group  # bytes read per weight
    weight_bytes = (linear + head) * per
    big = torch.randn(int(weight_bytes // 4))  # read bandwidth over a buffer of that size (cache vs DRAM)

    def rate(fn, work, n=10):
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return work * n / (time.perf_counter() - t)

    read_bps = max(rate(big.sum, big.numel() * 4) for _ in range(3))  # best of three: a ceiling
    figures = {"read GB/s": read_bps / 1e9, "weight MB read per token": weight_bytes * 1e-6}
    if bits is not None:  # a float16 scale per 32 inputs, a row's padded to whole chunks of 8 (kv_stride)
        figures["native MB read per token"] = sum(n * (k * bits / 8 + 2 * 8 * -(-k // 256)) for n, k in shapes) * 1e-6  # int8 / int4 prefill runs on integer dot products: no fp32 GEMM ceiling
        return read_bps / weight_bytes, None, figures
    h, i = cfg.hidden_size, cfg.intermediate_size
    x = torch.randn(prompt_len, h)
    gemms = [torch.randn(h, cfg.qkv_size), torch.randn(h, 2 * i), torch.randn(i, h)]
    xs = [x, x, torch.randn(prompt_len, i)]
    flops = sum(2 * prompt_len * w.shape[0] * w.shape[1] for w in gemms)
    gemm_fps = max(rate(lambda: [a @ w for a, w in zip(xs, gemms)], flops) for _ in range(3))
    lm_head = cfg.vocab_size * h
    # every projection for each prompt token, the lm_head for the last one only
    prefill_flops = 2 * prompt_len * (linear + head - lm_head) + 2 * lm_head
    return read_bps / weight_bytes, prefill_flops / gemm_fps, {**figures, "fp32 GEMM GFLOP/s": gemm_fps / 1e9}


# One kvedge generation in a fresh process, as GenAI's runner: no runtime's threads (ONNX Runtime's spin
# after a run, OpenMP's) or caches are left over from another's turn.
KVEDGE_RUNNER = textwrap.dedent("""
    import json, sys, torch
    from kvedge.runtime import load
    path, backend, quantize = sys.argv[1], sys.argv[2], sys.argv[3]
    prompt_len, gen, threads = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    torch.set_num_threads(threads)
    kw = dict(quantize=None if quantize == "none" else quantize, max_seq_len=prompt_len + gen, max_batch=1) \
        if backend == "native" else {}
    s = load(path, backend, threads=threads, **kw)
    prompt = [0] + list(range(3, 3 + prompt_len - 1))
    s.generate([prompt], max_new_tokens=gen, eos_token_id=None)  # warm-up, as GenAI's runner does
    r = s.generate([prompt], max_new_tokens=gen, eos_token_id=None)
    print(json.dumps({"prefill_s": r.prefill_s, "decode_tps": r.decode_tokens_per_s, "tokens": r.tokens[0]}))
""")


def kvedge_once(path: Path, backend: str, quantize: str | None, prompt_len: int, gen: int, threads: int):
    """(prefill s, decode tokens/s, tokens) of one generation, after a warm-up one, in a fresh process."""
    r = subprocess.run([sys.executable, "-c", KVEDGE_RUNNER, str(path), backend, quantize or "none", str(prompt_len),
                        str(gen), str(threads)], check=True, capture_output=True, text=True)
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return d["prefill_s"], d["decode_tps"], d["tokens"]


def bench_transformers(ckpt: Path, prompt: list[int], gen: int, repeat: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ids = torch.tensor([prompt])
    # an explicit mask: the prompt starts with token 0 (BOS), which generate must not take for padding
    kw = dict(do_sample=False, pad_token_id=2, eos_token_id=None, attention_mask=torch.ones_like(ids))

    def timed(n):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t, out[0, len(prompt):].tolist()

    timed(4)
    prefill = median([timed(1)[0] for _ in range(repeat)])
    full = [timed(gen) for _ in range(repeat)]
    decode = (gen - 1) / (median([f[0] for f in full]) - prefill)
    return prefill, decode, full[0][1]


def genai_model(python: str, ckpt: Path, work: Path, threads: int, precision: str = "fp32") -> Path:
    """GenAI's builder output for the checkpoint (built once per precision), set to `threads` threads."""
    out = work / f"genai-{precision}"
    if not (out / "genai_config.json").is_file():
        subprocess.run([python, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
                        "-p", precision, "-e", "cpu", "-c", str(work / "genai-cache")],
                       check=True, capture_output=True)
    cfg = json.loads((out / "genai_config.json").read_text())
    cfg["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    (out / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def genai_once(python: str, model: Path, prompt_len: int, gen: int) -> tuple[float, float]:
    """(prefill s, decode tokens/s) of one GenAI generation, after a warm-up one, in a fresh process."""
    r = subprocess.run([python, "-c", GENAI_RUNNER, str(model), str(prompt_len), str(gen), "1"],
                       check=True, capture_output=True, text=True)
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return d["prefill_s"], d["decode_tps"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--genai-python", help="a Python interpreter with onnxruntime-genai 0.18 installed")
    p.add_argument("--lowerings", default="decomposed,onnx,ort")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=None, help="folder for the checkpoint and exports (default: a temp dir)")
    p.add_argument("--quantize", choices=("int4", "int8"), help="compare weight-only quantized exports "
                   "(kvedge --quantize --quantize-lm-head --symmetric with the ort lowering; GenAI's builder at the same "
                   "precision, which quantizes its lm_head too)")
    p.add_argument("--asymmetric", action="store_true", help="kvedge's asymmetric groups (zero points) instead "
                   "of --symmetric, which GenAI's builder uses by default (MatMulNBits without zero points)")
    p.add_argument("--accuracy-level", type=int, default=4, help="kvedge's MatMulNBits accuracy_level "
                   "(GenAI's builder uses 4: int8 activations)")
    p.add_argument("--no-native", action="store_true", help="with --quantize, leave out kvedge's native backend "
                   "(its C engine, symmetric groups of 32 and a quantized lm_head, as the ort export here)")
    p.add_argument("--llamacpp-python", help="a Python with llama-cpp-python installed: measure llama.cpp against "
                   "kvedge's runtimes on one real GGUF file instead (benchmarks/gguf_vs_llamacpp.py, with --gguf, "
                   "--repeat, --threads, --prompt and --gen passed on)")
    p.add_argument("--gguf", default=str(Path(__file__).resolve().parents[1] / ".cache/models/"
                                         "SmolLM2-135M-Instruct.Q4_1.gguf"),
                   help="the GGUF file for --llamacpp-python (default: the demo's SmolLM2, `make model`)")
    a = p.parse_args()
    if a.llamacpp_python:  # same file, same threads, interleaved fresh processes: that script's protocol
        sys.path.insert(0, str(Path(__file__).parent))
        import gguf_vs_llamacpp

        raise SystemExit(gguf_vs_llamacpp.main(["--gguf", a.gguf, "--llamacpp-python", a.llamacpp_python,
                                                "--repeat", str(a.repeat), "--threads", str(a.threads),
                                                "--prompt", str(a.prompt), "--gen", str(a.gen)]))
    torch.set_num_threads(a.threads)

    from kvedge.export import ExportOptions, export
    from kvedge.models.demo import write_demo_checkpoint
    from kvedge.models.quant import QUANT_BITS

    work = Path(a.work or tempfile.mkdtemp(prefix="kvedge-peers-"))
    ckpt = write_demo_checkpoint(work / "smollm2-135m", "smollm2-135m")
    prompt = [0] + list(range(3, 3 + a.prompt - 1))
    lowerings = ["ort"] if a.quantize else a.lowerings.split(",")
    runners = {}  # name -> (path, backend) of each kvedge runtime
    for low in lowerings:
        out = work / f"kvedge-{low}-{a.quantize or 'fp32'}-acc{a.accuracy_level}{'-asym' if a.asymmetric else ''}"
        if not (out / "kvedge.json").is_file():
            export(ckpt, out, ExportOptions(attention=low, max_seq_len=a.prompt + a.gen, max_batch=1, force=True,
                                            quantize=a.quantize, quantize_lm_head=bool(a.quantize),
                                            symmetric=bool(a.quantize) and not a.asymmetric,
                                            accuracy_level=a.accuracy_level,
                                            tolerance={"max_rel": None, "min_cosine": -1.0} if a.quantize else None,  # figures printed below
                                            allow_degraded=True))
        if a.quantize:
            from kvedge.artifact import Sidecar

            v = Sidecar.read(out).verification
            print(f"kvedge {low} {a.quantize}: cosine vs quantized PyTorch {v['min_cosine']:.4f}, top-1 vs fp32 "
                  f"{v['vs_unquantized']['top1_agreement']:.0%}", file=sys.stderr)
        runners[low] = (out, "onnxruntime")
    if a.quantize and not a.no_native:  # kvedge's C engine over the same checkpoint, quantized the same way
        runners["native"] = (ckpt, "native")
    model = genai_model(a.genai_python, ckpt, work, a.threads, a.quantize or "fp32") if a.genai_python else None
    runs: dict[str, list] = {"genai": [], **{name: [] for name in runners}}
    for _ in range(a.repeat):  # in turns: a drift of the machine's speed falls on every runtime alike
        if model is not None:
            runs["genai"].append(genai_once(a.genai_python, model, a.prompt, a.gen))
        for name, (path, backend) in runners.items():
            runs[name].append(kvedge_once(path, backend, a.quantize, a.prompt, a.gen, a.threads))
    hf = bench_transformers(ckpt, prompt, a.gen, a.repeat)
    rows = []
    genai = None
    if model is not None:
        genai = median([r[0] for r in runs["genai"]]), median([r[1] for r in runs["genai"]])
        rows.append((f"onnxruntime-genai 0.18 {a.quantize or 'fp32'}", *genai))
    rows.append(("transformers generate fp32", hf[0], hf[1]))
    for low in runners:
        label = "kvedge native (C engine)" if low == "native" else f"kvedge onnxruntime ({low})"
        rows.append((f"{label} {a.quantize or 'fp32'}", median([r[0] for r in runs[low]]),
                     median([r[1] for r in runs[low]])))
        same = "same" if runs[low][0][2] == hf[2] else "DIFFERENT (expected when quantized)"
        print(f"kvedge {low}: greedy tokens {same} as transformers", file=sys.stderr)

    print(f"SmolLM2-135M shape (random weights), {a.quantize or 'fp32'}, batch 1, prompt {a.prompt}, gen {a.gen}, "
          f"{a.threads} threads, median of {a.repeat}")
    top = ceilings(ckpt, a.prompt, QUANT_BITS[a.quantize] if a.quantize else None)
    print("this machine, measured now: " + ", ".join(f"{k} {v:.1f}" for k, v in top[2].items())
          + f" -> decode <= {top[0]:.1f} tok/s" + (f", prefill >= {top[1] * 1e3:.1f} ms" if top[1] else ""))
    print(f"{'runtime':<36} {'prefill ms':>10} {'decode tok/s':>13} {'decode x genai':>15} {'prefill x genai':>16}"
          f" {'decode/ceiling':>15} {'ceiling/prefill':>16}")
    for name, pre, dec in rows:
        r_dec = f"{dec / genai[1]:.2f}" if genai else "-"
        r_pre = f"{genai[0] / pre:.2f}" if genai else "-"
        ceiling = top[0] * (top[2]["weight MB read per token"] / top[2]["native MB read per token"]
                            if "native" in name else 1.0)  # its own bytes
        c_dec = f"{dec / ceiling:.0%}" if not (a.quantize and name.startswith("transformers")) else "-"
        c_pre = f"{top[1] / pre:.0%}" if top[1] else "-"
        print(f"{name:<36} {pre * 1e3:10.1f} {dec:13.1f} {r_dec:>15} {r_pre:>16} {c_dec:>15} {c_pre:>16}")


if __name__ == "__main__":
    main()
