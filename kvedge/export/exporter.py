"""`kvedge export`: checkpoint -> model.onnx + tokenizer files + kvedge.json, verified against PyTorch.

The sidecar is written last and atomically: a folder without kvedge.json is not an export, so an
interrupted or failed export (verification over tolerance included) never looks like a good one.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvedge.calibration import calibration_rows
from kvedge.errors import KvedgeError
from kvedge.models.quant import QUANT_BITS
from kvedge.export import lowerings
from kvedge.export.contract import SIDECAR, Sidecar, input_names, io_spec, output_names
from kvedge.export.graph import ExportGraph
from kvedge.models import Decoder, KVCache, load_decoder
from kvedge.models.loader import torch_dtype

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3  # protobuf's hard limit for one file
DTYPES = ("fp32", "fp16", "bf16")
KV_DTYPES = DTYPES + ("int8",)
QUANT_METHODS = {"rtn": "round-to-nearest", "gptq": "GPTQ"}


@dataclass
class ExportOptions:
    dtype: str = "fp32"
    attention: str = "ort"  # the fastest on ONNX Runtime CPU (benchmarks/decode_vs_peers.py)
    max_seq_len: int = 2048
    max_batch: int = 4
    force: bool = False
    verify: bool = True
    verify_prompt_len: int = 16
    verify_steps: int = 16
    tolerance: tuple[float | None, float] | None = None  # (max abs, min cosine); None: the dtype's preset
    quantize: str | None = None  # None | "int8" | "int4": weight-only, per group
    quant_method: str = "rtn"  # "rtn" (round-to-nearest) | "gptq" (error-compensating, calibrated on text)
    symmetric: bool = False  # zero points at the midpoint: the signed form TensorRT's weight-only path builds
    calibration_text: str | None = None  # a UTF-8 text file; None: the built-in kvedge/models/calibration.txt
    calibration_tokens: int = 2048  # at most this many tokens of it (GPTQ calibration and the perplexity)
    group_size: int = 32
    quantize_lm_head: bool = False
    allow_degraded: bool = False  # a quantized export below its top-1 threshold is written anyway
    accuracy_level: int = 0  # MatMulNBits compute: 0 as the weights' dtype allows, 4 int8 activations (faster)
    kv_dtype: str | None = None  # None: the cache has --dtype; "int8": per-channel scales calibrated on the text


class _Progress:
    def __init__(self, report: Callable[[str], None] | None):
        self.report, self.t0 = report, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.report:
            self.report(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}")


def _check_options(model_dir: Path, out_dir: Path, o: ExportOptions, cfg) -> None:
    if o.dtype not in DTYPES:
        raise KvedgeError(f"--dtype {o.dtype!r}: expected one of {', '.join(DTYPES)}")
    low = lowerings.get(o.attention)
    reasons = low.unsupported(cfg)
    if reasons:
        raise KvedgeError(f"the {low.NAME!r} lowering cannot express this {cfg.arch} model: {'; '.join(reasons)}. "
                          f"Use --attention decomposed (or ort)")
    if o.kv_dtype is not None:
        if o.kv_dtype not in KV_DTYPES:
            raise KvedgeError(f"--kv-dtype {o.kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        if o.kv_dtype not in (o.dtype, "int8"):
            raise KvedgeError(f"--kv-dtype {o.kv_dtype} with --dtype {o.dtype}: a float cache has the model's dtype "
                              f"(export with --dtype {o.kv_dtype}), or use --kv-dtype int8")
        reasons = lowerings.kv_cache_refusals(low, o.kv_dtype)
        if reasons:
            raise KvedgeError(f"the {low.NAME!r} lowering cannot export an {o.kv_dtype} KV cache: {'; '.join(reasons)}")
    if o.quantize or o.kv_dtype == "int8":  # both run the model on the calibration text
        if o.calibration_text is not None and not Path(o.calibration_text).is_file():
            raise KvedgeError(f"--calibration-text {o.calibration_text}: no such file")
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
            raise KvedgeError(f"the {low.NAME!r} lowering cannot export {o.quantize} weights: {'; '.join(reasons)}")
        if o.group_size not in (16, 32, 64, 128, 256):
            raise KvedgeError(f"--group-size {o.group_size}: expected 16, 32, 64, 128 or 256")
        if o.quant_method not in QUANT_METHODS:
            raise KvedgeError(f"--method {o.quant_method!r}: expected {' or '.join(QUANT_METHODS)}")
    if out_dir.exists() and any(out_dir.iterdir()) and not o.force:
        raise KvedgeError(f"{out_dir} exists and is not empty; pass --force to overwrite it")
    if out_dir.resolve() == model_dir.resolve():
        raise KvedgeError("the output folder must not be the checkpoint folder")


def _quantize(decoder: Decoder, model_dir: Path, o: ExportOptions, say: Callable[[str], None]):
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


def _calibrate_kv(decoder: Decoder, model_dir: Path, o: ExportOptions, text, say: Callable[[str], None]):
    """The int8 cache's per-layer scales, calibrated on the text rows (those of the weight quantization if
    any, else calibration_rows), and the sidecar's "cache" record; returns (scales, record, text)."""
    from kvedge.models.cache import KV_SCALE_MARGIN, calibrate_kv_scales

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


def _quiet_export(fn):
    """torch.onnx prints its own progress and warnings; kvedge reports its own steps instead."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
        warnings.simplefilter("ignore")
        level = logging.getLogger("torch").level
        logging.getLogger("torch").setLevel(logging.ERROR)
        try:
            return fn()
        finally:
            logging.getLogger("torch").setLevel(level)


def to_onnx(decoder: Decoder, lowering: str, max_seq_len: int, kv_scales=None):
    """Trace the Decoder into an onnx ModelProto with the chosen attention lowering (names per contract).
    kv_scales (k_scales, v_scales): an int8 cache with these per-layer scales (initializers of the graph)."""
    low = lowerings.get(lowering)
    cfg = decoder.cfg
    dtype = torch.int8 if kv_scales is not None else next(decoder.parameters()).dtype
    b, l = 2, 3  # example sizes; both axes are dynamic
    cache = KVCache.allocate(cfg, b, max_seq_len, dtype=dtype, scales=kv_scales)
    past = [t for kv in zip(cache.keys, cache.values) for t in kv]
    args = (torch.zeros(b, l, dtype=torch.long), torch.arange(l).expand(b, l).contiguous(),
            torch.full((b,), l - 1), *past)
    batch = torch.export.Dim("batch", max=1024)
    seq = torch.export.Dim("seq", max=max_seq_len)
    dynamic = {"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq},
               "logits_index": {0: batch}, "past": tuple({0: batch} for _ in past)}
    table = {torch.ops.kvedge.cached_attention.default: low.translate}
    if getattr(low, "translate_qlinear", None) is not None:
        import kvedge.models.quant  # noqa: F401  (registers torch.ops.kvedge.qlinear)

        table[torch.ops.kvedge.qlinear.default] = low.translate_qlinear
    program = _quiet_export(lambda: torch.onnx.export(
        ExportGraph(decoder, kv_scales).eval(), args, dynamo=True, dynamic_shapes=dynamic,
        input_names=input_names(cfg.num_layers), output_names=output_names(cfg.num_layers),
        custom_translation_table=table,
        opset_version=max(low.OPSET, 18), optimize=True, verbose=False))
    proto = program.model_proto
    if low.OPSET < 18:
        from kvedge.export.opset17 import downgrade_to_17

        proto = downgrade_to_17(proto)
    _prune_unused_outputs(proto)
    if hasattr(low, "finalize"):  # a lowering's own graph rewrite (ort: packed QKV into GroupQueryAttention)
        low.finalize(proto)
    _name_dynamic_axes(proto)
    return proto


def _prune_unused_outputs(proto) -> None:
    """Drop trailing node outputs nobody reads (Attention's optional present/qk outputs), so runtimes
    neither compute nor allocate them."""
    used = {i for n in proto.graph.node for i in n.input} | {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        if node.op_type not in ("Attention",):
            continue
        keep = list(node.output)
        while len(keep) > 1 and keep[-1] not in used:
            keep.pop()
        del node.output[len(keep):]


def _name_dynamic_axes(proto) -> None:
    """Give every graph input/output the contract's axis names ('batch', 'seq')."""
    for vi in list(proto.graph.input) + list(proto.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if not dims:
            continue
        dims[0].dim_param = "batch"
        if vi.name in ("input_ids", "position_ids"):
            dims[1].dim_param = "seq"
        if vi.name == "logits":
            dims[1].dim_value = 1


def _save(proto, path: Path, data_name: str) -> str | None:
    """Save; weights go to an external data file `data_name` when they pass protobuf's 2 GiB limit."""
    import onnx

    size = sum(len(t.raw_data) for t in proto.graph.initializer)
    external = size > EXTERNAL_DATA_THRESHOLD
    location = data_name if external else None
    onnx.save_model(proto, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=location, size_threshold=1024)
    return location


def check_onnx(path: Path) -> None:
    """onnx.checker (full check) and strict shape inference; both must pass."""
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise KvedgeError(f"{path}: onnx.checker failed: {e}") from None


def _check_prequantized(model_dir: Path, o: ExportOptions, low):
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
        raise KvedgeError(f"the {low.NAME!r} lowering cannot export this pre-quantized int{spec.bits} checkpoint: "
                          f"{'; '.join(reasons)}")
    return spec


def _prequantized_record(decoder: Decoder, o: ExportOptions, say: Callable[[str], None]) -> dict:
    from kvedge.models.quant import QuantLinear

    for m in decoder.modules():
        if isinstance(m, QuantLinear):
            m.accuracy_level = o.accuracy_level
    record = {**decoder.prequantized, "accuracy_level": o.accuracy_level}
    say(f"pre-quantized checkpoint: {record['linears']} {record['method']} linears, {record['scheme']}, repacked "
        f"to MatMulNBits without dequantizing")
    return record


def export(model_dir: str | Path, out_dir: str | Path, options: ExportOptions | None = None,
           progress: Callable[[str], None] | None = None) -> Sidecar:
    """Export a checkpoint to out_dir and verify it (unless options.verify is False)."""
    o = options or ExportOptions()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    say = _Progress(progress)
    from kvedge.models import load_config

    cfg = load_config(model_dir)
    _check_options(model_dir, out_dir, o, cfg)
    low = lowerings.get(o.attention)
    pre = _check_prequantized(model_dir, o, low)
    if out_dir.exists():
        (out_dir / SIDECAR).unlink(missing_ok=True)  # never leave a stale sidecar next to new files
    out_dir.mkdir(parents=True, exist_ok=True)

    say(f"loading {model_dir} ({cfg.arch}, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads)")
    decoder = load_decoder(model_dir, dtype=torch_dtype(o.dtype))
    quant, text = _quantize(decoder, model_dir, o, say) if o.quantize else (None, None)
    if pre is not None:  # AWQ / GPTQ checkpoint: the loader already made its QuantLinears
        quant = _prequantized_record(decoder, o, say)
    kv_scales, cache_record = None, {}
    if o.kv_dtype == "int8":
        kv_scales, cache_record, text = _calibrate_kv(decoder, model_dir, o, text, say)
    say(f"tracing to ONNX: lowering {low.NAME!r}, opset {low.OPSET}, {o.dtype}, max_seq_len {o.max_seq_len}"
        + (", int8 KV cache" if kv_scales is not None else ""))
    proto = to_onnx(decoder, low.NAME, o.max_seq_len, kv_scales)
    onnx_path = out_dir / "model.onnx"
    tmp_path = out_dir / ".model.onnx.partial"
    say(f"writing {onnx_path} ({len(proto.graph.node)} nodes)")
    external = _save(proto, tmp_path, onnx_path.name + ".data")
    del proto
    tmp_path.replace(onnx_path)
    say("onnx.checker (full check, shape inference)")
    check_onnx(onnx_path)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)

    logits_dtype = "float32" if o.dtype == "fp32" else {"fp16": "float16", "bf16": "bfloat16"}[o.dtype]
    inputs, outputs = io_spec(cfg, o.dtype, o.max_seq_len, logits_dtype, o.kv_dtype)
    sidecar = Sidecar(model=cfg, lowering=low.NAME, dtype=o.dtype, opset=low.OPSET, max_seq_len=o.max_seq_len,
                      max_batch=o.max_batch, inputs=inputs, outputs=outputs, external_data=external,
                      extra={"source_checkpoint": str(model_dir.resolve()), "quantization": quant},
                      cache=cache_record or {"dtype": inputs[3]["dtype"]})
    if o.verify and not getattr(low, "RUNS_ON_ONNXRUNTIME", True):
        sidecar.verification = {"passed": True, "skipped": f"the {low.NAME!r} lowering runs only inside TensorRT "
                                "(its plugin); verify it on the device with `kvedge parity --backend tensorrt`",
                                "max_abs_error": float("nan"), "min_cosine": float("nan"),
                                "greedy_agreement": float("nan")}
    elif o.verify:
        from kvedge.export.verify import verify

        say(f"verifying on ONNX Runtime CPU against PyTorch: {o.verify_prompt_len}-token prompt + "
            f"{o.verify_steps} decode steps")
        # a pre-quantized checkpoint has no unquantized model: the graph is compared with the quantized one only
        reference = load_decoder(model_dir, dtype=torch_dtype(o.dtype)) if quant and pre is None else None
        tolerance = o.tolerance
        if tolerance is None and quant and o.accuracy_level:
            tolerance = (None, 0.999)  # int8 activations: compared by cosine only
        report = verify(decoder, out_dir, sidecar, o.verify_prompt_len, o.verify_steps, tolerance=tolerance,
                        fp_reference=reference, allow_degraded=o.allow_degraded, text=text, kv_scales=kv_scales)
        sidecar.verification = report
        say(f"max abs {report['max_abs_error']:.2e}, cosine {report['min_cosine']:.6f}, "
            f"greedy agreement {report['greedy_agreement']:.0%}" + ("" if report["passed"] else "  FAILED"))
        for key, against in (("vs_unquantized", "against the unquantized model"),
                             ("vs_fp_cache", "int8 KV cache against a float cache")):
            if key in report:
                v, t = report[key], report[key]["on_text"]
                say(f"{against}: top-1 {v['top1_agreement']:.0%}, min cosine {v['min_cosine']:.4f} (random "
                    f"prompt); on {t['tokens']} tokens of the {t['text']} text: top-1 {t['top1_agreement']:.0%}, "
                    f"mean cosine {t['mean_cosine']:.4f}, perplexity {t['reference_perplexity']:.3f} -> "
                    f"{t['perplexity']:.3f}")
        if not report["passed"]:
            raise KvedgeError(f"verification failed: {report['reason']}; no {SIDECAR} was written")
    path = sidecar.write(out_dir)
    say(f"wrote {path}")
    return sidecar
