"""Post-export verification: the ONNX graph on ONNX Runtime CPU against the PyTorch Decoder.

A prompt, then N greedy decode steps (the tokens PyTorch chooses are fed to both), with the caches
bound in place exactly as the runtime binds them. Reports max abs logit error, the lowest cosine and
the greedy-token agreement, judged per step by kvedge.runtime.compare (the tolerances of `kvedge parity`). A quantized export is also compared with
the unquantized model (top-1 agreement, cosine) and both models' perplexity on a text is reported.
An int8-cache export is compared with the same model over an int8 cache with the same scales (tightly:
both implement one quantization), and also with the model over a float cache ("vs_fp_cache").
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvedge.artifact import Sidecar
from kvedge.models import Decoder, KVCache
from kvedge.runtime import compare
from kvedge.runtime.ort_backend import OrtBackend

# Quantized exports are also compared with the unquantized model: top-1 agreement per scheme.
QUANT_TOP1 = {"int8": 0.95, "int4": 0.85}
KV_TOP1 = {"int8": 0.90}  # an int8 KV cache against a float one (same weights)


def _cache(decoder: Decoder, length: int, kv_scales=None) -> KVCache:
    """A batch-1 cache for `decoder`: float (its dtype), or int8 with kv_scales."""
    dtype = decoder.embed.weight.dtype if kv_scales is None else torch.int8
    return KVCache.allocate(decoder.cfg, 1, length, dtype=dtype, scales=kv_scales)


def _text_logits(decoder: Decoder, row: torch.Tensor, kv_scales=None) -> torch.Tensor:
    """Teacher-forced logits [L - 1, vocab] (float64) predicting row[1:], from position 0."""
    cache = _cache(decoder, row.numel(), kv_scales)
    return decoder(row[None], torch.arange(row.numel())[None], cache.for_batch(1))[0, :-1].double()


def _nll(logits: torch.Tensor, row: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum").item()


@torch.inference_mode()
def perplexity(decoder: Decoder, rows: torch.Tensor) -> float:
    """exp(mean next-token negative log-likelihood) over token rows [R, L], each row teacher-forced from
    position 0 (as transformers' loss with labels = input_ids, over all rows' predicted tokens)."""
    return math.exp(sum(_nll(_text_logits(decoder, row), row) for row in rows) / rows[:, 1:].numel())


@torch.inference_mode()
def compare_on_text(decoder: Decoder, reference: Decoder, rows: torch.Tensor, kv_scales=None) -> dict:
    """Both models teacher-forced on token rows [R, L]: their perplexities, and per predicted position the
    top-1 agreement and the logits' mean cosine of `decoder` (over an int8 cache with kv_scales if given)
    against `reference` (over a float cache)."""
    nll, ref_nll, agree, cos = 0.0, 0.0, 0, 0.0
    for row in rows:
        got, ref = _text_logits(decoder, row, kv_scales), _text_logits(reference, row)
        nll, ref_nll = nll + _nll(got, row), ref_nll + _nll(ref, row)
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        cos += torch.nn.functional.cosine_similarity(got, ref, dim=-1).sum().item()
    n = rows[:, 1:].numel()
    return {"perplexity": math.exp(nll / n), "reference_perplexity": math.exp(ref_nll / n),
            "top1_agreement": agree / n, "mean_cosine": cos / n, "predicted_tokens": n}


@torch.inference_mode()
def verify(decoder: Decoder, out_dir: str | Path, sidecar: Sidecar, prompt_len: int = 16, steps: int = 16,
           seed: int = 0, tolerance: dict | None = None,
           fp_reference: Decoder | None = None, allow_degraded: bool = False,
           text: tuple[torch.Tensor, dict] | None = None, kv_scales=None) -> dict:
    """tolerance: keys of kvedge.runtime.compare.TOLERANCES overriding the dtype's preset.
    `text`: (token rows [R, L], what they are) on which a quantized export is also compared with the
    unquantized model (PyTorch both; the quantized one is the graph within the tolerance).
    kv_scales: the int8 cache's per-layer (k, v) scales; the reference then runs over an int8 cache too."""
    if sidecar.dtype == "bf16":
        return {"passed": True, "skipped": "ONNX Runtime's CPU provider has no bf16 kernels; the graph was "
                "checked by onnx.checker only", "max_abs_error": float("nan"), "min_cosine": float("nan"),
                "greedy_agreement": float("nan")}
    cfg = decoder.cfg
    prompt_len = max(1, min(prompt_len, sidecar.max_seq_len - steps))
    backend = OrtBackend(out_dir, sidecar=sidecar, max_batch=1)
    cache = _cache(decoder, sidecar.max_seq_len, kv_scales)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g)
    pos = torch.arange(prompt_len)[None]
    last = torch.tensor([prompt_len - 1])
    tol = compare.tolerance(sidecar.dtype, tolerance)
    figs = []
    others = {}  # report key -> (model, float cache, scheme, top-1 thresholds): compared with the graph too
    if fp_reference is not None:  # the unquantized model, fed the same tokens
        scheme = (sidecar.extra.get("quantization") or {}).get("scheme", "int8")
        others["vs_unquantized"] = (fp_reference, _cache(fp_reference, sidecar.max_seq_len), scheme, QUANT_TOP1)
    if kv_scales is not None:  # the same model over a float cache
        others["vs_fp_cache"] = (decoder, _cache(decoder, sidecar.max_seq_len), "int8", KV_TOP1)
    seen = {name: ([], []) for name in others}  # top-1 agreements, cosines
    for step in range(steps + 1):
        ref = decoder(ids, pos, cache.for_batch(1), logit_index=last).float()
        got = backend.forward(ids, pos, last).float()
        figs.append(compare.step(got, ref))
        for name, (model, fp_cache, _, _) in others.items():
            fig = compare.step(got, model(ids, pos, fp_cache.for_batch(1), logit_index=last))
            seen[name][0].append(fig.top1_agree)
            seen[name][1].append(fig.cosine)
        ids = ref[:, -1].argmax(-1, keepdim=True)  # teacher-forced on PyTorch's greedy choice
        pos = torch.tensor([[prompt_len + step]])
        last = torch.tensor([0])
    worst = max(figs, key=lambda st: st.max_rel)
    min_cos = min(st.cosine for st in figs)
    reasons = []
    if tol["max_rel"] is not None and not worst.max_rel <= tol["max_rel"]:
        reasons.append(f"max abs logit error {worst.max_abs:.3e} > {tol['max_rel']:g} x {worst.scale:.3g} "
                       f"(largest |logit| of that step)")
    if not min_cos >= tol["min_cosine"]:
        reasons.append(f"cosine {min_cos:.6f} < {tol['min_cosine']}")
    quant = {}
    for name, (model, _, scheme, thresholds) in others.items():
        agree_fp, cos_fp = seen[name]
        top1 = sum(agree_fp) / len(agree_fp)
        quant[name] = {"top1_agreement": top1, "min_cosine": min(cos_fp), "threshold_top1": thresholds[scheme]}
        if text is not None:  # teacher-forced on the text: perplexity, top-1, cosine
            rows, what = text
            quant[name]["on_text"] = {**compare_on_text(decoder, model, rows, kv_scales), **what}
        if top1 < thresholds[scheme] and not allow_degraded:
            against = "the unquantized model" if name == "vs_unquantized" else "a float KV cache"
            reasons.append(f"{scheme} top-1 agreement with {against} {top1:.0%} < "
                           f"{thresholds[scheme]:.0%} (pass --allow-degraded to keep it)")
    return {**quant, "passed": not reasons, "reason": "; ".join(reasons), "prompt_len": prompt_len, "steps": steps,
            "max_abs_error": max(st.max_abs for st in figs), "max_rel_error": worst.max_rel,
            "max_abs_logit": max(st.scale for st in figs), "min_cosine": min_cos,
            "greedy_agreement": sum(st.top1_agree for st in figs) / len(figs), "tolerance": tol,
            "provider": "CPUExecutionProvider"}


def summary(report: dict) -> list[str]:
    """The verification report as progress lines: the graph against PyTorch, then each further comparison."""
    lines = [f"max abs {report['max_abs_error']:.2e}, cosine {report['min_cosine']:.6f}, "
             f"greedy agreement {report['greedy_agreement']:.0%}" + ("" if report["passed"] else "  FAILED")]
    for key, against in (("vs_unquantized", "against the unquantized model"),
                         ("vs_fp_cache", "int8 KV cache against a float cache")):
        if key in report:
            v, t = report[key], report[key]["on_text"]
            lines.append(f"{against}: top-1 {v['top1_agreement']:.0%}, min cosine {v['min_cosine']:.4f} (random "
                         f"prompt); on {t['tokens']} tokens of the {t['text']} text: top-1 {t['top1_agreement']:.0%}, "
                         f"mean cosine {t['mean_cosine']:.4f}, perplexity {t['reference_perplexity']:.3f} -> "
                         f"{t['perplexity']:.3f}")
    return lines
