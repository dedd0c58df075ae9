"""MLA attention, absorbed vs reconstructed, for prefill and decode (CPU, torch, float32).

    python benchmarks/mla_attention.py [--shape minicpm3|deepseek-v2-lite] [--threads 2] [--contexts 128,512,2048]

One layer's attention from its query (q_nope, q_rope) and its latent cache (c_kv, k_rope) to the heads'
outputs (before o_proj), batch 1:
- absorbed (what kvedge runs): q_nope @ W_uk into the latent, one-KV-head attention over [k_rope, c_kv]
  with value c_kv, then @ W_uv^T;
- reconstructed (transformers' form): K_nope = c_kv @ W_uk^T and V = c_kv @ W_uv^T for every cached
  token and head, then per-head attention over [k_rope, K_nope] and V.
Prefill: L = S tokens from an empty cache (causal); decode: one query over S cached tokens. For scale, "layer
matmuls" times the rest of the layer's matrix products for the same L tokens (q, kv_a, o and the dense MLP), and
"absorbed's cost" is (absorbed - reconstructed) / (reconstructed + layer matmuls): what the absorbed form adds to
(or, negative, saves from) the layer. Medians of repeated runs; ratios are what means anything (figures in
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {  # heads, qk_nope_head_dim, d_R, d_c, v_head_dim; hidden, q_lora_rank (0: none), intermediate (dense MLP)
    "minicpm3": (40, 64, 32, 256, 64, 2560, 768, 6400),  # openbmb/MiniCPM3-4B
    "deepseek-v2-lite": (16, 128, 64, 512, 128, 2048, 0, 10944),  # its dense first layer
}


def absorbed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale, mask):
    q = torch.cat((q_rope, q_nope @ w_uk), -1)  # [H, L, d_R + d_c]
    keys = torch.cat((k_rope, c_kv), -1)  # [S, d_R + d_c], one KV head
    probs = torch.softmax((q @ keys.T) * scale + mask, -1)
    return (probs @ c_kv) @ w_uv.transpose(1, 2)  # [H, L, d_v]


def reconstructed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale, mask):
    k_nope, v = c_kv @ w_uk.transpose(1, 2), c_kv @ w_uv.transpose(1, 2)  # [H, S, d_nope], [H, S, d_v]
    scores = q_nope @ k_nope.transpose(1, 2) + q_rope @ k_rope.T
    return torch.softmax(scores * scale + mask, -1) @ v


def timed(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="minicpm3")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="128,512,2048")
    p.add_argument("--repeat", type=int, default=9)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    h, dn, dr, dc, dv, hidden, q_rank, inter = SHAPES[a.shape]
    g = torch.Generator().manual_seed(0)
    w_uk, w_uv = torch.randn(h, dn, dc, generator=g) * dc**-0.5, torch.randn(h, dv, dc, generator=g) * dc**-0.5
    scale = (dn + dr) ** -0.5
    q_shapes = [(hidden, q_rank), (q_rank, h * (dn + dr))] if q_rank else [(hidden, h * (dn + dr))]
    dense = [torch.randn(k, n, generator=g) * k**-0.5 for k, n in q_shapes + [(hidden, dc + dr), (h * dv, hidden),
                                                                              (hidden, 2 * inter), (inter, hidden)]]

    def layer_matmuls(xs: list[torch.Tensor]) -> None:
        for x, w in zip(xs, dense):
            x @ w

    print(f"{a.shape}: {h} heads, d_nope {dn}, d_R {dr}, d_c {dc}, d_v {dv}, hidden {hidden}; {a.threads} threads, "
          "float32")
    print(f"{'phase':<8} {'S':>6} {'absorbed ms':>12} {'reconstructed ms':>17} {'layer matmuls ms':>17} "
          f"{'reconstructed / absorbed':>25} {'absorbed cost':>14}")
    for s in map(int, a.contexts.split(",")):
        c_kv, k_rope = torch.randn(s, dc, generator=g), torch.randn(s, dr, generator=g)
        for phase, l in (("prefill", s), ("decode", 1)):
            q_nope, q_rope = torch.randn(h, l, dn, generator=g), torch.randn(h, l, dr, generator=g)
            mask = torch.full((l, s), float("-inf")).triu(s - l + 1)
            args = (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, scale, mask)
            torch.testing.assert_close(absorbed(*args), reconstructed(*args), rtol=1e-4, atol=1e-4)
            ta, tr = timed(lambda: absorbed(*args), a.repeat), timed(lambda: reconstructed(*args), a.repeat)
            xs = [torch.randn(l, w.shape[0], generator=g) for w in dense]
            tm = timed(lambda: layer_matmuls(xs), a.repeat)
            print(f"{phase:<8} {s:>6} {ta * 1e3:>12.3f} {tr * 1e3:>17.3f} {tm * 1e3:>17.3f} {tr / ta:>25.2f} "
                  f"{(ta - tr) / (tr + tm):>+14.1%}")


if __name__ == "__main__":
    main()
