"""Pre-quantized Hugging Face checkpoints (AutoAWQ "gemm", AutoGPTQ / GPTQModel "gptq" and "gptq_v2")
loaded into kvedge's QuantLinear by repacking their integers: no floating-point weight is ever formed.

K = in_features, N = out_features, G = group size, pf = 32 / bits values per int32 word; value j of a
word sits at bits [j * bits, (j + 1) * bits). Dequantized, both formats mean w[n, k] = (q - z) * s.

AWQ (AutoAWQ WQLinear_GEMM), 4 bits, packed along the output dimension:
  qweight int32 [K, N / 8]       word c of row k holds column 8c + AWQ_ORDER[j] at value j
  qzeros  int32 [K / G, N / 8]   the same packing; zeros stored as they are
  scales  fp16  [K / G, N]
GPTQ (AutoGPTQ, GPTQModel), 4 or 8 bits:
  qweight int32 [K / pf, N]      packed along the input dimension: word r of column n holds row r * pf + j
  qzeros  int32 [K / G, N / pf]  packed along the output dimension, in order
  scales  fp16  [K / G, N]
  g_idx   int32 [K]              the group of each input channel: k // G, unless desc_act permuted them
  checkpoint_format "gptq" (v1) stores zero - 1 (z = stored + 1, so a stored 15 means 16, which 4-bit
  MatMulNBits cannot hold and is refused); "gptq_v2" stores the zero itself.

kvedge's QuantLinear holds ONNX Runtime's MatMulNBits layout (kvedge.models.quant): rows are output
channels, so the parts of a fused projection (q/k/v -> qkv, gate/up -> up) are concatenated along the
output rows, which needs one group size for all parts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvedge.errors import CheckpointError, ConfigError
from kvedge.models.quant import pack

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value j of an AWQ word holds column AWQ_ORDER[j] of its 8
AWQ_INVERSE = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c is value AWQ_INVERSE[c]
GPTQ_FORMATS = ("gptq", "gptq_v2")
_INT_DTYPES = ("I32", "torch.int32")
_FLOAT_DTYPES = ("F16", "F32", "BF16", "torch.float16", "torch.float32", "torch.bfloat16")


@dataclass(frozen=True)
class PrequantSpec:
    """What config.json's quantization_config says, reduced to what loading needs."""

    method: str  # "awq" | "gptq"
    bits: int
    group_size: int  # -1: one group over the whole input (GPTQ)
    checkpoint_format: str  # "gemm" (awq), "gptq" (v1) or "gptq_v2"
    source: str = field(default="config.json", compare=False)

    @property
    def zero_offset(self) -> int:
        return 1 if self.checkpoint_format == "gptq" else 0

    @property
    def tensors(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")


def read_spec(model_dir: str | Path) -> PrequantSpec | None:
    """The quantization_config of a checkpoint's config.json, checked; None when the checkpoint has none."""
    path = Path(model_dir)
    if path.suffix.lower() == ".gguf":
        return None  # a GGUF file's quantized weights are read by kvedge.models.gguf
    path = path / "config.json" if path.is_dir() else path
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # load_config reports a missing or malformed config.json
    qc = hf.get("quantization_config") if isinstance(hf, dict) else None
    return None if qc is None else parse_spec(qc, str(path))


def parse_spec(qc: dict[str, Any], source: str = "config.json") -> PrequantSpec:
    def bad(key: str, value: Any, accepted: str) -> ConfigError:
        return ConfigError(f"{source}: quantization_config.{key} = {value!r} is not supported; kvedge accepts "
                           f"{accepted}")

    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise bad("quant_method", qc.get("quant_method"),
                  "'awq' (AutoAWQ, version 'gemm') and 'gptq' (AutoGPTQ / GPTQModel, checkpoint_format 'gptq' "
                  "or 'gptq_v2'), or an unquantized checkpoint")
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if method == "awq":
        if bits != 4:
            raise bad("bits", bits, "4 for AWQ")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise bad("version", qc.get("version"), "'gemm' for AWQ (gemv, gemv_fast, marlin and exllama "
                      "checkpoints pack their integers differently)")
        if qc.get("zero_point", True) is not True:
            raise bad("zero_point", qc.get("zero_point"), "true for AWQ (the GEMM format stores zero points)")
        fmt = "gemm"
    else:
        if bits not in (4, 8):
            raise bad("bits", bits, "4 or 8 for GPTQ")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in GPTQ_FORMATS or qc.get("is_marlin_format"):
            key = "is_marlin_format" if qc.get("is_marlin_format") else "checkpoint_format"
            raise bad(key, qc.get(key) if key in qc else qc.get("format"),
                      "checkpoint_format 'gptq' (v1) or 'gptq_v2' (marlin, bitblas, exllama and other "
                      "kernel-specific layouts are not read)")
        if qc.get("lm_head"):
            raise bad("lm_head", qc.get("lm_head"), "false: a quantized lm_head is not loaded (the lm_head "
                      "must be floating point; export can quantize it with --quantize-lm-head)")
        if qc.get("dynamic"):
            raise bad("dynamic", qc.get("dynamic"), "no per-module overrides: one bits / group_size for every module")
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise bad("group_size", group, "a positive group size (or -1 for GPTQ)")
    if method == "awq" and group == -1:
        raise bad("group_size", group, "a positive group size for AWQ")
    return PrequantSpec(method, bits, group, fmt, source)


# -- unpacking: checkpoint words -> integers, [out, in] -----------------------------------------
def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> int32 [..., W, 32 / bits]: value j of each word (bits j*bits upward), unsigned."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """An AWQ GEMM qweight [K, N / 8] or qzeros [K / G, N / 8] -> int32 [K or K / G, N], columns in order."""
    values = unpack_words(packed, 4)[..., list(AWQ_INVERSE)]
    return values.reshape(packed.shape[0], -1)


def gptq_unpack_qweight(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """A GPTQ qweight [K / pf, N] -> int32 [K, N]."""
    values = unpack_words(qweight, bits)  # [K / pf, N, pf]
    return values.permute(0, 2, 1).reshape(-1, qweight.shape[1])


def gptq_unpack_qzeros(qzeros: torch.Tensor, bits: int, offset: int) -> torch.Tensor:
    """A GPTQ qzeros [K / G, N / pf] -> int32 [K / G, N], plus the format's offset (1 for v1)."""
    return unpack_words(qzeros, bits).reshape(qzeros.shape[0], -1) + offset


def unpack(spec: PrequantSpec, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One checkpoint linear's {qweight, qzeros} -> (q [N, K], z [N, K / G]) int32."""
    if spec.method == "awq":
        return awq_unpack(t["qweight"]).t(), awq_unpack(t["qzeros"]).t()
    return (gptq_unpack_qweight(t["qweight"], spec.bits).t(),
            gptq_unpack_qzeros(t["qzeros"], spec.bits, spec.zero_offset).t())


def matmulnbits(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, bits: int, group: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K], z and s [N, K / G] -> (qweight, scales, zeros) in the MatMulNBits layout of kvedge.models.quant."""
    return pack(q.to(torch.uint8).reshape(q.shape[0], -1, group), s, z.to(torch.uint8), bits)


# -- the plan: which kvedge linears come from which quantized checkpoint linears ----------------
@dataclass
class Prequantized:
    """The quantized linears of one checkpoint. `fp_map` is what still loads as floating point."""

    spec: PrequantSpec
    fp_map: dict  # kvedge name -> loader.Source
    modules: dict  # kvedge module name ("layers.0.qkv") -> loader.Source of its (former) weight
    groups: dict[str, int]  # kvedge module name -> group size
    names: list[str]  # every checkpoint tensor the quantized linears read
    where: str = ""

    @classmethod
    def plan(cls, spec: PrequantSpec, tmap: dict, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str],
             where: str) -> Prequantized:
        fp_map, modules = {}, {}
        for dst, src in tmap.items():
            bases = [n[: -len(".weight")] for n in src.names if n.endswith(".weight")]
            quantized = [b + ".qweight" in shapes for b in bases]
            if not (dst.endswith(".weight") and any(quantized)):
                fp_map[dst] = src
                continue
            if not all(quantized) or len(bases) != len(src.names):
                raise CheckpointError(
                    f"{where}: {', '.join(src.names)} are fused into kvedge's {dst[:-7]}, but only some of them "
                    f"are quantized ({', '.join(b for b, q in zip(bases, quantized) if q)}); all or none can be")
            if not dst.startswith("layers."):
                raise _not_a_projection(where, bases[0] + ".qweight")
            if src.transpose:
                raise CheckpointError(f"{where}: tensor '{bases[0]}.qweight': quantized Conv1D (gpt2) weights are "
                                      f"not loaded; kvedge loads quantized nn.Linear projections")
            modules[dst[: -len(".weight")]] = src
        if not modules:
            raise CheckpointError(f"{where}: quantization_config says {spec.method!r}, but no projection has a "
                                  f"'.qweight' tensor; is config.json from another checkpoint?")
        names, groups = [], {}
        for module, src in modules.items():
            groups[module] = _check_module(spec, module, src, shapes, dtypes, where)
            for name in src.names:
                base = name[: -len(".weight")]
                names += [f"{base}.{t}" for t in spec.tensors]
                if spec.method == "gptq" and f"{base}.g_idx" in shapes:
                    names.append(f"{base}.g_idx")
        stray = sorted(n for n in shapes if n.endswith((".qweight", ".qzeros", ".g_idx")) and n not in set(names))
        if stray:
            raise _not_a_projection(where, stray[0])
        return cls(spec, fp_map, modules, groups, names, where)

    def install(self, model: nn.Module, raw: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Put a QuantLinear at every quantized module of `model` (built on the meta device); returns their
        buffers as state-dict entries for the strict load that follows (the biases load as floating point)."""
        from kvedge.models.quant import QuantLinear

        state = {}
        for module, src in self.modules.items():
            q, z, s, k = _repack(self.spec, self.groups[module], src, raw, self.where)
            group = self.groups[module]
            with torch.device("meta"):  # a shell: its shape, dtype and bias; quantizing it computes nothing
                linear = QuantLinear(nn.Linear(k, q.shape[0], bias=module + ".bias" in self.fp_map, dtype=dtype),
                                     self.spec.bits, group)
            linear.qweight, linear.scales, linear.zeros = (
                t.to(device) for t in matmulnbits(q, z, s.to(dtype), self.spec.bits, group))
            model.set_submodule(module, linear)
            state.update({f"{module}.{b}": getattr(linear, b) for b in ("qweight", "scales", "zeros")})
        return state

    def record(self) -> dict[str, Any]:
        """The sidecar's quantization record."""
        groups = sorted(set(self.groups.values()))
        return {"scheme": f"int{self.spec.bits}", "bits": self.spec.bits,
                "group_size": groups[0] if len(groups) == 1 else groups, "method": self.spec.method,
                "checkpoint_format": self.spec.checkpoint_format, "lm_head": False, "linears": len(self.modules),
                "pre_quantized": True}


def _not_a_projection(where: str, tensor: str) -> CheckpointError:
    return CheckpointError(f"{where}: tensor {tensor!r} is quantized, but kvedge loads quantized weights only for the "
                           f"decoder blocks' projections; the lm_head and embeddings must be floating point "
                           f"(export can quantize the lm_head with --quantize-lm-head)")


def _check_module(spec: PrequantSpec, module: str, src, shapes, dtypes, where: str) -> int:
    """Shapes and dtypes of one kvedge linear's quantized parts, from the headers; returns its group size."""
    pf = 32 // spec.bits
    part_groups = {}
    for name, (n, k) in zip(src.names, src.shapes):
        base = name[: -len(".weight")]
        for t in spec.tensors:
            if f"{base}.{t}" not in shapes:
                raise CheckpointError(f"{where}: missing tensor {base}.{t} (a {spec.method} linear stores "
                                      f"{', '.join(spec.tensors)})")
        rows = shapes[f"{base}.scales"][0] if len(shapes[f"{base}.scales"]) == 2 else 0
        if not rows or k % rows:
            raise CheckpointError(f"{where}: tensor {base}.scales has shape {list(shapes[base + '.scales'])}, "
                                  f"expected [K / group_size, {n}] with K = {k}")
        part_groups[base] = k // rows
    groups = sorted(set(part_groups.values()))
    if len(groups) > 1:
        raise CheckpointError(
            f"{where}: mixed group sizes in kvedge's fused {module}: "
            + ", ".join(f"{b.rsplit('.', 1)[-1]} {g}" for b, g in part_groups.items())
            + "; its parts are concatenated into one MatMulNBits, which needs one group size for all")
    g = groups[0]
    if g < 16 or g & (g - 1):
        raise CheckpointError(f"{where}: {next(iter(part_groups))}: group size {g} is not supported; ONNX Runtime's "
                              f"MatMulNBits needs a power of two >= 16")
    for name, (n, k) in zip(src.names, src.shapes):
        base = name[: -len(".weight")]
        if spec.method == "awq":
            want = {"qweight": (k, n // pf), "qzeros": (k // g, n // pf), "scales": (k // g, n)}
        else:
            want = {"qweight": (k // pf, n), "qzeros": (k // g, n // pf), "scales": (k // g, n), "g_idx": (k,)}
        for t, shape in want.items():
            full = f"{base}.{t}"
            if full not in shapes:
                continue  # g_idx is optional
            if tuple(shapes[full]) != shape or n % pf or k % pf:
                raise CheckpointError(f"{where}: tensor {full!r} has shape {list(shapes[full])}, expected "
                                      f"{list(shape)} for a {spec.bits}-bit {spec.method} linear [{n} x {k}], group {g}")
            ok = _FLOAT_DTYPES if t == "scales" else _INT_DTYPES
            if dtypes[full] not in ok:
                raise CheckpointError(f"{where}: tensor {full!r} has dtype {dtypes[full]}, expected "
                                      f"{'a floating dtype' if t == 'scales' else 'I32 (int32)'}")
    return g


def _repack(spec: PrequantSpec, group: int, src, raw: dict[str, torch.Tensor], where: str):
    """The parts of one kvedge linear -> (q [N, K], z [N, K / G], s [N, K / G], K), parts stacked along N."""
    qs, zs, ss = [], [], []
    for name, (_, k) in zip(src.names, src.shapes):
        base = name[: -len(".weight")]
        t = {n: raw.pop(f"{base}.{n}") for n in spec.tensors}
        g_idx = raw.pop(f"{base}.g_idx", None)
        if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group):
            raise CheckpointError(
                f"{where}: tensor {base}.g_idx is not k // group_size: this checkpoint was quantized with desc_act "
                f"(act-order) and permuted input channels, which kvedge's MatMulNBits layout (groups of "
                f"consecutive input channels) cannot express; re-quantize with desc_act=false, or with "
                f"static_groups=true (GPTQ), which keeps g_idx trivial")
        q, z = unpack(spec, t)
        top = 2**spec.bits - 1
        if int(z.max()) > top:
            raise CheckpointError(
                f"{where}: tensor {base}.qzeros holds a zero point of {int(z.max())} (checkpoint_format 'gptq' stores "
                f"zero - 1, and a stored {top} means {top + 1}), which {spec.bits}-bit MatMulNBits cannot hold; "
                f"convert the checkpoint to gptq_v2 with a zero point in 0..{top}")
        qs.append(q)
        zs.append(z)
        ss.append(t["scales"].t())
    return torch.cat(qs), torch.cat(zs), torch.cat(ss), src.shapes[0][1]
