"""The backend registry is the one list: kvedge.load, the CLI's choices and dispatch, bench and doctor read it."""

from __future__ import annotations

import importlib

import pytest

from kvedge.errors import KvedgeError
from kvedge.runtime import BACKENDS, LoadOptions, load


def test_every_backend_module_has_an_opener_and_its_class_names_itself():
    for name, info in BACKENDS.items():
        module = importlib.import_module(info.module)  # imports no TensorRT: the tensorrt module imports it late
        assert callable(module.open_backend), info.module
        assert info.reads in ("export", "checkpoint")
        assert name in {getattr(v, "name", None) for v in vars(module).values() if isinstance(v, type)}


def test_the_cli_offers_exactly_the_registered_backends():
    from kvedge.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    generate = next(a for a in sub["generate"]._actions if a.dest == "backend")
    assert tuple(generate.choices) == ("auto", *BACKENDS)
    for command in ("bench", "parity"):
        backend = next(a for a in sub[command]._actions if a.dest == "backend")
        assert all(name in backend.help for name in BACKENDS)


def test_doctor_has_a_line_for_every_backend():
    from kvedge import doctor

    lines = {row["feature"] for row in doctor.features(doctor.facts())}
    assert {info.feature for info in BACKENDS.values()} <= lines


def test_unknown_backend_names_the_registered_ones(tmp_path):
    with pytest.raises(KvedgeError, match="unknown backend 'nope'; choose one of " + ", ".join(BACKENDS)):
        load(tmp_path, backend="nope")


@pytest.mark.parametrize("name", [n for n, info in BACKENDS.items() if info.reads == "export"])
def test_export_backends_refuse_a_checkpoint_and_a_cache_dtype(name, hf_checkpoint):
    ckpt, _ = hf_checkpoint("llama-gqa4-llama3rope")
    with pytest.raises(KvedgeError, match=f"the {name} backend runs an export folder.*run `kvedge export` first"):
        BACKENDS[name].open(ckpt)
    with pytest.raises(KvedgeError, match="an export's cache dtype is fixed when it is exported"):
        BACKENDS[name].open(ckpt, LoadOptions(kv_dtype="int8"))


def test_fused_attention_false_keeps_the_reference_attention_op(hf_checkpoint, monkeypatch):
    """On CUDA the torch backend runs the Triton kernels unless fused_attention=False, which a parity reference
    needs (tests/tensorrt/test_trt_engine.py): else TensorRT would be compared with the kernels. Checked on CPU:
    the choice with a stand-in for the kernels' module, and the option followed from kvedge.load to it."""
    import sys
    import types

    import torch

    from kvedge.models.attention import attention
    from kvedge.runtime import torch_backend

    kernels = types.ModuleType("kvedge.kernels.op")  # stands in for the Triton op, which needs triton and CUDA
    kernels.attention_op = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "kvedge.kernels.op", kernels)
    cuda = torch.device("cuda")
    assert torch_backend.attention_op_for(cuda, True, None) is kernels.attention_op
    assert torch_backend.attention_op_for(cuda, False, None) is attention
    assert torch_backend.attention_op_for(cuda, True, "int8") is attention  # the int8 cache: the reference only
    assert torch_backend.attention_op_for(torch.device("cpu"), True, None) is attention

    asked = []

    def choose(device, fused_attention, kv_dtype):
        asked.append(fused_attention)
        return attention

    monkeypatch.setattr(torch_backend, "attention_op_for", choose)
    ckpt, _ = hf_checkpoint("llama-gqa4-llama3rope")
    for fused in (False, True):
        backend = load(ckpt, "torch", device="cpu", max_batch=1, max_seq_len=16, fused_attention=fused).backend
        assert backend.model.attention_op is attention and not backend.fused
    assert asked == [False, True]
