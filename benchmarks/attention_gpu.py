"""Decode attention on a GPU: kvedge's Triton kernel vs torch SDPA, against the device's copy bandwidth.

    python benchmarks/attention_gpu.py [--contexts 1024,4096,16384,32768]

Llama-3-8B-shaped layer: 32 query heads, 8 KV heads, head_dim 128, bf16, batch 1, one query token.
Bytes moved per call = K and V of the context (2 * 8 * S * 128 * 2) — the floor for decode, which
is memory bound. Copy bandwidth is measured in the same run (device-to-device copy of 1 GiB, read +
write). Times are CUDA-event medians; figures in docs/benchmarks.md.
"+rope us": the same decode with the query rotated inside the kernel (RoPE tables, full rotary), and
"fused us": the one-launch kernel the TensorRT plugin's AOT path embeds (cache write + RoPE + attention,
no split-K), both on the same inputs.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F


def timed(fn, iters=50, warmup=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    a = p.parse_args()
    from kvedge.kernels import triton_attention as tk
    from kvedge.models.rope import tables

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / timed(lambda: dst.copy_(src), 20, 5)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    print(f"{'context':>8} {'kvedge us':>10} {'GB/s':>7} {'% copy':>7} {'sdpa us':>9} {'x sdpa':>7} {'max err':>9} "
          f"{'+rope us':>9} {'fused us':>9}")
    for s in (int(x) for x in a.contexts.split(",")):
        q = torch.randn(1, hq, 1, d, device="cuda", dtype=dt)
        kc = torch.randn(1, hkv, s, d, device="cuda", dtype=dt)
        vc = torch.randn(1, hkv, s, d, device="cuda", dtype=dt)
        lens = torch.tensor([s], device="cuda")
        scale = d ** -0.5
        t_k = timed(lambda: tk.decode(q, kc, vc, lens, scale))
        t_s = timed(lambda: F.scaled_dot_product_attention(q, kc, vc, scale=scale, enable_gqa=True))
        err = (tk.decode(q, kc, vc, lens, scale).float()
               - F.scaled_dot_product_attention(q, kc, vc, scale=scale, enable_gqa=True).float()).abs().max().item()
        freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        rope = tables(freq, s, dt)
        t_r = timed(lambda: tk.decode(q, kc, vc, lens, scale, rope=rope))
        k1, v1, pos = kc[:, :, -1:].clone(), vc[:, :, -1:].clone(), (lens - 1)[:, None]
        t_f = timed(lambda: tk.prefill(q, k1, v1, kc, vc, pos, scale, rope=rope, fused=True))
        moved = 2 * hkv * s * d * 2
        print(f"{s:>8} {t_k * 1e6:10.1f} {moved / t_k / 1e9:7.0f} {100 * moved / t_k / copy_bw:6.0f}% "
              f"{t_s * 1e6:9.1f} {t_s / t_k:7.2f} {err:9.2e} {t_r * 1e6:9.1f} {t_f * 1e6:9.1f}")


if __name__ == "__main__":
    main()
