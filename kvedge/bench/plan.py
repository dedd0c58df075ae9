"""`kvedge plan`: will a model fit a device? Weights + KV cache + an activation estimate, per figure.

Figures (bytes, each stated separately):
- weights: parameter count from the config (embeddings, every layer, lm_head unless tied) x dtype bytes;
  with --quantize int8|int4, the projections of every block (qkv, o, up, down; and the lm_head with
  --quantize-lm-head) as stored in the MatMulNBits layout (kvedge.models.quant): per output row, bits / 8
  bytes a weight, one scale (dtype bytes) and one zero point (bits, rounded up to whole bytes per row) a
  group; embeddings, norms and biases stay in dtype;
- KV cache: 2 * layers * kv_heads * head_dim * kv bytes, per token, times context and batch (int8: 1
  byte, plus its float32 scales once, 2 * layers * kv_heads * head_dim * 4 bytes); an MLA model's is
  (d_c + d_R) * layers (the latent and the decoupled RoPE key, shared by every head), and as many GQA KV heads
  of its head width (v_head_dim) would hold (d_c + d_R) / (2 * v_head_dim) heads: 2.25 at d_c = 4 d_h, d_R = d_h / 2;
- activations: the largest transient of one forward over a prefill chunk of `chunk` tokens:
  batch * chunk * (4 * hidden + 2 * intermediate + q_heads * context) * compute bytes, plus the
  logits of one position, batch * vocab * 4 (an estimate, not a measurement);
- usable memory: the device's memory minus its documented reserve (OS, CUDA context, display).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvedge.errors import KvedgeError
from kvedge.dtypes import nbytes as dtype_bytes
from kvedge.models.cache import cache_bytes_per_token, kv_bytes_per_token, kv_scale_bytes, mla_bytes_per_token
from kvedge.models.config import ModelConfig
from kvedge.models.quant import QUANT_BITS, projections

GiB = 1024**3


@dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float  # physical memory as sold (GiB)
    reserve_gb: float  # kept back for the OS, CUDA context, display: our assumption, documented here
    unified: bool  # CPU and GPU share the memory (Jetson)
    note: str
    tensorrt: str | None = None  # the TensorRT its current JetPack ships (docs/jetson.md); desktops: any


# Reserves on Jetson boards: the L4T desktop-less image with the CUDA/TensorRT runtime loaded keeps
# roughly 1.5-2.5 GiB busy (more with a desktop); we assume the upper end so a plan errs on the safe side.
# TensorRT: JetPack 6.1 / 6.2 ship 10.3 on Orin, JetPack 7.0 ships 10.13 on Thor (docs/jetson.md).
DEVICES = {d.name: d for d in (
    Device("orin-nano-8gb", 8, 2.5, True, "Jetson Orin Nano 8GB: 8 GiB LPDDR5 shared by CPU and GPU", "10.3"),
    Device("orin-nx-16gb", 16, 3.0, True, "Jetson Orin NX 16GB", "10.3"),
    Device("agx-orin-32gb", 32, 4.0, True, "Jetson AGX Orin 32GB", "10.3"),
    Device("agx-orin-64gb", 64, 5.0, True, "Jetson AGX Orin 64GB", "10.3"),
    Device("agx-thor", 128, 8.0, True, "Jetson AGX Thor (T5000): 128 GiB LPDDR5X", "10.13"),
    Device("rtx-4090", 24, 1.0, False, "GeForce RTX 4090 24GB: CUDA context + workspace"),
    Device("rtx-4080", 16, 1.0, False, "GeForce RTX 4080 16GB"),
    Device("rtx-3060-12gb", 12, 0.8, False, "GeForce RTX 3060 12GB"),
    Device("l4", 24, 1.0, False, "NVIDIA L4 24GB"),
    Device("a100-80gb", 80, 2.0, False, "A100 80GB"),
    Device("h100-80gb", 80, 2.0, False, "H100 80GB"),
)}


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one block's linears, the ones --quantize replaces: qkv, o, up (gate+up for GLU), down (and MLA's
    q_b; kvedge.models.quant.projections)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkv": (cfg.qkv_size, h), "q_b": (cfg.num_heads * cfg.qk_head_dim, cfg.q_lora_rank),
              "o": (h, cfg.num_heads * cfg.out_head_dim), "up": (2 * i if cfg.mlp == "glu" else i, h), "down": (h, i)}
    return [shapes[name] for name in projections(cfg)]


def parameter_count(cfg: ModelConfig) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    norm = h * (2 if cfg.norm == "layer" else 1)
    shapes = projection_shapes(cfg)
    per_layer = sum(n * k for n, k in shapes) + (cfg.qkv_size if cfg.qkv_bias else 0) + (h if cfg.o_bias else 0)
    per_layer += (shapes[-2][0] + h) if cfg.mlp_bias else 0
    per_layer += norm * (4 if cfg.post_norms else 2) + (2 * d if cfg.qk_norm else 0)
    if cfg.mla:  # kv_b (float, absorbed) and the latent's and the query rank's norms
        per_layer += cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank
        per_layer += cfg.kv_lora_rank + cfg.q_lora_rank
    total = cfg.num_layers * per_layer + cfg.vocab_size * h + norm
    if cfg.positions == "learned":
        total += cfg.max_position_embeddings * h
    if not cfg.tie_embeddings:
        total += cfg.vocab_size * h
    return total


def quantized_linear_bytes(n: int, k: int, bits: int, group: int, scale_bytes: float) -> int:
    """An [n, k] linear in the MatMulNBits layout: n * k * bits / 8 + n * groups * scale bytes + the zero
    points, n * ceil(groups * bits / 8)."""
    if k % group:
        raise KvedgeError(f"input size {k} is not a multiple of the group size {group}")
    groups = k // group
    return int(n * k * bits // 8 + n * groups * scale_bytes + n * -(-groups * bits // 8))


def weight_bytes(cfg: ModelConfig, dtype: str = "fp16", quantize: str | None = None, group: int = 32,
                 lm_head: bool = False) -> int:
    """Bytes of the weights: everything in dtype, or with quantize the block projections (and the lm_head
    if asked; tied, it becomes a quantized copy and the embedding stays) quantized, the rest in dtype."""
    fp = dtype_bytes(dtype)
    if quantize is None:
        return int(parameter_count(cfg) * fp)
    if quantize not in QUANT_BITS:
        raise KvedgeError(f"--quantize {quantize!r}: expected {' or '.join(QUANT_BITS)}")
    linears = projection_shapes(cfg) * cfg.num_layers
    fp_params = parameter_count(cfg) - sum(n * k for n, k in linears)
    if lm_head:
        linears.append((cfg.vocab_size, cfg.hidden_size))
        fp_params -= 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    return int(fp_params * fp) + sum(quantized_linear_bytes(n, k, QUANT_BITS[quantize], group, fp) for n, k in linears)


def activation_bytes(cfg: ModelConfig, context: int, batch: int, chunk: int, dtype: str) -> int:
    c = min(chunk, context)
    per_token = 4 * cfg.hidden_size + 2 * cfg.intermediate_size + cfg.num_heads * context
    return int(batch * c * per_token * dtype_bytes(dtype) + batch * cfg.vocab_size * 4)


@dataclass
class Plan:
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    usable_bytes: int | None
    max_context: int | None  # by memory, capped at the model's max_position_embeddings
    max_batch: int | None
    memory_max_context: int | None  # by memory alone
    kv_by_attention: dict[str, int]
    gqa_kv_heads: float  # the KV heads of head width out_head_dim a GQA cache of the same bytes has

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.usable_bytes is None else self.total_bytes <= self.usable_bytes


def plan(cfg: ModelConfig, seq_len: int, batch: int = 1, dtype: str = "fp16", kv_dtype: str | None = None,
         memory_gb: float | None = None, device: str | None = None, chunk: int = 512, quantize: str | None = None,
         group: int = 32, quantize_lm_head: bool = False) -> Plan:
    """dtype: the floating type of the weights, activations and scales (int8 / int4: short for
    quantize=dtype with fp16)."""
    if dtype in QUANT_BITS and quantize is None:
        quantize, dtype = dtype, "fp16"
    kv_dtype = kv_dtype or dtype
    if seq_len < 1 or batch < 1:
        raise KvedgeError(f"--seq-len and --batch must be >= 1, got {seq_len}, {batch}")
    usable = None
    if device is not None:
        if device not in DEVICES:
            raise KvedgeError(f"unknown device {device!r}; known: {', '.join(DEVICES)}")
        dev = DEVICES[device]
        usable = int((dev.memory_gb - dev.reserve_gb) * GiB)
    elif memory_gb is not None:
        usable = int(memory_gb * GiB)
    weights = weight_bytes(cfg, dtype, quantize, group, quantize_lm_head)
    per_token = cache_bytes_per_token(cfg, kv_dtype)
    scales = kv_scale_bytes(cfg, kv_dtype)  # int8: fixed, like weights
    act = activation_bytes(cfg, seq_len, batch, chunk, dtype)
    max_ctx = max_b = mem_ctx = None
    if usable is not None:
        mem_ctx = _largest(lambda n: weights + scales + per_token * n * batch + activation_bytes(cfg, n, batch, chunk, dtype)
                           <= usable, 1 << 24)
        max_ctx = min(mem_ctx, cfg.max_position_embeddings)
        max_b = _largest(lambda b: weights + scales + per_token * seq_len * b + activation_bytes(cfg, seq_len, b, chunk, dtype)
                         <= usable, 1 << 16)
    d = cfg.head_dim
    if cfg.mla:  # against the keys and values of every head, which it never stores
        kv_by = {"MHA (each head's key and value, reconstructed)": int(
            cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * dtype_bytes(kv_dtype)),
            "MLA (this model)": per_token}
    else:
        kv_by = {
            "MHA": kv_bytes_per_token(cfg.num_layers, cfg.num_heads, d, kv_dtype),
            f"{cfg.attention_kind} (this model)": per_token,
            "MQA": kv_bytes_per_token(cfg.num_layers, 1, d, kv_dtype),
            "MLA (d_c = 4 head_dim, d_rope = head_dim / 2)": mla_bytes_per_token(cfg.num_layers, 4 * d, d // 2,
                                                                                  kv_dtype),
        }
    gqa_heads = per_token / kv_bytes_per_token(cfg.num_layers, 1, cfg.out_head_dim, kv_dtype)
    return Plan(weights, per_token * seq_len * batch + scales, act, usable, max_ctx, max_b, mem_ctx, kv_by, gqa_heads)


WEIGHT_CHOICES = ("fp16", "int8", "int4")  # what a plan weighs against each other, most faithful first


def weight_options(cfg: ModelConfig, seq_len: int, batch: int = 1, kv_dtype: str | None = None, **where) -> dict:
    """The plan of each weight choice (fp16, or int8 / int4 projections with fp16 elsewhere) at seq_len and batch,
    over a kv_dtype cache (default fp16): which of them fits `where` (memory_gb= or device=), and its largest
    context."""
    return {w: plan(cfg, seq_len, batch, w, kv_dtype or "fp16", **where) for w in WEIGHT_CHOICES}


def _largest(fits, hi: int) -> int:
    """The largest n in [0, hi] with fits(n) (fits is monotone decreasing)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
