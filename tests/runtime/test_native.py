"""The native CPU engine against independent references.

- Its quantized linear equals, within float rounding, the formula written out here: activations rounded
  to int8 per 32 channels (scale max|x| / 127, half to even) times the dequantized weights, for INT4 and
  INT8, symmetric and asymmetric groups of 32/64/128, and every tail shape of the 8-sub-block kernel;
  for the AVX-VNNI build, an AVX2 build without VNNI and the portable C build. Affine blocks (GGUF's
  Q4_1: w = q * d + m with float16 d and m) too, run with their float16 mins. GGUF's K-quant blocks (Q4_K,
  Q5_K, Q6_K's 6-bit tiles) as kv_pack_gguf packs them, against gguf's own dequantizer.
- With int16 activations (activations="int16": two int8 planes, hi * 128 + lo) the same linears equal x
  rounded to 16256 levels per 32 channels times the weights, and the whole engine equals the PyTorch
  model's float activations within 1e-3 of the largest logit.
- The whole engine equals kvedge's PyTorch Decoder (itself checked against transformers) running the
  same quantized weights with the same activation rounding, for every architecture it supports; and
  in float32 it equals the PyTorch model and its greedy tokens, ragged batches and chunked prefill.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvedge.errors import KvedgeError
from kvedge.models import KVCache, load_decoder
from kvedge.models.quant import QuantLinear, dequantize, lm_head_linear, pack, quantize_decoder
from kvedge.runtime import Session, load
from kvedge.runtime.native_backend import FLAGS, KERNELS, NativeBackend, _Keep, compile_engine, pack_linear
from tests.conftest import ARCH_CASES, MAX_SEQ, MLA_CASES

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="the native engine needs a C compiler")

# The kernels each build compiles: the CPU's best (-march=native: AVX512-VNNI, whose 4-bit tiles take 512-bit
# registers, or AVX-VNNI), AVX-VNNI's 256-bit kernels where a CPU with AVX512-VNNI has them too, AVX2 without
# VNNI, portable C.
BUILDS = {"native": FLAGS}
if platform.machine() in ("x86_64", "AMD64"):
    _CPU = {f for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
            for f in ln.split(":", 1)[1].split()} if Path("/proc/cpuinfo").is_file() else set()
    BUILDS["avx2"] = tuple(f for f in FLAGS if f != "-march=native") + ("-mavx2", "-mfma", "-mf16c")
    if {"avx_vnni", "avx512_vnni"} <= _CPU:
        BUILDS["avx-vnni"] = BUILDS["avx2"] + ("-mavxvnni",)
    BUILDS["portable"] = tuple(f for f in FLAGS if f != "-march=native")


def fake_quant(x: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """x rounded per 32 channels (symmetric, scale max|x| / levels, round half to even), dequantized: int8
    activations (127), or int16 ones as the engine holds them (16256 = 127 * 128: hi * 128 + lo)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # levels / amax as a true division, as the engine computes it: `int / tensor` multiplies by a reciprocal,
    # which moves the odd product onto a rounding tie the engine does not see
    inv = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)
    return (q * (amax / levels)).reshape(x.shape)


LEVELS = {"int8": 127, "int16": 16256}  # activations -> fake_quant's levels


@pytest.fixture(scope="module", params=list(BUILDS))
def engine(request, tmp_path_factory):
    return compile_engine(BUILDS[request.param], cache_dir=tmp_path_factory.mktemp("native"))


def test_each_build_runs_the_kernels_it_is_meant_to(engine, request):
    """The vector kernels need AVX2, FMA and F16C; a build that silently fell back to portable C would pass
    every numeric test here and be several times slower."""
    build = request.node.callspec.params["engine"]
    flags = _CPU if platform.machine() in ("x86_64", "AMD64") else set()
    vector = build in ("avx2", "avx-vnni") or (build == "native" and {"avx2", "fma", "f16c"} <= flags)
    vnni = 3 if {"avx512_vnni", "avx512vl"} <= flags else 2 if "avx_vnni" in flags else 1
    expected = {"avx2": 1, "avx-vnni": 2, "native": vnni}.get(build, 0) if vector else 0
    assert engine.kv_simd() == expected  # a build that lost VNNI fails


def test_the_compile_cache_key_covers_every_file_the_engine_includes():
    """A header the key missed would hand an edited engine the cached build of the old one."""
    import re

    from kvedge.runtime.native_backend import SOURCE, engine_sources

    included, todo = {SOURCE}, [SOURCE]
    while todo:
        for name in re.findall(r'^#include "([^"]+)"', todo.pop().read_text(), re.M):
            f = SOURCE.parent / name
            if f not in included:
                included.add(f), todo.append(f)
    assert included <= set(engine_sources()) and len(included) >= 4  # kvedge_cpu.c and the three kernel files


def test_the_kernels_a_cpu_gets_follow_its_features():
    """-march=native's kernels from /proc/cpuinfo's feature names, and the -march an aarch64 CPU is built with where
    native is not taken; the emulated builds (test_native_arm.py) check each against kv_simd() under qemu."""
    from kvedge.runtime.native_backend import arm_march, expected_kernels

    x86 = {"avx2", "fma", "f16c"}
    assert [expected_kernels(f, "x86_64") for f in (set(), {"avx2", "fma"}, x86, x86 | {"avx_vnni"},
                                                    x86 | {"avx512_vnni", "avx512vl", "avx_vnni"})] == [0, 0, 1, 2, 3]
    arm = [{"fp", "asimd"}, {"fp", "asimd", "asimddp"}, {"fp", "asimd", "asimddp", "i8mm"}]
    assert [expected_kernels(f, "aarch64") for f in arm] == [4, 5, 6]
    assert [arm_march(f) for f in arm] == ["-march=armv8-a", "-march=armv8.2-a+dotprod",
                                           "-march=armv8.2-a+dotprod+i8mm"]


def test_the_kernels_this_cpu_gets_are_the_native_builds(engine, request):
    """kvedge doctor's prediction (the CPU's features) against what the compiler's macros gave the native build."""
    from kvedge.runtime.native_backend import expected_kernels

    if request.node.callspec.params["engine"] != "native":
        pytest.skip("the prediction is -march=native's")
    assert engine.kv_simd() == expected_kernels()


def quant_linear(w, bits, group, symmetric):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w
    return QuantLinear(lin, bits, group, accuracy_level=4, symmetric=symmetric)


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,group", [(24, 32, 32), (16, 96, 32), (40, 576, 32), (9, 1536, 64), (8, 288, 32),
                                       (8, 256, 128), (8, 544, 32), (8, 224, 32), (8, 416, 32), (12, 192, 64),
                                       (4, 128, 32)])
def test_linear_equals_the_activation_formula(engine, activations, bits, symmetric, n, k, group):
    torch.manual_seed(k + n + bits)
    mod = quant_linear(torch.randn(n, k), bits, group, symmetric)
    keep = _Keep()  # holds the tensors the engine's pointers refer to
    lin = pack_linear(engine, mod, keep, activations)
    assert lin.sym == int(symmetric)
    w = dequantize(mod.qweight, mod.scales, mod.zeros, bits, k)
    for m in (1, 2, 3, 5):  # 1 to 4 activation rows per kernel call, and a tail
        x = torch.randn(m, k) * torch.linspace(0.1, 3, k)  # uneven magnitudes across sub-blocks
        x[0, 32:64] = 0  # an all-zero sub-block has scale 0
        y = torch.empty(m, n)
        assert engine.kv_linear_forward(ctypes.byref(lin), m, x.data_ptr(), y.data_ptr(), 2) == 0
        ref = fake_quant(x, LEVELS[activations]) @ w.T
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        # and against the float activations: int8 rounding costs a few percent at most here, int16 128x less
        exact = x.double() @ w.double().T
        assert (y - exact).abs().max() <= {"int8": 0.03, "int16": 3e-4}[activations] * exact.abs().max()


def affine_linear(lin: torch.nn.Linear, bits: int, group: int, g: torch.Generator, k_quant: bool = False
                  ) -> QuantLinear:
    """A QuantLinear of lin's shape and bias over affine blocks as GGUF's Q4_1 stores them: random integers q,
    float16 scales d and mins m (about -d * qmax / 2, so weights q * d + m center near 0), w = q * d + m; d
    spread around lin's own weight magnitude. Group 0 of row 0 is a constant block (d = 0, q = 0: w = m).
    k_quant: scales and mins as Q4_K / Q5_K make them, a float16 times a 6-bit integer (float32 values)."""
    n, k, qmax = lin.out_features, lin.in_features, 2 ** bits - 1
    q = torch.randint(0, qmax + 1, (n, k // group, group), generator=g).to(torch.uint8)
    top = 2 * float(lin.weight.detach().abs().max()) / qmax
    d = (top * (0.2 + torch.rand(n, k // group, generator=g))).half()
    m = (-d.float() * qmax / 2 * (1 + 0.3 * torch.randn(n, k // group, generator=g))).half()
    if k_quant:  # d * sc, dmin * m with sc, m in [0, 63]: float16 * 6 bits, rarely a float16 value
        d = d.float() / 32 * torch.randint(1, 64, d.shape, generator=g)
        m = m.float() / 32 * torch.randint(1, 64, m.shape, generator=g)
    d[0, 0], q[0, 0] = 0, 0
    qweight = pack(q, d.float(), torch.zeros_like(d.float()), bits)[0]
    return QuantLinear(lin, bits, group, accuracy_level=4, mins=m.float().reshape(-1),
                       packed=(qweight, d.float().reshape(-1), torch.empty(0, dtype=torch.uint8)))


@pytest.mark.parametrize("figures", ["float16", "k-quant"])
@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,group", [(24, 32, 32), (40, 576, 32), (9, 1536, 64), (8, 224, 32), (8, 416, 32),
                                       (12, 192, 64), (8, 256, 128)])
def test_affine_linear_equals_the_activation_formula(engine, figures, activations, bits, n, k, group):
    """GGUF's affine blocks run as the file has them, d and m float16 (Q4_1) or float32 (Q4_K / Q5_K's d * sc
    and dmin * m): d * sa * dot + m * c per sub-block (c = sa * sum(xq)), which is fake_quant(x) @ w.T up to
    float rounding."""
    g = torch.Generator().manual_seed(k + n + bits)
    mod = affine_linear(torch.nn.Linear(k, n, bias=False), bits, group, g, k_quant=figures == "k-quant")
    if figures == "k-quant":
        assert not torch.equal(mod.scales.half().float(), mod.scales)  # not float16 values
    keep = _Keep()
    lin = pack_linear(engine, mod, keep, activations)
    assert lin.sym == 0 and not lin.z and bool(lin.mins) == (figures == "float16") != bool(lin.s32)
    w = dequantize(mod.qweight, mod.scales, mod.zeros, bits, k, mod.mins)
    assert bool((w[0, :group] == mod.mins[0]).all())  # the constant block
    for m in (1, 2, 3, 5):
        x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 3, k)
        x[0, :32] = 0  # an all-zero sub-block (here the constant block's) has scale 0
        y = torch.empty(m, n)
        assert engine.kv_linear_forward(ctypes.byref(lin), m, x.data_ptr(), y.data_ptr(), 2) == 0
        ref = fake_quant(x, LEVELS[activations]) @ w.T
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("n,k", [(8, 256), (13, 512), (40, 2304), (3, 768)])
def test_gguf_k_quant_blocks_equal_the_activation_formula(engine, kind, activations, n, k):
    """A K-quant's blocks packed by kv_pack_gguf (Q4_K tiles with the file's 6-bit figures, Q5_K's float32 ones,
    Q6_K's 6-bit tiles with int8 scales per 16 channels) against gguf's own dequantizer: fake_quant(x) @ w.T up to
    float rounding, for 1 to 5 activation rows, several super-blocks and a partial last tile."""
    import gguf

    from kvedge.runtime.native_backend import pack_gguf
    from tests.gguf_files import random_kquant_blocks

    rng = np.random.default_rng(n * k)
    blocks = random_kquant_blocks(kind, n * k // 256, rng).reshape(n, -1)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).astype(np.float32))
    assert w.shape == (n, k)
    keep = _Keep()
    lin = pack_gguf(engine, kind, blocks.ctypes.data + np.arange(n, dtype=np.uint64) * blocks.shape[1], k, keep,
                    activations, threads=2)
    del blocks  # the engine holds its own copy
    for m in (1, 2, 3, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.1, 3, k)
        x[0, 32:64] = 0  # an all-zero sub-block has scale 0
        y = torch.empty(m, n)
        assert engine.kv_linear_forward(ctypes.byref(lin), m, x.data_ptr(), y.data_ptr(), 2) == 0
        ref = fake_quant(x, LEVELS[activations]) @ w.T
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_pack_refuses_scales_it_cannot_run_as_they_are(engine):
    """A zero-point linear's scales are kept as float16 (affine blocks' take float32 where they must)."""
    mod = quant_linear(torch.randn(4, 64), 4, 32, True)
    mod.scales[1] = 0.1  # not a float16 value
    with pytest.raises(KvedgeError, match="stores scales as float16"):
        pack_linear(engine, mod, _Keep())


def test_pack_refuses_groups_that_are_not_whole_sub_blocks(engine):
    mod = quant_linear(torch.randn(4, 48), 4, 16, True)
    with pytest.raises(KvedgeError, match="multiples of 32"):
        pack_linear(engine, mod, _Keep())


NATIVE_CASES = [c for c in ARCH_CASES if c != "gpt2" and c not in MLA_CASES]  # the engine refuses both (test_refusals)


def _run(model, backend_or_cache, ids, pos, index):
    """One chunk through either the native backend or the PyTorch model over its KVCache."""
    if isinstance(backend_or_cache, NativeBackend):
        return backend_or_cache.forward(ids, pos, index).clone()
    with torch.no_grad():
        return model(ids, pos, backend_or_cache.for_batch(ids.shape[0]), logit_index=index)


@pytest.mark.parametrize("case", NATIVE_CASES)
@pytest.mark.parametrize("bits,symmetric", [(4, True), (8, False), (0, None)])
def test_engine_equals_the_pytorch_decoder(case, bits, symmetric, hf_checkpoint, monkeypatch):
    path, _ = hf_checkpoint(case)
    model = load_decoder(path, dtype="float32")
    if bits:
        quantize_decoder(model, bits, 32, lm_head=True, accuracy_level=4, symmetric=symmetric)
    _equals_the_decoder(case, path, model, bits, monkeypatch)


@pytest.mark.parametrize("build", list(BUILDS))
def test_each_build_runs_the_whole_engine_as_the_pytorch_decoder(build, hf_checkpoint, monkeypatch):
    """Not only the linears: the norms, rotary, softmax, softcaps, window and GELU of gemma2 as each build compiles
    them (portable C is what ARM and Jetson CPUs run), at int4 and in float32."""
    path, _ = hf_checkpoint("gemma2")
    for bits in (4, 0):
        model = load_decoder(path, dtype="float32")
        if bits:
            quantize_decoder(model, bits, 32, lm_head=True, accuracy_level=4, symmetric=True)
        _equals_the_decoder("gemma2", path, model, bits, monkeypatch, flags=BUILDS[build])
        monkeypatch.undo()


@pytest.mark.parametrize("case", ["llama-gqa2-bias"])
def test_engine_runs_affine_blocks_as_the_pytorch_decoder(case, hf_checkpoint, monkeypatch):
    """Every projection and the lm_head as GGUF Q4_1-style affine blocks (float16 d and m, groups of 32;
    biases kept): the engine's logits and caches equal the PyTorch Decoder's over the same blocks."""
    path, _ = hf_checkpoint(case)
    model = load_decoder(path, dtype="float32")
    g = torch.Generator().manual_seed(1)
    for blk in model.layers:
        for name in ("qkv", "o", "up", "down"):
            setattr(blk, name, affine_linear(getattr(blk, name), 4, 32, g))
    model.lm_head = affine_linear(lm_head_linear(model), 4, 32, g)
    _equals_the_decoder(case, path, model, 4, monkeypatch)


@pytest.mark.parametrize("case", ["llama-gqa2-bias", "gemma2"])
def test_int16_activations_are_the_pytorch_decoders_float_ones(case, hf_checkpoint, monkeypatch):
    """activations="int16": the quantized engine against the PyTorch Decoder over the same integers with float
    activations, no rounding emulated, within the float32 engine's own tolerance scaled by 100 (int8
    activations miss it by far: the check below)."""
    path, _ = hf_checkpoint(case)
    model = load_decoder(path, dtype="float32")
    quantize_decoder(model, 4, 32, lm_head=True, accuracy_level=4, symmetric=True)
    _equals_the_decoder(case, path, model, 0, monkeypatch, activations="int16", rel=1e-3)
    with pytest.raises(AssertionError, match="logits"):
        _equals_the_decoder(case, path, model, 0, monkeypatch, activations="int8", rel=1e-3)


def _equals_the_decoder(case, path, model, bits, monkeypatch, activations="int8", rel=None, flags=FLAGS):
    """The engine over `model` (bits 0: the reference does not round activations) against the PyTorch Decoder: a
    ragged prefill of 3 rows, then 4 decode steps; logits and caches."""
    native = NativeBackend(path, max_batch=3, max_seq_len=MAX_SEQ, threads=2, model=model, activations=activations,
                           flags=flags)
    assert native.kernels == KERNELS[native.dll.kv_simd()]
    assert any(lin.mins for ly in native._layers for lin in (ly.qkv, ly.o)) == any(
        getattr(blk.qkv, "mins", None) is not None for blk in model.layers)
    cache = KVCache.allocate(model.cfg, 3, MAX_SEQ, dtype=torch.float32)
    if bits:  # the reference rounds its projections' inputs as the engine does
        forward = QuantLinear.forward
        monkeypatch.setattr(QuantLinear, "forward", lambda self, x: forward(self, fake_quant(x)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (3, 9), generator=g)
    pos = torch.arange(9).expand(3, -1).contiguous()
    last = torch.tensor([8, 5, 2])  # ragged rows: their own last tokens
    steps = [(ids, pos, last)]
    for i in range(4):
        steps.append((torch.randint(3, model.cfg.vocab_size, (3, 1), generator=g), (last + 1 + i)[:, None],
                      torch.zeros(3, dtype=torch.long)))
    for ids_, pos_, idx in steps:
        got, want = _run(model, native, ids_, pos_, idx), _run(model, cache, ids_, pos_, idx)
        # float32: rounding only. Quantized: a activation that lands within float error of a rounding
        # boundary rounds the other way in one of the two, moving a logit by one int8 step (< 2% of its scale)
        tol = rel or (1e-5 if not bits else 2e-2)
        assert (got - want).abs().max() <= tol * want.abs().max(), f"{case}: logits"
        cosine = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1)).min()
        assert cosine > 1 - (1e-6 if not bits else 1e-3)
    for mine, ref in zip(native.caches[0::2] + native.caches[1::2], cache.keys + cache.values):
        torch.testing.assert_close(mine, ref, rtol=0, atol=(tol if not bits else 0.1) * float(ref.abs().max()))


def test_float32_greedy_tokens_and_chunked_prefill_equal_torch(hf_checkpoint):
    path, _ = hf_checkpoint("llama-gqa4-llama3rope")
    native = load(path, backend="native", quantize=None, max_batch=3, max_seq_len=MAX_SEQ, threads=2)
    ref = load(path, backend="torch", max_batch=3, max_seq_len=MAX_SEQ, device="cpu")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (5, 17, 11)]
    a = native.generate(prompts, max_new_tokens=12, eos_token_id=None)
    b = ref.generate(prompts, max_new_tokens=12, eos_token_id=None)
    c = Session(native.backend, chunk_size=4).generate(prompts, max_new_tokens=12, eos_token_id=None)
    assert a.tokens == b.tokens == c.tokens


def test_default_int4_load_generates_and_its_first_token_is_float32s(hf_checkpoint):
    """The default (int4, symmetric, lm_head too) through kvedge.load on a random tiny model: a smoke check of
    that path, not a quality claim (the numerics are the tests above)."""
    path, _ = hf_checkpoint("llama-gqa2-bias")
    prompt = list(range(3, 40))
    a = load(path, backend="native", max_seq_len=MAX_SEQ).generate([prompt], max_new_tokens=8, eos_token_id=None)
    b = load(path, backend="torch", max_batch=1, max_seq_len=MAX_SEQ).generate([prompt], max_new_tokens=8,
                                                                               eos_token_id=None)
    assert len(a.tokens[0]) == 8 and a.tokens[0][0] == b.tokens[0][0]


def test_refusals(hf_checkpoint):
    with pytest.raises(KvedgeError, match="layer norms"):
        NativeBackend(hf_checkpoint("gpt2")[0])
    with pytest.raises(KvedgeError, match=r"cannot run this deepseek_v2 model: multi-head latent attention \(MLA.*use "
                                          r"the onnxruntime or torch backend"):
        NativeBackend(hf_checkpoint("deepseek_v2-mla")[0])
    path, _ = hf_checkpoint("llama-mha")
    with pytest.raises(KvedgeError, match="quantize 'int3'"):
        NativeBackend(path, quantize="int3")
    b = NativeBackend(path, max_batch=1, max_seq_len=16)
    with pytest.raises(KvedgeError, match="outside the cache"):
        b.forward(torch.tensor([[5]]), torch.tensor([[16]]), torch.tensor([0]))
    for bad in (-1, b.cfg.vocab_size):  # the engine would read past its embedding
        with pytest.raises(KvedgeError, match=rf"token ids {bad}\.\.{bad} are outside the vocabulary"):
            b.forward(torch.tensor([[bad]]), torch.tensor([[0]]), torch.tensor([0]))
    with pytest.raises(KvedgeError, match="exceeds max_batch"):
        b.forward(torch.tensor([[5], [6]]), torch.tensor([[0], [0]]), torch.tensor([0, 0]))


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    from kvedge.errors import MissingDependencyError

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(MissingDependencyError, match="C compiler"):
        compile_engine(cache_dir=tmp_path)


def test_bench_runs_the_native_backend_quantized_as_the_export_was(exported, hf_checkpoint, tmp_path):
    from kvedge.cli import main
    from kvedge.runtime import BACKENDS, LoadOptions

    case = "llama-gqa2-bias"
    out, _ = exported(case, "ort", quantize="int4", symmetric=True, quantize_lm_head=True, group_size=32,
                      allow_degraded=True)  # random tiny weights: int4 is far from fp32, speed only
    be = BACKENDS["native"].open(hf_checkpoint(case)[0], LoadOptions(threads=2, max_seq_len=MAX_SEQ, max_batch=1),
                                 export=out)
    # the engine holds the export's MatMulNBits integers and scales, linear by linear, in its own layout
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(out / "model.onnx").graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    exported_linears = {tiles_of(inits[n.input[1]], _attr(n, "N"), _attr(n, "K")): inits[n.input[2]]
                        for n in graph.node if n.op_type == "MatMulNBits"}
    mine = [getattr(ly, n) for ly in be._layers for n in ("qkv", "o", "up", "down")] + [be.m.lm_head]
    assert len(exported_linears) == len(mine)
    for lin in mine:
        assert lin.bits == 4 and lin.sym == 1 and not lin.w
        scales = exported_linears.get(ctypes.string_at(lin.q, (lin.n + 7) // 8 * 8 * lin.k // 2))
        assert scales is not None, "a linear whose integers the export does not hold"
        np_, nsb = (lin.n + 7) // 8 * 8, lin.k // 32  # figures [tile][sub-block][8 rows] (groups of 32 here)
        held = np.frombuffer(ctypes.string_at(lin.s, np_ * nsb * 2), np.float16).reshape(np_ // 8, nsb, 8)
        assert np.array_equal(held.transpose(0, 2, 1).reshape(np_, nsb)[:lin.n].astype(np.float32),
                              scales.reshape(lin.n, nsb).astype(np.float32))
    report = tmp_path / "report"
    assert main(["bench", str(out), "--backend", "onnxruntime,native", "--prompt-lens", "8", "--gen-len", "4",
                 "--repeat", "1", "--warmup", "0", "-o", str(report), "--quiet"]) == 0
    import json

    rows = {r["backend"]: r for r in json.loads((report / "bench.json").read_text())["results"]}
    assert rows["native"]["kv_formula_bytes"] == rows["native"]["kv_allocated_bytes"]
    # int4 weights + an fp32 scale per 32 are well under the float32 checkpoint's bytes
    fp32 = sum(p.numel() * 4 for p in load_decoder(hf_checkpoint(case)[0]).parameters())
    assert 0 < rows["native"]["weights_bytes"] < fp32


def tiles_of(q: np.ndarray, n: int, k: int) -> bytes:
    """The engine's 4-bit tiles written with numpy from MatMulNBits bytes [n][k / 2] (element 2i in byte i's low
    nibble, 2i + 1 in its high one), as docs/native.md lays them out: tile t, sub-block sb, vector v, lane r holds
    row 8t + r's channels 32 sb + 8 v + b (low nibbles, b < 4) and 32 sb + 8 v + 4 + b (high ones); rows past n
    are zero."""
    b = q.reshape(n, k // 2)
    w = np.empty((n, k), np.uint8)
    w[:, 0::2], w[:, 1::2] = b & 15, b >> 4
    w = np.pad(w, ((0, -n % 8), (0, 0))).reshape(-1, 8, k // 32, 4, 2, 4)  # t, r, sb, v, low / high, b
    w = w.transpose(0, 2, 3, 1, 5, 4)  # t, sb, v, r, b, low / high
    return (w[..., 0] | w[..., 1] << 4).tobytes()


def _attr(node, name: str) -> int:
    return next(a.i for a in node.attribute if a.name == name)


@pytest.mark.parametrize("threads", [1, 3])
def test_odd_thread_counts_and_wide_batches_split_the_work_correctly(hf_checkpoint, threads):
    """3 threads on 2 cores, and a batch of 5 whose decode steps take the split (not replicated) path; and a team
    of one, which takes every chunk of each projection's pooled units itself (the pool starts again each time)."""
    path, _ = hf_checkpoint("qwen2-bias")
    native = load(path, backend="native", quantize=None, max_batch=5, max_seq_len=MAX_SEQ, threads=threads)
    ref = load(path, backend="torch", max_batch=5, max_seq_len=MAX_SEQ, device="cpu")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (3, 9, 14, 6, 1)]
    a = native.generate(prompts, max_new_tokens=10, eos_token_id=None)
    b = ref.generate(prompts, max_new_tokens=10, eos_token_id=None)
    assert a.tokens == b.tokens


def test_the_engine_on_another_thread_computes_as_on_the_main_one(hf_checkpoint):
    """kvedge serve runs the engine on its scheduler thread while the main thread keeps the OpenMP team torch made
    there; the engine's team then synchronizes with its own barrier (kvedge_cpu.c: sync_team, not libgomp's, which
    sleeps in the kernel at once when a process's OpenMP threads outnumber the cores). A prefill of two rows and
    decode steps give the same logits, bitwise, on a worker thread as on the main one, on 2 and 3 threads."""
    import threading

    path, _ = hf_checkpoint("qwen2-bias")
    torch.ones(1 << 20).sum()  # torch's own team on the main thread
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 160, (2, 9), generator=g)
    steps = [(ids, torch.arange(9).expand(2, -1).contiguous(), torch.tensor([8, 5]))]
    steps += [(torch.randint(3, 160, (2, 1), generator=g), torch.tensor([[9 + i], [6 + i]]),
               torch.zeros(2, dtype=torch.long)) for i in range(3)]
    for threads in (2, 3):
        native = NativeBackend(path, max_batch=2, max_seq_len=MAX_SEQ, threads=threads, quantize="int4")

        def run(out):
            native.reset()
            out += [native.forward(*step).clone() for step in steps]

        on_main, on_worker = [], []
        run(on_main)
        worker = threading.Thread(target=run, args=(on_worker,))
        worker.start()
        worker.join()
        assert len(on_worker) == len(steps)
        assert all(torch.equal(a, b) for a, b in zip(on_worker, on_main))


def decode_slices(native, pos: torch.Tensor) -> tuple[int, ...]:
    """Per layer, the slices the engine's decode cuts each attention item in for rows at positions pos [B, 1] on
    its threads: kv_decode_slices, the count kv_forward itself takes (1: the item whole, no merge). It is asked
    with the threads asked for; kv_forward passes the team OpenMP gave it, the same unless OMP_DYNAMIC is set
    (off by default), so this pins the decision, not what a run did."""
    pos = pos.to(torch.int64).contiguous()
    return tuple(native.dll.kv_decode_slices(ctypes.byref(native.m), li, pos.shape[0], pos.data_ptr(), native.threads)
                 for li in range(native.cfg.num_layers))


def _ragged_prefill_then_decode(model, native, cache, g, length, lasts, steps, slices):
    """A prefill of `length` tokens in each of the cache's rows, row b's logits taken at lasts[b] (its
    decode continues from there), then `steps` decode steps, each of which cuts layer i's attention items in
    slices[i] slices: float32 logits of the engine and of the PyTorch model over `cache` agree to 1e-5 of the
    largest at every step."""
    batch = native.caches[0].shape[0]
    last = torch.tensor(lasts)[:batch]
    ids = torch.randint(3, model.cfg.vocab_size, (batch, length), generator=g)
    chunks = [(ids, torch.arange(length).expand(batch, -1).contiguous(), last)]
    for i in range(steps):
        chunks.append((torch.randint(3, model.cfg.vocab_size, (batch, 1), generator=g), (last + 1 + i)[:, None],
                       torch.zeros(batch, dtype=torch.long)))
    for ids_, pos_, idx in chunks:
        if ids_.shape[1] == 1:
            assert decode_slices(native, pos_) == slices, f"decode at positions {pos_.flatten().tolist()}"
        got, want = _run(model, native, ids_, pos_, idx), _run(model, cache, ids_, pos_, idx)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


# A build whose decode slices a KV head's slots from 8 on (SLICE_MIN 4; by default 128 slots), to test the
# slices and their merge on the tests' short caches. The default build's tests here decode whole items.
SLICED = FLAGS + ("-DSLICE_MIN=4",)


@pytest.mark.parametrize("case,threads,batch,flags,lasts,slices", [
    ("llama-gqa4-llama3rope", 2, 1, FLAGS, [49], (1, 1)), ("llama-mqa-linearrope", 3, 2, FLAGS, [49, 33], (1, 1)),
    ("gemma", 2, 1, FLAGS, [49], (1, 1)), ("gemma2", 3, 2, FLAGS, [49, 33], (1, 1, 1)),
    ("llama-mha", 2, 2, FLAGS, [49, 33], (1, 1)), ("gemma", 2, 1, SLICED, [49], (2, 2)),
    ("gemma2", 3, 2, SLICED, [49, 0], (2, 3, 2)), ("llama-mha", 3, 2, SLICED, [49, 33], (3, 3))])
def test_long_ragged_decode_equals_torch(case, threads, batch, flags, lasts, slices, hf_checkpoint):
    """Decode past 32 cached positions (many 2-key blocks, a partial last one), on 2 and 3 threads, one row or
    two ragged ones: float32 logits and caches equal the PyTorch model's. GQA 4, MQA with 8 query heads (2
    blocks of 4), MQA with 4, gemma2 (windowed and global layers, soft-capped scores), MHA. Sliced: gemma's
    one KV head in 2 slices on 2 threads; gemma2's 4 items in 3 slices each, windows of 8 (layers 0 and 2) in 2,
    and a row one token long, whose first decode steps leave a slice empty; MHA's 16 items in 3."""
    path, _ = hf_checkpoint(case)
    model = load_decoder(path, dtype="float32")
    native = NativeBackend(path, max_batch=batch, max_seq_len=MAX_SEQ, threads=threads, model=model, flags=flags)
    cache = KVCache.allocate(model.cfg, batch, MAX_SEQ, dtype=torch.float32)
    _ragged_prefill_then_decode(model, native, cache, torch.Generator().manual_seed(7), 50, lasts, 5, slices)
    for mine, ref in zip(native.caches[0::2] + native.caches[1::2], cache.keys + cache.values):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def _heads_of_64(path) -> Path:
    """A checkpoint with SmolLM2's head shape: heads of 64 channels, 3 query heads per KV head."""
    from tests.conftest import save_hf_model

    save_hf_model(path, "llama", hidden_size=96, head_dim=64, num_attention_heads=6, num_key_value_heads=2)
    return path


@pytest.mark.parametrize("threads,flags,slices", [(2, FLAGS, (1, 1)), (3, SLICED, (3, 3))])
def test_decode_with_heads_of_64_channels_equals_torch(threads, flags, slices, tmp_path):
    """Heads of 64 channels in groups of 3 query heads, SmolLM2's shape (the tests' other cases have at most 32
    channels: the engine sums V 64 channels at a time only when a head has a multiple of 64): prefill of two
    ragged rows, then decode, whole and in 3 slices, equals the PyTorch model to 1e-5 of the largest logit."""
    model = load_decoder(_heads_of_64(tmp_path), dtype="float32")
    native = NativeBackend(tmp_path, max_batch=2, max_seq_len=MAX_SEQ, threads=threads, model=model, flags=flags)
    cache = KVCache.allocate(model.cfg, 2, MAX_SEQ, dtype=torch.float32)
    _ragged_prefill_then_decode(model, native, cache, torch.Generator().manual_seed(3), 50, [49, 33], 5, slices)


@pytest.mark.parametrize("build", list(BUILDS))
def test_float16_cache_equals_the_torch_backends(build, tmp_path):
    """kv_dtype="fp16" (K and V rounded to float16 as they are written, read as float32) on each build, heads of
    64 channels and a GQA group of 3: a prefill of two ragged rows and decode steps give the logits of the torch
    backend over its float16 cache (within 1e-4 of the largest), whose difference from float32 caches is
    far larger; the caches hold the same float16 values (up to one unit in the last place, where a float32 k
    or v computed in another order sat next to a rounding boundary, and 1e-4 of the largest: such a flip in one
    layer's cache moves the next layers' k and v)."""
    from kvedge.runtime.torch_backend import TorchBackend

    native = NativeBackend(_heads_of_64(tmp_path), max_batch=2, max_seq_len=MAX_SEQ, threads=2, quantize=None, kv_dtype="fp16",
                           flags=BUILDS[build])
    ref, full = (TorchBackend(tmp_path, max_batch=2, max_seq_len=MAX_SEQ, dtype="fp32", kv_dtype=kv)
                 for kv in ("fp16", None))
    g = torch.Generator().manual_seed(5)
    ids, pos, idx = torch.randint(3, 160, (2, 40), generator=g), torch.arange(40).repeat(2, 1), torch.tensor([39, 25])
    worst = apart = 0.0
    for step in range(6):  # row 1 decodes from position 26 on, over the rest of its prompt's slots
        got, want, f32 = (be.forward(ids, pos, idx).clone() for be in (native, ref, full))
        worst, apart = max(worst, float((got - want).abs().max() / want.abs().max())), \
            max(apart, float((f32 - want).abs().max() / want.abs().max()))
        pos = (pos.gather(1, idx[:, None]) if step == 0 else pos) + 1
        ids, idx = torch.randint(3, 160, (2, 1), generator=g), torch.zeros(2, dtype=torch.long)
    assert worst <= 1e-4 < 5 * worst < apart
    for mine, theirs in zip(native.caches[0::2] + native.caches[1::2], ref.cache.keys + ref.cache.values):
        assert mine.dtype == theirs.dtype == torch.float16
        near = torch.finfo(torch.float16).eps * theirs.float().abs() + 1e-4 * theirs.float().abs().max()
        assert bool(((mine.float() - theirs.float()).abs() <= near).all())


def test_longrope_switches_tables_per_call_as_the_pytorch_decoder(hf_checkpoint):
    """longrope: short frequencies until a call reaches original_max_position_embeddings (16), long ones from
    there, short again for a new prompt: the engine swaps its tables per call as Decoder.forward does."""
    path, _ = hf_checkpoint("phi3-longrope")
    model = load_decoder(path, dtype="float32")
    native = NativeBackend(path, max_batch=1, max_seq_len=MAX_SEQ, threads=2, model=model)
    cache = KVCache.allocate(model.cfg, 1, MAX_SEQ, dtype=torch.float32)
    g = torch.Generator().manual_seed(8)
    for prompt, steps in ((10, 10), (8, 2), (20, 2)):  # crossing in decode; short again; long from the prompt on
        chunks = [(torch.randint(3, model.cfg.vocab_size, (1, prompt), generator=g), torch.arange(prompt)[None],
                   torch.tensor([prompt - 1]))]
        chunks += [(torch.randint(3, model.cfg.vocab_size, (1, 1), generator=g), torch.tensor([[prompt + i]]),
                    torch.zeros(1, dtype=torch.long)) for i in range(steps)]
        for ids, pos, idx in chunks:
            got, want = _run(model, native, ids, pos, idx), _run(model, cache, ids, pos, idx)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), f"prompt {prompt}, position {int(pos[0, -1])}"


@pytest.mark.parametrize("case", ["awq", "gptq", "gptq-8bit"])
def test_prequantized_checkpoints_run_as_they_are(case, tmp_path, monkeypatch):
    """An AWQ / GPTQ checkpoint (its float16 scales, packed integers and zero points, written by the
    packers in tests/models/test_prequant.py) runs on the engine without re-quantizing: its logits and
    caches equal the PyTorch Decoder's over the same integers with the same activation rounding."""
    from tests.models.test_prequant import write_quantized

    write_quantized(tmp_path, case)
    native = NativeBackend(tmp_path, max_batch=2, max_seq_len=MAX_SEQ, threads=2)
    model = load_decoder(tmp_path, dtype="float32")  # the same integers: the engine's reference
    assert model.prequantized and all(isinstance(getattr(blk, "qkv"), QuantLinear) for blk in model.layers)
    cache = KVCache.allocate(model.cfg, 2, MAX_SEQ, dtype=torch.float32)
    forward = QuantLinear.forward
    monkeypatch.setattr(QuantLinear, "forward", lambda self, x: forward(self, fake_quant(x)))
    g = torch.Generator().manual_seed(2)
    steps = [(torch.randint(3, 160, (2, 7), generator=g), torch.arange(7).expand(2, -1).contiguous(),
              torch.tensor([6, 3]))]
    for i in range(3):
        steps.append((torch.randint(3, 160, (2, 1), generator=g), torch.tensor([[7 + i], [4 + i]]),
                      torch.zeros(2, dtype=torch.long)))
    for ids, pos, idx in steps:
        got, want = _run(model, native, ids, pos, idx), _run(model, cache, ids, pos, idx)
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), case
        assert torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1)).min() > 1 - 1e-3


@pytest.mark.parametrize("case,threads,batch,flags,slices", [
    ("llama-gqa4-llama3rope", 2, 1, FLAGS, (1, 1)), ("gemma2", 3, 2, FLAGS, (1, 1, 1)),
    ("qwen3-qknorm", 2, 2, FLAGS, (1, 1)), ("llama-mqa-linearrope", 2, 2, FLAGS, (1, 1)),
    ("gemma2", 3, 2, SLICED, (2, 3, 2))])
def test_int8_cache_equals_the_reference_int8_cache(case, threads, batch, flags, slices, hf_checkpoint):
    """kv_dtype="int8": the engine writes the same int8 cache bytes as the reference op
    (kvedge.models.attention: round-half-even(x * (1 / scale)), clamped) and its float32 logits equal the
    PyTorch Decoder's over an int8 cache with the same calibrated scales, through prefill of ragged rows
    (many 4-query blocks of one KV head on a thread) and decode past 32 positions; windows and softcaps in
    gemma2, q/k norms in qwen3, MQA with 8 query heads; gemma2 again with decode's slices (SLICED), each
    dequantizing its own rows."""
    from kvedge.runtime.calibration import calibrate_kv_scales

    path, _ = hf_checkpoint(case)
    model = load_decoder(path, dtype="float32")
    g = torch.Generator().manual_seed(11)
    scales = calibrate_kv_scales(model, torch.randint(3, model.cfg.vocab_size, (2, 24), generator=g), margin=1.0)
    native = NativeBackend(path, max_batch=batch, max_seq_len=MAX_SEQ, threads=threads, model=model,
                           kv_dtype="int8", kv_scales=scales, flags=flags)
    cache = KVCache.allocate(model.cfg, batch, MAX_SEQ, dtype=torch.int8, scales=scales)
    _ragged_prefill_then_decode(model, native, cache, g, 40, [39, 21], 4, slices)  # margin 1.0: some clamp at +-127
    for mine, ref in zip(native.caches[0::2] + native.caches[1::2], cache.keys + cache.values):
        assert mine.dtype == torch.int8 and torch.equal(mine, ref)


def test_int8_cache_calibrates_itself_and_is_a_quarter_of_float32(hf_checkpoint):
    path, _ = hf_checkpoint("llama-gqa2-bias")
    a = load(path, backend="native", quantize="int8", max_seq_len=MAX_SEQ, kv_dtype="int8")
    b = load(path, backend="native", quantize="int8", max_seq_len=MAX_SEQ)
    assert a.backend.kv_scales is not None
    size = lambda s: sum(t.numel() * t.element_size() for t in s.backend.caches)  # noqa: E731
    assert 4 * size(a) == size(b)
    out = a.generate([list(range(3, 20))], max_new_tokens=6, eos_token_id=None)
    assert len(out.tokens[0]) == 6
    with pytest.raises(KvedgeError, match="fp32, fp16 or int8"):
        NativeBackend(path, max_seq_len=MAX_SEQ, kv_dtype="fp8")
