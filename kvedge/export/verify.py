"""An export's checks: the quantization's quality gate in PyTorch before tracing (`quality`), then the ONNX graph
on ONNX Runtime CPU against the PyTorch Decoder (`verify`).

quality: a quantized model is compared with the unquantized one, an int8-cache model with itself over a float
cache ("vs_fp_cache"), on a random prompt and its greedy steps (top-1 agreement against QUANT_TOP1 / KV_TOP1, the
gate) and teacher-forced on a text (perplexities, top-1, cosine: reported). It runs before the graph is traced,
so that a model the gate refuses costs seconds and writes nothing.

verify: the same prompt, then N greedy decode steps (the tokens PyTorch chooses are fed to both), with the caches
bound in place exactly as the runtime binds them. PyTorch runs first (`reference`), so that an export can free the
Decoder before ONNX Runtime loads the graph. Reports max abs logit error, the lowest cosine and the
greedy-token agreement, judged per step by kvedge.runtime.compare (the tolerances of `kvedge parity`). An
int8-cache export is compared with the same model over an int8 cache with the same scales (tightly: both
implement one quantization).
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
    dtype = next(decoder.parameters()).dtype if kv_scales is None else torch.int8
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


def random_prompt(cfg, max_seq_len: int, prompt_len: int, steps: int, seed: int = 0) -> torch.Tensor:
    """The verification's prompt [1, P]: seeded random tokens, P = prompt_len where `steps` more fit the cache."""
    prompt_len = max(1, min(prompt_len, max_seq_len - steps))
    return torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))


GATES = {  # report key -> (what is quantized, compared with, what else may pass the gate)
    "vs_unquantized": ("{scheme} weights", "the unquantized model",
                       {"int4": "--quantize int8, --method gptq or a smaller --group-size may pass",
                        "int8": "--method gptq or a smaller --group-size may pass"}),
    "vs_fp_cache": ("int8 KV cache", "a float KV cache",
                    {"int8": "a longer or more typical --calibration-text, or a float cache (no --kv-dtype int8), "
                             "may pass"}),
}


@torch.inference_mode()
def quality(decoder: Decoder, max_seq_len: int, prompt_len: int, steps: int, scheme: str | None = None,
            fp_reference: Decoder | None = None, kv_scales=None, text: tuple[torch.Tensor, dict] | None = None,
            allow_degraded: bool = False, seed: int = 0) -> tuple[dict, str | None]:
    """The quantized model against the model without its quantization, in PyTorch, before anything is traced
    (seconds, where tracing and verifying take minutes): `decoder` (over an int8 cache with kv_scales, as the graph
    will run) and, fed the same tokens (verify's random prompt, then the decoder's greedy choices), fp_reference,
    the unquantized model of weight scheme `scheme` ("vs_unquantized"), and / or the same decoder over a float
    cache ("vs_fp_cache"). Returns (the report's entries: top-1 agreement, lowest cosine, the threshold; and with
    `text`, both teacher-forced on it, "on_text"; None, or the failed gates as one line saying which check failed
    by how much and the way out, which a caller refuses unless allow_degraded). The text figures are skipped when
    a gate fails and nothing is kept."""
    others = {}  # report key -> (model, its float cache, the gate's scheme, top-1 thresholds)
    if fp_reference is not None:
        others["vs_unquantized"] = (fp_reference, _cache(fp_reference, max_seq_len), scheme, QUANT_TOP1)
    if kv_scales is not None:
        others["vs_fp_cache"] = (decoder, _cache(decoder, max_seq_len), "int8", KV_TOP1)
    cache = _cache(decoder, max_seq_len, kv_scales)
    ids = random_prompt(decoder.cfg, max_seq_len, prompt_len, steps, seed)
    pos, last = torch.arange(ids.shape[1])[None], torch.tensor([ids.shape[1] - 1])
    seen = {name: ([], []) for name in others}  # per step: top-1 agreement, cosine
    for step in range(steps + 1):
        got = decoder(ids, pos, cache.for_batch(1), logit_index=last).float()
        for name, (model, fp_cache, _, _) in others.items():
            fig = compare.step(got, model(ids, pos, fp_cache.for_batch(1), logit_index=last))
            seen[name][0].append(fig.top1_agree)
            seen[name][1].append(fig.cosine)
        ids, pos, last = got[:, -1].argmax(-1, keepdim=True), pos[:, -1:] + 1, torch.tensor([0])
    report, failures, ways = {}, [], ["--allow-degraded keeps it"]
    for name, (model, _, gate_scheme, thresholds) in others.items():
        agree, cos = seen[name]
        top1, threshold = sum(agree) / len(agree), thresholds[gate_scheme]
        report[name] = {"top1_agreement": top1, "min_cosine": min(cos), "threshold_top1": threshold,
                        "measured": f"in PyTorch before tracing, over {len(agree)} positions: a random prompt's "
                                    f"last, then the quantized model's greedy steps"}
        if top1 < threshold:
            what, against, others_may = GATES[name]
            failures.append(f"{what.format(scheme=gate_scheme)}: top-1 agreement with {against} {top1:.0%} < "
                            f"{threshold:.0%} ({round(100 * (threshold - top1))} points short)")
            ways += [others_may[gate_scheme]] if gate_scheme in others_may else []
    refusal = None if not failures else (
        f"{'; '.join(failures)}: over {steps + 1} positions of a random prompt and its greedy steps, scored in "
        f"PyTorch before tracing; nothing was written. {'; '.join(ways)}")
    if text is not None and (allow_degraded or not failures):  # teacher-forced on the text: perplexity, top-1
        rows, what = text
        for name, (model, _, _, _) in others.items():
            report[name]["on_text"] = {**compare_on_text(decoder, model, rows, kv_scales), **what}
    return report, refusal


def runs_on_cpu(dtype: str) -> bool:
    """Whether ONNX Runtime's CPU provider can run a graph of this dtype (it has no bf16 kernels)."""
    return dtype != "bf16"


@torch.inference_mode()
def reference(decoder: Decoder, max_seq_len: int, prompt_len: int = 16, steps: int = 16, seed: int = 0,
              kv_scales=None) -> dict:
    """PyTorch's side of `verify`, run before the graph's: the random prompt, then `steps` greedy decode steps of
    `decoder` (over an int8 cache with kv_scales if given), each step's inputs and logits. Nothing of it depends on
    the graph, so the Decoder can be freed before ONNX Runtime loads the graph: the two never hold their weights at
    the same time."""
    ids = random_prompt(decoder.cfg, max_seq_len, prompt_len, steps, seed)
    prompt_len = ids.shape[1]
    cache = _cache(decoder, prompt_len + steps, kv_scales)  # what the run fills: not max_seq_len (MBs a layer)
    pos, last = torch.arange(prompt_len)[None], torch.tensor([prompt_len - 1])
    inputs, logits = [], []
    for step in range(steps + 1):
        ref = decoder(ids, pos, cache.for_batch(1), logit_index=last).float()
        inputs.append((ids, pos, last))
        logits.append(ref)
        ids = ref[:, -1].argmax(-1, keepdim=True)  # teacher-forced on PyTorch's greedy choice
        pos = torch.tensor([[prompt_len + step]])
        last = torch.tensor([0])
    return {"prompt_len": prompt_len, "steps": steps, "inputs": inputs, "logits": logits}


@torch.inference_mode()
def verify(ref: dict, out_dir: str | Path, sidecar: Sidecar, tolerance: dict | None = None,
           quality_report: dict | None = None) -> dict:
    """The graph in out_dir on ONNX Runtime against PyTorch's run `ref` (`reference`): the same inputs at every
    step, within `tolerance` (keys of kvedge.runtime.compare.TOLERANCES overriding the dtype's preset).
    quality_report: the quantization's own figures (`quality`, scored before tracing), carried into the report."""
    if not runs_on_cpu(sidecar.dtype):
        return {"passed": True, "skipped": "ONNX Runtime's CPU provider has no bf16 kernels; the graph was "
                "checked by onnx.checker only", "max_abs_error": float("nan"), "min_cosine": float("nan"),
                "greedy_agreement": float("nan"), **(quality_report or {})}
    backend = OrtBackend(out_dir, sidecar=sidecar, max_batch=1)
    tol = compare.tolerance(sidecar.dtype, tolerance)
    figs = [compare.step(backend.forward(*inputs).float(), logits)
            for inputs, logits in zip(ref["inputs"], ref["logits"])]
    del backend
    worst = max(figs, key=lambda st: st.max_rel)
    min_cos = min(st.cosine for st in figs)
    reasons = []
    if tol["max_rel"] is not None and not worst.max_rel <= tol["max_rel"]:
        reasons.append(f"max abs logit error {worst.max_abs:.3e} > {tol['max_rel']:g} x {worst.scale:.3g} "
                       f"(largest |logit| of that step)")
    if not min_cos >= tol["min_cosine"]:
        reasons.append(f"cosine {min_cos:.6f} < {tol['min_cosine']}")
    return {**(quality_report or {}), "passed": not reasons, "reason": "; ".join(reasons),
            "prompt_len": ref["prompt_len"], "steps": ref["steps"], "max_abs_error": max(st.max_abs for st in figs),
            "max_rel_error": worst.max_rel, "max_abs_logit": max(st.scale for st in figs), "min_cosine": min_cos,
            "greedy_agreement": sum(st.top1_agree for st in figs) / len(figs), "tolerance": tol,
            "provider": "CPUExecutionProvider"}


def summary(report: dict) -> list[str]:
    """The graph against PyTorch as a progress line (FAILED when it is outside the tolerance)."""
    return [f"the graph against PyTorch: max abs {report['max_abs_error']:.2e}, cosine {report['min_cosine']:.6f}, "
            f"greedy agreement {report['greedy_agreement']:.0%}" + ("" if report["passed"] else
                                                                    f"  FAILED: {report['reason']}")]


def quality_lines(report: dict) -> list[str]:
    """The quantization's figures (`quality`) as progress lines."""
    lines = []
    for key, against in (("vs_unquantized", "against the unquantized model"),
                         ("vs_fp_cache", "int8 KV cache against a float cache")):
        if key in report:
            v = report[key]
            gate = (f"gate {v['threshold_top1']:.0%}" if v["top1_agreement"] >= v["threshold_top1"] else
                    f"below the {v['threshold_top1']:.0%} gate, kept: --allow-degraded")
            line = (f"{against}: top-1 {v['top1_agreement']:.0%} ({gate}), min cosine {v['min_cosine']:.4f} "
                    f"(random prompt)")
            if "on_text" in v:
                t = v["on_text"]
                line += (f"; on {t['tokens']} tokens of the {t['text']} text: top-1 {t['top1_agreement']:.0%}, mean "
                         f"cosine {t['mean_cosine']:.4f}, perplexity {t['reference_perplexity']:.3f} -> "
                         f"{t['perplexity']:.3f}")
            lines.append(line)
    return lines
