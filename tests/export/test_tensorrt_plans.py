"""TensorRT pre-flight, version gating, profiles and buffer plan: all without TensorRT (nothing mocks it)."""

from __future__ import annotations

import pytest

from kvedge.cli import main
from kvedge.errors import KvedgeError
from kvedge.export.trt_plan import buffer_plan, profiles, select_path
from kvedge.export.trt_support import check
from tests.conftest import MAX_SEQ

VERSIONS = ["8.6", "10.3", "10.15", "11.0"]


@pytest.mark.parametrize("lowering,verdicts", [
    ("decomposed", {"8.6": True, "10.3": True, "10.15": True, "11.0": True}),
    ("onnx", {"8.6": False, "10.3": False, "10.15": True, "11.0": True}),
    ("ort", {"8.6": False, "10.3": False, "10.15": False, "11.0": False}),
])
def test_check_verdicts_per_lowering_and_version(lowering, verdicts, exported):
    out, _ = exported("llama-gqa4-llama3rope", lowering)
    for version, ok in verdicts.items():
        rep = check(out / "model.onnx", version)
        assert rep.buildable == ok, (lowering, version, [f.message for f in rep.findings])
    if lowering == "onnx":
        msgs = " ".join(f.message for f in check(out / "model.onnx", "10.3").findings)
        assert "Attention needs TensorRT >= 10.15" in msgs and "TensorScatter needs TensorRT >= 10.15" in msgs
        assert "graph opset 24 is newer than TensorRT 10.3's parser reads (<= 20)" in msgs
    if lowering == "ort":
        assert any(f.kind == "plugin" and "GroupQueryAttention" in f.message
                   for f in check(out / "model.onnx", "10.15").findings)
    if lowering == "decomposed":
        notes = check(out / "model.onnx", "8.6").findings
        assert notes and all(not f.blocking for f in notes)  # int64 cast-down note only


def test_check_flags_bf16_before_10(exported):
    out, _ = exported("llama-gqa4-llama3rope", "decomposed", dtype="bf16")
    assert not check(out / "model.onnx", "8.6").buildable
    assert any("bfloat16 needs TensorRT >= 10.0" in f.message for f in check(out / "model.onnx", "8.6").findings)
    assert check(out / "model.onnx", "10.3").buildable


def test_check_cli_exit_codes(exported, capsys):
    out, _ = exported("llama-gqa4-llama3rope", "onnx")
    assert main(["check", str(out / "model.onnx"), "--trt-version", "10.3"]) == 1
    assert "NOT buildable" in capsys.readouterr().out
    assert main(["check", str(out / "model.onnx"), "--trt-version", "10.15"]) == 0


def test_version_gating():
    p86, p103, p1015, p11 = (select_path(v) for v in VERSIONS)
    assert (p86.lowering, p86.in_place_cache, p86.explicit_batch_flag, p86.user_managed_memory) == \
        ("decomposed", False, True, "legacy")
    assert (p103.lowering, p103.in_place_cache, p103.explicit_batch_flag, p103.progress_monitor) == \
        ("decomposed", False, False, True)
    assert (p1015.lowering, p1015.in_place_cache, p1015.strongly_typed) == ("onnx", True, False)
    assert (p11.lowering, p11.strongly_typed, p11.precision_flags) == ("onnx", True, False)
    with pytest.raises(KvedgeError, match="older than kvedge supports"):
        select_path("8.5")
    with pytest.raises(KvedgeError, match="expected MAJOR.MINOR"):
        select_path("ten")


def test_profiles_fix_the_cache_axis(exported):
    _, sc = exported("llama-gqa4-llama3rope", "onnx")
    prefill, decode = profiles(sc, max_batch=2, max_prefill_len=32)
    cfg = sc.model
    assert prefill.shapes["input_ids"] == ((1, 1), (2, 16), (2, 32))
    assert decode.shapes["input_ids"] == ((1, 1), (2, 1), (2, 1))
    assert decode.shapes["logits_index"] == ((1,), (2,), (2,))
    cache = (cfg.num_kv_heads, MAX_SEQ, cfg.head_dim)
    for prof in (prefill, decode):
        assert prof.shapes["past_key.0"] == ((1, *cache), (2, *cache), (2, *cache))
        assert len([n for n in prof.shapes if n.startswith("past_")]) == 2 * cfg.num_layers
    with pytest.raises(KvedgeError, match="exceeds the export's max_batch"):
        profiles(sc, max_batch=9)


def test_buffer_plan_in_place_and_double_buffered(exported):
    _, sc = exported("llama-gqa4-llama3rope", "onnx")
    cfg = sc.model
    cache_bytes = 3 * cfg.num_kv_heads * MAX_SEQ * cfg.head_dim * 4  # max_batch 3, fp32
    inplace = buffer_plan(sc, select_path("10.15"))
    caches = [b for b in inplace if b.role == "cache-inplace"]
    assert len(caches) == 2 * cfg.num_layers and all(b.bytes == cache_bytes for b in caches)
    assert caches[0].binds == ("past_key.0", "present_key.0")
    double = buffer_plan(sc, select_path("10.3"))
    pairs = [b for b in double if b.role == "cache-double"]
    assert len(pairs) == 4 * cfg.num_layers and sum(b.bytes for b in pairs) == 2 * sum(b.bytes for b in caches)
    assert pairs[0].binds == ("past_key.0", "present_key.0") and pairs[1].binds == ("present_key.0", "past_key.0")
    logits = next(b for b in inplace if b.name == "logits")
    assert logits.bytes == 3 * cfg.vocab_size * 4
