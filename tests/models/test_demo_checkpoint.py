"""The built-in demo checkpoint is deterministic and is a real Hugging Face checkpoint."""

import hashlib

import torch

from kvedge.models import KVCache, load_decoder
from kvedge.models.demo import write_demo_checkpoint


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_deterministic(tmp_path):
    a = write_demo_checkpoint(tmp_path / "a")
    b = write_demo_checkpoint(tmp_path / "b")
    assert digest(a) == digest(b)


def test_transformers_loads_it_and_agrees_with_kvedge(tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = write_demo_checkpoint(tmp_path / "demo")
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    ids = tok("Hello, Jetson!", return_tensors="pt").input_ids
    assert ids[0].tolist() == [0] + [b + 3 for b in b"Hello, Jetson!"]  # <s>, then id = byte + 3
    model = load_decoder(path)
    with torch.no_grad():
        ref = hf(ids).logits
    got = model(ids, torch.arange(ids.shape[1])[None], KVCache.allocate(model.cfg, 1, 32).for_batch(1))
    assert (got - ref).abs().max() < 1e-4
    assert model.cfg.num_heads // model.cfg.num_kv_heads == 4
