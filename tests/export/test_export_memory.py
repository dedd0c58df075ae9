"""An export holds the model's weights about once: a generated file of SmolLM2-135M's shape (Q4_0 layers, a Q8_0
embedding of 49152 x 576) exports and verifies in a fresh process with its resident memory growing by at most
2x the bytes of the graph it writes + 300 MB (what does not grow with the model: what torch.export leaves behind,
about 125 MB, and ONNX Runtime's own). The weights are streamed to model.onnx.data as a large model's are (the
threshold is lowered for the test). The ModelProto holding a copy of the weights beside the Decoder, the Decoder
kept beside ONNX Runtime's session, or one float copy of the embedding (113 MB) breaks it (docs/benchmarks.md,
Export memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GGUF = os.environ.get("KVEDGE_SMOLLM2_GGUF", "")  # its tokenizer: an export of a GGUF file writes the file's own

RUNNER = textwrap.dedent("""
    import json, sys
    import onnx, onnxruntime, torch
    from kvedge.bench.latency import peak_rss
    from kvedge.export import ExportOptions, export
    import kvedge.export.exporter, kvedge.export.verify, kvedge.models.gguf  # imported before the baseline
    kvedge.export.exporter.EXTERNAL_DATA_THRESHOLD = 0  # the path of a model over 512 MB: model.onnx.data
    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark from here (Linux carries a parent's over exec)
    before = rss()
    sc = export(sys.argv[1], sys.argv[2], ExportOptions(max_seq_len=64, verify_steps=2, verify_prompt_len=8))
    print(json.dumps({"before": before, "peak": peak_rss(), "passed": sc.verification["passed"]}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not Path(GGUF).is_file(), reason="KVEDGE_SMOLLM2_GGUF names no file (the tokenizer's source): "
                                                     "`make test` fetches the real model and sets it")
def test_a_gguf_file_exports_within_twice_its_graphs_size(tmp_path):
    from kvedge.models.demo import write_random_gguf

    path = write_random_gguf(tmp_path / "m.gguf", "smollm2-135m", "Q4_0", embed_kind="Q8_0", tokenizer_from=GGUF)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", RUNNER, str(path), str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["passed"]
    graph = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("model.onnx"))
    grew = m["peak"] - m["before"]
    bound = 2 * graph + 300e6
    print(f"grew {grew / 1e6:.0f} MB, graph {graph / 1e6:.0f} MB")
    assert grew <= bound, f"grew {grew / 1e6:.0f} MB for a {graph / 1e6:.0f} MB graph (bound {bound / 1e6:.0f})"
