"""Issue 32, item 2: a quantized export's quality gate runs in PyTorch before the graph is traced, and a refused or
failed export leaves nothing behind: no model.onnx, no empty folder, an earlier export in the folder untouched.

`kvedge import-gguf FILE -o hf && kvedge export hf -o o --quantize int4` traced and verified for minutes, then
refused on "int4 top-1 agreement 82% < 85%", leaving a 182 MB model.onnx without kvedge.json, under a summary line
that read "greedy agreement 100% FAILED"."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys

import pytest

from kvedge.artifact import SIDECAR, Sidecar
from kvedge.errors import KvedgeError
from kvedge.export import ExportOptions, export
from tests.conftest import MAX_SEQ

CASE = "llama-gqa4-llama3rope"


def kvedge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvedge", *args], capture_output=True, text=True, timeout=600)


def int4_args(ckpt) -> list[str]:
    """int4 weights at accuracy level 4 over an int8 cache: far below the 85% gate on the tiny random model (its
    graph, kept with --allow-degraded, agrees with transformers on too few tokens: tests/export/test_readme_claims)."""
    return ["export", str(ckpt), "--quantize", "int4", "--accuracy-level", "4", "--max-seq-len", str(MAX_SEQ),
            "--verify-steps", "4", "--calibration-tokens", "128"]


def test_the_int4_gate_refuses_before_tracing_in_one_line_naming_the_check_and_the_way_out(hf_checkpoint, tmp_path):
    out = tmp_path / "o"
    r = kvedge(*int4_args(hf_checkpoint(CASE)[0]), "-o", str(out))
    assert r.returncode == 2 and r.stdout == ""
    *progress, err = r.stderr.strip().splitlines()
    assert not any("tracing to ONNX" in line or "writing" in line for line in progress), r.stderr
    m = re.fullmatch(r"kvedge: error: int4 weights: top-1 agreement with the unquantized model (\d+)% < 85% "
                     r"\((\d+) points short\b.*", err)
    assert m and int(m.group(1)) + int(m.group(2)) == 85, err
    assert "--allow-degraded" in err and "--quantize int8" in err
    assert not out.exists()


def test_the_gate_s_figures_are_the_kept_export_s(hf_checkpoint, tmp_path):
    """What the gate scores in PyTorch before tracing is what the kept graph scores: the report in kvedge.json
    of the same export with --allow-degraded gives the same top-1 agreement the refusal named."""
    r = kvedge(*int4_args(hf_checkpoint(CASE)[0]), "-o", str(tmp_path / "gated"), "--quiet")
    refused = int(re.search(r"unquantized model (\d+)%", r.stderr).group(1))
    assert kvedge(*int4_args(hf_checkpoint(CASE)[0]), "-o", str(tmp_path / "kept"), "--allow-degraded",
                  "--quiet").returncode == 0
    v = Sidecar.read(tmp_path / "kept").verification
    assert round(100 * v["vs_unquantized"]["top1_agreement"]) == refused < 85
    assert v["passed"] and "FAILED" not in r.stderr


def test_quantizing_a_quantized_gguf_leaves_no_folder(tmp_path):
    """`kvedge export FILE.gguf -o out --quantize int4` on an already-quantized file left an empty out/."""
    from tests.conftest import ARCH_CASES
    from tests.gguf_files import save_hf_checkpoint, write_gguf

    model_type, overrides = ARCH_CASES[CASE]
    save_hf_checkpoint(tmp_path / "hf", model_type, **overrides)
    gguf = write_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", "Q8_0")
    r = kvedge("export", str(gguf), "-o", str(tmp_path / "out"), "--quantize", "int4")
    assert r.returncode == 2 and "already quantized" in r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].startswith("kvedge: error: ")
    assert not (tmp_path / "out").exists()


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_a_verification_failure_after_tracing_leaves_nothing_and_keeps_an_earlier_export(hf_checkpoint, tmp_path):
    """A failure after the graph is written (here the graph against PyTorch, over an impossible tolerance) removes
    what this export wrote; with --force over an earlier export, that one stays whole (model.onnx and kvedge.json
    as they were), not half overwritten."""
    ckpt = hf_checkpoint(CASE)[0]
    impossible = {"max_rel": 0.0, "min_cosine": 1.1}
    with pytest.raises(KvedgeError, match="verification failed"):
        export(ckpt, tmp_path / "new", ExportOptions(max_seq_len=MAX_SEQ, verify_steps=2, tolerance=impossible))
    assert not (tmp_path / "new").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging folder left beside it either

    good = tmp_path / "good"
    export(ckpt, good, ExportOptions(max_seq_len=MAX_SEQ, verify_steps=2))
    before = _digest(good)
    with pytest.raises(KvedgeError, match="verification failed"):
        export(ckpt, good, ExportOptions(max_seq_len=MAX_SEQ + 8, verify_steps=2, tolerance=impossible, force=True))
    assert _digest(good) == before and Sidecar.read(good).max_seq_len == MAX_SEQ
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]


def test_an_interrupted_export_leaves_nothing(hf_checkpoint, tmp_path, monkeypatch):
    """Ctrl-C while tracing (KeyboardInterrupt, not an Exception) cleans up too."""
    import kvedge.export.exporter as exporter

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(exporter, "to_onnx", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(hf_checkpoint(CASE)[0], tmp_path / "o", ExportOptions(max_seq_len=MAX_SEQ))
    assert list(tmp_path.iterdir()) == []


def test_a_good_export_into_a_folder_with_other_files_keeps_them(hf_checkpoint, tmp_path):
    """--force writes the export's files into the folder; what else it holds stays (as before staging)."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    export(hf_checkpoint(CASE)[0], out, ExportOptions(max_seq_len=MAX_SEQ, verify_steps=2, force=True))
    assert (out / "notes.txt").read_text() == "mine" and (out / SIDECAR).is_file() and (out / "model.onnx").is_file()
