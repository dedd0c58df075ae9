"""The native CPU backend: kvedge's own C engine (kvedge/runtime/native/kvedge_cpu.c) for weight-only
INT4/INT8 decoders, compiled at first use with the system C compiler and driven through ctypes.

Why it exists: at int4 a decode step of a small model is dominated by per-node overhead in a graph
runtime, not by the weights it reads; this engine runs a whole step as one call with one thread team.
It runs the one model definition: the checkpoint is loaded with kvedge's loader and quantized by
kvedge.models.quant (round to nearest) or taken as it is (a pre-quantized AWQ / GPTQ checkpoint), and
the engine reads those same MatMulNBits bytes in place (a GGUF file's blocks too). Projections compute with
int8 activations per 32 input channels (ONNX Runtime's accuracy_level 4 scheme, and llama.cpp's), or int16
ones (activations="int16": within float rounding of the torch model); norms, RoPE, attention and the cache
are float32 (or a float16 cache, kv_dtype="fp16", or an int8 one, kv_dtype="int8"). Caches are torch tensors
[max_batch, kv_heads, max_seq_len, head_dim], allocated once and written in place by the engine.

Supported: RMSNorm decoders with rotary positions (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3, phi3,
granite, olmo2, smollm3: layers without RoPE or with their own RoPE base, norms before and / or after each sublayer).
Refused with a reason: LayerNorm / learned positions (gpt2), a cache other than float32, float16 or int8.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvedge.errors import KvedgeError, MissingDependencyError
from kvedge.models import is_checkpoint, load_config, load_decoder, rope
from kvedge.models.quant import QUANT_BITS, QuantLinear, lm_head_linear, quantize_decoder, unpack_zeros
from kvedge.runtime.backend import CacheList, check_rows, int64_inputs

SOURCE = Path(__file__).with_name("native") / "kvedge_cpu.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
KERNELS = {0: "portable C", 1: "AVX2", 2: "AVX-VNNI", 3: "AVX512-VNNI", 4: "NEON", 5: "NEON dotprod",
           6: "NEON dotprod i8mm"}  # kv_simd()
ACTIVATIONS = {"int8": 1, "int16": 2}  # a quantized projection's input: int8, or int16 as two int8 planes


class Linear(ctypes.Structure):
    _c_struct_ = "kv_linear"  # the C struct this mirrors, field for field (check_layout)
    _fields_ = [("n", ctypes.c_int32), ("k", ctypes.c_int32), ("bits", ctypes.c_int32), ("sym", ctypes.c_int32),
                ("zsym", ctypes.c_float), ("q", ctypes.c_void_p), ("s", ctypes.c_void_p), ("z", ctypes.c_void_p),
                ("mins", ctypes.c_void_p), ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("planes", ctypes.c_int32),
                ("s32", ctypes.c_void_p), ("mins32", ctypes.c_void_p), ("sc16", ctypes.c_void_p),
                ("ksc", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _c_struct_ = "kv_layer"
    _fields_ = [(n, ctypes.c_void_p) for n in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm",
                                              "post_mlp_norm")] + \
               [(n, Linear) for n in ("qkv", "o", "up", "down")] + \
               [("window", ctypes.c_int32)] + \
               [(n, ctypes.c_void_p) for n in ("k_cache", "v_cache", "k_scale", "v_scale", "k_inv", "v_inv", "cos",
                                              "sin")] + \
               [("qkv_tail", Linear)]


class Model(ctypes.Structure):
    _c_struct_ = "kv_model"
    _fields_ = [(n, ctypes.c_int32) for n in ("vocab", "hidden", "n_layers", "hq", "hkv", "d", "inter", "rot_half",
                                              "glu", "act", "unit_offset", "max_batch", "max_seq", "qk_norm_all",
                                              "kv_half")] + \
               [(n, ctypes.c_float) for n in ("eps", "attn_scale", "attn_softcap", "final_softcap", "embed_scale",
                                              "residual_scale", "logits_divisor")] + \
               [("embed", Linear), ("final_norm", ctypes.c_void_p), ("lm_head", Linear),
                ("layers", ctypes.POINTER(Layer))]


def check_layout(dll: ctypes.CDLL, structs: tuple[type[ctypes.Structure], ...] = (Linear, Layer, Model)) -> None:
    """Raise KvedgeError unless each ctypes struct lays out as the C struct it mirrors (named by _c_struct_):
    the same size, and every field, by name, at the same offset with the same size (the engine's kv_layout)."""
    dll.kv_layout.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
    dll.kv_layout.restype = ctypes.c_char_p
    c, at = {}, (ctypes.c_size_t * 2)()  # "kv_linear" -> (0, sizeof), "kv_linear.n" -> (offsetof, sizeof)
    while (name := dll.kv_layout(len(c), at)) is not None:
        c[name.decode()] = (at[0], at[1])
    bad, none = [], ("none", "none")  # none: a field one side lacks
    for st in structs:
        cs = st._c_struct_
        py = {cs: (0, ctypes.sizeof(st))} | {f"{cs}.{f}": (getattr(st, f).offset, getattr(st, f).size)
                                             for f, *_ in st._fields_}
        whats = []
        for key in [*py, *(k for k in c if k.startswith(cs + ".") and k not in py)]:
            (co, csz), (po, psz) = c.get(key, none), py.get(key, none)
            if key == cs and csz != psz:
                whats.append(f"in size: C {csz}, ctypes {psz}")
            elif key != cs and (co, csz) != (po, psz):
                whats.append(f"at field {key[len(cs) + 1:]}: " + (f"C offset {co}, ctypes {po}" if co != po else
                                                                   f"C size {csz}, ctypes {psz}"))
        if whats:
            bad.append(f"the native engine's C struct {cs} and its ctypes mirror {st.__name__} disagree "
                       + "; ".join(whats))
    if bad:
        raise KvedgeError("; ".join(bad) + f" (kvedge/runtime/native_backend.py must mirror {SOURCE.name})")


def _cpuinfo(*keys: str) -> set[str]:
    """/proc/cpuinfo's lines that start with these keys (x86 `flags`, aarch64 `Features`, ...); empty elsewhere."""
    try:
        return {ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(keys)}
    except OSError:
        return set()


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a cache shared between machines
    must not hand one CPU's build to another)."""
    lines = _cpuinfo("model name", "flags", "Features", "CPU part")
    return "".join(sorted(lines)) if lines else platform.machine() + platform.processor()


def cpu_features() -> set[str]:
    """The CPU's feature names as /proc/cpuinfo lists them (x86 `flags`, aarch64 `Features`); empty elsewhere."""
    return {f for ln in _cpuinfo("flags", "Features") for f in ln.split(":", 1)[1].split()}


def expected_kernels(features: set[str] | None = None, machine: str | None = None) -> int:
    """The kernels (kv_simd's number, KERNELS) a -march=native build runs on a CPU with these features: x86's
    AVX2 + FMA + F16C, then AVX-VNNI or AVX512-VNNI; aarch64's NEON, then the dot product (`asimddp`: Cortex-A76,
    A78AE) and i8mm (the Linux hwcap names, arch/arm64/kernel/cpuinfo.c)."""
    f = cpu_features() if features is None else features
    machine = machine or platform.machine()
    if machine in ("aarch64", "arm64"):
        return 4 + ("asimddp" in f) + ("asimddp" in f and "i8mm" in f)
    if not {"avx2", "fma", "f16c"} <= f:
        return 0
    return 3 if {"avx512_vnni", "avx512vl"} <= f else 2 if "avx_vnni" in f else 1


def arm_march(features: set[str]) -> str:
    """-march for an aarch64 CPU with these features where -march=native is not taken (an older compiler, a cross
    build): ARMv8.2's dot product and i8mm where the CPU has them, else plain ARMv8 (NEON is part of it)."""
    if "asimddp" not in features:
        return "-march=armv8-a"
    return "-march=armv8.2-a+dotprod" + ("+i8mm" if "i8mm" in features else "")


def c_compiler() -> str | None:
    """The compiler the engine is built with: $CC when set (and found), else cc or gcc on PATH."""
    want = os.environ.get("CC")
    return shutil.which(want) if want else (shutil.which("cc") or shutil.which("gcc"))


def engine_sources() -> list[Path]:
    """Every file the engine is built from (kvedge_cpu.c and the headers it includes): the compile cache's key."""
    return [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]


def compile_engine(flags: tuple[str, ...] = FLAGS, cache_dir: str | Path | None = None) -> ctypes.CDLL:
    """Compile kvedge_cpu.c (once per source, compiler and flags; cached) and load it."""
    want, cc = os.environ.get("CC"), c_compiler()
    if cc is None:
        raise MissingDependencyError(f"the native backend compiles its C engine at first use and needs a C compiler "
                                     f"with OpenMP ({f'CC={want} is not found' if want else 'no cc or gcc on PATH'}): "
                                     f"e.g. apt install gcc, or set CC")
    src = b"".join(f.read_bytes() for f in engine_sources())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(src + " ".join((cc, version, _cpu(), *flags)).encode()).hexdigest()[:16]
    root = Path(cache_dir or os.environ.get("KVEDGE_CACHE") or Path.home() / ".cache" / "kvedge") / "native"
    lib = root / f"kvedge_cpu-{key}.so"
    if not lib.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        print(f"kvedge: compiling the native engine ({cc} {' '.join(flags)})", file=sys.stderr)
        def run(flags):
            return subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True)

        r = run(flags)
        if r.returncode and "-march=native" in flags and platform.machine() in ("aarch64", "arm64"):
            flags = tuple(arm_march(cpu_features()) if f == "-march=native" else f for f in flags)
            print(f"kvedge: {cc} does not build -march=native here; building with {' '.join(flags)}", file=sys.stderr)
            r = run(flags)
        if r.returncode:
            raise KvedgeError(f"compiling {SOURCE.name} failed ({cc} {' '.join(flags)}):\n{r.stderr[-2000:]}")
        tmp.replace(lib)  # atomic: concurrent first uses each compile, one file wins
    dll = ctypes.CDLL(str(lib))
    check_layout(dll)
    dll.kv_figures.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    dll.kv_figures.restype = ctypes.c_size_t
    dll.kv_record_bytes.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    dll.kv_record_bytes.restype = ctypes.c_size_t
    dll.kv_pack_tiles.argtypes = [ctypes.POINTER(Linear), ctypes.c_void_p, ctypes.c_void_p]
    dll.kv_pack.argtypes = [ctypes.POINTER(Linear), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    dll.kv_pack_mins.argtypes = [ctypes.POINTER(Linear), ctypes.c_void_p, ctypes.c_int]
    dll.kv_pack_affine32.argtypes = [ctypes.POINTER(Linear), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    dll.kv_linear_forward.argtypes = [ctypes.POINTER(Linear), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int]
    dll.kv_scratch_bytes.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int, ctypes.c_int]
    dll.kv_scratch_bytes.restype = ctypes.c_size_t
    dll.kv_forward.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    dll.kv_forward.restype = None
    dll.kv_pack_gguf.argtypes = [ctypes.POINTER(Linear), ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    dll.kv_weight_rows.argtypes = [ctypes.POINTER(Linear), ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                                   ctypes.c_void_p]
    dll.kv_decode_slices.argtypes = [ctypes.POINTER(Model), ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return dll


class _Keep:
    """Holds every tensor a pointer handed to C refers to, for as long as the engine lives."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        self.tensors.append(t)
        return t.data_ptr()


def pack_linear(dll: ctypes.CDLL, mod: nn.Module, keep: _Keep, activations: str = "int8") -> Linear:
    """A QuantLinear (its MatMulNBits bytes, read in place) or a float nn.Linear as the engine's Linear. An
    affine QuantLinear (`mins`: w = q * scale + min, GGUF's Q4_1) runs with its float16 mins, or with float32
    scales and mins where they are not float16 values (GGUF's Q4_K / Q5_K: d * sc, dmin * m). activations:
    a quantized linear's input precision (ACTIVATIONS)."""
    bias = getattr(mod, "bias", None)
    bias = keep(None if bias is None else bias.detach().float().contiguous())
    if not isinstance(mod, QuantLinear):
        return Linear(n=mod.out_features, k=mod.in_features, bits=32, sym=1,
                      w=keep(mod.weight.detach().float().contiguous()), bias=bias)
    n, k, bits = mod.out_features, mod.in_features, mod.bits
    groups = mod.qweight.shape[1]
    group = k // groups
    if k % 32 or group % 32:
        raise KvedgeError(f"the native engine works on groups that are multiples of 32 channels; this linear has "
                          f"{k} inputs in groups of {group}")
    mins = getattr(mod, "mins", None)
    zeros = None if mins is not None else unpack_zeros(mod.zeros, bits, n, groups).contiguous()
    mid = 2 ** (bits - 1)
    figs = dll.kv_figures(n, k, bits)  # per-sub-block figures, in the engine's order and padding
    if mins is not None and not (_is_half(mod.scales) and _is_half(mins)):
        lin = Linear(n, k, bits, 0, float(mid), _weights(dll, mod, keep), 0, 0, 0, 0, bias,
                     ACTIVATIONS[activations], keep(torch.empty(figs)), keep(torch.empty(figs)))
        if dll.kv_pack_affine32(ctypes.byref(lin), keep(mod.scales.float().contiguous()),
                                keep(mins.float().contiguous()), group):
            raise KvedgeError(f"kv_pack_affine32 refused a {n}x{k} linear in groups of {group}")
        return lin
    sym = mins is None and bool((zeros == mid).all())
    # the engine keeps scales (and an affine block's mins) in 16 bits: kvedge's quantizer, AWQ / GPTQ and GGUF's
    # Q4_0 / Q8_0 / Q4_1 make them float16 values
    half = _half_exact(mod.scales.float().contiguous(), "scales", n, k)
    s = torch.empty(figs, dtype=torch.int16)
    m16 = None if mins is None else mins.float().half().contiguous()  # float16 values: checked above
    z = None if sym or mins is not None else torch.empty(figs, dtype=torch.uint8)
    lin = Linear(n, k, bits, int(sym), float(mid), _weights(dll, mod, keep), keep(s), keep(z),
                 keep(None if m16 is None else torch.empty(figs, dtype=torch.int16)), 0, bias,
                 ACTIVATIONS[activations])
    if dll.kv_pack(ctypes.byref(lin), keep(half.view(torch.int16)), keep(zeros), group) or (
            m16 is not None and dll.kv_pack_mins(ctypes.byref(lin), keep(m16.view(torch.int16)), group)):
        raise KvedgeError(f"kv_pack refused a {n}x{k} linear in groups of {group}")
    return lin


def _weights(dll: ctypes.CDLL, mod: QuantLinear, keep: _Keep) -> int:
    """The engine's copy of a QuantLinear's integers: 8-bit rows are its MatMulNBits bytes, read in place; 4-bit
    ones are rewritten as the engine's tiles of 8 rows (kv_pack_tiles), the same integers in another order."""
    q = mod.qweight.contiguous()
    if mod.bits != 4:
        return keep(q)
    n, k = mod.out_features, mod.in_features
    tiles = torch.empty(dll.kv_figures(n, k, 4) * 16, dtype=torch.uint8)  # 16 bytes a figure (32 channels)
    lin = Linear(n=n, k=k, bits=4)
    if dll.kv_pack_tiles(ctypes.byref(lin), tiles.data_ptr(), q.data_ptr()):
        raise KvedgeError(f"kv_pack_tiles refused a {n}x{k} 4-bit linear")
    return keep(tiles)


def _is_half(v: torch.Tensor) -> bool:
    """Every value of v is a float16 value."""
    return torch.equal(v.float().half().float(), v.float())


def _half_exact(v: torch.Tensor, what: str, n: int, k: int) -> torch.Tensor:
    """v as float16, which the engine keeps; refused unless every value is a float16 value."""
    if not _is_half(v):
        raise KvedgeError(f"the native engine stores {what} as float16 and this {n}x{k} linear has {what} float16 "
                          f"cannot hold exactly; quantize it with kvedge.models.quant (which rounds them up to "
                          f"float16 values)")
    return v.half()


NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
LINEARS = ("qkv", "o", "up", "down")  # qkv first: it may have a tail (_GGUFWeights.linear_parts)
# GGUF block types the engine packs from the file as they are (kv_pack_gguf's codes; Q6_K as its bits-6 format);
# float tensors, and a fused linear whose parts differ in type, run as float32 linears of the file's values
GGUF_TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}


def pack_gguf(dll: ctypes.CDLL, kind: str, rows: np.ndarray, k: int, keep: _Keep, activations: str = "int8",
              threads: int = 1, bias: int = 0, what: str = "a tensor") -> Linear:
    """A linear of GGUF blocks of type kind (a GGUF_TYPES name) packed by kv_pack_gguf into the engine's layout:
    rows [n] uint64 holds the address where each row's blocks start (the rows of k inputs, in the order the
    linear takes them); the blocks are read, never kept."""
    from kvedge.models.gguf import QUANT_TYPES

    bits, _, affine, zero = QUANT_TYPES[kind]
    bits = 6 if kind == "Q6_K" else bits
    n = len(rows)
    figs = dll.kv_figures(n, k, bits)
    # 4-bit and 6-bit tiles: 16 and 24 bytes a figure (32 channels of a row); other types a byte a weight
    lin = Linear(n=n, k=k, bits=bits, sym=int(not affine), zsym=float(zero or 2 ** (bits - 1)), bias=bias,
                 planes=ACTIVATIONS[activations],
                 q=keep(torch.empty({4: 16 * figs, 6: 24 * figs}.get(bits, n * k), dtype=torch.uint8)))
    # K-quants keep the file's figures, a record per 8 rows and 256 channels (k_rec): Q6_K's int8 scales per 16
    # channels and float16 d, Q4_K's 6-bit scales and mins and float16 d, dmin
    if kind in ("Q6_K", "Q4_K"):
        setattr(lin, "sc16" if kind == "Q6_K" else "ksc",
                keep(torch.empty(dll.kv_record_bytes(n, k, GGUF_TYPES[kind]), dtype=torch.uint8)))
    elif kind.endswith("_K"):  # float32 d * sc and dmin * m
        lin.s32, lin.mins32 = keep(torch.empty(figs)), keep(torch.empty(figs))
    else:
        lin.s = keep(torch.empty(figs, dtype=torch.int16))
        lin.mins = keep(torch.empty(figs, dtype=torch.int16) if affine else None)
    rows = np.ascontiguousarray(rows, dtype=np.uint64)
    if dll.kv_pack_gguf(ctypes.byref(lin), GGUF_TYPES[kind], rows.ctypes.data, threads):
        raise KvedgeError(f"kv_pack_gguf refused {what} ({kind}, {n}x{k})")
    return lin


class _DecoderWeights:
    """The engine's weights from a built Decoder (a checkpoint loaded, and quantized, by kvedge.models)."""

    def __init__(self, model: nn.Module, dll: ctypes.CDLL, keep: _Keep, activations: str):
        self.model, self.dll, self.keep, self.activations = model, dll, keep, activations

    def norm(self, name: str) -> int:
        mod = self.model.get_submodule(name) if _has(self.model, name) else None
        return self.keep(None if mod is None else mod.weight.detach().float().contiguous())

    def linear(self, name: str) -> Linear:
        mod = self.model.get_submodule(name) if name != "lm_head" or hasattr(self.model, "lm_head") \
            else lm_head_linear(self.model)
        return pack_linear(self.dll, mod, self.keep, self.activations)

    def linear_parts(self, name: str) -> tuple[Linear, Linear | None]:
        return self.linear(name), None

    def embed(self) -> Linear:
        w = self.model.embed.weight
        return Linear(n=w.shape[0], k=w.shape[1], bits=32, sym=1, w=self.keep(w.detach().float().contiguous()))


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


class _GGUFWeights:
    """The engine's weights straight from a GGUF file's map, a tensor at a time: quantized tensors packed from
    their blocks (kv_pack_gguf), the rest read as float32; each tensor's mapped pages are let go once it is
    packed, so no float copy of a quantized tensor and no second copy of the file is ever resident. The
    embedding stays in its type (looked up a row at a time), and a tied head is the same packed bytes."""

    def __init__(self, path: str | Path, dll: ctypes.CDLL, keep: _Keep, activations: str, threads: int):
        from kvedge.models import gguf

        self.gguf, self.g = gguf, gguf.open_gguf(path)
        self.cfg = gguf.load_config(path)
        self.plan = gguf.tensor_plan(self.g, self.cfg)
        self.dll, self.keep, self.activations, self.threads = dll, keep, activations, threads
        self.float_linears: list[str] = []  # quantized linears run as float32: fused parts of different types
        self._embed: Linear | None = None

    def _floats(self, names: tuple[str, ...]) -> torch.Tensor:
        parts = [self.gguf.read_float(self.g, n, self.cfg) for n in names]
        self._release(names)
        return torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))

    def _release(self, names: tuple[str, ...]) -> None:
        for n in names:
            t = self.g.tensors[n]
            self.g.reader.release(t.data_offset, t.data_offset + t.n_bytes)

    def norm(self, name: str) -> int:
        entry = self.plan.get(name + ".weight")
        return self.keep(None if entry is None else self._floats(entry[0]))

    def linear_parts(self, name: str) -> tuple[Linear, Linear | None]:
        """A fused linear whose parts are of two packed types (Q4_K_M's q, k in Q4_K and v in Q6_K) as two packed
        linears, the engine's qkv and qkv_tail; otherwise (linear(name), None)."""
        names = self.plan[name + ".weight"][0]
        kinds = [self.g.type_name(n) for n in names]
        cut = next((i for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1]), None)
        if cut is None or len(set(kinds)) != 2 or not set(kinds) <= set(GGUF_TYPES):
            return self.linear(name), None
        bias = self.plan.get(name + ".bias")
        rows = sum(self.g.shape(n)[0] for n in names[:cut])
        bias = None if bias is None else self._floats(bias[0])
        head = self._pack(names[:cut], kinds[0], self.keep(None if bias is None else bias[:rows].contiguous()))
        tail = self._pack(names[cut:], kinds[cut], self.keep(None if bias is None else bias[rows:].contiguous()))
        return head, tail

    def linear(self, name: str) -> Linear:
        if name == "lm_head" and "lm_head.weight" not in self.plan:
            return self.embed()  # tied: the embedding's own packed bytes
        names = self.plan[name + ".weight"][0]
        bias = self.plan.get(name + ".bias")
        bias = self.keep(None if bias is None else self._floats(bias[0]))
        kinds = {self.g.type_name(n) for n in names}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind not in GGUF_TYPES:
            if any(k in self.gguf.QUANT_TYPES for k in kinds | {kind}):
                self.float_linears.append(name)
            w = self._floats(names)
            return Linear(n=w.shape[0], k=w.shape[1], bits=32, sym=1, w=self.keep(w), bias=bias)
        return self._pack(names, kind, bias)

    def _pack(self, names: tuple[str, ...], kind: str, bias: int) -> Linear:
        g = self.g
        rows = []
        for name in names:  # each row's first block in the map, Q/K permutation undone by taking rows in order
            t, (n, _) = g.tensors[name], g.shape(name)
            order = self.gguf.row_order(g, name, self.cfg, n)
            rows.append(t.data.ctypes.data + (np.arange(n) if order is None else order) * (t.n_bytes // n))
        rows = np.ascontiguousarray(np.concatenate(rows), dtype=np.uint64)
        for name in names:
            t = g.tensors[name]
            g.reader.populate(t.data_offset, t.data_offset + t.n_bytes)
        lin = pack_gguf(self.dll, kind, rows, g.shape(names[0])[1], self.keep, self.activations, self.threads, bias,
                        what=", ".join(names))
        self._release(names)
        return lin

    def embed(self) -> Linear:
        if self._embed is None:
            names = self.plan["embed.weight"][0]
            kind = self.g.type_name(names[0])
            if kind in GGUF_TYPES:
                self._embed = self._pack(names, kind, 0)
            else:
                w = self._floats(names)
                self._embed = Linear(n=w.shape[0], k=w.shape[1], bits=32, sym=1, w=self.keep(w))
        return self._embed


def unsupported(cfg) -> list[str]:
    """Why the engine cannot run this model ([] when it can)."""
    why = []
    if cfg.norm != "rms":
        why.append(f"{cfg.norm} norms (the engine has RMSNorm only)")
    if cfg.positions != "rope":
        why.append(f"{cfg.positions} positions (the engine has rotary positions only)")
    if cfg.act not in _ACTS:
        why.append(f"activation {cfg.act}")
    if cfg.mla:
        why.append("multi-head latent attention (MLA: the engine has no latent cache, nor its absorbed query and "
                   "output)")
    return why


def _refuse(cfg) -> None:
    why = unsupported(cfg)
    if why:
        raise KvedgeError(f"the native backend cannot run this {cfg.arch} model: {'; '.join(why)}; use the "
                          f"onnxruntime or torch backend")


class NativeBackend(CacheList):
    name = "native"

    def __init__(self, model_dir: str | Path, max_batch: int = 1, max_seq_len: int = 2048, threads: int = 0,
                 quantize: str | None = "int4", group_size: int = 32, symmetric: bool = True,
                 quantize_lm_head: bool = True, model: nn.Module | None = None, kv_dtype: str | None = None,
                 kv_scales=None, activations: str = "int8", flags: tuple[str, ...] = FLAGS):
        """model_dir: a Hugging Face checkpoint (pre-quantized AWQ / GPTQ ones run as they are), or a GGUF file,
        whose blocks are packed from the file a tensor at a time (no Decoder is built; see _GGUFWeights). quantize: None
        keeps float32 projections; int8 / int4 round to nearest per group (as `kvedge export --quantize`).
        model: an already built (and quantized) Decoder to run instead of loading model_dir. The backend keeps
        no Decoder: the engine reads its own copies (4-bit weights as tiles) or the Decoder's tensors in place
        (8-bit weights, float32 norms and tables), so a Decoder it loaded is freed but for those.
        kv_dtype "int8": an int8 cache (a quarter of float32's bytes) with per-layer, KV head and channel
        scales, kv_scales (k_scales, v_scales) as kvedge.runtime.calibration.calibrate_kv_scales gives them, or
        calibrated here on the built-in text through the (quantized) model, as `kvedge export --kv-dtype
        int8` does; new K/V are quantized on write and attention reads them dequantized, as the reference op.
        kv_dtype "fp16": a float16 cache (half of float32's bytes, as llama.cpp's default): new K/V are rounded
        to float16 on write and attention reads them as float32, as the reference op over a float16 cache.
        activations: what a quantized projection multiplies its weights with. "int8" (per 32 channels, as
        llama.cpp and ONNX Runtime's accuracy level 4 do) is the fast one; "int16" (two int8 planes) is within
        float rounding of the torch model, for twice the multiply-adds (slower, most of all in prefill).
        flags: the compiler flags of the engine's build (default -march=native: this CPU's best kernels; the
        tests also build AVX2-only and portable C, the code ARM and Jetson CPUs run)."""
        if activations not in ACTIVATIONS:
            raise KvedgeError(f"activations {activations!r}: the native engine's are {' or '.join(ACTIVATIONS)}")
        if kv_dtype not in (None, "fp32", "fp16", "int8"):
            raise KvedgeError(f"kv_dtype {kv_dtype!r}: the native engine's cache is fp32, fp16 or int8")
        if model is None and not is_checkpoint(model_dir):
            raise KvedgeError(f"{model_dir}: the native backend loads a Hugging Face checkpoint (config.json) "
                              "or a GGUF file")
        self.activations = activations
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.threads = threads or torch.get_num_threads()
        gguf_file = model is None and str(model_dir).endswith(".gguf")
        cfg = self.cfg = model.cfg if model is not None else load_config(model_dir)
        _refuse(cfg)  # before any weight is read
        if kv_dtype == "int8" and kv_scales is None:  # calibrated through the (quantized) model, then let go
            from kvedge.runtime.calibration import builtin_kv_scales

            if model is None:
                model = self._decoder(model_dir, quantize, group_size, quantize_lm_head, symmetric)
            kv_scales = builtin_kv_scales(model, model_dir)
            if gguf_file:
                model = None
        self.dll = compile_engine(flags)
        self.kernels = KERNELS[self.dll.kv_simd()]
        keep = self._keep = _Keep()
        if gguf_file:
            weights = _GGUFWeights(model_dir, self.dll, keep, activations, self.threads)
        else:
            if model is None:
                model = self._decoder(model_dir, quantize, group_size, quantize_lm_head, symmetric)
            weights = _DecoderWeights(model, self.dll, keep, activations)
        self.kv_scales = None
        if kv_dtype == "int8":
            if any(len(side) != cfg.num_layers for side in kv_scales):
                raise KvedgeError(f"kv_scales: one (k, v) scale tensor per layer expected, the model has "
                                  f"{cfg.num_layers} layers")
            self.kv_scales = tuple([s.float().reshape(cfg.num_kv_heads, cfg.head_dim).contiguous() for s in side]
                                   for side in kv_scales)
        shape = (max_batch, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        cache_dtype = {"int8": torch.int8, "fp16": torch.float16}.get(kv_dtype, torch.float32)
        self.caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2 * cfg.num_layers)]  # k0, v0, k1, ...
        layers = (Layer * cfg.num_layers)()
        # global[, local (gemma3's sliding layers), long (longrope: the forward picks it, see forward)]
        tables = {kind: tuple(keep(t.float().contiguous()) for t in pair)
                  for kind, pair in rope.all_tables(cfg, rope.buffers(cfg), max_seq_len, torch.float32).items()}
        kinds = [rope.layer_kind(cfg, i) for i in range(cfg.num_layers)]
        for i, ly in enumerate(layers):
            for name in NORMS:
                setattr(ly, name, weights.norm(f"layers.{i}.{name}"))
            ly.qkv, tail = weights.linear_parts(f"layers.{i}.qkv")
            if tail is not None:
                ly.qkv_tail = tail
            for name in LINEARS[1:]:
                setattr(ly, name, weights.linear(f"layers.{i}.{name}"))
            ly.window = cfg.layer_windows[i] or 0
            ly.k_cache, ly.v_cache = self.caches[2 * i].data_ptr(), self.caches[2 * i + 1].data_ptr()
            if self.kv_scales is not None:
                ks, vs = self.kv_scales[0][i], self.kv_scales[1][i]
                ly.k_scale, ly.v_scale = keep(ks), keep(vs)
                ly.k_inv, ly.v_inv = keep(torch.reciprocal(ks)), keep(torch.reciprocal(vs))
            ly.cos, ly.sin = tables.get(kinds[i], (0, 0))  # none for a layer without RoPE
        self.float_linears = getattr(weights, "float_linears", [])
        if self.float_linears:
            print(f"kvedge: the native engine runs {len(self.float_linears)} linear(s) of this file as float32 "
                  f"with its values (fused parts of different types): "
                  f"{', '.join(self.float_linears[:4])}{' ...' if len(self.float_linears) > 4 else ''}",
                  file=sys.stderr)
        self._switch, self._tables, self._long = rope.long_switch(cfg), tables, False  # longrope: see forward
        self._global = [ly for kind, ly in zip(kinds, layers) if kind == "global"]
        self._layers, self._first_row = layers, 0
        lm_head = weights.linear("lm_head")
        self.m = Model(cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       cfg.intermediate_size, cfg.rotary_dim // 2, int(cfg.mlp == "glu"), _ACTS[cfg.act],
                       int(cfg.norm_unit_offset), max_batch, max_seq_len,
                       int(cfg.qk_norm and cfg.qk_norm_scope == "all"), int(kv_dtype == "fp16"), cfg.norm_eps,
                       cfg.attn_scale, cfg.attn_softcap or 0.0, cfg.final_softcap or 0.0, cfg.embed_scale,
                       cfg.residual_scale, cfg.logits_divisor, weights.embed(), weights.norm("norm"), lm_head, layers)
        self.logits = torch.empty(max_batch * cfg.vocab_size)  # flat: [B, n, V] is a view of its start; grown
        self.scratch = torch.empty(0, dtype=torch.uint8)  # the engine's work buffers, grown to the largest chunk
        self._need: dict[tuple[int, int], int] = {}  # (B, L) -> kv_scratch_bytes: a ctypes call releases the GIL

    @staticmethod
    def _decoder(model_dir, quantize, group_size, quantize_lm_head, symmetric) -> nn.Module:
        """The checkpoint's Decoder, quantized round to nearest unless it comes pre-quantized (or unquantized)."""
        model = load_decoder(model_dir, dtype="float32")
        if quantize and not getattr(model, "prequantized", None):
            if quantize not in QUANT_BITS:
                raise KvedgeError(f"quantize {quantize!r}: expected int8, int4 or None")
            quantize_decoder(model, QUANT_BITS[quantize], group_size, lm_head=quantize_lm_head,
                             accuracy_level=4, symmetric=symmetric)
        return model

    def weights_bytes(self) -> int:
        """Bytes of everything the engine reads besides the caches (weights, scales, norms, RoPE tables)."""
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in self._keep.tensors}
        return sum(seen.values())

    def _point_at(self, first_row: int) -> None:
        """Point the engine's caches at row first_row: it reads and writes rows 0..B-1 from there."""
        for i, ly in enumerate(self._layers):
            ly.k_cache, ly.v_cache = (self.caches[2 * i + j][first_row].data_ptr() for j in (0, 1))
        self._first_row = first_row

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                logits_index: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Run one chunk [B, L] on cache rows first_row..; returns a view of the preallocated logits [B, n, V] for
        logits_index [B, n] ([B, 1, V] for [B]), valid until the next call."""
        b, length = input_ids.shape
        check_rows(self, first_row, b)
        if first_row != self._first_row:
            self._point_at(first_row)
        ids, pos, idx = int64_inputs(input_ids, position_ids, logits_index)
        p, t, i = pos.numpy(), ids.numpy(), idx.numpy()  # not torch.aminmax, which releases the GIL (int64_inputs)
        n = i.shape[1] if i.ndim == 2 else 1
        if not 1 <= n <= length or i.min() < 0 or i.max() >= length:  # the engine reads the rows they name
            raise KvedgeError(f"logits_index {i.shape} with values {int(i.min())}..{int(i.max())}: 1..{length} "
                              f"positions of the chunk's {length} expected")
        if b * n * self.cfg.vocab_size > self.logits.numel():
            self.logits = torch.empty(b * n * self.cfg.vocab_size)
        lo, hi = int(p.min()), int(p.max())  # the engine writes the cache at these: check them
        if lo < 0 or hi >= self.max_seq_len:
            raise KvedgeError(f"positions {lo}..{hi} are outside the cache [0, {self.max_seq_len})")
        if t.min() < 0 or t.max() >= self.cfg.vocab_size:  # the engine reads the embedding's row at each
            raise KvedgeError(f"token ids {int(t.min())}..{int(t.max())} are outside the vocabulary "
                              f"[0, {self.cfg.vocab_size})")
        if self._switch is not None and (hi >= self._switch) != self._long:  # longrope: this call's set, as
            self._long = not self._long                                      # Decoder.forward picks it
            for ly in self._global:
                ly.cos, ly.sin = self._tables["long" if self._long else "global"]
        need = self._need.get((b, length))
        if need is None:
            need = self._need[b, length] = self.dll.kv_scratch_bytes(ctypes.byref(self.m), b, length, self.threads)
        if need > self.scratch.numel():
            self.scratch = torch.empty(need, dtype=torch.uint8)
        self.dll.kv_forward(ctypes.byref(self.m), b, length, ids.data_ptr(), pos.data_ptr(), idx.data_ptr(), n,
                            self.logits.data_ptr(), self.threads, self.scratch.data_ptr())
        return self.logits[:b * n * self.cfg.vocab_size].view(b, n, self.cfg.vocab_size)


def open_backend(path: Path, o, export: Path | None = None) -> NativeBackend:
    """The runtime's entry point (kvedge.runtime.backends): the C engine on a checkpoint. With `export` (kvedge
    bench / parity), quantized as that export was (the same round-to-nearest integers), float32 for an
    unquantized export; a pre-quantized checkpoint runs as it is."""
    if export is None:
        return NativeBackend(path, max_batch=o.max_batch or 1, max_seq_len=o.max_seq_len, threads=o.threads,
                             quantize=o.quantize, kv_dtype=o.kv_dtype, activations=o.activations)
    from kvedge.artifact import Sidecar

    q = Sidecar.read(export).extra.get("quantization") or {}
    if q and not q.get("pre_quantized") and q.get("method", "rtn") != "rtn":
        raise KvedgeError(f"{export} was quantized with {q['method']}; the native backend quantizes the checkpoint "
                          f"round-to-nearest and would not run the same weights. Compare an RTN export")
    opts = {} if q.get("pre_quantized") else dict(
        quantize=q.get("scheme"), group_size=q.get("group_size", 32), symmetric=bool(q.get("symmetric")),
        quantize_lm_head=bool(q.get("lm_head")))
    return NativeBackend(path, max_batch=o.max_batch or 1, max_seq_len=o.max_seq_len, threads=o.threads,
                         kv_dtype=o.kv_dtype, activations=o.activations, **opts)
