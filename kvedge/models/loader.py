"""Load a local Hugging Face checkpoint (config.json + *.safetensors) into the one Decoder.

Every tensor is checked (present, not extra, right shape, floating dtype) from the safetensors
headers before any weight is read, so a bad checkpoint loads nothing half-way. Pickled `.bin`
checkpoints are refused unless asked for, and then read with `weights_only=True`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvedge.dtypes import FLOATS, GRAPH, TORCH
from kvedge.errors import CheckpointError, ConfigError
from kvedge.models.config import ModelConfig, load_config
from kvedge.models import prequant
from kvedge.models.decoder import Decoder

FLOAT_NAMES = (*FLOATS, *GRAPH.values())  # the dtypes a model may have
_FLOAT_ST_DTYPES = {"F32", "F16", "BF16", "F64"}
# Non-parameter buffers some exporters saved; they carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class Source:
    """How one kvedge parameter is made from checkpoint tensors: concatenated rows, maybe transposed."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    transpose: bool = False  # GPT-2's Conv1D stores [in, out]
    rows: tuple[int, ...] | None = None  # the concatenated rows in this order (deepseek's interleaved RoPE rows)


def torch_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in FLOAT_NAMES:
        raise ConfigError(f"unknown dtype {name!r}; expected one of {sorted(FLOAT_NAMES)}")
    return TORCH[name]


def tensor_map(cfg: ModelConfig, prefix: str = "") -> dict[str, Source]:
    """kvedge parameter name -> the checkpoint tensors it comes from, for cfg's architecture."""
    if cfg.arch == "gpt2":
        return _gpt2_map(cfg, prefix)
    h, d, i_size = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd, od = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_heads * cfg.out_head_dim
    m: dict[str, Source] = {}

    def one(dst: str, src: str, shape: tuple[int, ...]) -> None:
        m[dst] = Source((src,), (shape,))

    one("embed.weight", "model.embed_tokens.weight", (cfg.vocab_size, h))
    one("norm.weight", "model.norm.weight", (h,))
    if not cfg.tie_embeddings:
        one("lm_head.weight", "lm_head.weight", (cfg.vocab_size, h))
    for i in range(cfg.num_layers):
        p, k = f"model.layers.{i}.", f"layers.{i}."
        if not cfg.pre_norms:  # olmo2: only the norms after each sublayer
            one(k + "post_attn_norm.weight", p + "post_attention_layernorm.weight", (h,))
            one(k + "post_mlp_norm.weight", p + "post_feedforward_layernorm.weight", (h,))
        elif cfg.post_norms:  # gemma2 names its four norms differently
            one(k + "attn_norm.weight", p + "input_layernorm.weight", (h,))
            one(k + "post_attn_norm.weight", p + "post_attention_layernorm.weight", (h,))
            one(k + "mlp_norm.weight", p + "pre_feedforward_layernorm.weight", (h,))
            one(k + "post_mlp_norm.weight", p + "post_feedforward_layernorm.weight", (h,))
        else:
            one(k + "attn_norm.weight", p + "input_layernorm.weight", (h,))
            one(k + "mlp_norm.weight", p + "post_attention_layernorm.weight", (h,))
        if cfg.arch == "phi3":  # already fused in the checkpoint
            one(k + "qkv.weight", p + "self_attn.qkv_proj.weight", (cfg.qkv_size, h))
            one(k + "up.weight", p + "mlp.gate_up_proj.weight", (2 * i_size, h))
        else:
            a = p + "self_attn."
            if cfg.mla:
                m.update(_mla_map(cfg, a, k))
            else:
                m[k + "qkv.weight"] = Source((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                                             ((qd, h), (kvd, h), (kvd, h)))
            if cfg.qkv_bias:
                m[k + "qkv.bias"] = Source((a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                                           ((qd,), (kvd,), (kvd,)))
            m[k + "up.weight"] = Source((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                                        ((i_size, h), (i_size, h)))
            if cfg.mlp_bias:
                m[k + "up.bias"] = Source((p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"),
                                          ((i_size,), (i_size,)))
        one(k + "o.weight", p + "self_attn.o_proj.weight", (h, od))
        if cfg.o_bias:
            one(k + "o.bias", p + "self_attn.o_proj.bias", (h,))
        one(k + "down.weight", p + "mlp.down_proj.weight", (h, i_size))
        if cfg.mlp_bias:
            one(k + "down.bias", p + "mlp.down_proj.bias", (h,))
        if cfg.qk_norm:
            wide = cfg.qk_norm_scope == "all"  # olmo2: over the whole projection
            one(k + "q_norm.weight", p + "self_attn.q_norm.weight", (qd if wide else d,))
            one(k + "k_norm.weight", p + "self_attn.k_norm.weight", (kvd if wide else d,))
    return m


def _mla_map(cfg: ModelConfig, a: str, k: str) -> dict[str, Source]:
    """MLA's attention tensors (prefix `a`) as kvedge's: qkv = [q_proj or q_a_proj; kv_a_proj_with_mqa] (both read
    the normed input), kv_a_norm, kv_b, and with a query rank q_a_norm and q_b. A checkpoint with interleaved RoPE
    channels (cfg.rope_interleaved) gets its RoPE rows of the query and of k_rope reordered to halves."""
    h, dr, dc, q_rank = cfg.hidden_size, cfg.head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    q_rows = cfg.num_heads * cfg.qk_head_dim
    q_ropes = range(cfg.qk_nope_head_dim, q_rows, cfg.qk_head_dim)  # each head's RoPE rows start here

    def rows(n: int, starts) -> tuple[int, ...] | None:
        if not cfg.rope_interleaved:
            return None
        order = list(range(n))
        for s in starts:
            order[s:s + dr] = [*range(s, s + dr, 2), *range(s + 1, s + dr, 2)]
        return tuple(order)

    m = {k + "kv_a_norm.weight": Source((a + "kv_a_layernorm.weight",), ((dc,),)),
         k + "kv_b.weight": Source((a + "kv_b_proj.weight",), ((cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                                                  dc),))}
    first = (a + "q_a_proj.weight", (q_rank, h)) if q_rank else (a + "q_proj.weight", (q_rows, h))
    k_rope = [cfg.qkv_size - dr]  # the last rows of qkv; before them c_kv, and q's (or q_a's: no RoPE there)
    m[k + "qkv.weight"] = Source((first[0], a + "kv_a_proj_with_mqa.weight"), (first[1], (dc + dr, h)),
                                 rows=rows(cfg.qkv_size, k_rope if q_rank else [*q_ropes, *k_rope]))
    if q_rank:
        m[k + "q_a_norm.weight"] = Source((a + "q_a_layernorm.weight",), ((q_rank,),))
        m[k + "q_b.weight"] = Source((a + "q_b_proj.weight",), ((q_rows, q_rank),), rows=rows(q_rows, q_ropes))
    return m


def _gpt2_map(cfg: ModelConfig, prefix: str) -> dict[str, Source]:
    h, i_size = cfg.hidden_size, cfg.intermediate_size
    m: dict[str, Source] = {
        "embed.weight": Source((prefix + "wte.weight",), ((cfg.vocab_size, h),)),
        "pos_embed.weight": Source((prefix + "wpe.weight",), ((cfg.max_position_embeddings, h),)),
        "norm.weight": Source((prefix + "ln_f.weight",), ((h,),)),
        "norm.bias": Source((prefix + "ln_f.bias",), ((h,),)),
    }
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = Source(("lm_head.weight",), ((cfg.vocab_size, h),))
    for i in range(cfg.num_layers):
        p, k = f"{prefix}h.{i}.", f"layers.{i}."
        for dst, src, n_in, n_out in (("qkv", "attn.c_attn", h, 3 * h), ("o", "attn.c_proj", h, h),
                                      ("up", "mlp.c_fc", h, i_size), ("down", "mlp.c_proj", i_size, h)):
            m[f"{k}{dst}.weight"] = Source((f"{p}{src}.weight",), ((n_in, n_out),), transpose=True)
            m[f"{k}{dst}.bias"] = Source((f"{p}{src}.bias",), ((n_out,),))
        for dst, src in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for part in ("weight", "bias"):
                m[f"{k}{dst}.{part}"] = Source((f"{p}{src}.{part}",), ((h,),))
    return m


# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    file: Path
    shape: tuple[int, ...]
    dtype: str


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index, expected a 'weight_map' object ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if sorted(model_dir.glob("*.bin")) or (model_dir / "pytorch_model.bin.index.json").is_file():
        raise CheckpointError(
            f"{model_dir}: only pickled .bin weights found, and kvedge does not unpickle by default "
            f"(a pickle can run code). Convert once with transformers: "
            f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True), "
            f"or pass allow_bin=True (Python API) to read it with torch.load(weights_only=True)"
        )
    raise CheckpointError(f"{model_dir}: no *.safetensors weights found")


def _read_headers(files: list[Path]) -> dict[str, _Entry]:
    from safetensors import safe_open

    entries: dict[str, _Entry] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    sl = sf.get_slice(name)
                    if name in entries:
                        raise CheckpointError(f"{f}: tensor {name!r} is also in {entries[name].file.name}")
                    entries[name] = _Entry(f, tuple(sl.get_shape()), sl.get_dtype())
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
    return entries


class _Checkpoint:
    """Tensor names, shapes and dtypes of a checkpoint, read from headers; tensors on request."""

    def __init__(self, model_dir: Path, allow_bin: bool):
        self.where = str(model_dir)
        bins = sorted(model_dir.glob("*.bin"))
        self._bin: dict[str, torch.Tensor] | None = None
        if allow_bin and bins and not sorted(model_dir.glob("*.safetensors")):
            self._bin = {}
            for f in bins:
                self._bin.update(_load_bin(f))
            self.shapes = {n: tuple(t.shape) for n, t in self._bin.items()}
            self.dtypes = {n: _ST_NAMES.get(t.dtype, str(t.dtype)) for n, t in self._bin.items()}
            return
        self._entries = _read_headers(_weight_files(model_dir))
        self.shapes = {n: e.shape for n, e in self._entries.items()}
        self.dtypes = {n: e.dtype for n, e in self._entries.items()}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        if self._bin is not None:
            return {n: self._bin[n] for n in names}
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._entries[n].file, []).append(n)
        out: dict[str, torch.Tensor] = {}
        for f, group in by_file.items():
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for n in group:
                    out[n] = sf.get_tensor(n)
        return out


def _load_bin(f: Path) -> dict[str, torch.Tensor]:
    """A pickled state dict, read with weights_only=True: torch refuses to build any object but tensors and
    plain containers (a pickle can run code), and anything but {name: tensor} is refused here too."""
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch: UnpicklingError for a refused object, RuntimeError for a corrupt file
        msg = str(e)
        _, found, rest = msg.partition("WeightsUnpickler error:")  # torch's reason, after advice that fits not here
        reason = (rest if found else msg).strip().split("\n")[0].split(". Please")[0] or type(e).__name__
        raise CheckpointError(f"{f}: not a weights-only state dict, torch.load(weights_only=True) refused it "
                              f"({reason}); save the weights as safetensors where the pickle is trusted") from None
    bad = None if isinstance(state, dict) else f"a {type(state).__name__}"
    if bad is None:
        bad = next((f"{k!r}: a {type(v).__name__}" for k, v in state.items()
                    if not (isinstance(k, str) and isinstance(v, torch.Tensor))), None)
    if bad is not None:
        raise CheckpointError(f"{f}: expected a state dict {{name: tensor}}, found {bad}")
    return state


_ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def _check(cfg: ModelConfig, tmap: dict[str, Source], shapes: dict[str, tuple[int, ...]],
           dtypes: dict[str, str], where: str, known: tuple[str, ...] | list[str] = ()) -> None:
    """`known`: further tensor names that are expected (the quantized linears' tensors, checked by prequant)."""
    wanted = {n: s for src in tmap.values() for n, s in zip(src.names, src.shapes)}
    missing = sorted(set(wanted) - set(shapes))
    if missing:
        raise CheckpointError(
            f"{where}: missing tensor(s) for {cfg.arch}: {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    ignorable = ({"lm_head.weight"} if cfg.tie_embeddings else set()) | set(known)
    extra = sorted(n for n in set(shapes) - set(wanted) - ignorable if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise CheckpointError(
            f"{where}: unexpected tensor(s) for {cfg.arch} with {cfg.num_layers} layers: "
            f"{', '.join(extra[:5])}" + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            + "; does config.json match these weights?"
        )
    for name, shape in wanted.items():
        if tuple(shapes[name]) != tuple(shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {list(shapes[name])}, expected {list(shape)} from config.json"
            )
        if dtypes[name] not in _FLOAT_ST_DTYPES:
            raise CheckpointError(
                f"{where}: tensor {name!r} has dtype {dtypes[name]}, expected a floating dtype "
                f"(F32, F16 or BF16); quantized checkpoints need a quantization_config kvedge supports"
            )


def load_decoder(model_dir: str | Path, dtype: str | torch.dtype | None = None,
                 device: str | torch.device = "cpu", allow_bin: bool = False,
                 quantized_embedding: tuple[int, ...] = ()) -> Decoder:
    """Build the Decoder of a local checkpoint directory (or a GGUF file), in the checkpoint's dtype or `dtype`.
    quantized_embedding: bit widths at which a GGUF file's quantized embedding is kept in its integers
    (kvedge.models.gguf.load_decoder); other checkpoints' embeddings are float anyway."""
    model_dir = Path(model_dir)
    if model_dir.suffix.lower() == ".gguf":
        from kvedge.models import gguf

        return gguf.load_decoder(model_dir, dtype=dtype, device=device, quantized_embedding=quantized_embedding)
    cfg = load_config(model_dir)
    want = torch_dtype(dtype) or (TORCH[cfg.dtype] if cfg.dtype in FLOAT_NAMES else torch.float32)
    ckpt = _Checkpoint(model_dir, allow_bin)
    prefix = "transformer." if cfg.arch == "gpt2" and "transformer.wte.weight" in ckpt.shapes else ""
    tmap = tensor_map(cfg, prefix)
    spec = prequant.read_spec(model_dir)  # a pre-quantized (AWQ / GPTQ) checkpoint: its linears are repacked
    if spec and cfg.mla:  # kv_b is read as a matrix (absorbed) and RoPE rows may be reordered: both need floats
        raise CheckpointError(f"{ckpt.where}: pre-quantized ({spec.method}) MLA checkpoints are not supported; "
                              f"load the float checkpoint (export can quantize it with --quantize)")
    quantized = prequant.Prequantized.plan(spec, tmap, ckpt.shapes, ckpt.dtypes, ckpt.where) if spec else None
    if quantized is not None:
        tmap = quantized.fp_map
    _check(cfg, tmap, ckpt.shapes, ckpt.dtypes, ckpt.where, known=quantized.names if quantized else ())

    raw = ckpt.read([n for src in tmap.values() for n in src.names] + (quantized.names if quantized else []))
    state: dict[str, torch.Tensor] = {}
    for dst, src in tmap.items():
        parts = [raw.pop(n) for n in src.names]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if src.rows is not None:
            t = t[list(src.rows)]
        state[dst] = (t.t() if src.transpose else t).to(device=device, dtype=want).contiguous()
    with torch.device("meta"):
        model = Decoder(cfg)
    if quantized is not None:
        state.update(quantized.install(model, raw, want, device))
        model.prequantized = quantized.record()
    model.load_state_dict(state, strict=True, assign=True)
    model.set_rope_buffers(device)
    return model.eval().requires_grad_(False)
