"""Every bad checkpoint gives a KvedgeError that names the file or tensor and what was expected."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvedge.errors import CheckpointError, ConfigError, KvedgeError
from kvedge.models import KVCache, load_config, load_decoder


@pytest.fixture
def ckpt(tmp_path, hf_checkpoint):
    """A private copy of a tiny llama checkpoint that a test may break."""
    src, _ = hf_checkpoint("llama-gqa2-bias")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path, fn):
    w = load_file(path / "model.safetensors")
    fn(w)
    save_file(w, path / "model.safetensors")


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_decoder(tmp_path)


def test_malformed_config(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "llama",\n "hidden_size": }')
    with pytest.raises(ConfigError, match=r"config\.json: malformed JSON at line 2"):
        load_decoder(ckpt)


def test_unknown_model_type(ckpt):
    edit_config(ckpt, model_type="mamba")
    with pytest.raises(ConfigError, match=r"unknown model_type 'mamba'; kvedge supports llama"):
        load_decoder(ckpt)


def test_missing_required_key(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"missing required key 'num_hidden_layers'"):
        load_decoder(ckpt)


def test_heads_not_dividing(ckpt):
    edit_config(ckpt, num_attention_heads=8, num_key_value_heads=3)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(8\) is not divisible by num_key_value_heads \(3\)"):
        load_decoder(ckpt)


def test_hidden_not_dividing_heads_without_head_dim(ckpt):
    edit_config(ckpt, num_attention_heads=6, num_key_value_heads=3, head_dim=None)
    with pytest.raises(ConfigError, match=r"hidden_size \(64\) is not divisible by num_attention_heads \(6\)"):
        load_decoder(ckpt)


def test_unsupported_rope_type(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ConfigError, match=r"rope type 'yarn' is not supported"):
        load_decoder(ckpt)


def test_missing_tensor(ckpt):
    edit_weights(ckpt, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) for llama: model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_decoder(ckpt)


def test_extra_tensor(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.layers.2.self_attn.q_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) for llama with 2 layers: model\.layers\.2"):
        load_decoder(ckpt)


def test_shape_mismatch(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}))
    with pytest.raises(CheckpointError,
                       match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape \[95, 64\], expected \[96, 64\]"):
        load_decoder(ckpt)


def test_dtype_mismatch(ckpt):
    def to_int(w):
        w["model.norm.weight"] = w["model.norm.weight"].to(torch.int32)

    edit_weights(ckpt, to_int)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' has dtype I32, expected a floating dtype"):
        load_decoder(ckpt)


def logits(model, ids):
    n = ids.shape[1]
    return model(ids, torch.arange(n)[None], KVCache.allocate(model.cfg, 1, n).for_batch(1))


def test_bin_only_checkpoint_is_refused_unless_asked_then_gives_the_same_logits(ckpt, hf_checkpoint):
    ids = torch.arange(3, 15)[None]
    from_safetensors = logits(load_decoder(ckpt), ids)
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"only pickled \.bin weights.*safe_serialization=True.*allow_bin=True"):
        load_decoder(ckpt)
    # When asked, it is read with weights_only=True and gives the same model: the safetensors load's logits
    # exactly, and transformers' (the model these weights came from) within float error.
    got = logits(load_decoder(ckpt, allow_bin=True), ids)
    assert torch.equal(got, from_safetensors)
    assert (got - hf_checkpoint("llama-gqa2-bias")[1](ids).logits).abs().max().item() < 1e-4


UNPICKLED: list[bool] = []


def _record_unpickling():
    UNPICKLED.append(True)
    return torch.ones(64)  # what a malicious pickle could hand back after running its code


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return _record_unpickling, ()


def test_bin_holding_anything_but_tensors_is_refused_and_nothing_in_it_runs(ckpt):
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    state["model.norm.weight"] = _RunsCodeWhenUnpickled()
    torch.save(state, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: not a weights-only state dict, "
                                              r"torch\.load\(weights_only=True\) refused it \(Unsupported global"):
        load_decoder(ckpt, allow_bin=True)
    assert not UNPICKLED, "the pickle's code ran"
    state["model.norm.weight"] = 3  # plain values pass weights_only=True; a state dict holds tensors
    torch.save(state, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"expected a state dict \{name: tensor\}, found 'model\.norm\.weight': "
                                              r"a int"):
        load_decoder(ckpt, allow_bin=True)


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_decoder(ckpt)


def test_index_naming_a_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"lists shard\(s\) that do not exist: model-00002\.safetensors"):
        load_decoder(ckpt)


def test_all_errors_are_one_family():
    assert issubclass(ConfigError, KvedgeError) and issubclass(CheckpointError, KvedgeError)


def test_good_checkpoint_still_loads(ckpt):
    cfg = load_config(ckpt)
    assert (cfg.arch, cfg.num_heads, cfg.num_kv_heads, cfg.attention_kind) == ("llama", 8, 4, "GQA")
    model = load_decoder(ckpt)
    out = model(torch.tensor([[3, 4, 5]]), torch.arange(3)[None], KVCache.allocate(cfg, 1, 8).for_batch(1))
    assert torch.isfinite(out).all()
