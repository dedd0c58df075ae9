"""`kvedge …`: thin command-line wrappers over the library. Run `kvedge COMMAND --help` for each."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvedge import __version__
from kvedge.errors import KvedgeError


def _say(args, *parts) -> None:
    if not getattr(args, "quiet", False):
        print(*parts, file=sys.stderr, flush=True)


def cmd_make_demo(args) -> int:
    from kvedge.models.demo import write_demo_checkpoint

    path = write_demo_checkpoint(args.dir, args.preset)
    print(path)
    return 0


def cmd_info(args) -> int:
    from kvedge.models import kv_bytes_per_token, load_config

    cfg = load_config(args.model)
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.kv_dtype)
    info = {
        "arch": cfg.arch, "layers": cfg.num_layers, "hidden": cfg.hidden_size, "q_heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "attention": cfg.attention_kind,
        "vocab": cfg.vocab_size, "sliding_windows": sorted({w for w in cfg.layer_windows if w}),
        "kv_dtype": args.kv_dtype, "kv_bytes_per_token": per_token,
        "kv_bytes_at_max_positions": per_token * cfg.max_position_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:>26}: {v}")
    return 0


def cmd_demo(args) -> int:
    """The main job on the built-in default: write the demo checkpoint, load it, generate."""
    import torch

    from kvedge.models import KVCache, load_decoder
    from kvedge.models.demo import write_demo_checkpoint
    from kvedge.runtime import greedy

    torch.set_num_threads(args.threads) if args.threads else None
    out = Path(args.out)
    ckpt = write_demo_checkpoint(out / "checkpoint")
    _say(args, f"[1/2] demo checkpoint: {ckpt}")
    model = load_decoder(ckpt)
    cfg = model.cfg
    _say(args, f"      {cfg.arch}, {cfg.num_layers} layers, {cfg.num_heads} q heads / {cfg.num_kv_heads} kv heads "
               f"({cfg.attention_kind}), {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prompt = [cfg.bos_token_id] + tok.encode(args.prompt).ids
    cache = KVCache.allocate(cfg, 1, len(prompt) + args.max_new_tokens)
    _say(args, f"[2/2] generating {args.max_new_tokens} tokens on torch (CPU), cache "
               f"{cache.nbytes / 2**20:.2f} MiB allocated once")
    res = greedy(model, prompt, args.max_new_tokens, cache, eos_token_id=None)
    text = tok.decode(res.tokens)
    print(f"prompt: {args.prompt!r}")
    print(f"output: {text!r}")
    print(f"prefill: {len(prompt)} tokens in {res.prefill_s * 1e3:.1f} ms; "
          f"decode: {res.decode_tokens_per_s:.1f} tokens/s ({len(res.tokens)} tokens)")
    return 0


def cmd_export(args) -> int:
    from kvedge.export import ExportOptions, export

    opts = ExportOptions(dtype=args.dtype, attention=args.attention, max_seq_len=args.max_seq_len,
                         max_batch=args.max_batch, force=args.force, verify=not args.no_verify,
                         verify_steps=args.verify_steps)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvedge", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvedge {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("demo", help="run the pipeline on the built-in demo model (no download)")
    s.add_argument("--out", default="demo", help="working folder (default: ./demo)")
    s.add_argument("--prompt", default="Once upon a time", help="prompt text")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    s.add_argument("--quiet", action="store_true", help="no progress lines")
    s.set_defaults(fn=cmd_demo)

    from kvedge.export.lowerings import LOWERINGS

    s = sub.add_parser("export", help="export a checkpoint to ONNX (KV cache as inputs/outputs) and verify it",
                       description="Writes OUT/model.onnx, the tokenizer files and OUT/kvedge.json (last). "
                                   "Verification runs the graph on ONNX Runtime CPU against PyTorch.")
    s.add_argument("model", help="Hugging Face checkpoint directory")
    s.add_argument("-o", "--out", required=True, help="output folder")
    s.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    s.add_argument("--attention", choices=list(LOWERINGS), default="decomposed",
                   help="attention lowering: onnx (opset 24, ORT and TensorRT >= 10.15), ort "
                        "(com.microsoft.GroupQueryAttention), decomposed (opset 17, TensorRT 8.6-10.14, any runtime)")
    s.add_argument("--max-seq-len", type=int, default=2048, help="cache length (default 2048)")
    s.add_argument("--max-batch", type=int, default=4, help="largest batch the runtime will bind (default 4)")
    s.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    s.add_argument("--no-verify", action="store_true", help="skip the ONNX Runtime vs PyTorch check")
    s.add_argument("--verify-steps", type=int, default=16, help="decode steps to verify (default 16)")
    s.add_argument("--json", action="store_true", help="print the sidecar as JSON")
    s.add_argument("--quiet", action="store_true", help="no progress lines")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("make-demo", help="write the built-in demo checkpoint (Hugging Face format) to DIR")
    s.add_argument("dir")
    s.add_argument("--preset", default="demo", choices=("demo", "smollm2-135m"),
                   help="demo (3M parameters) or smollm2-135m (that public shape, random weights)")
    s.set_defaults(fn=cmd_make_demo)

    s = sub.add_parser("info", help="summarize a checkpoint's config: heads, GQA ratio, KV-cache bytes per token")
    s.add_argument("model", help="checkpoint directory (or config.json)")
    s.add_argument("--kv-dtype", default="fp16", help="cache dtype for the size figures (default fp16)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KvedgeError as e:
        if args.debug:
            raise
        print(f"kvedge: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
