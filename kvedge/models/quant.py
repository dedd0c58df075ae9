"""Weight-only block quantization (INT8 / INT4): the one quantized linear of kvedge.

Round-to-nearest, asymmetric, per group of `group` input channels: for each output row and group,
scale = (max - min) / (2^bits - 1), zero = round(-min / scale), q = clamp(round(w / scale) + zero).
Dequantized: w' = (q - zero) * scale; |w - w'| <= scale / 2 per element. Every scale is a float16 value
(rounded up; see fp16_ceil), so a runtime may keep scales in 16 bits without changing the model.

Storage follows ONNX Runtime's MatMulNBits layout, so the `ort` lowering exports it as is:
  qweight uint8 [N, K / group, group * bits / 8]   (4 bits: two values a byte, the even index in the low nibble)
  scales  float [N * K / group]
  zeros   uint8 [N * ceil((K / group) * bits / 8)] (4 bits: packed like the weights)
The model calls `torch.ops.kvedge.qlinear`; export translates it per target (MatMulNBits, or
blocked DequantizeLinear + MatMul), as it does the attention op. An embedding kept quantized (QuantEmbedding: a
GGUF file's token_embd) holds the same layout and calls `torch.ops.kvedge.qembedding` for its rows.
"""

from __future__ import annotations

import torch
from torch import nn

from kvedge.errors import KvedgeError


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """[..., 2n] values in 0..15 -> [..., n] bytes, even index in the low nibble."""
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)


def unpack4(b, n: int):
    """[..., m] bytes -> [..., n] values in 0..15 (n <= 2m), the even index from the low nibble; a torch
    tensor or a numpy array, returned as the same kind."""
    if isinstance(b, torch.Tensor):
        out = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    else:
        import numpy as np

        out = np.stack((b & 0x0F, b >> 4), axis=-1).reshape(*b.shape[:-1], -1)
    return out[..., :n]


def fp16_ceil(s: torch.Tensor) -> torch.Tensor:
    """The least float16 value >= s, as float32. Scales are kept float16-exact: the native engine stores them
    in 16 bits (as AWQ / GPTQ checkpoints and llama.cpp's Q8_0 do), 6% of an int8 weight's bytes and 11%
    of an int4 one's, which decode reads every token. Rounding up (by at most 2^-10 relative for scales in
    float16's normal range, >= 6.1e-5, and 6e-8 absolute below it) keeps every weight inside the grid,
    so |w - w'| <= scale / 2 still holds."""
    if not s.is_meta and bool((s > 65504).any()):
        raise KvedgeError(f"a group scale of {float(s.max()):g} exceeds float16's range: weights this large "
                          f"cannot be quantized by kvedge")
    h = s.to(torch.float16)
    return torch.where(h.float() < s, torch.nextafter(h, torch.full_like(h, float("inf"))), h).float()


def group_params(wg: torch.Tensor, bits: int, symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """wg [..., group] float -> (scale, zero) [...]: the range of each group, widened to include 0.
    symmetric: zero fixed at the midpoint 2^(bits-1) and scale = max|w| / (2^(bits-1) - 1), so the stored
    integers minus the midpoint are the signed values TensorRT's weight-only INT4/INT8 path takes."""
    if symmetric:
        mid = 2 ** (bits - 1)
        scale = fp16_ceil((wg.abs().amax(-1) / (mid - 1)).clamp(min=1e-12))
        return scale, torch.full_like(scale, mid)
    lo = wg.amin(-1).clamp(max=0.0)
    hi = wg.amax(-1).clamp(min=0.0)
    qmax = 2**bits - 1
    scale = fp16_ceil(((hi - lo) / qmax).clamp(min=1e-12))
    return scale, torch.round(-lo / scale).clamp(0, qmax)


def quantize_values(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Round w to its grid (scale, zero broadcast against w) -> uint8 in 0..2^bits-1."""
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1).to(torch.uint8)


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K / group, group] uint8, scale and zero [N, K / group] -> the MatMulNBits layout (module doc)."""
    if bits == 4:
        return _pack4(q), scale.reshape(-1), _pack4(zero.to(torch.uint8)).reshape(-1)
    return q, scale.reshape(-1), zero.to(torch.uint8).reshape(-1)


def check_shape(bits: int, k: int, group: int) -> None:
    if bits not in (4, 8):
        raise KvedgeError(f"bits must be 4 or 8, got {bits}")
    if k % group:
        raise KvedgeError(f"input size {k} is not a multiple of the group size {group}")


def quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qweight, scales, zeros) in the MatMulNBits layout (see module doc)."""
    n, k = w.shape
    check_shape(bits, k, group)
    wg = w.float().reshape(n, k // group, group)
    scale, zero = group_params(wg, bits, symmetric)
    return pack(quantize_values(wg, scale[..., None], zero[..., None], bits), scale, zero, bits)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, k: int,
               mins: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights [N, K]: (q - zero) * scale, or with `mins` (GGUF's affine blocks: Q4_1, Q4_K, Q5_K)
    q * scale + min, each in float32 as gguf.quants.dequantize computes it."""
    n, nb = qweight.shape[0], qweight.shape[1]
    group = k // nb
    q = unpack4(qweight, group) if bits == 4 else qweight
    if mins is not None:
        return (q.float() * scales.float().reshape(n, nb)[..., None] + mins.float().reshape(n, nb)[..., None]
                ).reshape(n, k)
    z = unpack_zeros(zeros, bits, n, nb)
    return dequantize_values(q, scales.reshape(n, nb)[..., None], z[..., None]).reshape(n, k)


def unpack_zeros(zeros: torch.Tensor, bits: int, n: int, groups: int) -> torch.Tensor:
    """The MatMulNBits zero points (4 bits: packed two a byte, rows padded to whole bytes) -> uint8 [n, groups]."""
    return unpack4(zeros.reshape(n, -1), groups) if bits == 4 else zeros.reshape(n, groups)


def dequantize_values(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q - zero) * scale in float32 (scale and zero broadcast against q): the inverse of quantize_values."""
    return (q.float() - zero.float()) * scale


def dequantize_rows(index, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, k: int,
                    mins: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize of the rows `index` (a slice or an index tensor) only, float32 [rows, K]."""
    n = qweight.shape[0]

    def part(t):  # those rows of a per-row tensor (zeros is empty for affine blocks)
        return None if t is None else t.reshape(n, -1)[index] if t.numel() else t

    return dequantize(qweight[index], part(scales), part(zeros), bits, k, part(mins))


# Elements of the weight matrix the torch reference dequantizes at once (whole rows; 4 MB as float32): the float
# temporaries stay in the CPU's caches and below glibc's mmap threshold. A whole matrix (or 16 MB chunks) is mapped
# and faulted in afresh on every call: 5x slower on a 1.7B model, and a float copy of the largest matrix resident.
DEQUANT_ROWS_OF = 1 << 20


@torch.library.custom_op("kvedge::qlinear", mutates_args=())
def qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
            k: int, accuracy_level: int, mins: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(W).T -> [..., N] (the reference: dequantize, then matmul in x's dtype).
    accuracy_level is a lowering hint (MatMulNBits: 4 computes with int8 activations); the reference
    ignores it. mins: per-group additive terms of an affine block (then zeros is unused).
    Dequantized DEQUANT_ROWS_OF elements at a time (whole output rows), so a large matrix (a 49152-row output head)
    never exists in float beside the model."""
    n = qweight.shape[0]
    rows = max(1, DEQUANT_ROWS_OF // k)
    return torch.cat([torch.nn.functional.linear(x, dequantize_rows(
        slice(a, a + rows), qweight, scales, zeros, bits, k, mins).to(x.dtype)) for a in range(0, n, rows)], dim=-1)


@qlinear.register_fake
def _(x, qweight, scales, zeros, bits, k, accuracy_level, mins=None):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("kvedge::qembedding", mutates_args=())
def qembedding(ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               k: int, mins: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` [...] of the quantized [N, K] matrix, dequantized -> [..., K] in scales' dtype: only the rows
    looked up are ever float. mins: as in qlinear."""
    w = dequantize_rows(ids.reshape(-1), qweight, scales, zeros, bits, k, mins)
    return w.to(scales.dtype).reshape(*ids.shape, k)


@qembedding.register_fake
def _(ids, qweight, scales, zeros, bits, k, mins=None):
    return scales.new_empty((*ids.shape, k))


QUANT_BITS = {"int8": 8, "int4": 4}  # the --quantize schemes
PROJECTIONS = ("qkv", "o", "up", "down")  # the linears of a Block, in the order data flows through them


def projections(cfg) -> tuple[str, ...]:
    """The linears of a Block of `cfg` that quantization replaces, in data-flow order: PROJECTIONS, and MLA's q_b
    after qkv when its query has a low rank. MLA's kv_b stays float: decode multiplies by its weight (absorbed)."""
    return ("qkv", "q_b", *PROJECTIONS[1:]) if cfg.q_lora_rank else PROJECTIONS


class QuantLinear(nn.Module):
    def __init__(self, linear: nn.Linear, bits: int, group: int, accuracy_level: int = 0,
                 packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, symmetric: bool = False,
                 mins: torch.Tensor | None = None):
        """packed: (qweight, scales, zeros) already quantized (e.g. by GPTQ, or read from a GGUF file); None:
        round-to-nearest. mins [N * K / group] float32: an affine block, w = q * scale + min (GGUF's Q4_1,
        Q4_K, Q5_K), kept as the file has it; zeros is then empty. Scales (and mins) are kept in float32
        where the linear is float32, so a file's exact values stay exact. group 0: one group per row (per
        channel)."""
        super().__init__()
        group = group or linear.in_features
        self.bits, self.group, self.accuracy_level = bits, group, accuracy_level
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, s, z = packed if packed is not None else quantize(linear.weight.detach(), bits, group, symmetric)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", s.to(linear.weight.dtype))
        self.register_buffer("zeros", z)
        self.register_buffer("mins", None if mins is None else mins.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mins = None if self.mins is None else self.mins.to(x.dtype)
        y = torch.ops.kvedge.qlinear(x, self.qweight, self.scales.to(x.dtype), self.zeros, self.bits,
                                     self.in_features, self.accuracy_level, mins)
        return y if self.bias is None else y + self.bias


class QuantEmbedding(QuantLinear):
    """An embedding [vocab, hidden] kept in its quantized blocks (a GGUF file's token_embd): forward(ids) dequantizes
    the rows looked up; linear(h) is the same integers as a tied output head (h @ W.T), so neither direction ever
    holds a float copy of the matrix. Built like a QuantLinear with in_features = hidden, out_features = vocab."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvedge.qembedding(ids, self.qweight, self.scales, self.zeros, self.bits, self.in_features,
                                           self.mins)

    def linear(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h)


def quantize_decoder(model: nn.Module, bits: int, group: int = 32, lm_head: bool = False,
                     accuracy_level: int = 0, symmetric: bool = False) -> int:
    """Replace every projection of every block (and the lm_head if asked) by a QuantLinear, in place.
    Embeddings stay in floating point. Returns the number of linears quantized."""
    count = 0
    for layer in model.layers:
        for name in projections(model.cfg):
            setattr(layer, name, QuantLinear(getattr(layer, name), bits, group, accuracy_level, symmetric=symmetric))
            count += 1
    if lm_head:
        model.lm_head = QuantLinear(lm_head_linear(model), bits, group, accuracy_level, symmetric=symmetric)
        count += 1
    return count


def lm_head_linear(model: nn.Module) -> nn.Linear:
    """The model's lm_head; tied: a Linear over the embedding (which itself stays in floating point)."""
    head = getattr(model, "lm_head", None)
    if head is None:
        head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False)
        head.weight = nn.Parameter(model.embed.weight.detach(), requires_grad=False)
    return head
