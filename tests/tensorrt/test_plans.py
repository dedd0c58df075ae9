"""TensorRT pre-flight, version gating, profiles and buffer plan: all without TensorRT (nothing mocks it)."""

from __future__ import annotations

import pytest

from kvedge.artifact import LOGITS_CHUNK
from kvedge.cli import main
from kvedge.errors import KvedgeError
from kvedge.tensorrt.buffers import buffer_plan, logits_per_row, profiles
from kvedge.tensorrt.versions import select_path
from kvedge.tensorrt.check import check
from tests.conftest import MAX_SEQ

VERSIONS = ["8.6", "10.3", "10.15", "11.0"]


@pytest.mark.parametrize("lowering,verdicts", [
    ("decomposed", {"8.6": True, "10.3": True, "10.15": True, "11.0": True}),
    ("onnx", {"8.6": False, "10.3": False, "10.15": True, "11.0": True}),
    ("ort", {"8.6": False, "10.3": False, "10.15": False, "11.0": False}),
])
def test_check_verdicts_follow_kvedges_table_per_lowering_and_version(lowering, verdicts, exported):
    """These verdicts are what kvedge's own support table (kvedge.tensorrt.check) says of real exports: they prove
    that check reads the graphs against that table, not that TensorRT builds them (no TensorRT here). Each row of
    the table is tied to its source in test_every_row_of_kvedges_support_table_has_its_source."""
    out, _ = exported("llama-gqa4-llama3rope", lowering)
    for version, ok in verdicts.items():
        rep = check(out / "model.onnx", version)
        assert rep.buildable == ok, (lowering, version, [f.message for f in rep.findings])
    if lowering == "onnx":
        msgs = " ".join(f.message for f in check(out / "model.onnx", "10.3").findings)
        assert "Attention needs TensorRT >= 10.14" in msgs and "TensorScatter needs TensorRT >= 10.15" in msgs
        assert "graph opset 24 is newer than TensorRT 10.3's parser reads (<= 21)" in msgs
        msgs = [f.message for f in check(out / "model.onnx", "10.14").findings]  # Attention parses, TensorScatter not
        assert not any("Attention" in m for m in msgs) and any("TensorScatter needs TensorRT >= 10.15" in m
                                                                for m in msgs)
    if lowering == "ort":
        assert any(f.kind == "plugin" and "GroupQueryAttention" in f.message
                   for f in check(out / "model.onnx", "10.15").findings)
    if lowering == "decomposed":
        notes = check(out / "model.onnx", "8.6").findings
        assert notes and all(not f.blocking for f in notes)  # int64 cast-down note only


# kvedge's TensorRT support table (kvedge.tensorrt.check), row by row, with where each row was read: a release of
# onnx/onnx-tensorrt or NVIDIA/TensorRT (a quote where the row was checked against that file). A row changed, added
# or dropped in kvedge without its source changed here fails test_every_row_of_kvedges_support_table_has_its_source.
OPS_MD, CHANGES = "onnx/onnx-tensorrt docs/operators.md", "onnx/onnx-tensorrt docs/Changelog.md"
NVINFER = "NVIDIA/TensorRT include/NvInfer.h IDequantizeLayer"
TABLE_SOURCES = {
    ("MAX_OPSET", (8, 6)): (17, f"{OPS_MD} @ 8.6-GA: 'TensorRT 8.6 supports operators up to Opset 17'"),
    ("MAX_OPSET", (9, 0)): (19, f"{OPS_MD} @ 9.0-GA: 'TensorRT 9.0 supports operators up to Opset 19' (9.3 too)"),
    ("MAX_OPSET", (10, 0)): (21, f"{OPS_MD} @ 10.0-GA: 'in the inclusive range of opset 9 to opset 20', but "
                                 "onnx-tensorrt ModelImporter.cpp importModel has no upper opset bound (10.0 eb43908b, "
                                 "10.16 6bde6596) and third_party/onnx is v1.16.0 (newest opset 21) at 10.0 and 10.1"),
    ("MAX_OPSET", (10, 9)): (22, f"{OPS_MD} @ 10.9-GA"),
    ("MAX_OPSET", (10, 13)): (24, f"{OPS_MD} @ 10.13-GA (@ 10.15-GA: 'in the inclusive range of opset 9 to opset 24')"),
    ("MAX_OPSET", (11, 0)): (24, f"{OPS_MD} @ 11.0"),
    ("LATER_OPS", "Gelu"): ((10, 0), f"{OPS_MD} @ 10.0-GA: 'Gelu | Y' (no Gelu row @ 8.6-GA)"),
    ("LATER_OPS", "Attention"): ((10, 14), f"{CHANGES} 10.14 GA: 'Added support for the `Attention` operator'"),
    **{("LATER_OPS", op): ((10, 15), f"{CHANGES} 10.15 GA: 'Added support for `RotaryEmbedding`, "
                                     "`RMSNormalization` and `TensorScatter`'")
       for op in ("RotaryEmbedding", "RMSNormalization", "TensorScatter")},
    **{("DTYPE_SINCE", dt): ((8, 6), f"{OPS_MD} @ 8.6-GA: 'TensorRT supports the following ONNX data types: "
                                     "DOUBLE, FLOAT32, FLOAT16, INT8, and BOOL' (INT32, INT64 cast down: limited)")
       for dt in (1, 10, 6, 7, 9, 3)},
    ("DTYPE_SINCE", 2): ((8, 6), f"{CHANGES} 8.5 GA: 'Added support for importing ONNX networks with `UINT8` I/O "
                                 "types'"),
    ("DTYPE_SINCE", 16): ((9, 0), f"{OPS_MD} @ 9.0-GA data types: 'BFLOAT16' (not @ 8.6-GA)"),
    ("DTYPE_SINCE", 17): ((9, 0), f"{OPS_MD} @ 9.0-GA data types: 'FP8' (not @ 8.6-GA)"),
    ("DTYPE_SINCE", 22): ((10, 0), f"{CHANGES} 10.0 EA: 'Added support for `INT4` quantization'"),
    ("QUANT_FORMS", "INT8"): (((8, 6), None, None), f"{OPS_MD} @ 8.6-GA: 'DequantizeLinear | Y | INT8'; blocked: "
                                                    f"{NVINFER} (kINT4 only @ release/10.0-10.12, kFP4, kFP8, "
                                                    "kINT4 @ release/10.13-11.1)"),
    ("QUANT_FORMS", "INT4"): (((10, 0), (10, 0), (64, 128)), f"{OPS_MD} @ 10.0-GA: 'DequantizeLinear | Y | INT8, "
                                                             f"FP8, INT4'; {NVINFER} @ release/10.0; block sizes: "
                                                             "TensorRT docs, Quantization Schemes"),
    ("QUANT_FORMS", "FP8"): (((9, 0), (10, 13), None), f"{OPS_MD} @ 9.0-GA: 'DequantizeLinear | Y | INT8, FP8'; "
                                                       f"blocked: {NVINFER} @ release/10.13"),
}


def test_every_row_of_kvedges_support_table_has_its_source():
    """What this proves: every row of kvedge's table is one that was read in a named release (the source is
    recorded above, next to the value read there), and no row was changed, added or dropped without it. What it
    cannot prove: that NVIDIA's files still say so (nothing here reads them). The per-version table of
    docs/tensorrt.md names a source in each row too."""
    import re
    from pathlib import Path

    from kvedge.tensorrt import check as table

    rows = {("MAX_OPSET", v): n for v, n in table.MAX_OPSET.items()}
    rows |= {("LATER_OPS", op): v for op, v in table.LATER_OPS.items()}
    rows |= {("DTYPE_SINCE", dt): v for dt, v in table.DTYPE_SINCE.items()}
    rows |= {("QUANT_FORMS", f["name"]): (f["since"], f["blocked_since"], f["block_sizes"])
             for f in table.QUANT_FORMS.values()}
    assert set(rows) == set(TABLE_SOURCES), "a row without its source, or a source without its row"
    for row, value in rows.items():
        assert value == TABLE_SOURCES[row][0], (row, value, TABLE_SOURCES[row])
    assert table.BASE_OPS.isdisjoint(table.LATER_OPS)  # the 8.6 set: each 'Y' in OPS_MD @ 8.6-GA
    doc = (Path(__file__).parents[2] / "docs" / "tensorrt.md").read_text()
    lines = doc[doc.index("| TensorRT | what kvedge does | source |"):].splitlines()[2:]
    cells = [line.split(" | ")[-1] for line in lines[:lines.index("")]]
    assert len(cells) > 10 and all(re.search(r"\.(md|h|cpp|py)`", c) and re.search(r"\d+\.\d+", c)
                                   for c in cells), cells


def test_check_flags_bf16_before_9(exported):
    """bfloat16 tensors parse from 9.0 (onnx-tensorrt docs/operators.md @ 9.0-GA; not @ 8.6-GA)."""
    out, _ = exported("llama-gqa4-llama3rope", "decomposed", dtype="bf16")
    assert not check(out / "model.onnx", "8.6").buildable
    assert any("bfloat16 needs TensorRT >= 9.0" in f.message for f in check(out / "model.onnx", "8.6").findings)
    assert check(out / "model.onnx", "9.0").buildable and check(out / "model.onnx", "10.3").buildable


def test_check_cli_exit_codes(exported, capsys):
    out, _ = exported("llama-gqa4-llama3rope", "onnx")
    assert main(["check", str(out / "model.onnx"), "--trt-version", "10.3"]) == 1
    assert "NOT buildable" in capsys.readouterr().out
    assert main(["check", str(out / "model.onnx"), "--trt-version", "10.15"]) == 0
    assert "TensorRT 10.15: buildable (KV cache in place)" in capsys.readouterr().out


def test_a_decomposed_graph_on_10_15_and_later_is_buildable_and_double_buffered(exported, capsys):
    """A decomposed graph is standard ops (ScatterElements writes a whole new present), so 10.15+ builds it as it
    builds it on 10.3; TensorRT's in-place update is IKVCacheUpdateLayer, which only TensorScatter maps to (onnx-
    tensorrt docs/operators.md, 10.15), so its caches stay two buffers. `check`, the plan and `kvedge build` (whose
    one gate is check) agree: check once said "in place" for it, and build refused what check passed."""
    out, sc = exported("llama-gqa4-llama3rope", "decomposed")
    for version in ("10.16", "11.0"):
        assert main(["check", str(out / "model.onnx"), "--trt-version", version]) == 0
        assert f"TensorRT {version}: buildable (KV cache double-buffered)" in capsys.readouterr().out
        assert {b.role for b in buffer_plan(sc, select_path(version)) if b.role.startswith("cache")} == \
            {"cache-double"}


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
    # logits: 1 position a row when decoding; up to LOGITS_CHUNK (eval's chunk) within the prefill length
    assert decode.shapes["logits_index"] == ((1, 1), (2, 1), (2, 1))
    assert prefill.shapes["logits_index"] == ((1, 1), (2, 1), (2, min(LOGITS_CHUNK, 32)))
    assert logits_per_row(sc, 512) == LOGITS_CHUNK == 64  # a longer prefill still returns at most eval's chunk
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
    assert logits.bytes == 3 * min(LOGITS_CHUNK, MAX_SEQ) * cfg.vocab_size * 4  # up to eval's chunk a row


def test_a_plugin_graph_keeps_its_cache_in_place_on_every_version(exported):
    """The `trt` lowering's plugin outputs alias its cache inputs (TensorDesc.aliased()), so its caches are one
    buffer each on 10.7-10.14 too: the plan, which the TensorRT backend binds by name, says so. (The backend
    once looked up `past_key.0` where the plan had made only `past_key.0#A` / `#B`: a KeyError.)"""
    from kvedge.artifact import PLUGIN_ID

    _, sc = exported("llama-gqa4-llama3rope", "trt")
    assert sc.plugins == [PLUGIN_ID] and sc.lowering == "trt"
    for version in ("10.7", "10.9", "10.15"):
        plan = buffer_plan(sc, select_path(version))
        caches = [b for b in plan if b.role.startswith("cache")]
        assert {b.role for b in caches} == {"cache-inplace"} and [b.name for b in caches] == \
            [past for past, _ in sc.cache_pairs]


@pytest.mark.parametrize("lowering,scheme,reason", [
    ("onnx", "int8", "blocked INT8 DequantizeLinear: TensorRT's block dequantization takes FP4, FP8 and INT4 only"),
    ("ort", "int4", "com.microsoft::MatMulNBits is a plugin node: ONNX Runtime's contrib op"),
])
def test_check_refuses_kvedge_quantized_exports(lowering, scheme, reason, exported):
    """int8 in groups of 32 is blocked INT8, which no TensorRT builds, and MatMulNBits is ONNX Runtime's. No version
    builds these graphs, and check says why."""
    out, _ = exported("llama-gqa4-llama3rope", lowering, quantize=scheme, allow_degraded=True)
    for version in VERSIONS:
        rep = check(out / "model.onnx", version)
        assert not rep.buildable
        assert [f.message for f in rep.findings if reason in f.message and f.blocking], (version, rep.findings)
    if lowering == "onnx":  # one finding for the 4 projections x 2 layers, not one per node
        assert any(f.message.endswith("(8 nodes)") for f in check(out / "model.onnx", "10.15").findings)


def _weight_only_graph(path, np_dtype, block: int, zero: int | None = None):
    """x [1, 256] @ DequantizeLinear(W [256 (K), 64 (N)], scales [256 / block, 64], axis 0): the form TensorRT's
    weight-only path parses (signed integers; a zero point only if given)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    w = np.arange(256 * 64).reshape(256, 64) % 15 - 7
    inits = [numpy_helper.from_array(w.astype(np_dtype), "w"),
             numpy_helper.from_array(np.full((256 // block, 64), 0.01, np.float32), "s")]
    if zero is not None:
        inits.append(numpy_helper.from_array(np.full((256 // block, 64), zero).astype(np_dtype), "z"))
    nodes = [helper.make_node("DequantizeLinear", [t.name for t in inits], ["wf"], axis=0, block_size=block),
             helper.make_node("MatMul", ["x", "wf"], ["y"])]
    graph = helper.make_graph(nodes, "woq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])], initializer=inits)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    return path


def test_check_knows_symmetric_weight_only_forms(tmp_path):
    import ml_dtypes
    import numpy as np

    int4 = _weight_only_graph(tmp_path / "int4.onnx", ml_dtypes.int4, 128)
    # INT4 blocked from TensorRT 10.0 (onnx-tensorrt docs/operators.md 10.0: "DequantizeLinear | Y | INT8, FP8, INT4"),
    # at opset 21, which the 10.0 parser reads (no upper bound in ModelImporter.cpp; ONNX v1.16.0 bundled)
    assert {v: check(int4, v).buildable for v in ("8.6", "10.0", "10.3", "10.9", "10.15", "11.0")} == \
        {"8.6": False, "10.0": True, "10.3": True, "10.9": True, "10.15": True, "11.0": True}
    note = [f for f in check(int4, "10.15").findings if f.kind == "quantization"]
    assert len(note) == 1 and not note[0].blocking and "Ampere and later" in note[0].message
    # block 32: the parser infers blocks from the scale's shape with no size limit (onnxOpImporters.cpp
    # QuantDequantLinearHelper, 10.0 to 10.16), NVIDIA's docs name {64, 128}: a caution, not a refusal
    g32 = _weight_only_graph(tmp_path / "g32.onnx", ml_dtypes.int4, 32)
    caution = [f for f in check(g32, "10.3").findings if "block size 32" in f.message]
    assert check(g32, "10.3").buildable and len(caution) == 1 and not caution[0].blocking
    assert "outside the sizes NVIDIA documents (64 or 128)" in caution[0].message
    zp = _weight_only_graph(tmp_path / "zp.onnx", ml_dtypes.int4, 64, zero=1)
    assert any("non-zero zero points" in f.message for f in check(zp, "10.15").findings)
    assert check(_weight_only_graph(tmp_path / "zp0.onnx", ml_dtypes.int4, 64, zero=0), "10.15").buildable

def test_blocked_dequantization_takes_fp4_fp8_and_int4_only(tmp_path):
    """Issue 17, item 10. NVIDIA/TensorRT include/NvInfer.h, IDequantizeLayer: "Block dequantization is supported
    only for input tensors with DataType::kINT4" (release/10.0 to release/10.12); "Block dequantization is supported
    for input types DataType::kFP4, DataType::kFP8 and DataType::kINT4" (release/10.13 to release/11.1). Blocked INT8
    builds on no release; blocked FP8 from 10.13."""
    import ml_dtypes
    import numpy as np

    int8 = _weight_only_graph(tmp_path / "int8.onnx", np.int8, 128)
    for version in ("10.9", "10.15", "11.1"):
        assert [f.message for f in check(int8, version).findings if f.blocking] == [
            "blocked INT8 DequantizeLinear: TensorRT's block dequantization takes FP4, FP8 and INT4 only, in no "
            "release (export --quantize int4, blocks of 64 or 128) (1 node)"]
    fp8 = _weight_only_graph(tmp_path / "fp8.onnx", ml_dtypes.float8_e4m3fn, 128)
    assert {v: check(fp8, v).buildable for v in ("10.12", "10.13", "11.1")} == \
        {"10.12": False, "10.13": True, "11.1": True}
    assert any("blocked FP8 DequantizeLinear needs TensorRT >= 10.13" in f.message
               for f in check(fp8, "10.12").findings)


@pytest.mark.parametrize("scheme,dtype,ok", [("int4", 22, {"10.3": False, "10.15": True, "11.0": True}),
                                             ("int8", 3, {"10.9": False, "10.15": False, "11.0": False})])
def test_symmetric_export_is_the_form_tensorrt_builds(scheme, dtype, ok, tmp_path):
    """--symmetric with --attention onnx writes signed INT4 / INT8 weights and DequantizeLinear without zero
    points, blocks of 128 along K: check finds nothing blocking where TensorRT documents the form (blocked INT4;
    blocked INT8 on no release, see test_blocked_dequantization_takes_fp4_fp8_and_int4_only), and the graph
    still verifies on ONNX Runtime against the quantized PyTorch model."""
    import onnx

    from kvedge.export import ExportOptions, export
    from tests.conftest import save_hf_model

    ckpt = tmp_path / "llama128"
    save_hf_model(ckpt, "llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=1)
    out = tmp_path / scheme
    sc = export(ckpt, out, ExportOptions(attention="onnx", max_seq_len=MAX_SEQ, quantize=scheme, group_size=128,
                                         symmetric=True, allow_degraded=True))
    assert sc.verification["passed"] and sc.extra["quantization"]["symmetric"]
    graph = onnx.load(str(out / "model.onnx")).graph
    dq = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    inits = {t.name: t for t in graph.initializer}
    assert len(dq) == 4 and all(inits[n.input[0]].data_type == dtype for n in dq)
    # no zero point, but per-channel INT8 (a group of the whole row, K = 128) carries an all-zero one for 8.6
    assert all(len(n.input) == 2 or (dtype == 3 and "block_size" not in {a.name for a in n.attribute}) for n in dq)
    assert {v: check(out / "model.onnx", v).buildable for v in ok} == ok


# The shared-device-memory calls of TensorRT's Python bindings, per release: NVIDIA/TensorRT
# python/src/infer/pyCore.cpp at release/8.6, release/10.0, release/10.1 and release/11.0 (USER_MANAGED: the
# ExecutionContextAllocationStrategy value; the others: method and property names).
PYCORE_DEVICE_MEMORY = {
    "8.6": {"create_execution_context_without_device_memory", "device_memory", "device_memory_size"},
    "10.0": {"create_execution_context_without_device_memory", "device_memory", "device_memory_size",
             "get_device_memory_size_for_profile", "USER_MANAGED"},
    "10.1": {"create_execution_context_without_device_memory", "device_memory", "device_memory_size",
             "get_device_memory_size_for_profile", "USER_MANAGED", "set_device_memory", "device_memory_size_v2",
             "get_device_memory_size_for_profile_v2"},
    "11.0": {"device_memory", "USER_MANAGED", "set_device_memory", "device_memory_size_v2",
             "get_device_memory_size_for_profile_v2"},
}
# what kvedge.tensorrt.backend (contexts) and kvedge.tensorrt.build (per-profile sizes) call for each mode
CALLS = {"legacy": {"create_execution_context_without_device_memory", "device_memory", "device_memory_size"},
         "property": {"USER_MANAGED", "device_memory", "device_memory_size", "get_device_memory_size_for_profile"},
         "v2": {"USER_MANAGED", "set_device_memory", "device_memory_size_v2", "get_device_memory_size_for_profile_v2"}}


def test_device_memory_calls_exist_in_each_release():
    """Issue 17, item 4: set_device_memory(ptr, size) and the *_v2 sizes arrive in 10.1 (release/10.0's pyCore.cpp
    has only the write-only `device_memory` property); 11.0 drops the calls without _v2."""
    assert [select_path(v).user_managed_memory for v in PYCORE_DEVICE_MEMORY] == ["legacy", "property", "v2", "v2"]
    for version, api in PYCORE_DEVICE_MEMORY.items():
        assert CALLS[select_path(version).user_managed_memory] <= api, version


def test_bf16_precision_needs_tensorrts_bf16_builder_flag():
    """Issue 17, item 5: release/8.6's include/NvInfer.h BuilderFlag and pyCore.cpp `py::enum_<BuilderFlag>` have
    kFP16 and no kBF16; `.value("BF16", BuilderFlag::kBF16, ...)` appears in release/9.0 (and 10.x). 11.x builds
    strongly typed networks only (precision from the graph)."""
    from kvedge.tensorrt.versions import builder_settings

    with pytest.raises(KvedgeError, match=r"--precision bf16: TensorRT 8.6 has no BuilderFlag.BF16 .* fp16 or fp32"):
        builder_settings(select_path("8.6"), "bf16", "fp32", plugins=False)
    assert builder_settings(select_path("8.6"), "fp16", "fp32", plugins=False)["flags"] == ["FP16"]
    assert builder_settings(select_path("10.3"), "bf16", "fp32", plugins=False)["flags"] == ["BF16"]
    assert builder_settings(select_path("10.3"), "fp32", "fp32", plugins=False)["flags"] == []
    with pytest.raises(KvedgeError, match="strongly typed networks"):
        builder_settings(select_path("11.0"), "fp16", "fp32", plugins=False)
    assert builder_settings(select_path("11.0"), "bf16", "bf16", plugins=False)["flags"] == []
    # quantized weights: strongly typed from 10.0 (NvInfer.h release/10.0 has kSTRONGLY_TYPED; NVIDIA's Explicit
    # Quantization docs: "Use explicit quantization with Strong Typing"), precision from the graph
    q = builder_settings(select_path("10.3"), "fp16", "fp16", plugins=False, quantized_weights=True)
    assert q == {"flags": [], "preview_features": [], "strongly_typed": True}
    with pytest.raises(KvedgeError, match="quantized weights as a strongly typed network.*--dtype fp16"):
        builder_settings(select_path("10.3"), "fp16", "fp32", plugins=False, quantized_weights=True)
    assert not builder_settings(select_path("8.6"), "fp16", "fp32", plugins=False, quantized_weights=True)[
        "strongly_typed"]  # 8.6 has no strongly typed networks


def test_plugin_graphs_turn_on_aliased_plugin_io():
    """Issue 17, item 7: IPluginV3OneBuildV2::getAliasedInput "will only be called and have an effect when
    PreviewFeature::kALIASED_PLUGIN_IO_10_03 is turned on" (NVIDIA/TensorRT include/NvInferRuntime.h, release/10.3
    through release/11.1; pyCore.cpp binds it as PreviewFeature.ALIASED_PLUGIN_IO_10_03 there), and NVIDIA's
    samples/python/quickly_deployable_plugins/qdp_runner.py (release/10.9) builds its in-place plugin with
    preview_features=[trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03]. Without it the plugin's cache outputs are not
    its cache inputs: the new K/V would be written where attention never reads them."""
    from kvedge.tensorrt.versions import builder_settings

    for version in ("10.6", "10.9", "10.15", "11.0"):
        path = select_path(version)
        assert path.aliased_plugin_io
        assert builder_settings(path, "fp16", "fp16", plugins=True)["preview_features"] == ["ALIASED_PLUGIN_IO_10_03"]
        assert builder_settings(path, "fp16", "fp16", plugins=False)["preview_features"] == []
    assert not select_path("10.0").aliased_plugin_io


def test_int64_inputs_are_int32_engine_tensors_on_8_6(exported):
    """Issue 17, item 8: onnx-tensorrt docs/Changelog.md, 9.0 EA: "ONNX models with INT64 I/O require INT64
    bindings. Note that prior to this release, such models required INT32 bindings" (release/8.6's
    NvInferRuntimeBase.h DataType has no kINT64). The backend binds each input in the dtype
    engine.get_tensor_dtype reports; the plan sizes the id buffers the same way."""
    assert select_path("8.6").index_dtype == "int32" and select_path("10.3").index_dtype == "int64"
    _, sc = exported("llama-gqa4-llama3rope", "decomposed")
    for version, size in (("8.6", 4), ("10.3", 8)):
        plan = {b.name: b.bytes for b in buffer_plan(sc, select_path(version), max_prefill_len=16)}
        assert (plan["input_ids"], plan["position_ids"], plan["logits_index"]) == (3 * 16 * size, 3 * 16 * size,
                                                                                   3 * 16 * size)


def _graph(path, nodes, inputs, outputs, opset: int):
    from onnx import TensorProto, helper, save

    def info(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    graph = helper.make_graph(nodes, "g", [info(*i) for i in inputs], [info(*o) for o in outputs])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def test_check_knows_what_the_parser_refuses_on_attention_and_tensorscatter(tmp_path):
    """Issue 17, item 10, for any graph: onnx-tensorrt docs/operators.md (10.15): Attention "`past_key`, `past_value`
    and `nonpad_kv_seqlen` inputs are unsupported. `present_key`, `present_value` and `qk_matmul_output` outputs are
    unsupported. `qk_matmul_output_mode` and `softcap` attributes are unsupported."; TensorScatter "`past_cache` and
    `update` must be 4D. `axis` must be -2."."""
    from onnx import helper

    q = ("q", [1, 2, 4, 8])
    attention = helper.make_node("Attention", ["q", "q", "q", "", "", "", "n"], ["y", "pk", "", "qk"],
                                 qk_matmul_output_mode=1, softcap=5.0)
    g = _graph(tmp_path / "a.onnx", [attention], [q, ("n", [1])], [("y", [1, 2, 4, 8])], 24)
    msgs = [f.message for f in check(g, "10.15").findings if f.blocking]
    assert msgs == ["Attention node '' has input nonpad_kv_seqlen, output present_key, output qk_matmul_output, "
                    "attribute qk_matmul_output_mode, attribute softcap, which TensorRT's parser does not support"]
    plain = helper.make_node("Attention", ["q", "q", "q"], ["y"])
    assert check(_graph(tmp_path / "b.onnx", [plain], [q], [("y", [1, 2, 4, 8])], 24), "10.15").buildable
    for axis, shape, ok in ((-2, [1, 2, 8, 4], True), (2, [1, 2, 8, 4], False), (-2, [2, 8, 4], False)):
        scatter = helper.make_node("TensorScatter", ["c", "u"], ["o"], axis=axis)
        g = _graph(tmp_path / "s.onnx", [scatter], [("c", shape), ("u", shape)], [("o", shape)], 24)
        assert check(g, "10.15").buildable == ok, (axis, shape)


def test_the_onnx_lowering_writes_tensorscatter_axis_minus_2(exported):
    """Issue 17, item 10: TensorRT's parser takes TensorScatter with `axis` -2 only (onnx-tensorrt docs/operators.md,
    10.15), -2 being also the ONNX default; the onnx lowering wrote 2 (the same axis of a 4-D cache)."""
    import onnx

    out, _ = exported("llama-gqa4-llama3rope", "onnx")
    scatters = [n for n in onnx.load(str(out / "model.onnx")).graph.node if n.op_type == "TensorScatter"]
    assert scatters and all(onnx.helper.get_attribute_value(a) == -2 for n in scatters for a in n.attribute
                            if a.name == "axis")


def test_group_normalization_parses_on_8_6(tmp_path):
    """Issue 17, item 10: onnx-tensorrt docs/Changelog.md, 8.6 EA: "Added support for `GroupNormalization`"
    (docs/operators.md at 8.6-GA: GroupNormalization | Y | FP32, FP16). Its opset (18) is a separate finding."""
    from onnx import helper

    node = helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2)
    g = _graph(tmp_path / "gn.onnx", [node], [("x", [1, 4, 8]), ("s", [2]), ("b", [2])], [("y", [1, 4, 8])], 18)
    assert not any("GroupNormalization" in f.message for f in check(g, "8.6").findings)
