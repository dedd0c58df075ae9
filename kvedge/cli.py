"""`kvedge …`: thin command-line wrappers over the library. Run `kvedge COMMAND --help` for each."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from kvedge import __version__
from kvedge.errors import KvedgeError


DEMO_PROMPT = "Once upon a time"


class Parser(argparse.ArgumentParser):
    """A usage mistake is one line like every other error (`kvedge: error: ...`, exit 2), not argparse's usage
    block; --help still prints the usage."""

    def error(self, message: str):
        print(f"kvedge: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def number(kind=int, min=None, max=None, above=None):
    """An argparse type: an int (or float) in [min, max] (above: strictly more than that), checked while the
    command line is read, so that `--max-seq-len 0` is refused by name before anything is loaded."""
    bounds = [f">= {min}" if min is not None else None, f"> {above}" if above is not None else None,
              f"<= {max}" if max is not None else None]
    want = f"{'an integer' if kind is int else 'a number'} {' and '.join(b for b in bounds if b)}".strip()

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if (min is not None and v < min) or (max is not None and v > max) or (above is not None and v <= above):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text}")
        return v

    return parse


def numbers(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (bench's --prompt-lens and --batch)."""
    one = number(int, min=1)
    try:
        return [one(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None


POSITIVE, NONNEGATIVE = number(int, min=1), number(int, min=0)


def _trt_version(text: str) -> str:
    """A TensorRT version MAJOR.MINOR that kvedge knows (8.6 and later), checked while the command line is read."""
    from kvedge.tensorrt.versions import select_path

    try:
        select_path(text)
    except KvedgeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def existing(text: str) -> str:
    """An argparse type for a path the command reads: a missing one is named as missing, not as the wrong kind of
    thing (`kvedge generate /nope` said the torch backend needed a checkpoint)."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text}")
    return text


def _say(args, *parts) -> None:
    if not getattr(args, "quiet", False):
        print(*parts, file=sys.stderr, flush=True)


def cmd_make_demo(args) -> int:
    from kvedge.models.demo import write_demo_checkpoint

    path = write_demo_checkpoint(args.dir, args.preset)
    print(path)
    return 0


def cmd_info(args) -> int:
    from kvedge.models import cache_bytes_per_token, load_config

    cfg = load_config(args.model)
    per_token = cache_bytes_per_token(cfg, args.kv_dtype)  # MLA: the latent and the RoPE key, (d_c + d_R) a layer
    info = {
        "arch": cfg.arch, "layers": cfg.num_layers, "hidden": cfg.hidden_size, "q_heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "attention": cfg.attention_kind,
        "vocab": cfg.vocab_size, "sliding_windows": sorted({w for w in cfg.layer_windows if w}),
        "kv_dtype": args.kv_dtype, "kv_bytes_per_token": per_token,
        "kv_bytes_at_max_positions": per_token * cfg.max_position_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    if cfg.mla:
        info.update(kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank or None,
                    mla_elements_per_layer=cfg.kv_lora_rank + cfg.head_dim)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:>26}: {v}")
    return 0


def cmd_demo(args) -> int:
    """The main job: a model -> ONNX export (verified) -> generation on onnxruntime and the native engine, with
    parity against torch. --model: a GGUF file (make demo's real model); else the built-in random-weight model."""
    if args.model:
        return _demo_real(args)
    from kvedge.export import ExportOptions, export
    from kvedge.models.demo import write_demo_checkpoint
    from kvedge.runtime import load

    out = Path(args.out)
    ckpt = write_demo_checkpoint(out / "checkpoint")
    _say(args, f"[1/3] demo checkpoint (Llama-style GQA, random weights): {ckpt}")
    _say(args, "[2/3] export to ONNX and verify against PyTorch")
    export(ckpt, out / "onnx", ExportOptions(max_seq_len=512, max_batch=1, force=True), progress=_indented(args))
    _say(args, f"[3/3] generate on onnxruntime (CPU), {args.max_new_tokens} tokens")
    session = load(out / "onnx", threads=args.threads)
    res = session.generate(args.prompt, max_new_tokens=args.max_new_tokens, eos_token_id=None)
    ref = load(ckpt, backend="torch", max_batch=1, max_seq_len=512).generate(
        args.prompt, max_new_tokens=args.max_new_tokens, eos_token_id=None)
    print(f"prompt: {args.prompt!r}")
    print(f"output: {res.texts[0]!r}  (random weights: the text is noise)")
    print(f"prefill: {res.prompt_tokens[0]} tokens in {res.prefill_s * 1e3:.1f} ms; "
          f"decode: {res.decode_tokens_per_s:.1f} tokens/s on onnxruntime, "
          f"{ref.decode_tokens_per_s:.1f} tokens/s on torch")
    print(f"parity: onnxruntime tokens {'==' if res.tokens == ref.tokens else '!='} torch tokens")
    return 0 if res.tokens == ref.tokens else 1


def _indented(args):
    return None if args.quiet else (lambda m: print("      " + m, file=sys.stderr, flush=True))


def _demo_real(args) -> int:
    """A real GGUF model: export it with its own integers (verified), answer a chat question on onnxruntime and on
    the native engine, then teacher-forced parity of the export against torch and perplexity on held-out text."""
    from kvedge.bench.eval import evaluate
    from kvedge.bench.parity import compare
    from kvedge.export import ExportOptions, export
    from kvedge.models import load_config
    from kvedge.runtime import load
    from kvedge.runtime.calibration import heldout_rows

    model, out = Path(args.model), Path(args.out) / "onnx"
    cfg = load_config(model)
    # the native engine twice: int16 activations (the float model's answer) and int8 ones (llama.cpp's scheme,
    # the fastest; on a near tie its answer can differ, as llama.cpp's does)
    answers = (("onnxruntime", out, "int8"), ("native", model, "int16"), ("native", model, "int8"))
    total = 1 + len(answers) + 1  # the export, one answer each, parity and perplexity: numbered, never by hand
    step = iter(f"[{i}/{total}]" for i in range(1, total + 1))
    _say(args, f"{next(step)} {model.name}: {cfg.arch}, {cfg.num_layers} layers, {cfg.num_heads} query / "
               f"{cfg.num_kv_heads} KV heads; export to ONNX with the file's own integers, verified against PyTorch")
    export(model, out, ExportOptions(max_seq_len=512, max_batch=1, force=True), progress=_indented(args))
    prompt = args.prompt if args.prompt != DEMO_PROMPT else "What is the capital of France?"
    print(f"prompt (chat): {prompt!r}")
    ok = True
    for name, path, acts in answers:
        label = name if name != "native" else f"native {acts}"
        _say(args, f"{next(step)} greedy chat answer on {label}")
        session = load(path, name, threads=args.threads, max_batch=1, max_seq_len=512, activations=acts)
        res = session.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens)
        print(f"{label:>12}: {res.texts[0].strip()!r}  (prefill {res.prompt_tokens[0]} tokens in "
              f"{res.prefill_s * 1e3:.0f} ms; {res.decode_tokens_per_s:.1f} tokens/s)")
    _say(args, f"{next(step)} parity of the export against torch (teacher-forced), and perplexity on held-out text")
    ort = load(out, "onnxruntime", threads=args.threads, max_batch=1)
    ref = load(model, "torch", threads=args.threads, max_batch=1, max_seq_len=512)
    rep = compare(ort, ref, ort.tokenizer.encode(prompt), 8)
    print(f"parity: onnxruntime vs torch {'PASSED' if rep.passed else 'FAILED'}, worst max rel "
          f"{max(s.max_rel for s in rep.steps):.1e}, cosine >= {min(s.cosine for s in rep.steps):.6f}")
    ok &= rep.passed
    rows, text = heldout_rows(out, ort.cfg, None, 512)
    ev = evaluate(load(out, "onnxruntime", threads=args.threads, max_batch=2), rows, text)
    print(f"perplexity on {ev.predicted_tokens} tokens of kvedge's held-out text: {ev.perplexity:.3f} (onnxruntime)")
    return 0 if ok else 1


def cmd_import_gguf(args) -> int:
    from kvedge.models.gguf import write_hf_folder

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise KvedgeError(f"{out} exists and is not empty; pass --force to overwrite it")
    print(write_hf_folder(args.gguf, out))
    return 0


def cmd_generate(args) -> int:
    from kvedge.runtime import SamplingParams

    session = _open(args, max_batch=1)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)

    def show(row, token, text):
        if not args.json:
            print(text, end="", flush=True)

    prompt = [int(t) for t in args.ids.split(",")] if args.ids else args.prompt
    if prompt is None:
        raise KvedgeError("give --prompt TEXT or --ids 1,2,3")
    res = session.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop,
                           chat=args.chat, truncate=args.truncate, on_token=show,
                           eos_token_id=None if args.ignore_eos else -1)
    stats = {"backend": session.backend.name, "prompt_tokens": res.prompt_tokens[0],
             "generated_tokens": len(res.tokens[0]), "finish_reason": res.finish_reasons[0],
             "prefill_ms": round(res.prefill_s * 1e3, 2), "decode_tokens_per_s": round(res.decode_tokens_per_s, 2)}
    if args.json:
        print(json.dumps({"text": res.texts[0], "tokens": res.tokens[0], **stats}, indent=2))
    else:
        print()
        _say(args, f"[{stats['backend']}] {stats['prompt_tokens']} prompt tokens, prefill {stats['prefill_ms']} ms; "
                   f"{stats['generated_tokens']} tokens at {stats['decode_tokens_per_s']} tokens/s "
                   f"({stats['finish_reason']})")
    return 0


def cmd_serve(args) -> int:
    from kvedge.serve import build_app, run

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"kvedge serve: warning: listening on {args.host} without --api-key: anyone who can reach it can "
              f"use it", file=sys.stderr)
    name = args.model_name or Path(args.path).name.removesuffix(".gguf")
    if args.ray is not None:
        if args.autoscale and args.replicas != 1:
            raise KvedgeError("give --replicas N or --autoscale MIN:MAX, not both")
        return _serve_on_ray(args, name)
    ray_only = [flag for flag, on in (("--replicas", args.replicas != 1), ("--autoscale", args.autoscale),
                                      ("--replica-cpus", args.replica_cpus is not None),
                                      ("--replica-gpus", args.replica_gpus is not None),
                                      ("--replica-resource", args.replica_resource)) if on]
    if ray_only:
        raise KvedgeError(f"{', '.join(ray_only)} place replicas on a Ray cluster: add --ray [ADDRESS]")
    session = _open(args, max_batch=args.max_batch)
    app = build_app(session, name, api_key=args.api_key, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk)
    _say(args, f"kvedge serve: {name!r} on {session.backend.name}, {session.backend.max_batch} rows of "
               f"{session.max_seq_len} tokens, at http://{args.host}:{args.port}/v1")
    run(app, args.host, args.port, log_level="warning" if args.quiet else "info")
    return 0


def _serve_on_ray(args, name: str) -> int:
    from kvedge.serve import cluster

    gpus = args.replica_gpus if args.replica_gpus is not None else float(args.backend == "tensorrt")
    placement = cluster.Placement(cpus=args.replica_cpus or max(args.threads, 1), gpus=gpus,
                                  resources=dict(args.replica_resource))
    # a replica runs as many engine threads as the cores it reserves: "the runtime's choice" would be every
    # core of its node, shared with the other replicas there
    args.threads = args.threads or max(int(placement.cpus), 1)
    scaling = cluster.Scaling(replicas=args.replicas, autoscale=args.autoscale)
    replicas = f"{args.autoscale[0]} to {args.autoscale[1]}" if args.autoscale else str(args.replicas)
    _say(args, f"kvedge serve: starting {name!r} as {replicas} Ray Serve replica(s) of {args.max_batch} rows, each "
               f"asking Ray for {placement.actor_options()}")
    cluster.serve_forever(args.path, _load_options(args, args.max_batch),
                          {"model_name": name, "api_key": args.api_key, "prefill_chunk": args.prefill_chunk},
                          on_ready=lambda: _say(args, f"kvedge serve: ready at http://{args.host}:{args.port}/v1 "
                                                      f"(Ctrl-C ends it)"),
                          address=args.ray or None, host=args.host, port=args.port, placement=placement,
                          scaling=scaling, max_queue=args.max_queue,
                          progress=lambda line: print(f"kvedge serve: Ray: {line}", file=sys.stderr))
    return 0


def _min_max(text: str) -> tuple[int, int]:
    """--autoscale MIN:MAX."""
    from kvedge.serve.cluster import Scaling

    lo, sep, hi = text.partition(":")
    try:
        if not (sep and lo.isdigit() and hi.isdigit()):
            raise KvedgeError(f"MIN:MAX replicas expected, got {text!r}")
        return Scaling(autoscale=(int(lo), int(hi))).autoscale
    except KvedgeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _resource(text: str) -> tuple[str, float]:
    """--replica-resource NAME=AMOUNT."""
    name, sep, amount = text.partition("=")
    try:
        value = float(amount) if sep and name else -1.0
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"NAME=AMOUNT with an amount > 0 expected (as `ray start --resources`), "
                                         f"got {text!r}")
    return name, value


def cmd_export(args) -> int:
    from kvedge.export import ExportOptions, export

    target = {}
    if args.trt_version:  # the lowering and weight form that TensorRT builds (kvedge.tensorrt.versions)
        from kvedge.models import load_config
        from kvedge.tensorrt.versions import export_recipe

        cfg = load_config(args.model)
        inputs = {cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.out_head_dim, cfg.q_lora_rank or 0}
        target = export_recipe(args.trt_version, args.quantize, inputs - {0}, args.attention)
        if args.group_size is not None and args.quantize:
            target["group_size"] = args.group_size
        if not args.quiet:
            print(f"TensorRT {args.trt_version}: " + ", ".join(f"{k} {v}" for k, v in target.items()), file=sys.stderr)
    opts = ExportOptions(dtype=args.dtype, attention=args.attention or "ort", max_seq_len=args.max_seq_len,
                         max_batch=args.max_batch, force=args.force, verify=not args.no_verify,
                         verify_steps=args.verify_steps, quantize=args.quantize,
                         group_size=32 if args.group_size is None else args.group_size,
                         quantize_lm_head=args.quantize_lm_head, allow_degraded=args.allow_degraded,
                         accuracy_level=args.accuracy_level, quant_method=args.method, symmetric=args.symmetric,
                         calibration_text=args.calibration_text, calibration_tokens=args.calibration_tokens,
                         eval_text=args.eval_text, kv_dtype=args.kv_dtype)
    opts = dataclasses.replace(opts, **target)
    sidecar = export(args.model, args.out, opts, progress=None if args.quiet else
                     (lambda m: print(m, file=sys.stderr, flush=True)))
    if args.json:
        print(json.dumps(sidecar.to_json(), indent=2))
    else:
        v = sidecar.verification
        verdict = ("not verified" if v is None else v.get("skipped") or
                   f"verified: max abs {v['max_abs_error']:.2e}, cosine {v['min_cosine']:.6f}, "
                   f"greedy agreement {v['greedy_agreement']:.0%}")
        print(f"{Path(args.out) / sidecar.onnx_file} ({sidecar.lowering}, {sidecar.dtype}, opset {sidecar.opset}); "
              f"{verdict}")
    return 0


def _resolve(path: str):
    """(export folder or None, checkpoint folder or None) for a PATH given to bench / parity."""
    from kvedge.artifact import SIDECAR, Sidecar
    from kvedge.models import is_checkpoint

    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return None, p
    if (p / SIDECAR).is_file():
        src = Sidecar.read(p).extra.get("source_checkpoint")
        return p, (Path(src) if src and is_checkpoint(src) else None)
    if (p / "config.json").is_file():
        return None, p
    raise KvedgeError(f"{p}: neither an export folder (kvedge.json), a checkpoint (config.json) nor a .gguf file")


def _sessions(args, export_dir, ckpt, names, max_seq_len, max_batch, reference=False):
    """Backend name -> a function opening its Session on what it reads: the export folder, or the checkpoint
    (matched to the export: the native engine quantizes as the export was). reference: torch stands as the
    reference (parity, eval), so on CUDA it keeps the reference attention op, not the Triton kernels."""
    from kvedge.runtime import LoadOptions, Session, backends

    opts = LoadOptions(max_batch=max_batch, max_seq_len=max_seq_len, threads=args.threads,
                       device=getattr(args, "device", None), activations=args.activations,
                       fused_attention=not reference)
    opened = {}
    for name in names:
        info = backends.get(name)
        path = export_dir if info.reads == "export" else ckpt
        if path is None:
            raise KvedgeError(f"the {name} backend needs an export folder: run `kvedge export` first"
                              if info.reads == "export" else
                              f"the {name} backend needs the checkpoint; the export does not record a readable "
                              "one: pass --reference CHECKPOINT")
        opened[name] = lambda info=info, path=path: Session(info.open(path, opts, export=export_dir))
    return opened


def cmd_bench(args) -> int:
    from kvedge.bench import latency

    export_dir, ckpt = _resolve(args.path)
    if args.reference:
        ckpt = Path(args.reference)
    prompt_lens, batches = args.prompt_lens, args.batch
    need = max(prompt_lens) + args.gen_len
    if export_dir is not None:
        from kvedge.artifact import Sidecar

        sc = Sidecar.read(export_dir)
        if need > sc.max_seq_len:
            raise KvedgeError(f"prompt {max(prompt_lens)} + gen {args.gen_len} exceeds the export's max_seq_len "
                              f"{sc.max_seq_len}")
    names = args.backend.split(",")
    opened = _sessions(args, export_dir, ckpt, names, need, max(batches))
    import torch

    from kvedge import doctor
    from kvedge.jetson import Sampler

    env = doctor.facts()
    jet = env["jetson"]
    sampler = None
    if jet["is_jetson"]:
        if jet["clocks_pinned"] is not True:
            print("kvedge bench: warning: the clocks are not pinned (run `sudo jetson_clocks`); figures will "
                  "vary with DVFS", file=sys.stderr)
        sampler = Sampler()
        if not sampler.start():
            print(f"kvedge bench: warning: no telemetry: {sampler.error}", file=sys.stderr)
    try:
        results = latency.run(opened, prompt_lens, batches, args.gen_len, args.warmup, args.repeat,
                              progress=None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True)))
    finally:
        if sampler is not None:
            sampler.stop()
    context = {"path": str(args.path), "gen_len": args.gen_len, "warmup": args.warmup, "repeat": args.repeat,
               "threads": args.threads or torch.get_num_threads(), "platform": env["platform"],
               "cuda": env["cuda_available"], "gpu": (env["gpu"] or {}).get("name"), "torch": env["torch"],
               "onnxruntime": env["onnxruntime"], "jetson": jet if jet["is_jetson"] else False}
    if sampler is not None:
        context["tegrastats"] = sampler.summary()
    for r in results:
        if r.kv_formula_bytes != r.kv_allocated_bytes:
            raise KvedgeError(f"{r.backend}: KV cache formula {r.kv_formula_bytes} B != allocated "
                              f"{r.kv_allocated_bytes} B")
    paths = latency.write_reports(results, Path(args.out), context)
    print(json.dumps([r.__dict__ for r in results], indent=2) if args.json else latency.table(results))
    _say(args, "wrote " + ", ".join(str(p) for p in paths))
    return 0


def cmd_parity(args) -> int:
    from kvedge.bench.parity import compare

    export_dir, ckpt = _resolve(args.path)
    if args.reference:
        ckpt = Path(args.reference)
    names = args.backend.split(",")
    sessions = _sessions(args, export_dir, ckpt, ["torch"] + [n for n in names if n != "torch"],
                         args.prompt_len + args.steps + 2, 1, reference=True)
    reference = sessions.pop("torch")()
    tol = {k: v for k, v in (("max_rel", args.max_rel), ("min_cosine", args.min_cosine)) if v is not None}
    from kvedge.artifact import Sidecar

    dtype = args.dtype or (Sidecar.read(export_dir).dtype if export_dir else "fp32")
    if args.ids:
        prompt = [int(t) for t in args.ids.split(",")]
    else:
        import torch

        g = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(3, reference.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok, written = True, []
    for name, open_session in sessions.items():
        rep = compare(open_session(), reference, prompt, args.steps, dtype, tol)
        written += [out / f"parity-{name}.json", out / f"parity-{name}.md"]
        written[-2].write_text(json.dumps(rep.to_json(), indent=2))
        written[-1].write_text(rep.markdown())
        worst = max(rep.steps, key=lambda s: s.max_rel)
        print(f"{name} vs torch ({dtype}): {'PASSED' if rep.passed else 'FAILED'}; worst step {worst.step}: "
              f"max abs {worst.max_abs:.2e}, max rel {worst.max_rel:.2e}, cosine {min(s.cosine for s in rep.steps):.6f}; "
              f"top-1 agreement {sum(s.top1_agree for s in rep.steps)}/{len(rep.steps)}; greedy "
              + ("agrees" if rep.greedy_agree else f"diverges at step {rep.first_divergent_step}")
              + ("" if rep.first_failing_step is None else f"; first failing step {rep.first_failing_step}"))
        ok &= rep.passed
    _say(args, "wrote " + ", ".join(map(str, written)))
    return 0 if ok else 1


def cmd_eval(args) -> int:
    from kvedge.bench.eval import evaluate
    from kvedge.runtime.calibration import CALIBRATION_ROW, heldout_rows

    export_dir, ckpt = _resolve(args.path)
    name = args.backend if args.backend != "auto" else ("onnxruntime" if export_dir else "torch")
    session = _sessions(args, export_dir, ckpt, [name], CALIBRATION_ROW, args.batch)[name]()
    ref = Path(args.reference) if args.reference else ckpt if name != "torch" else None
    reference = _sessions(args, None, ref, ["torch"], CALIBRATION_ROW, args.batch, reference=True)["torch"]() \
        if ref else None
    rows, text = heldout_rows(export_dir or ckpt, session.cfg, args.text, args.tokens)
    _say(args, f"evaluating {name} on {text['tokens']} tokens of the {text['text']} text"
         + (" against torch" if reference else ""))
    rep = evaluate(session, rows, text, reference, progress=None if args.quiet else _eval_progress())
    if args.json:
        print(json.dumps(rep.to_json(), indent=2))
    else:
        line = f"{name}: perplexity {rep.perplexity:.4f} over {rep.predicted_tokens} predicted tokens"
        if reference is not None:
            line += (f"; torch (reference) {rep.reference_perplexity:.4f}; top-1 agreement {rep.top1_agreement:.1%}, "
                     f"mean cosine {rep.mean_cosine:.6f}")
        print(line + f" ({rep.seconds:.1f} s{'' if reference is None else f', torch {rep.reference_seconds:.1f} s'})")
    return 0


def _eval_progress(every_s: float = 2.0):
    """eval's progress lines on stderr: tokens scored and the running perplexity, every few seconds and at the
    end (a long run shows it is moving; a short one prints its last line only)."""
    import time

    t0 = last = time.perf_counter()

    def show(done: int, total: int, perplexity: float) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= every_s or done == total:
            last = now
            print(f"  {done}/{total} tokens, perplexity {perplexity:.4f} ({now - t0:.1f} s)", file=sys.stderr,
                  flush=True)

    return show


def cmd_plan(args) -> int:
    from kvedge.bench.plan import DEVICES, plan, weight_options
    from kvedge.models import load_config

    cfg = load_config(args.model)
    p = plan(cfg, args.seq_len, args.batch, args.dtype, args.kv_dtype, args.memory_gb, args.device,
             quantize=args.quantize, group=args.group_size, quantize_lm_head=args.quantize_lm_head)
    trt = args.trt_version or (DEVICES[args.device].tensorrt if args.device else None)
    options = {} if p.usable_bytes is None else weight_options(
        cfg, args.seq_len, args.batch, args.kv_dtype, memory_gb=args.memory_gb, device=args.device,
        group=args.group_size, quantize_lm_head=args.quantize_lm_head)
    deploy = _plan_recipe(options, trt, args.model) if options else []
    mib = 2**20
    info = {"model": f"{cfg.arch}, {cfg.num_layers} layers, {cfg.num_heads} q / {cfg.num_kv_heads} kv heads",
            "weights_bytes": p.weights_bytes, "kv_bytes": p.kv_bytes, "activation_bytes": p.activation_bytes,
            "total_bytes": p.total_bytes, "usable_bytes": p.usable_bytes, "fits": p.fits,
            "max_context_at_batch": p.max_context, "memory_max_context_at_batch": p.memory_max_context,
            "max_batch_at_seq_len": p.max_batch,
            "kv_bytes_per_token_by_attention": p.kv_by_attention, "gqa_equivalent_kv_heads": p.gqa_kv_heads,
            "weight_options": {w: {"fits": o.fits, "total_bytes": o.total_bytes, "max_context_at_batch": o.max_context}
                               for w, o in options.items()}, "tensorrt": trt, "recipe": deploy}
    if args.device:
        d = DEVICES[args.device]
        info["device"] = f"{d.note}; {d.memory_gb} GiB, reserve {d.reserve_gb} GiB assumed"
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    quant = f" ({args.quantize} projections, group {args.group_size})" if args.quantize else ""
    print(f"model: {info['model']}; seq_len {args.seq_len}, batch {args.batch}, weights {args.dtype}{quant}, "
          f"KV {args.kv_dtype or args.dtype}")
    if args.device:
        print(f"device: {info['device']}")
    print(f"  weights      {p.weights_bytes / mib:12.1f} MiB")
    print(f"  KV cache     {p.kv_bytes / mib:12.1f} MiB")
    print(f"  activations  {p.activation_bytes / mib:12.1f} MiB (estimate)")
    print(f"  total        {p.total_bytes / mib:12.1f} MiB")
    if p.usable_bytes is not None:
        print(f"  usable       {p.usable_bytes / mib:12.1f} MiB -> {'fits' if p.fits else 'DOES NOT FIT'}")
        capped = "" if p.max_context == p.memory_max_context else \
            f" (the model's limit; memory alone would allow {p.memory_max_context})"
        print(f"  largest context at batch {args.batch}: {p.max_context} tokens{capped}; "
              f"largest batch at {args.seq_len} tokens: {p.max_batch}")
    print("  KV cache per token if the same model used:")
    for k, v in p.kv_by_attention.items():
        print(f"    {k:<48} {v / 1024:10.1f} KiB")
    print(f"  this model's cache is a GQA cache of {p.gqa_kv_heads:g} KV heads of head_dim {cfg.out_head_dim}")
    if options:
        print(f"  each weight choice at {args.seq_len} tokens, batch {args.batch} (KV {args.kv_dtype or 'fp16'}):")
        for w, o in options.items():
            flag = "fp16" if w == "fp16" else f"--quantize {w}"
            capped = "" if o.max_context == o.memory_max_context else " (the model's limit)"
            print(f"    {flag:<16} {o.total_bytes / mib:10.1f} MiB -> {'fits' if o.fits else 'DOES NOT FIT'}; "
                  f"largest context {o.max_context} tokens{capped}")
        print("\n".join(deploy))
    return 0 if p.fits in (None, True) else 1


def _plan_recipe(options: dict, trt: str | None, model: str) -> list[str]:
    """plan's last lines: the most faithful weight choice that fits the memory and that the device's TensorRT
    builds, as commands; or a plain statement that none does and why, and what runs on the CPU instead."""
    from kvedge.tensorrt.recipe import cpu_recipe, recipe

    fitting = [w for w, o in options.items() if o.fits]
    if not fitting:
        best = max(options, key=lambda w: options[w].max_context or 0)
        return [f"recipe: none: no weight choice fits at this context; the most, {best}, fits "
                f"{options[best].max_context} tokens (a shorter --seq-len or a smaller --batch)"]
    if trt is None:
        return [f"recipe: {fitting[0]} fits; pass --trt-version X.Y for what TensorRT builds", cpu_recipe(fitting[0],
                                                                                                         model)]
    tried = [recipe(trt, w) for w in fitting]
    good = next((r for r in tried if r.export is not None), None)
    if good is not None:
        return [f"recipe: {good.line(model)}"]
    missing = [f"{w} does not fit" for w in options if w not in fitting]
    return [f"recipe: none deploys on TensorRT {tried[0].tensorrt}: " + "; ".join(
                missing + [f"{r.weights} fits, but {r.why}" for r in tried]),
            cpu_recipe(fitting[0], model)]


def cmd_check(args) -> int:
    import onnx

    from kvedge.artifact import SIDECAR, Sidecar
    from kvedge.tensorrt.buffers import in_place_cache
    from kvedge.tensorrt.check import check
    from kvedge.tensorrt.recipe import cpu_recipe, graph_weights, recipe
    from kvedge.tensorrt.versions import select_path

    rep = check(args.model, args.trt_version)
    path = select_path(args.trt_version)
    # what the way out must carry: the graph's quantized weights, else its float dtype (from its sidecar)
    folder = Path(args.model).parent
    sc = Sidecar.read(folder) if (folder / SIDECAR).is_file() else None
    weights = graph_weights(onnx.load(args.model, load_external_data=False)) or (sc.dtype if sc else "fp16")
    way = recipe(args.trt_version, weights)
    model = (sc.extra.get("source_checkpoint") if sc else None) or "MODEL"
    if args.json:
        print(json.dumps({"tensorrt": args.trt_version, "buildable": rep.buildable, "lowering_wanted": path.lowering,
                          "in_place_cache": None if sc is None else in_place_cache(sc, path),
                          "findings": [f.__dict__ for f in rep.findings], "weights": weights,
                          "recipe": None if rep.buildable else way.__dict__}, indent=2))
    else:
        for f in rep.findings:
            print(f"{'error' if f.blocking else 'note'}: [{f.kind}] {f.message}")
        cache = "" if sc is None else f" (KV cache {'in place' if in_place_cache(sc, path) else 'double-buffered'})"
        print(f"TensorRT {args.trt_version}: {'buildable' if rep.buildable else 'NOT buildable'}{cache}")
        if not rep.buildable:  # the way out that carries these weights, or why there is none
            print(f"recipe: {way.line(model)}")
            if way.export is None:
                print(cpu_recipe(weights, model))
    return 0 if rep.buildable else 1


def cmd_build(args) -> int:
    from kvedge.tensorrt.build import build

    report = build(args.path, args.precision, args.max_batch, args.max_prefill_len, args.workspace_gb,
                   args.timing_cache, args.opt_level, progress=None if args.quiet else
                   (lambda m: print(m, file=sys.stderr, flush=True)))
    print(json.dumps(report, indent=2))
    return 0


def cmd_doctor(args) -> int:
    from kvedge import doctor

    f = doctor.facts()
    if args.json:
        print(json.dumps({"facts": f, "features": doctor.features(f)}, indent=2))
    else:
        print(doctor.table(f))
    return 0


def _backend_arg(s: argparse.ArgumentParser, backends, otherwise: str = "torch for a checkpoint") -> None:
    s.add_argument("--backend", default="auto", choices=("auto", *backends),
                   help=f"auto (default): onnxruntime for an export folder, {otherwise}")


def _activations_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--activations", choices=("int8", "int16"), default="int8",
                   help="native backend: a quantized projection's input, int8 per 32 channels (default, as llama.cpp; "
                        "fastest) or int16 (within float rounding of the torch model; slower prefill)")


def _runtime_args(s: argparse.ArgumentParser, seq_len_help: str) -> None:
    """How generate and serve open PATH (read back by _open)."""
    s.add_argument("--quantize", choices=("int4", "int8", "none"), default="int4",
                   help="native backend: a checkpoint's projections and lm_head, rounded per group of 32 (symmetric) "
                        "as `kvedge export --quantize ... --symmetric --quantize-lm-head`; a GGUF file's and a "
                        "pre-quantized AWQ / GPTQ checkpoint's integers are kept as they are (default int4)")
    s.add_argument("--max-seq-len", type=number(int, min=2), default=2048, help=seq_len_help)
    s.add_argument("--kv-dtype", choices=("fp16", "int8"), default=None,
                   help="torch and native backends, float32 models: fp16, a float16 cache (half of float32's bytes; K "
                        "and V rounded on write, as llama.cpp's default cache), or int8 (calibrated on the built-in "
                        "text; a quarter); default float32. An export's cache dtype is set by kvedge export --kv-dtype")
    s.add_argument("--threads", type=NONNEGATIVE, default=0, help="CPU threads (default: the runtime's choice)")
    _activations_arg(s)


def _load_options(args, max_batch: int) -> dict:
    return {"backend": args.backend, "threads": args.threads, "max_seq_len": args.max_seq_len, "max_batch": max_batch,
            "quantize": None if args.quantize == "none" else args.quantize, "kv_dtype": args.kv_dtype,
            "activations": args.activations}


def _open(args, max_batch: int):
    from kvedge.runtime import load

    return load(args.path, **_load_options(args, max_batch))


def build_parser() -> argparse.ArgumentParser:
    from kvedge.dtypes import FLOATS, KV_DTYPES
    from kvedge.export.lowerings import LOWERINGS
    from kvedge.export.prepare import GROUP_SIZES
    from kvedge.runtime.backends import BACKENDS

    p = Parser(prog="kvedge", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvedge {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("demo", help="run the pipeline on a real GGUF model (--model) or the built-in random one",
                       description="Nothing is downloaded: `make demo` fetches the pinned real model at setup and "
                                   "passes it as --model.")
    s.add_argument("--model", metavar="FILE.gguf", type=existing, help="a GGUF model (make demo: SmolLM2-135M-Instruct Q4_1); "
                   "default: the built-in random-weight demo checkpoint")
    s.add_argument("--out", default="demo", help="working folder (default: ./demo)")
    s.add_argument("--prompt", default=DEMO_PROMPT, help="prompt text (with --model: a chat question, default "
                   "'What is the capital of France?')")
    s.add_argument("--max-new-tokens", type=POSITIVE, default=64)
    s.add_argument("--threads", type=NONNEGATIVE, default=0, help="CPU threads (default: the runtime's choice)")
    s.add_argument("--quiet", action="store_true", help="no progress lines")
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser("generate", help="generate text from an export folder (onnxruntime) or a checkpoint (torch, "
                       "native)", description="Streams the text as it is produced, then prints prefill time and "
                       "tokens/s. --backend native runs a checkpoint on kvedge's C engine for weight-only INT4/INT8 "
                       "on the CPU (compiled at first use; needs a C compiler).")
    s.add_argument("path", type=existing,
                   help="export folder (kvedge.json), Hugging Face checkpoint folder or .gguf file")
    s.add_argument("--prompt", help="prompt text")
    s.add_argument("--ids", help="prompt as comma-separated token ids instead of text")
    _backend_arg(s, BACKENDS)
    _runtime_args(s, "torch and native backends' cache length (default 2048)")
    s.add_argument("--max-new-tokens", type=POSITIVE, default=64)
    s.add_argument("--temperature", type=number(float, min=0), default=0.0, help="0 (default) is greedy")
    s.add_argument("--top-k", type=NONNEGATIVE, default=0, help="0 (default): no top-k cut")
    s.add_argument("--top-p", type=number(float, above=0, max=1), default=1.0)
    s.add_argument("--repetition-penalty", type=number(float, above=0), default=1.0)
    s.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    s.add_argument("--truncate", action="store_true", help="drop the oldest prompt tokens if it does not fit")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    s.add_argument("--json", action="store_true", help="print the result as JSON at the end instead of streaming")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions, streamed or not) "
                       "with continuous batching", description="POST /v1/chat/completions and /v1/completions, GET "
                       "/v1/models, /health and /metrics (Prometheus). Requests share the backend's cache rows: a new "
                       "one takes a free row at the next step and its prompt is prefilled in chunks while the others "
                       "keep decoding; past --max-queue waiting requests the server answers 429. Needs "
                       "pip install 'kvedge[serve]'. See docs/serve.md.")
    s.add_argument("path", type=existing,
                   help="export folder (kvedge.json), Hugging Face checkpoint folder or .gguf file")
    _backend_arg(s, BACKENDS)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=number(int, min=0, max=65535), default=8000, help="default 8000")
    s.add_argument("--max-batch", type=POSITIVE, default=4, help="cache rows: requests generating at once (default 4)")
    s.add_argument("--max-queue", type=NONNEGATIVE, default=16,
                   help="requests that may wait for a row; past that the server answers 429 (default 16)")
    _runtime_args(s, "torch and native backends: tokens per row, prompt + completion (default 2048; an export's "
                     "is fixed)")
    s.add_argument("--prefill-chunk", type=POSITIVE,
                   help="prompt tokens prefilled per step while other rows decode (default 256)")
    s.add_argument("--api-key", default=os.environ.get("KVEDGE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $KVEDGE_API_KEY; "
                        "none: no key asked)")
    s.add_argument("--model-name", help="the model's id in the API (default: the path's name)")
    s.add_argument("--quiet", action="store_true", help="no startup line and no access log")
    r = s.add_argument_group("replicas on a Ray cluster (pip install 'kvedge[ray]'; docs/serve.md)")
    r.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="serve as Ray Serve replicas, each one backend with its own rows; ADDRESS: a cluster's "
                        "(ray start --head prints it); without one, $RAY_ADDRESS, a cluster started on this machine, "
                        "else a new local Ray instance")
    r.add_argument("--replicas", type=POSITIVE, default=1, help="replicas (default 1)")
    r.add_argument("--autoscale", type=_min_max, metavar="MIN:MAX",
                   help="scale between MIN and MAX replicas on ongoing requests, aiming at --max-batch per replica")
    r.add_argument("--replica-cpus", type=number(float, above=0), metavar="N",
                   help="CPU cores each replica asks Ray for (default: --threads, at least 1); without --threads, a "
                        "replica runs that many threads")
    r.add_argument("--replica-gpus", type=number(float, min=0), metavar="N",
                   help="GPUs each replica asks Ray for (default 1 with --backend tensorrt, else 0)")
    r.add_argument("--replica-resource", type=_resource, action="append", default=[], metavar="NAME=AMOUNT",
                   help="a custom resource each replica needs, as given to `ray start --resources` on the nodes that "
                        "have it (a Jetson model: orin_nx=1); repeatable")
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("export", help="export a checkpoint to ONNX (KV cache as inputs/outputs) and verify it",
                       description="Writes OUT/model.onnx, the tokenizer files and OUT/kvedge.json (last). A "
                                   "quantization is scored against the model without it in PyTorch first (the "
                                   "quality gate: refused in seconds, before tracing); the graph is then verified on "
                                   "ONNX Runtime CPU against PyTorch. A refused or failed export leaves OUT as it was.")
    s.add_argument("model", type=existing,
                   help="Hugging Face checkpoint folder (config.json + safetensors) or .gguf file")
    s.add_argument("-o", "--out", required=True, help="output folder")
    s.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    s.add_argument("--attention", choices=list(LOWERINGS),
                   help="attention lowering (default ort, or what --trt-version builds): "
                        + "; ".join(f"{n}: {low.summary}" for n, low in LOWERINGS.items()))
    s.add_argument("--trt-version", metavar="X.Y",
                   help="the TensorRT the graph is for (e.g. 10.3 on JetPack 6, 10.13 on JetPack 7): picks the "
                        "lowering and the weight form it builds (int4 blocks of 128 or 64 from 10.0, per-channel "
                        "int8), symmetric; a GGUF file's 4-bit blocks are kept, its other types requantized "
                        "(docs/tensorrt.md)")
    s.add_argument("--max-seq-len", type=number(int, min=2), default=2048, help="cache length (default 2048)")
    s.add_argument("--max-batch", type=POSITIVE, default=4, help="largest batch the runtime will bind (default 4)")
    s.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    s.add_argument("--no-verify", action="store_true", help="skip the checks: a quantization's quality gate and the graph on ONNX Runtime against "
                   "PyTorch")
    s.add_argument("--verify-steps", type=NONNEGATIVE, default=16, help="decode steps to verify (default 16)")
    s.add_argument("--quantize", choices=("int8", "int4"), help="weight-only quantization, per group (--method)")
    s.add_argument("--symmetric", action="store_true",
                   help="symmetric groups (zero point at the midpoint): with --attention onnx the weights become "
                        "signed INT4/INT8 DequantizeLinear without zero points, the form TensorRT's weight-only "
                        "path builds (use --group-size 64 or 128 for INT4 there); default: asymmetric")
    s.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="rtn (default): round-to-nearest, needs no text and judges no input over another. gptq: "
                        "compensates rounding errors on the activations of a calibration text: closer to the fp "
                        "model on text like it, possibly worse on unlike inputs, and its calibration pass is slow "
                        "on big models (docs/quantization.md)")
    s.add_argument("--kv-dtype", choices=("fp32", "fp16", "bf16", "int8"),
                   help="KV cache dtype: the model's --dtype (default), or int8 (--attention ort): half of fp16's "
                        "bytes, symmetric per layer, KV head and channel, scales calibrated on --calibration-text "
                        "(docs/quantization.md)")
    s.add_argument("--calibration-text", metavar="FILE", type=existing,
                   help="UTF-8 text for GPTQ and int8 KV calibration (default: a built-in English text)")
    s.add_argument("--calibration-tokens", type=number(int, min=2), default=2048, metavar="N",
                   help="use at most N tokens of the calibration (and evaluation) text (default 2048)")
    s.add_argument("--eval-text", metavar="FILE", type=existing,
                   help="UTF-8 text the quality report (perplexity, top-1 against the unquantized model) measures on; "
                        "default: a built-in English text disjoint from the calibration text")
    s.add_argument("--group-size", type=int, choices=GROUP_SIZES,
                   help="quantization group size (default 32; with --trt-version as it says); 0: per channel")
    s.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the lm_head too (tied embeddings: a quantized copy; the embedding stays fp)")
    s.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4), default=0,
                   help="MatMulNBits compute precision (ort): 0 exact (default), 4 int8 activations, faster")
    s.add_argument("--allow-degraded", action="store_true",
                   help="keep a quantized export below its top-1 threshold (int8 95%%, int4 85%%)")
    s.add_argument("--json", action="store_true", help="print the sidecar as JSON")
    s.add_argument("--quiet", action="store_true", help="no progress lines")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("bench", help="latency and memory per backend: table, JSON, CSV, Markdown and PNG plots")
    s.add_argument("path", type=existing, help="export folder (onnxruntime; torch via its source checkpoint), "
                   "checkpoint folder or .gguf file")
    s.add_argument("--backend", default="onnxruntime,torch", help=f"comma-separated, of {','.join(BACKENDS)} "
                   "(native: kvedge's C engine on the export's checkpoint, quantized as the export was)")
    s.add_argument("--prompt-lens", type=numbers, default=[128, 512], help="comma-separated (default 128,512)")
    s.add_argument("--gen-len", type=POSITIVE, default=128)
    s.add_argument("--batch", type=numbers, default=[1], help="comma-separated batch sizes (default 1)")
    s.add_argument("--warmup", type=NONNEGATIVE, default=1)
    s.add_argument("--repeat", type=POSITIVE, default=3)
    s.add_argument("--threads", type=NONNEGATIVE, default=0)
    _activations_arg(s)
    s.add_argument("--reference", type=existing,
                   help="checkpoint for the torch backend (default: the one the export recorded)")
    s.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    s.add_argument("-o", "--out", default="bench-report", help="report folder (default ./bench-report)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("parity", help="compare a backend with the PyTorch reference step by step")
    s.add_argument("path", type=existing, help="export folder (its source checkpoint is the reference), checkpoint "
                   "folder or .gguf file")
    s.add_argument("--backend", default="onnxruntime", help=f"comma-separated, of {','.join(BACKENDS)}")
    s.add_argument("--steps", type=POSITIVE, default=32)
    s.add_argument("--prompt-len", type=POSITIVE, default=16, help="length of the seeded random prompt")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ids", help="the prompt as comma-separated token ids (instead of a random one)")
    s.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="tolerance preset (default: the export's)")
    s.add_argument("--max-rel", type=number(float, above=0),
                   help="override: max |logit error| / max(1, largest |logit|)")
    s.add_argument("--min-cosine", type=number(float, min=-1, max=1), help="override: minimum cosine per step")
    s.add_argument("--reference", type=existing,
                   help="checkpoint to compare against (default: the one the export recorded)")
    s.add_argument("--threads", type=NONNEGATIVE, default=0)
    _activations_arg(s)
    s.add_argument("-o", "--out", default="parity-report")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_parity)

    s = sub.add_parser("eval", help="quality on held-out text: perplexity, and top-1 / cosine against torch",
                       description="Each position teacher-forced through the backend's cache, rows of at most 256 "
                                   "tokens read in chunks of 64: one forward a chunk returns the logits of every "
                                   "position in it. Progress lines go to stderr. The reference is the export's source checkpoint (or --reference) on the "
                                   "torch backend; a checkpoint or GGUF file on another backend is compared with "
                                   "itself on torch.")
    s.add_argument("path", type=existing, help="export folder, checkpoint folder or .gguf file")
    _backend_arg(s, BACKENDS, "torch otherwise")
    s.add_argument("--text", metavar="FILE", type=existing,
                   help="UTF-8 text (default: kvedge's built-in held-out English text, "
                   "disjoint from the calibration text)")
    s.add_argument("--tokens", type=number(int, min=2), default=2048,
                   help="at most this many tokens of it (default 2048)")
    s.add_argument("--reference", type=existing,
                   help="checkpoint to compare against (default: the export's source checkpoint)")
    s.add_argument("--batch", type=POSITIVE, default=4, help="rows evaluated together (default 4)")
    s.add_argument("--threads", type=NONNEGATIVE, default=0)
    _activations_arg(s)
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_eval)

    s = sub.add_parser("plan", help="memory plan: weights + KV cache + activations against a device")
    s.add_argument("model", type=existing, help="checkpoint folder, its config.json or a .gguf file")
    from kvedge.bench.plan import DEVICES

    s.add_argument("--device", help="a known device: " + ", ".join(DEVICES))
    s.add_argument("--memory-gb", type=number(float, above=0), help="usable memory in GiB (instead of --device)")
    s.add_argument("--seq-len", type=POSITIVE, default=4096)
    s.add_argument("--batch", type=POSITIVE, default=1)
    s.add_argument("--dtype", default="fp16", choices=(*FLOATS, "int8", "int4"),
                   help="weight dtype (int8 / int4: fp16 with --quantize)")
    s.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,  # what an export or a backend can hold
                   help="cache dtype (default: --dtype); int8: 1 byte an element plus float32 scales per layer, KV "
                        "head and channel")
    s.add_argument("--quantize", choices=["int8", "int4"], help="weight-only quantized projections, as exported")
    s.add_argument("--trt-version", type=_trt_version,
                   help="the device's TensorRT, for the recipe (default: what a Jetson --device's JetPack ships)")
    s.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=32)
    s.add_argument("--quantize-lm-head", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser("check", help="pre-flight: would TensorRT X.Y build this ONNX graph? (no TensorRT needed)")
    s.add_argument("model", type=existing, help="model.onnx")
    s.add_argument("--trt-version", required=True, type=_trt_version, help="e.g. 8.6, 10.3, 10.15, 11.0")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_check)

    s = sub.add_parser("build", help="build model.engine with TensorRT (on the device; needs TensorRT + GPU)")
    s.add_argument("path", type=existing, help="export folder")
    s.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    s.add_argument("--max-batch", type=POSITIVE)
    s.add_argument("--max-prefill-len", type=POSITIVE)
    s.add_argument("--workspace-gb", type=number(float, above=0), default=4.0)
    s.add_argument("--timing-cache", help="timing cache file, read and updated")
    s.add_argument("--opt-level", type=int, choices=range(6), default=3, metavar="{0..5}")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_build)

    s = sub.add_parser("doctor", help="report the environment and which kvedge features it can run")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_doctor)

    s = sub.add_parser("import-gguf", help="write a GGUF file as a Hugging Face folder (config, safetensors, tokenizer)",
                       description="Weights are the file's values (quantized tensors dequantized exactly, to float32). "
                                   "Every other command also takes the .gguf file directly.")
    s.add_argument("gguf", type=existing, help="the .gguf file")
    s.add_argument("-o", "--out", required=True, help="output folder")
    s.add_argument("--force", action="store_true", help="write into a non-empty folder")
    s.set_defaults(fn=cmd_import_gguf)

    s = sub.add_parser("make-demo", help="write the built-in demo checkpoint (Hugging Face format) to DIR")
    s.add_argument("dir")
    s.add_argument("--preset", default="demo", choices=("demo", "smollm2-135m"),
                   help="demo (3M parameters) or smollm2-135m (that public shape, random weights)")
    s.set_defaults(fn=cmd_make_demo)

    s = sub.add_parser("info", help="summarize a checkpoint's config: heads, GQA ratio, KV-cache bytes per token")
    s.add_argument("model", type=existing, help="checkpoint folder, its config.json or a .gguf file")
    s.add_argument("--kv-dtype", default="fp16", choices=KV_DTYPES,
                   help="cache dtype for the size figures (default fp16)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_info)
    return p


LIBRARIES = ("onnxruntime", "tensorrt")  # what they raise during a command is reported as one line too


def raised_by(e: BaseException) -> str | None:
    """The library of LIBRARIES that raised `e`: its exception type is that library's (onnxruntime's Fail,
    InvalidArgument, ...), or its innermost frame runs that library's Python code (onnxruntime's run_with_iobinding
    raises a plain RuntimeError, tensorrt.plugin a ValueError). None otherwise: kvedge's own bugs keep their
    traceback."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return next((m for m in (type(e).__module__.split(".")[0], frame.split(".")[0]) if m in LIBRARIES), None)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader went away (`kvedge plan ... | head -3`): stop quietly, as `head` expects
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit would raise again
        return 141  # what a shell reports for a command ended by SIGPIPE


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KvedgeError as e:
        if args.debug:
            raise
        print(f"kvedge: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        library = raised_by(e)
        if library is None or args.debug:
            raise
        message = " ".join(str(e).split())  # one line
        print(f"kvedge: error: {library}: {message} (--debug shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
