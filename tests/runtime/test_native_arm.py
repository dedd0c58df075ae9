"""The native engine's aarch64 NEON kernels, under emulation, against the portable C build.

The engine and its self-test driver (kvedge/runtime/native/kvedge_selftest.c) are built with Debian's
gcc-aarch64-linux-gnu for three CPUs and run by qemu-user: `-cpu cortex-a72` (NEON, no dot product: the widening
kernels), `-cpu cortex-a76` (ARMv8.2 dot product: sdot) and `-cpu max` (dot product and i8mm: usdot). The inputs are
the x86 engine's own packed structs (kvedge.runtime.native_dump): every weight format the engine runs, from
kvedge's quantizer and from GGUF files. The reference is the portable C build (-DKV_NO_SIMD), on x86 through
ctypes and on aarch64 under qemu. Every build contracts no multiply-add (-ffp-contract=off), so the kernels'
integer sums and float epilogues must give the portable build's outputs bit for bit: a wrong lane, a dropped
tail or a sign shows as a mismatch, not as a tolerance to argue about. The float helpers are another matter:
NEON's e^x (softmax, SiLU) is the AVX2 path's polynomial, not libm's expf, so they are held to float64's values
within its stated error, and whole models to the emulated portable build's logits within 1e-3 of the largest
(x86's portable build too: its libm is not aarch64's): the engine's rounding steps (int8 activations, a float16
or int8 cache) turn a last-bit difference into a step of their grid now and then, as they do between any two
builds; a kernel's wrong lane or sign moves logits by their own size.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from kvedge.runtime.native_backend import (NativeBackend, _Keep, arm_march, compile_engine, expected_kernels, pack_gguf,
                                         pack_linear)
from kvedge.runtime.native_dump import FORWARD, HELPERS, LAYOUT, LINEAR, SIMD, Dump, dump_backend, parse_layout
from tests.gguf_files import random_kquant_blocks, save_hf_checkpoint, write_gguf
from tests.runtime.test_native import affine_linear, quant_linear

CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
pytestmark = pytest.mark.skipif(CC is None or QEMU is None or shutil.which("gcc") is None,
                                reason="needs gcc-aarch64-linux-gnu and qemu-user (apt-get install gcc-aarch64-linux-gnu "
                                       "qemu-user)")

DRIVER = Path(__file__).parents[2] / "kvedge" / "runtime" / "native" / "kvedge_selftest.c"
COMMON = ("-O3", "-fopenmp", "-ffp-contract=off", "-static")
# /proc/cpuinfo's Features of a Raspberry Pi 4 (Cortex-A72), a Pi 5 (Cortex-A76; an Orin's A78AE adds no kernel
# feature to it) and a CPU with i8mm (Neoverse V2 / V3AE class, abridged): the flags kvedge builds with where
# -march=native is not taken (arm_march), and the kernels kv_simd() must then name (4 NEON, 5 with the dot product,
# 6 with i8mm too: the engine's numbering, KERNELS)
FEATURES = {"cortex-a72": {"fp", "asimd", "evtstrm", "crc32", "cpuid"},
            "cortex-a76": {"fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics", "fphp",
                           "asimdhp", "cpuid", "asimdrdm", "lrcpc", "dcpop", "asimddp"},
            "max": {"fp", "asimd", "asimdhp", "asimddp", "sve", "sve2", "i8mm", "bf16"}}
# build -> (its flags, the qemu CPU it runs on, the kernels kv_simd() must name)
SIMD_OF = {"cortex-a72": 4, "cortex-a76": 5, "max": 6}
BUILDS = {cpu: ((arm_march(f),), cpu, SIMD_OF[cpu]) for cpu, f in FEATURES.items()}
BUILDS["portable"] = (("-march=armv8-a", "-DKV_NO_SIMD"), "cortex-a72", 0)
NEON = [b for b in BUILDS if b != "portable"]
X86_PORTABLE = ("-O3", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off", "-DKV_NO_SIMD")


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    out = tmp_path_factory.mktemp("arm")

    def build(name):
        exe = out / f"selftest-{name}"
        r = subprocess.run([CC, *COMMON, *BUILDS[name][0], "-o", str(exe), str(DRIVER), "-lm"], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        return name, exe

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, BUILDS))


def run(drivers, name: str, dump: Dump, tmp_path: Path) -> bytes:
    f = dump.write(tmp_path / f"{name}.kvd")
    r = subprocess.run([QEMU, "-cpu", BUILDS[name][1], str(drivers[name]), str(f)], capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return r.stdout


@pytest.fixture(scope="module")
def x86(tmp_path_factory):
    return compile_engine(X86_PORTABLE, cache_dir=tmp_path_factory.mktemp("x86"))


def test_each_build_runs_its_kernels_and_lays_the_structs_out_as_x86(drivers, x86, tmp_path):
    """A build that fell back to portable C would pass every comparison below; and the dumps hand x86's structs
    over byte for byte, which holds only while both sides lay them out alike."""
    want, at = {}, (ctypes.c_size_t * 2)()
    while (name := x86.kv_layout(len(want), at)) is not None:
        want[name.decode()] = (at[0], at[1])
    assert {cpu: expected_kernels(f, "aarch64") for cpu, f in FEATURES.items()} == SIMD_OF  # kvedge doctor's word
    for build, (_, _, simd) in BUILDS.items():
        d = Dump()
        d.call(SIMD), d.call(LAYOUT)
        raw = run(drivers, build, d, tmp_path)
        assert np.frombuffer(raw[:4], np.int32)[0] == simd, build
        layout, rest = parse_layout(raw[4:])
        assert layout == want and rest == b"", build


def _linears(engine):
    """(name, Linear, keep) for every quantized format the engine's kernels run, shapes with partial chunks of 8
    sub-blocks and a partial last tile"""
    g = torch.Generator().manual_seed(0)
    out = []
    for bits in (4, 8):
        for sym in (True, False):
            for n, k, group in ((24, 96, 32), (13, 288, 32), (8, 544, 32), (9, 256, 128), (12, 192, 64)):
                for act in ("int8", "int16"):
                    torch.manual_seed(n * k + bits)
                    keep = _Keep()
                    mod = quant_linear(torch.randn(n, k), bits, group, sym)
                    out.append((f"int{bits} sym={sym} {n}x{k}/{group} {act}", pack_linear(engine, mod, keep, act), keep))
    for bits in (4, 8):
        for k_quant in (False, True):  # Q4_1-like float16 mins; K-quant float32 scales and mins
            for act in ("int8", "int16"):
                keep = _Keep()
                lin = torch.nn.Linear(256, 20)
                mod = affine_linear(lin, bits, 32, g, k_quant=k_quant)
                out.append((f"affine int{bits} k_quant={k_quant} {act}", pack_linear(engine, mod, keep, act), keep))
    rng = np.random.default_rng(0)
    for kind in ("Q4_K", "Q5_K", "Q6_K"):  # GGUF's K-quant blocks as kv_pack_gguf packs them
        for n, k in ((13, 512), (8, 256)):
            blocks = random_kquant_blocks(kind, n * k // 256, rng).reshape(n, -1)
            for act in ("int8", "int16"):
                keep = _Keep()
                rows = blocks.ctypes.data + np.arange(n, dtype=np.uint64) * blocks.shape[1]
                out.append((f"{kind} {n}x{k} {act}", pack_gguf(engine, kind, rows, k, keep, act), keep))
    return out


def test_every_linear_format_equals_the_portable_build_bit_for_bit(drivers, x86, tmp_path):
    """kv_linear_forward (activation quantization, then qtile or qdot_rows) for 1, 2, 3 and 5 rows: 1 to 4
    activation rows per tile call and a tail, one or two per row call. The emulated portable build equals x86's
    too: the layouts and the arithmetic are the architecture's no more than the kernels are."""
    dump, want = Dump(), []  # the dump holds every struct and tensor it names
    for name, lin, keep in _linears(x86):
        li = dump.struct(lin)
        for t in keep.tensors:
            dump.tensor(t)
        for m in (1, 2, 3, 5):
            x = torch.randn(m, lin.k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.1, 3, lin.k)
            x[0, 32:64] = 0  # an all-zero sub-block: scale 0
            y = torch.empty(m, lin.n)
            assert x86.kv_linear_forward(ctypes.byref(lin), m, x.data_ptr(), y.data_ptr(), 2) == 0
            keep.tensors.append(x)
            dump.call(LINEAR, li, m, dump.tensor(x), 2)
            want.append((f"{name} m={m}", y))
    expect = np.concatenate([y.numpy().ravel() for _, y in want]).view(np.uint32)
    for build in BUILDS:
        got = np.frombuffer(run(drivers, build, dump, tmp_path), np.uint32)
        assert got.shape == expect.shape, build
        if not np.array_equal(got, expect):
            at, bad = 0, []
            for name, y in want:
                if not np.array_equal(got[at:at + y.numel()], expect[at:at + y.numel()]):
                    bad.append(name)
                at += y.numel()
            pytest.fail(f"{build}: {len(bad)} of {len(want)} calls differ from x86's portable build: {bad[:6]}")


def test_the_float_helpers_are_within_their_error_of_float64(drivers, tmp_path):
    """softmax_exp over an odd count (the vector loop and its tail) and SiLU, 8 at a time as the MLP calls it: e^x
    within 3e-7 + 1.2e-7 |x| relative (the polynomial's 2e-7; float32's rounding of x - max and of x log2(e),
    half an ulp each, moves e^x by that much relative) for x > -86, below within 2e-38 (the polynomial clamps x at
    -87: e^-87 is 1.6e-38), their sum within 1e-6; SiLU likewise (x = -|v|), below within 1e-34 (v e^-87)."""
    x = torch.cat([torch.linspace(-100, 30, 61), torch.tensor([0.0, -0.0, 87.5]), torch.randn(64) * 8])
    d = Dump()
    d.call(HELPERS, d.tensor(x), x.numel())
    v = x.double().numpy()
    e = np.exp(v[:-1] - v[:-1].max())
    silu = v / (1 + np.exp(-v))
    for build in BUILDS:
        got = np.frombuffer(run(drivers, build, d, tmp_path), np.float32).astype(np.float64)
        n = x.numel()
        big = v[:-1] - v[:-1].max() > -86
        rel = np.abs(got[:n - 1] / e - 1) / (3e-7 + 1.2e-7 * np.abs(v[:-1] - v[:-1].max()))
        assert (rel[big] <= 1).all(), (build, rel[big].max())
        assert np.allclose(got[:n - 1][~big], e[~big], rtol=0, atol=2e-38), (build, np.abs(got[:n - 1] - e)[~big].max())
        assert abs(got[n - 1] / e.sum() - 1) < 1e-6, build
        rel = np.abs(got[n:] - silu) / ((3e-7 + 1.2e-7 * np.abs(v)) * np.abs(silu) + 1e-45)  # silu(0) = 0
        assert (rel[v > -86] <= 1).all(), (build, rel[v > -86].max())
        assert np.allclose(got[n:][v <= -86], silu[v <= -86], rtol=0, atol=1e-34), build


LLAMA_256 = dict(hidden_size=256, intermediate_size=512, num_key_value_heads=2, head_dim=32)
Q4_K_M = {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K"}
PROMPT, STEPS = 9, 3


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-llama-256")
    save_hf_checkpoint(path, "llama", **LLAMA_256)
    return path


MODELS = {  # name -> NativeBackend keyword arguments (model_dir filled in)
    **{f"gguf {q}": dict(gguf=(q, {})) for q in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")},
    "gguf Q4_K_M": dict(gguf=("Q4_K", Q4_K_M)),
    "int4 asymmetric /128, int16 activations, fp16 cache": dict(quantize="int4", symmetric=False, group_size=128,
                                                              activations="int16", kv_dtype="fp16"),
    "int8 symmetric /32, int8 cache": dict(quantize="int8", symmetric=True, group_size=32, kv_dtype="int8"),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_a_whole_models_logits_equal_the_portable_build(model, drivers, hf_dir, tmp_path):
    """Prefill 2 rows of 9 tokens, then 3 decode steps, through the engine's own forward: the NEON builds and x86's
    portable build equal the emulated portable build within 1e-3 of the largest logit (see the module doc)."""
    kw = dict(MODELS[model])
    if "gguf" in kw:
        qtype, types = kw.pop("gguf")
        source = write_gguf(tmp_path / f"{qtype}.gguf", hf_dir, qtype, types=types)
    else:
        source = hf_dir
    b = NativeBackend(source, max_batch=2, max_seq_len=PROMPT + STEPS, threads=2, flags=X86_PORTABLE, **kw)
    dump, mi = dump_backend(b)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, b.cfg.vocab_size, (2, PROMPT + STEPS), generator=g)
    calls = [(ids[:, :PROMPT], torch.arange(PROMPT).expand(2, PROMPT), torch.tensor([[PROMPT - 1], [PROMPT - 2]]))]
    calls += [(ids[:, p:p + 1], torch.tensor([[p], [p]]), torch.tensor([[0], [0]])) for p in range(PROMPT, PROMPT + STEPS)]
    keep = []
    for i, p, li in calls:
        i, p, li = (t.contiguous() for t in (i, p, li))
        keep += [i, p, li]
        dump.call(FORWARD, mi, 2, i.shape[1], dump.tensor(i), dump.tensor(p), dump.tensor(li), 1, 2)
    f = dump.write(tmp_path / "model.kvd")  # before x86 runs: the caches as they start
    x86 = torch.cat([b.forward(i, p, li).clone().ravel() for i, p, li in calls])
    out = {}
    for build in BUILDS:
        r = subprocess.run([QEMU, "-cpu", BUILDS[build][1], str(drivers[build]), str(f)], capture_output=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        out[build] = torch.from_numpy(np.frombuffer(r.stdout, np.float32).copy())
    ref = out["portable"]
    assert ref.shape == x86.shape
    for build, got in [("x86 portable", x86)] + [(b, out[b]) for b in NEON]:
        diff = float((got - ref).abs().max() / ref.abs().max())
        assert diff <= 1e-3, f"{build}: {diff:.3g} of the largest logit from the emulated portable build"
