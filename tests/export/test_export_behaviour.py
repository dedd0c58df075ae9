"""Export's behaviour: dtypes, refusals, atomic sidecar, external data, and the CLI."""

from __future__ import annotations

import onnx
import pytest
import torch

from kvedge.cli import main
from kvedge.errors import KvedgeError
from kvedge.artifact import SIDECAR, Sidecar
from kvedge.export import ExportOptions, export
from kvedge.export import exporter as exporter_module
from kvedge.models import KVCache, load_decoder
from kvedge.runtime.ort_backend import OrtBackend


@pytest.mark.parametrize("dtype,elem", [("fp16", onnx.TensorProto.FLOAT16), ("bf16", onnx.TensorProto.BFLOAT16)])
@pytest.mark.parametrize("lowering", ["decomposed", "onnx"])
def test_half_precision_exports_pass_checker_and_carry_half_caches(dtype, elem, lowering, exported):
    out, sidecar = exported("llama-gqa4-llama3rope", lowering, dtype=dtype)
    model = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    caches = [v for v in model.graph.input if v.name.startswith("past_")]
    assert caches and all(v.type.tensor_type.elem_type == elem for v in caches)
    v = sidecar.verification
    if dtype == "bf16":
        assert "no bf16 kernels" in v["skipped"]
    else:  # ONNX Runtime CPU runs fp16: compared with PyTorch in fp16
        assert v["passed"] and v["min_cosine"] >= 0.999


def test_fp16_runtime_agrees_with_pytorch_fp16(exported, hf_checkpoint):
    out, _ = exported("llama-gqa4-llama3rope", "decomposed", dtype="fp16")
    model = load_decoder(hf_checkpoint("llama-gqa4-llama3rope")[0], dtype="fp16")
    backend = OrtBackend(out, max_batch=1)
    ids = torch.arange(3, 19)[None]
    ref = model(ids, torch.arange(16)[None], KVCache.allocate(model.cfg, 1, 64, dtype=torch.float16).for_batch(1),
                logit_index=torch.tensor([15])).float()
    got = backend.forward(ids, torch.arange(16)[None], torch.tensor([15])).float()
    assert torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0) > 0.999


def test_existing_folder_is_refused_without_force(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint("llama-mha")
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(KvedgeError, match="exists and is not empty; pass --force"):
        export(path, tmp_path, ExportOptions(max_seq_len=32))
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_failed_verification_leaves_nothing(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint("llama-mha")
    with pytest.raises(KvedgeError, match=r"verification failed: the graph against PyTorch: max abs logit error .* > "
                                          r"0 x .*; nothing was written"):
        export(path, tmp_path / "out", ExportOptions(max_seq_len=32, tolerance={"max_rel": 0.0, "min_cosine": -1.0}))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lowering,scheme", [("ort", "int4"), ("onnx", "int8")])
def test_verification_fails_on_a_quantized_graph_with_one_weight_changed(lowering, scheme, tmp_path, hf_checkpoint,
                                                                         monkeypatch):
    """The quantized export tests rely on verify()'s verdict: here it fails. Once the graph is saved and checked, one
    stored byte of the first quantized weight (MatMulNBits' B, or DequantizeLinear's x) is changed in the saved file
    (onnx load, edit, save); the export's verification must then refuse it against the quantized PyTorch model."""
    from onnx import numpy_helper

    check_onnx = exporter_module.check_onnx

    def check_then_perturb(path):
        check_onnx(path)
        model = onnx.load(str(path))
        node = next(n for n in model.graph.node if n.op_type in ("MatMulNBits", "DequantizeLinear"))
        name = node.input[1] if node.op_type == "MatMulNBits" else node.input[0]
        init = next(t for t in model.graph.initializer if t.name == name)
        w = numpy_helper.to_array(init).copy()
        assert w.dtype == ("uint8" if node.op_type == "MatMulNBits" else "int8"), w.dtype
        w.view("uint8").flat[0] ^= 0x88  # a packed int4 byte: both weights move by 8 steps; an int8 one by 120 / 136
        init.CopyFrom(numpy_helper.from_array(w, name))
        onnx.save(model, str(path))

    monkeypatch.setattr(exporter_module, "check_onnx", check_then_perturb)
    path, _ = hf_checkpoint("llama-gqa4-llama3rope")
    with pytest.raises(KvedgeError, match=r"verification failed: the graph against PyTorch: max abs logit error .* > "
                                          r"0.001 x .*; nothing was written"):
        export(path, tmp_path / "out", ExportOptions(attention=lowering, quantize=scheme, max_seq_len=32,
                                                     verify_steps=4, calibration_tokens=64, allow_degraded=True))
    assert not (tmp_path / "out").exists()


def test_interrupted_export_keeps_the_old_one_whole_and_a_rerun_replaces_it(tmp_path, hf_checkpoint):
    """An export writes into a staging folder beside OUT and moves its files in at the end: interrupted, the earlier
    export in OUT is as it was (its sidecar beside its own graph, never a stale sidecar beside a new graph); a rerun
    replaces it."""
    path, _ = hf_checkpoint("llama-mha")
    out = tmp_path / "out"
    export(path, out, ExportOptions(max_seq_len=32, verify=False))
    graph = (out / "model.onnx").read_bytes()

    def interrupt(msg):
        if msg.split("] ", 1)[1].startswith("verifying"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export(path, out, ExportOptions(max_seq_len=48, force=True), progress=interrupt)
    assert Sidecar.read(out).max_seq_len == 32 and (out / "model.onnx").read_bytes() == graph
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not list(out.glob(".kvedge-*"))
    export(path, out, ExportOptions(max_seq_len=48, force=True, verify_steps=2))
    assert Sidecar.read(out).max_seq_len == 48 and (out / "model.onnx").read_bytes() != graph


def test_lowering_refuses_what_it_cannot_express(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint("gemma2")
    with pytest.raises(KvedgeError, match=r"'onnx' lowering cannot express this gemma2 model: attention logit softcapping"):
        export(path, tmp_path / "o", ExportOptions(attention="onnx"))
    assert not (tmp_path / "o").exists()


def test_ort_refuses_a_head_dim_that_is_not_a_multiple_of_8(tmp_path):
    """Issue 17, item 11: ONNX Runtime's GroupQueryAttention fails at run time on a head size that is not a multiple
    of 8 ("head_size must be a multiple of 8", onnxruntime 1.32, seen on a gpt2 with 6 heads of 12): the ort
    lowering (the default) refuses it before anything is written, with the reason and the lowering to use."""
    from tests.conftest import save_hf_model

    save_hf_model(tmp_path / "gpt2", "gpt2", n_embd=72, n_layer=1, n_head=6, vocab_size=160, n_positions=64,
                  bos_token_id=1, eos_token_id=2)
    with pytest.raises(KvedgeError, match=r"^the 'ort' lowering cannot express this gpt2 model: head_dim 12 is not a "
                                          r"multiple of 8, which ONNX Runtime's GroupQueryAttention requires\. "
                                          r"Use --attention decomposed$"):
        export(tmp_path / "gpt2", tmp_path / "o", ExportOptions(max_seq_len=32))
    assert not (tmp_path / "o").exists()


def test_bad_options(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint("gpt2")
    with pytest.raises(KvedgeError, match=r"--max-seq-len 4096 exceeds this model's learned positions \(128\)"):
        export(path, tmp_path / "o", ExportOptions(max_seq_len=4096))
    with pytest.raises(KvedgeError, match=r"unknown attention lowering 'flash'"):
        export(path, tmp_path / "o", ExportOptions(attention="flash"))
    with pytest.raises(KvedgeError, match=r"--dtype 'int3'"):
        export(path, tmp_path / "o", ExportOptions(dtype="int3"))


def test_large_weights_go_to_external_data(tmp_path, hf_checkpoint, monkeypatch):
    monkeypatch.setattr(exporter_module, "EXTERNAL_DATA_THRESHOLD", 1024)  # as if the weights were > 2 GiB
    path, _ = hf_checkpoint("llama-mha")
    out = tmp_path / "out"
    sidecar = export(path, out, ExportOptions(max_seq_len=32))
    assert sidecar.external_data == "model.onnx.data" and (out / "model.onnx.data").is_file()
    assert (out / "model.onnx").stat().st_size < (out / "model.onnx.data").stat().st_size
    assert sidecar.verification["passed"]
    assert Sidecar.read(out).external_data == "model.onnx.data"


def test_cli_export_progress_and_tokenizer_files(tmp_path, capsys):
    main(["make-demo", str(tmp_path / "demo")])
    rc = main(["export", str(tmp_path / "demo"), "-o", str(tmp_path / "out"), "--max-seq-len", "64",
               "--attention", "onnx", "--verify-steps", "4"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "tracing to ONNX" in captured.err and "verifying" in captured.err
    assert "verified: max abs" in captured.out
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / SIDECAR).is_file()
    assert main(["export", str(tmp_path / "demo"), "-o", str(tmp_path / "out")]) == 2
