"""`kvedge export`: checkpoint -> model.onnx + tokenizer files + kvedge.json, verified against PyTorch.

The steps: check the options and prepare the model (kvedge.export.prepare: quantize, calibrate), score a
quantization against the model without it in PyTorch (kvedge.export.verify.quality: the quality gate, seconds,
before minutes of tracing), trace it with the chosen lowering (to_onnx), save and check the graph, write the
sidecar's record, verify the graph (kvedge.export.verify.verify), and write the sidecar.

Everything is written into a staging folder beside out_dir and moved into it at the end, the sidecar last and
atomically: a refused, failed or interrupted export leaves nothing (no model.onnx, no empty folder) and an
earlier export in out_dir whole; a folder without kvedge.json is never an export.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from kvedge.artifact import SIDECAR, Sidecar, input_names, io_spec, output_names
from kvedge.errors import KvedgeError
from kvedge.export import lowerings, prepare
from kvedge.export.graph import ExportGraph
from kvedge.export.prepare import ExportOptions
from kvedge.models import Decoder, load_decoder
from kvedge.models.loader import torch_dtype

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")
# Weights above this go to model.onnx.data, written a tensor at a time; a single file is serialized whole in memory
# first, a second copy of the weights beside the graph's own (protobuf cannot write one file past 2 GiB at all).
EXTERNAL_DATA_THRESHOLD = 512 * 1024**2
# While tracing, tensors from this size go to a scratch file (to_onnx), so the ModelProto never holds the weights.
SCRATCH_THRESHOLD = 1024
DATA_ALIGNMENT = 4096  # each tensor of model.onnx.data starts on a page: a runtime may map it in place


def _release_freed() -> None:
    """Collect, then hand freed memory back to the system. glibc keeps the freed tensors of a model in its arenas
    (its mmap threshold grows to 32 MB as large blocks come and go), so without malloc_trim a freed Decoder still
    counts in the process's resident memory. Other C libraries: collection only."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class _Progress:
    def __init__(self, report: Callable[[str], None] | None):
        self.report, self.t0 = report, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.report:
            self.report(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}")


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


def to_onnx(decoder: Decoder, lowering: str, max_seq_len: int, kv_scales=None, scratch: Path | None = None):
    """Trace the Decoder into an onnx ModelProto with the chosen attention lowering (names per contract).
    kv_scales (k_scales, v_scales): an int8 cache with these per-layer scales (initializers of the graph).
    scratch: a file the weights are written to a tensor at a time as soon as they are traced; the ModelProto then
    refers to them there (external data) instead of holding a copy of every weight (`_save` moves them on)."""
    low = lowerings.get(lowering)
    cfg = decoder.cfg
    dtype = torch.int8 if kv_scales is not None else next(decoder.parameters()).dtype
    b, l = 2, 3  # example sizes; both axes are dynamic
    k_shape, v_shape = cfg.cache_shapes(b, max_seq_len)
    # only the example caches' shapes are traced: left empty, their pages are never touched (never resident)
    past = [torch.empty(shape, dtype=dtype) for _ in range(cfg.num_layers) for shape in (k_shape, v_shape)]
    # two positions' logits a row in the example: an axis of size 1 would be traced as a constant 1
    args = (torch.zeros(b, l, dtype=torch.long), torch.arange(l).expand(b, l).contiguous(),
            torch.arange(1, l).expand(b, l - 1).contiguous(), *past)
    batch = torch.export.Dim("batch", max=1024)
    seq = torch.export.Dim("seq", max=max_seq_len)
    logits = torch.export.Dim("logits", max=max_seq_len)
    dynamic = {"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq},
               "logits_index": {0: batch, 1: logits}, "past": tuple({0: batch} for _ in past)}
    table = {torch.ops.kvedge.cached_attention.default: low.translate}
    if low.translate_qlinear is not None:
        import kvedge.models.quant  # noqa: F401  (registers torch.ops.kvedge.qlinear)

        table[torch.ops.kvedge.qlinear.default] = low.translate_qlinear
    if low.translate_qembedding is not None:
        table[torch.ops.kvedge.qembedding.default] = low.translate_qembedding
    opset = graph_opset(decoder, low)
    program = _quiet_export(lambda: torch.onnx.export(
        ExportGraph(decoder, kv_scales).eval(), args, dynamo=True, dynamic_shapes=dynamic,
        input_names=input_names(cfg.num_layers), output_names=output_names(cfg.num_layers),
        custom_translation_table=table,
        opset_version=max(opset, 18), optimize=True, verbose=False))
    model = program.model  # the ONNX IR: its initializers are views of the Decoder's tensors, not copies
    del program  # the exported program: only the ONNX IR is kept
    _release_freed()  # torch.export's graphs hold reference cycles
    import onnx_ir

    base_dir = ""
    if scratch is not None:
        from onnx_ir.external_data import unload_from_model

        unload_from_model(model, scratch.parent, scratch.name, size_threshold_bytes=SCRATCH_THRESHOLD)
        base_dir = str(scratch.parent)
    proto = onnx_ir.serde.serialize_model(model)
    del model
    if opset < 18:
        from kvedge.export.opset17 import downgrade_to_17

        proto = downgrade_to_17(proto, base_dir)
    if low.finalize is not None:  # the lowering's own graph rewrite
        low.finalize(proto, base_dir)
    _name_dynamic_axes(proto)
    return proto


def graph_opset(decoder: Decoder, low) -> int:
    """The lowering's opset, or the higher one its quantized weights need (the DequantizeLinear form: 21 for INT4
    or blocks)."""
    from kvedge.models.quant import QuantLinear

    quant = [m for m in decoder.modules() if isinstance(m, QuantLinear)]
    if not quant:
        return low.opset
    blocked = any(m.qweight.shape[1] > 1 for m in quant)
    return max(low.opset, low.weights_opset({m.bits for m in quant}, blocked))


def _name_dynamic_axes(proto) -> None:
    """Give every graph input/output the contract's axis names ('batch', 'seq', 'logits')."""
    for vi in list(proto.graph.input) + list(proto.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if not dims:
            continue
        dims[0].dim_param = "batch"
        if vi.name in ("input_ids", "position_ids"):
            dims[1].dim_param = "seq"
        if vi.name in ("logits_index", "logits"):
            dims[1].dim_param = "logits"


def _save(proto, path: Path, base_dir: str = "") -> str | None:
    """Save the graph. Its weights, held in the proto or in external data under base_dir (to_onnx's scratch file),
    go into model.onnx itself up to EXTERNAL_DATA_THRESHOLD, else to `model.onnx.data` a tensor at a time (then
    returns that file's name). Tensors the graph no longer reads (a rewrite replaced them) are not carried."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    inits = list(proto.graph.initializer)
    external = [t for t in inits if uses_external_data(t)]
    size = sum(t.ByteSize() for t in inits) + sum(ExternalDataInfo(t).length for t in external)
    if size <= EXTERNAL_DATA_THRESHOLD:
        if external:
            onnx.load_external_data_for_model(proto, base_dir)
        onnx.save_model(proto, str(path))
        return None
    data = path.with_name(path.name + ".data")
    sources: dict[str, io.BufferedReader] = {}
    try:
        with open(data, "wb") as out:
            for t in inits:
                if uses_external_data(t):
                    info = ExternalDataInfo(t)
                    if info.location not in sources:
                        sources[info.location] = open(os.path.join(base_dir, info.location), "rb")
                    src = sources[info.location]
                    src.seek(info.offset or 0)
                    raw = src.read(info.length)
                elif t.HasField("raw_data") and len(t.raw_data) >= 1024:
                    raw = t.raw_data
                else:
                    continue
                out.write(b"\0" * (-out.tell() % DATA_ALIGNMENT))
                offset = out.tell()
                out.write(raw)
                t.ClearField("raw_data")
                del t.external_data[:]
                t.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", data.name), ("offset", offset), ("length", len(raw))):
                    t.external_data.add(key=key, value=str(value))
                del raw
    finally:
        for f in sources.values():
            f.close()
    onnx.save_model(proto, str(path))
    return data.name


def check_onnx(path: Path) -> None:
    """onnx.checker (full check) and strict shape inference; both must pass."""
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise KvedgeError(f"{path}: onnx.checker failed: {e}") from None


@contextlib.contextmanager
def _staged(out_dir: Path):
    """A fresh folder beside out_dir for the export to write into. On any failure (a refusal, a verification over
    tolerance, Ctrl-C) it is removed, with the folders made for it, so that nothing is left behind and an earlier
    export in out_dir stays whole; on success the caller publishes it (_publish)."""
    made = [p for p in (out_dir.parent, *out_dir.parent.parents) if not p.exists()]  # parents -o asked for
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for p in made:  # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def _publish(stage: Path, out_dir: Path, sidecar: Sidecar) -> Path:
    """Move the staged files into out_dir (made if need be; its other files stay), the sidecar last."""
    out_dir.mkdir(exist_ok=True)
    (out_dir / SIDECAR).unlink(missing_ok=True)  # never a stale sidecar next to new files, even for a moment
    for f in stage.iterdir():
        os.replace(f, out_dir / f.name)
    stage.rmdir()
    return sidecar.write(out_dir)


def export(model_dir: str | Path, out_dir: str | Path, options: ExportOptions | None = None,
           progress: Callable[[str], None] | None = None) -> Sidecar:
    """Export a checkpoint to out_dir and verify it (unless options.verify is False). A refusal or a failure
    leaves out_dir as it was (no folder if there was none)."""
    o = options or ExportOptions()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    say = _Progress(progress)
    from kvedge.models import load_config

    cfg = load_config(model_dir)
    low = lowerings.get(o.attention)
    prepare.check_options(model_dir, out_dir, o, cfg, low)
    prepare.check_prequantized(model_dir, o, low)  # an AWQ / GPTQ config, before the weights are read
    with _staged(out_dir) as stage:
        sidecar = _export(model_dir, stage, o, cfg, low, say)
        path = _publish(stage, out_dir, sidecar)
    say(f"wrote {path}")
    return sidecar


def _export(model_dir: Path, out_dir: Path, o: ExportOptions, cfg, low, say) -> Sidecar:
    """export's work, into the staging folder out_dir; returns the sidecar, not yet written."""
    say(f"loading {model_dir} ({cfg.arch}, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads)")
    decoder = load_decoder(model_dir, dtype=torch_dtype(o.dtype), quantized_embedding=embedding_bits(cfg, o, low))
    from kvedge.models.quant import QuantLinear

    for m in decoder.modules():  # the loader's QuantLinears (a QuantEmbedding's tied head too) compute as asked
        if isinstance(m, QuantLinear):
            m.accuracy_level = o.accuracy_level
    pre = getattr(decoder, "prequantized", None)  # AWQ / GPTQ / GGUF: the loader made its QuantLinears
    requantized = 0
    if pre is not None:
        prepare.check_loaded_quant(decoder, o, low)
        quant, calibration = prepare.prequantized_record(decoder, o, say), None
        if o.requantize:
            requantized = prepare.requantize(decoder, o, say)
            if requantized:
                quant.update(source_scheme=quant["scheme"], scheme=o.requantize, requantized={
                    "linears": requantized, "group_size": o.group_size, "symmetric": True})
    else:
        quant, calibration = prepare.quantize(decoder, model_dir, o, say) if o.quantize else (None, None)
    kv_scales, cache_record = None, {}
    if o.kv_dtype == "int8":
        kv_scales, cache_record, calibration = prepare.calibrate_kv(decoder, model_dir, o, calibration, say)
    quality = {}
    scored = quant if pre is None or requantized else None  # weights that have a model without that quantization
    if o.verify and (scored or kv_scales is not None):
        quality = _quality_gate(decoder, model_dir, o, scored, kv_scales, say)
    from kvedge.export import verify

    checks = o.verify and low.runs_on_onnxruntime
    reference = None
    if checks and verify.runs_on_cpu(o.dtype):  # before tracing, whose leftovers in the C heap a run would grow
        say(f"PyTorch's side of the verification: a {o.verify_prompt_len}-token prompt + {o.verify_steps} greedy "
            f"decode steps")
        reference = verify.reference(decoder, o.max_seq_len, o.verify_prompt_len, o.verify_steps,
                                     kv_scales=kv_scales)
    opset = graph_opset(decoder, low)
    say(f"tracing to ONNX: lowering {low.name!r}, opset {opset}, {o.dtype}, max_seq_len {o.max_seq_len}"
        + (", int8 KV cache" if kv_scales is not None else ""))
    scratch = out_dir / ".traced-weights"  # inside the staging folder: removed with it on any failure
    proto = to_onnx(decoder, low.name, o.max_seq_len, kv_scales, scratch)
    del decoder  # from here on the weights are in the files only: ONNX Runtime never loads beside the Decoder
    _release_freed()
    onnx_path = out_dir / "model.onnx"
    say(f"writing the graph ({len(proto.graph.node)} nodes)")
    external = _save(proto, onnx_path, str(out_dir))
    scratch.unlink(missing_ok=True)
    del proto
    _release_freed()
    say("onnx.checker (full check, shape inference)")
    check_onnx(onnx_path)
    if model_dir.suffix.lower() == ".gguf":  # the file's own tokenizer and chat template, as Hugging Face files
        from kvedge.models.gguf_vocab import write_tokenizer_files

        write_tokenizer_files(model_dir, out_dir)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out_dir / name)

    inputs, outputs = io_spec(cfg, o.dtype, o.max_seq_len, o.kv_dtype)
    requires = {"onnxruntime": ".".join(map(str, low.min_onnxruntime))} if low.min_onnxruntime else {}
    sidecar = Sidecar(model=cfg, lowering=low.name, dtype=o.dtype, opset=opset, max_seq_len=o.max_seq_len,
                      max_batch=o.max_batch, inputs=inputs, outputs=outputs, external_data=external,
                      extra={"source_checkpoint": str(model_dir.resolve()), "quantization": quant},
                      plugins=list(low.plugins), requires=requires)
    sidecar.cache = cache_record or {"dtype": sidecar.cache_dtype}
    if o.verify and not checks:
        sidecar.verification = {"passed": True, "skipped": f"the {low.name!r} lowering runs only inside TensorRT "
                                "(its plugin); verify it on the device with `kvedge parity --backend tensorrt`",
                                "max_abs_error": float("nan"), "min_cosine": float("nan"),
                                "greedy_agreement": float("nan"), **quality}
    elif o.verify:
        say("verifying the graph on ONNX Runtime CPU against PyTorch's run")
        tolerance = o.tolerance
        if tolerance is None and quant and o.accuracy_level:
            tolerance = {"max_rel": None, "min_cosine": 0.999}  # int8 activations: compared by cosine only
        report = verify.verify(reference, out_dir, sidecar, tolerance=tolerance, quality_report=quality)
        sidecar.verification = report
        for line in verify.summary(report):
            say(line)
        if not report["passed"]:
            raise KvedgeError(f"verification failed: the graph against PyTorch: {report['reason']}; nothing was "
                              f"written")
    return sidecar


def embedding_bits(cfg, o: ExportOptions, low) -> tuple[int, ...]:
    """The bit widths at which a GGUF file's quantized embedding is exported in its integers (no float copy of the
    largest matrix of a small model), where the lowering can gather them. A tied head then computes on them too:
    at 8 bits only with int8 activations (accuracy level 4), since ONNX Runtime's CPU MatMulNBits dequantizes
    8-bit weights on every call otherwise, 25x slower than the float MatMul on a 49152 x 576 head
    (docs/benchmarks.md)."""
    if low.translate_qembedding is None:
        return ()
    return (4, 8) if not cfg.tie_embeddings or o.accuracy_level == 4 else (4,)


def _quality_gate(decoder: Decoder, model_dir: Path, o: ExportOptions, quant: dict | None, kv_scales, say) -> dict:
    """The quantization's quality in PyTorch, before tracing: refused (KvedgeError, one line) below its gate unless
    --allow-degraded. quant: the weight quantization's record (None: weights as loaded, an int8 cache only)."""
    from kvedge.export.verify import quality, quality_lines

    what = " and ".join(x for x in (quant and f"{quant['scheme']} weights", kv_scales is not None and "int8 KV cache")
                        if x)
    say(f"scoring the {what} against the model without that quantization in PyTorch (the quality gate, before "
        f"tracing)")
    # a pre-quantized checkpoint has no unquantized model: its weights are compared with nothing
    reference = load_decoder(model_dir, dtype=torch_dtype(o.dtype)) if quant else None
    text = prepare.evaluation_rows(model_dir, decoder, o)
    report, refusal = quality(decoder, o.max_seq_len, o.verify_prompt_len, o.verify_steps,
                              quant["scheme"] if quant else None, reference, kv_scales, text, o.allow_degraded)
    if refusal and not o.allow_degraded:
        raise KvedgeError(refusal)
    for line in quality_lines(report):
        say(line)
    return report
