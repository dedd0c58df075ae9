"""The native backend on a GGUF file holds the file's weights once: a generated file of SmolLM2-135M's shape
(Q4_0 layers, a Q8_0 embedding of 49152 x 576, 90 MB of tensors) loads in a fresh process with its resident
memory growing by at most 1.1x the tensor bytes + the cache + 60 MB (the process's own: allocator, threads,
tables). A float32 copy of the embedding alone (113 MB), or the mapped file kept beside the packed copy
(90 MB), breaks it (both seen failing: 425 and 194 MB against a bound of 142 at + 40 MB)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvedge.runtime.native_backend import c_compiler

pytestmark = pytest.mark.skipif(not c_compiler(), reason="the native engine needs a C compiler")

RUNNER = textwrap.dedent("""
    import json, resource, sys
    import torch
    from kvedge.bench.latency import peak_rss
    from kvedge.runtime.native_backend import NativeBackend, compile_engine
    compile_engine()  # built (or found) before the baseline: the compiler's memory is not the model's
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    before = rss()
    b = NativeBackend(sys.argv[1], max_seq_len=64, threads=2)
    peak = peak_rss()  # VmHWM: Linux carries ru_maxrss over exec, so a child of a large process reports its parent's
    logits = b.forward(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], torch.tensor([2]))
    print(json.dumps({"before": before, "peak": peak, "after": rss(),
                      "cache": sum(c.numel() * c.element_size() for c in b.caches),
                      "finite": bool(torch.isfinite(logits).all())}))
""")


def test_a_gguf_file_loads_at_its_own_size(tmp_path):
    from kvedge.models.demo import write_random_gguf
    from kvedge.models.gguf import open_gguf

    path = write_random_gguf(tmp_path / "m.gguf", "smollm2-135m", "Q4_0", embed_kind="Q8_0")
    tensors = sum(t.n_bytes for t in open_gguf(path).tensors.values())
    r = subprocess.run([sys.executable, "-c", RUNNER, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["finite"]
    grew = max(m["peak"] - m["before"], m["after"] - m["before"])
    bound = 1.1 * tensors + m["cache"] + 60e6
    assert grew <= bound, f"grew {grew / 1e6:.0f} MB for {tensors / 1e6:.0f} MB of tensors (bound {bound / 1e6:.0f})"
