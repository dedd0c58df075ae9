"""What export does to the model before tracing it: the options and their checks, weight quantization
(round-to-nearest or GPTQ on the calibration text), an int8 cache's scales, a pre-quantized checkpoint's
record. Each returns the sidecar record of what it did."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvedge.dtypes import FLOATS, KV_DTYPES
from kvedge.errors import KvedgeError
from kvedge.export.lowerings import LOWERINGS, Lowering
from kvedge.models import Decoder
from kvedge.models.quant import QUANT_BITS
from kvedge.runtime.calibration import calibration_rows, heldout_rows

QUANT_METHODS = {"rtn": "round-to-nearest", "gptq": "GPTQ"}
GROUP_SIZES = (0, 16, 32, 64, 128, 256)  # --group-size; 0: one group per row (per channel)


@dataclass
class ExportOptions:
    dtype: str = "fp32"
    attention: str = "ort"  # the fastest on ONNX Runtime CPU (docs/benchmarks.md)
    max_seq_len: int = 2048
    max_batch: int = 4
    force: bool = False
    verify: bool = True
    verify_prompt_len: int = 16
    verify_steps: int = 16
    tolerance: dict | None = None  # overrides of kvedge.runtime.compare's preset ("max_rel", "min_cosine")
    quantize: str | None = None  # None | "int8" | "int4": weight-only, per group
    quant_method: str = "rtn"  # "rtn" (round-to-nearest) | "gptq" (error-compensating, calibrated on text)
    symmetric: bool = False  # zero points at the midpoint: the signed form TensorRT's weight-only path builds
    calibration_text: str | None = None  # a UTF-8 text file; None: the built-in kvedge/models/calibration.txt
    calibration_tokens: int = 2048  # at most this many tokens of it (and of the evaluation text)
    eval_text: str | None = None  # a UTF-8 text file the quality report measures on; None: built-in heldout.txt
    group_size: int = 32
    quantize_lm_head: bool = False
    allow_degraded: bool = False  # a quantized export below its top-1 threshold is written anyway
    accuracy_level: int = 0  # MatMulNBits compute: 0 as the weights' dtype allows, 4 int8 activations (faster)
    kv_dtype: str | None = None  # None: the cache has --dtype; "int8": per-channel scales calibrated on the text
    # a model that came quantized (GGUF): its linears in a form the target cannot build (anything but 4-bit blocks
    # when "int4"; anything but whole-row int8 when "int8") are requantized to this scheme, symmetric, group_size
    # (0: per channel); set by the CLI's --trt-version from kvedge.tensorrt.versions.export_recipe
    requantize: str | None = None


def check_options(model_dir: Path, out_dir: Path, o: ExportOptions, cfg, low: Lowering) -> None:
    if o.dtype not in FLOATS:
        raise KvedgeError(f"--dtype {o.dtype!r}: expected one of {', '.join(FLOATS)}")
    reasons = low.unsupported(cfg)
    if reasons:
        others = [n for n in ("decomposed", "ort") if n != low.name and not LOWERINGS[n].unsupported(cfg)]
        raise KvedgeError(f"the {low.name!r} lowering cannot express this {cfg.arch} model: {'; '.join(reasons)}. "
                          f"Use --attention {' or '.join(others)}")
    if o.kv_dtype is not None:
        if o.kv_dtype not in KV_DTYPES:
            raise KvedgeError(f"--kv-dtype {o.kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        if o.kv_dtype not in (o.dtype, "int8"):
            raise KvedgeError(f"--kv-dtype {o.kv_dtype} with --dtype {o.dtype}: a float cache has the model's dtype "
                              f"(export with --dtype {o.kv_dtype}), or use --kv-dtype int8")
        reasons = low.kv_refusals(o.kv_dtype)
        if o.kv_dtype == "int8" and cfg.mla:
            reasons = ["MLA's latent cache (k_rope, c_kv) is int8 in the torch backend only: the one lowering with "
                       "an int8 cache, ort, cannot run MLA; export a float cache"]
        if reasons:
            raise KvedgeError(f"the {low.name!r} lowering cannot export an {o.kv_dtype} KV cache: {'; '.join(reasons)}")
    if o.quantize or o.kv_dtype == "int8":  # both run the model on the calibration text
        for flag, f in (("--calibration-text", o.calibration_text), ("--eval-text", o.eval_text)):
            if f is not None and not Path(f).is_file():
                raise KvedgeError(f"{flag} {f}: no such file")
        if o.calibration_tokens < 2:
            raise KvedgeError(f"--calibration-tokens {o.calibration_tokens}: expected at least 2")
    if o.max_seq_len < 2 or o.max_batch < 1:
        raise KvedgeError(f"--max-seq-len must be >= 2 and --max-batch >= 1, got {o.max_seq_len}, {o.max_batch}")
    if cfg.positions == "learned" and o.max_seq_len > cfg.max_position_embeddings:
        raise KvedgeError(f"--max-seq-len {o.max_seq_len} exceeds this model's learned positions "
                          f"({cfg.max_position_embeddings})")
    if o.quantize is not None:
        if o.quantize not in QUANT_BITS:
            raise KvedgeError(f"--quantize {o.quantize!r}: expected int8 or int4")
        reasons = low.unsupported_quant(QUANT_BITS[o.quantize])
        if reasons:
            raise KvedgeError(f"the {low.name!r} lowering cannot export {o.quantize} weights: {'; '.join(reasons)}")
        if o.group_size not in GROUP_SIZES:
            raise KvedgeError(f"--group-size {o.group_size}: expected one of {', '.join(map(str, GROUP_SIZES))} "
                              "(0: per channel)")
        if o.group_size == 0 and o.quant_method != "rtn":
            raise KvedgeError("--group-size 0 (per channel) is round-to-nearest only: drop --method gptq")
        if o.quant_method not in QUANT_METHODS:
            raise KvedgeError(f"--method {o.quant_method!r}: expected {' or '.join(QUANT_METHODS)}")
    if out_dir.exists() and any(out_dir.iterdir()) and not o.force:
        raise KvedgeError(f"{out_dir} exists and is not empty; pass --force to overwrite it")
    if out_dir.resolve() == model_dir.resolve():
        raise KvedgeError("the output folder must not be the checkpoint folder")


def quantize(decoder: Decoder, model_dir: Path, o: ExportOptions, say: Callable[[str], None]):
    """Quantize the decoder in place; returns (the sidecar's quantization record, the text rows)."""
    bits = QUANT_BITS[o.quantize]
    rows, text = calibration_rows(model_dir, decoder.cfg, o.calibration_text, o.calibration_tokens)
    record = {"scheme": o.quantize, "bits": bits, "group_size": o.group_size, "method": o.quant_method,
              "lm_head": o.quantize_lm_head, "accuracy_level": o.accuracy_level, "symmetric": o.symmetric}
    if o.quant_method == "gptq":
        from kvedge.models.gptq import DAMP, gptq_quantize_decoder

        say(f"GPTQ calibration on {text['tokens']} tokens ({text['rows']} x {text['row_length']}) of the "
            f"{text['text']} text")
        fig = gptq_quantize_decoder(decoder, rows, bits, o.group_size, o.quantize_lm_head, o.accuracy_level, say,
                                    symmetric=o.symmetric)
        record.update(linears=fig.pop("linears"), calibration={**text, "damp": DAMP, **fig})
    else:
        from kvedge.models.quant import quantize_decoder

        record["linears"] = quantize_decoder(decoder, bits, o.group_size, o.quantize_lm_head, o.accuracy_level,
                                             o.symmetric)
    say(f"quantized {record['linears']} linears to {o.quantize} ({QUANT_METHODS[o.quant_method]}, "
        f"groups of {o.group_size})")
    return record, (rows, text)


def calibrate_kv(decoder: Decoder, model_dir: Path, o: ExportOptions, text, say: Callable[[str], None]):
    """The int8 cache's per-layer scales, calibrated on the text rows (those of the weight quantization if
    any, else calibration_rows), and the sidecar's "cache" record; returns (scales, record, text)."""
    from kvedge.runtime.calibration import KV_SCALE_MARGIN, calibrate_kv_scales

    rows, what = text or calibration_rows(model_dir, decoder.cfg, o.calibration_text, o.calibration_tokens)
    say(f"int8 KV cache: calibrating per-channel scales on {what['tokens']} tokens of the {what['text']} text")
    scales = calibrate_kv_scales(decoder, rows)
    n = decoder.cfg.num_layers
    record = {"dtype": "int8", "quantization": {
        "scheme": "symmetric int8 per layer, KV head and channel (GroupQueryAttention PER_CHANNEL)",
        "write": "q = clamp(round_half_even(x * (1 / scale)), -128, 127), k after RoPE",
        "read": "q * scale", "scales": {"where": "model.onnx initializers", "dtype": "float32",
                                        "shape": [1, decoder.cfg.num_kv_heads, 1, decoder.cfg.head_dim],
                                        "k": [f"k_scale_{i}" for i in range(n)], "v": [f"v_scale_{i}" for i in range(n)]},
        "calibration": {**what, "margin": KV_SCALE_MARGIN, "statistic": "max |x| over the text"}}}
    return scales, record, (rows, what)


def check_prequantized(model_dir: Path, o: ExportOptions, low):
    """The quantization_config of a pre-quantized (AWQ / GPTQ) checkpoint, checked against the options."""
    from kvedge.models.prequant import read_spec

    spec = read_spec(model_dir)
    if spec is None:
        return None
    if o.quantize:
        raise KvedgeError(f"{model_dir} is already quantized ({spec.method}, {spec.bits} bits, says the "
                          f"quantization_config of its config.json): drop --quantize, it exports as it is")
    reasons = low.unsupported_quant(spec.bits)
    if reasons:
        raise KvedgeError(f"the {low.name!r} lowering cannot export this pre-quantized int{spec.bits} checkpoint: "
                          f"{'; '.join(reasons)}")
    return spec


def prequantized_record(decoder: Decoder, o: ExportOptions, say: Callable[[str], None]) -> dict:
    record = {**decoder.prequantized, "accuracy_level": o.accuracy_level}
    say(f"pre-quantized model: {record['linears']} {record['method']} linears, {record['scheme']}, kept as they "
        f"are (no re-rounding)")
    return record


def requantize(decoder: Decoder, o: ExportOptions, say: Callable[[str], None]) -> int:
    """Requantize, in place, the projections of a model that came quantized whose form o.requantize rules out (module
    doc of ExportOptions.requantize) from their exact float values; returns how many. The caller keeps the
    model as loaded as the reference the quality report compares with."""
    import torch

    from kvedge.models.quant import QuantLinear, dequantize, projections

    bits = QUANT_BITS[o.requantize]
    done = 0
    places = [(layer, name) for layer in decoder.layers for name in projections(decoder.cfg)]
    if isinstance(getattr(decoder, "lm_head", None), QuantLinear):  # a file's own output.weight (Q6_K in Q4_K_M)
        places.append((decoder, "lm_head"))
    for layer, name in places:
        m = getattr(layer, name)
        if isinstance(m, QuantLinear) and m.bits == bits and (bits == 4 or m.qweight.shape[1] == 1):
            continue
        w = (dequantize(m.qweight, m.scales.float(), m.zeros, m.bits, m.in_features, m.mins)
             if isinstance(m, QuantLinear) else m.weight.detach().float())
        with torch.device("meta"):
            shell = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        shell.weight = torch.nn.Parameter(w, requires_grad=False)
        if m.bias is not None:
            shell.bias = torch.nn.Parameter(m.bias.detach().clone(), requires_grad=False)
        dtype = m.scales.dtype if isinstance(m, QuantLinear) else m.weight.dtype
        q = QuantLinear(shell, bits, o.group_size or m.in_features, symmetric=True)
        q.scales = q.scales.to(dtype)
        setattr(layer, name, q)
        done += 1
    if done:
        say(f"requantized {done} linears the target cannot build as they are to {o.requantize} "
            f"({'per channel' if not o.group_size else f'groups of {o.group_size}'}, symmetric)")
    return done


def check_loaded_quant(decoder: Decoder, o: ExportOptions, low: Lowering) -> None:
    """Refuse, before tracing, what the lowering cannot hold of a model that came quantized (AWQ / GPTQ / GGUF):
    --quantize on top of it, its bit widths, and affine blocks (a GGUF file's Q4_1 / Q4_K / Q5_K)."""
    from kvedge.models.quant import QuantLinear

    what = decoder.prequantized["method"]
    if o.quantize:
        raise KvedgeError(f"this model is already quantized ({what}, {decoder.prequantized['scheme']}): drop "
                          f"--quantize, it exports as it is")
    quant = [m for m in decoder.modules() if isinstance(m, QuantLinear)]
    reasons = [r for b in sorted({m.bits for m in quant}) for r in low.unsupported_quant(b)]
    bits = sorted({m.bits for m in quant if m.mins is not None})
    reasons += [r for b in bits for r in low.affine_refusals(b)]
    if reasons:
        raise KvedgeError(f"the {low.name!r} lowering cannot export this {what} model's quantized weights: "
                          f"{'; '.join(dict.fromkeys(reasons))}")


def evaluation_rows(model_dir: Path, decoder: Decoder, o: ExportOptions):
    """(token rows, what they are) of the text a quantized export's quality is measured on: never the
    calibration text (GPTQ and the int8 cache's scales are fitted to that one)."""
    return heldout_rows(model_dir, decoder.cfg, o.eval_text, o.calibration_tokens)
