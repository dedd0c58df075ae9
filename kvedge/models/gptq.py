"""GPTQ (Frantar et al., 2022): weight-only quantization that compensates each rounding error.

For one linear y = x W^T with calibration inputs X [n, K], the error that matters is
||X W^T - X Wq^T||, whose curvature in each row of W is H = 2 X^T X / n. GPTQ quantizes the K input
columns of W in order; the rounding error of column c, divided by U[c, c], is pushed onto the columns
not yet quantized through row c of U, the upper Cholesky factor of H^-1 (dampened: + 1% of H's mean
diagonal), so that later columns absorb it along the directions the inputs actually use. Columns go
in blocks of BLOCK: inside a block the update is column by column, the block's accumulated error
reaches the rest of W in one matmul ("lazy batch"). A group's scale and zero come from its current,
error-updated weights when its first column is reached. Columns stay in order (no act-order), so
groups stay contiguous and the result is stored exactly like round-to-nearest (quant.py's layout);
with H a multiple of the identity nothing is propagated and GPTQ gives RTN's integers.

Calibration is sequential, as in the paper: each Block is quantized on the inputs that the already
quantized Blocks before it produce, and inside a Block qkv, o, up, down one after another.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from kvedge.errors import KvedgeError
from kvedge.models.cache import KVCache
from kvedge.models.quant import (QuantLinear, check_shape, dequantize, dequantize_values, group_params,
                                 lm_head_linear, pack, projections, quantize, quantize_values)

DAMP = 0.01  # fraction of H's mean diagonal added to its diagonal
BLOCK = 128  # columns per lazy-batch block (rounded to whole groups)


def _inverse_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, dead): U the upper Cholesky factor of (H + damp * mean(diag H) * I)^-1; dead the input
    columns no calibration input ever used (H[c, c] == 0), which get H[c, c] = 1 and weight 0."""
    h = h.double().clone()
    dead = h.diagonal() == 0
    h.diagonal()[dead] = 1.0
    h.diagonal().add_(damp * h.diagonal().mean())
    low, info = torch.linalg.cholesky_ex(h)
    if info.item():
        raise KvedgeError(f"GPTQ: the calibration Hessian is not positive definite even with damping {damp}; "
                          "use more calibration tokens (--calibration-tokens)")
    return torch.linalg.cholesky(torch.cholesky_inverse(low), upper=True).float(), dead


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group: int, damp: float = DAMP,
                  block: int = BLOCK, symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K], h [K, K] (2 X^T X / n) -> (qweight, scales, zeros) in quant.py's MatMulNBits layout."""
    n, k = w.shape
    check_shape(bits, k, group)
    u, dead = _inverse_factor(h, damp)
    wt = w.detach().float().t().contiguous()  # [K, N]: one input column of W per row, contiguous
    wt[dead] = 0.0
    q = torch.empty(k, n, dtype=torch.uint8)
    scale, zero = torch.empty(k // group, n), torch.empty(k // group, n)
    block = max(1, block // group) * group  # a block holds whole groups
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = wt[b0:b1]  # a view: the updates below write into wt
        err = torch.empty_like(wb)
        for j, c in enumerate(range(b0, b1)):
            g = c // group
            if c % group == 0:
                scale[g], zero[g] = group_params(wb[j:j + group].t(), bits, symmetric)
            q[c] = quantize_values(wb[j], scale[g], zero[g], bits)
            err[j] = (wb[j] - dequantize_values(q[c], scale[g], zero[g])) / u[c, c]
            wb[j + 1:] -= u[c, c + 1:b1, None] * err[j]
        wt[b1:] -= u[b0:b1, b1:].t() @ err
    return pack(q.t().reshape(n, k // group, group), scale.t(), zero.t(), bits)


def output_error(w: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor], h: torch.Tensor,
                 bits: int) -> float:
    """||X (W - Wq)^T|| / ||X W^T|| on the calibration inputs, from H = 2 X^T X / n."""
    w = w.detach().double()
    d = w - dequantize(*packed, bits, w.shape[1]).double()
    return math.sqrt(((d @ h) * d).sum().clamp(min=0).item() / max(((w @ h) * w).sum().item(), 1e-30))


class _Inputs:
    """A forward hook that accumulates X^T X over the inputs (or outputs) of a module."""

    def __init__(self, k: int, outputs: bool = False):
        self.xtx, self.rows, self.outputs = torch.zeros(k, k, dtype=torch.float64), 0, outputs

    def __call__(self, module, args, output) -> None:
        x = output if self.outputs else args[0]
        x = x.detach().reshape(-1, x.shape[-1]).double()
        self.xtx += x.T @ x
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return 2 * self.xtx / max(self.rows, 1)


class _Stop(Exception):
    """Raised by the hook on the final norm: calibration never needs the logits."""


def _calibrated(linear: nn.Linear, run: Callable[[], object], bits: int, group: int, accuracy_level: int,
                errors: list, source: nn.Module | None = None, symmetric: bool = False) -> QuantLinear:
    """Run `run` with a hook collecting the inputs of `linear` (or the outputs of `source`, which
    feeds it), then return the GPTQ-quantized replacement of `linear`."""
    acc = _Inputs(linear.in_features, outputs=source is not None)
    handle = (source or linear).register_forward_hook(acc, prepend=True)  # before the _Stop hook
    try:
        run()
    finally:
        handle.remove()
    h = acc.hessian()
    packed = gptq_quantize(linear.weight, h, bits, group, symmetric=symmetric)
    errors.append((output_error(linear.weight, packed, h, bits),
                   output_error(linear.weight, quantize(linear.weight.detach(), bits, group, symmetric), h, bits)))
    return QuantLinear(linear, bits, group, accuracy_level, packed=packed)


@torch.no_grad()
def gptq_quantize_decoder(model: nn.Module, rows: torch.Tensor, bits: int, group: int = 32, lm_head: bool = False,
                          accuracy_level: int = 0, progress: Callable[[str], None] | None = None,
                          symmetric: bool = False) -> dict:
    """Replace every projection (and the lm_head if asked) by a GPTQ-quantized QuantLinear, in place,
    calibrated on token rows [R, L]. Returns the figures: linears quantized and the mean relative
    output error on the calibration inputs of GPTQ and of round-to-nearest."""
    cfg = model.cfg
    r, l = rows.shape
    caches = KVCache.allocate(cfg, r, l, dtype=model.embed.weight.dtype).for_batch(r)
    errors: list[tuple[float, float]] = []

    def calibrate(index: int, block: nn.Module, args: tuple) -> None:
        """Pre-hook of Block `index`: args are what the already-quantized blocks before it produced."""
        start, names = len(errors), projections(cfg)
        for name in names:  # each sees the inputs the already-quantized ones before it give it
            setattr(block, name, _calibrated(getattr(block, name), lambda: block.forward(*args), bits, group,
                                             accuracy_level, errors, symmetric=symmetric))
        if progress:
            g, rtn = (sum(e[i] for e in errors[start:]) / len(names) for i in (0, 1))
            progress(f"GPTQ layer {index + 1}/{cfg.num_layers}: relative output error {g:.2%} "
                     f"(round-to-nearest {rtn:.2%})")

    def stop(module, args, output):
        raise _Stop

    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: calibrate(i, m, a))
             for i, layer in enumerate(model.layers)]
    hooks.append(model.norm.register_forward_hook(stop))
    def run() -> None:  # the blocks quantize themselves on the way, then the final norm stops the pass
        try:
            model(rows, torch.arange(l).expand(r, l), caches)
        except _Stop:
            pass

    try:
        if lm_head:  # the head's inputs are the final norm's outputs
            model.lm_head = _calibrated(lm_head_linear(model), run, bits, group, accuracy_level, errors,
                                        source=model.norm, symmetric=symmetric)
        else:
            run()
    finally:
        for hk in hooks:
            hk.remove()
    return {"linears": len(errors), "output_error": sum(e[0] for e in errors) / len(errors),
            "rtn_output_error": sum(e[1] for e in errors) / len(errors)}
