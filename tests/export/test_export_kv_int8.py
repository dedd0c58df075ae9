"""`--kv-dtype int8` through the ort lowering: the graph against the int8-cache PyTorch model, the runtime
over int8 caches bound in place, and the refusals."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from kvedge.errors import KvedgeError
from kvedge.export import ExportOptions, export
from kvedge.runtime.calibration import calibration_rows
from kvedge.models import KVCache, ModelConfig, load_decoder
from kvedge.runtime.calibration import calibrate_kv_scales
from kvedge.runtime import Session
from kvedge.runtime.ort_backend import OrtBackend
from tests.conftest import MAX_SEQ

CASE, PROMPT, STEPS = "llama-gqa4-llama3rope", 16, 16


@pytest.fixture(scope="module")
def int8_export(exported):
    return exported(CASE, "ort", kv_dtype="int8")


def test_int8_cache_export_matches_the_int8_reference_and_stays_close_to_the_float_cache(int8_export, hf_checkpoint):
    out, sidecar = int8_export
    ckpt = hf_checkpoint(CASE)[0]
    record = json.loads((out / "kvedge.json").read_text())
    assert record["cache"]["dtype"] == "int8" and sidecar.cache_dtype == "int8"
    assert record["cache"]["quantization"]["scales"]["k"] == ["k_scale_0", "k_scale_1"]
    assert all(i["dtype"] == "int8" for i in record["inputs"][3:] + record["outputs"][1:])
    v = sidecar.verification
    assert v["passed"] and v["greedy_agreement"] == 1.0 and v["vs_fp_cache"]["top1_agreement"] >= 0.9

    model = load_decoder(ckpt)
    rows, _ = calibration_rows(ckpt, model.cfg, None, 2048)
    # what export calibrated: the same text, the same model (the rule itself: the two tests below, independently)
    scales = calibrate_kv_scales(model, rows)
    backend = OrtBackend(out)
    assert all(t.dtype == torch.int8 for t in backend.cache_tensors())
    cache = KVCache.allocate(model.cfg, 1, MAX_SEQ, dtype=torch.int8, scales=scales)
    fp_cache = KVCache.allocate(model.cfg, 1, MAX_SEQ)
    ids = torch.randint(3, model.cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    pos, last = torch.arange(PROMPT)[None], torch.tensor([PROMPT - 1])
    worst, greedy_equal, fp_agree = 0.0, True, 0
    with torch.inference_mode():
        for step in range(STEPS + 1):
            ref = model(ids, pos, cache.for_batch(1), logit_index=last)
            fp = model(ids, pos, fp_cache.for_batch(1), logit_index=last)
            got = backend.forward(ids, pos, last)
            worst = max(worst, (ref - got).abs().max().item())
            greedy_equal &= bool(ref.argmax(-1) == got.argmax(-1))
            fp_agree += int(fp.argmax(-1) == got.argmax(-1))
            ids, pos, last = ref[:, -1].argmax(-1, keepdim=True), torch.tensor([[PROMPT + step]]), torch.tensor([0])
    assert worst < 1e-4 and greedy_equal  # measured 1.9e-6
    reference_caches = [t for kv in zip(cache.keys, cache.values) for t in kv]
    assert all(torch.equal(a[:1], b) for a, b in zip(backend.cache_tensors(), reference_caches))  # same bytes
    assert fp_agree / (STEPS + 1) >= 0.9  # measured 17 / 17 (verification's random prompt: 100%; text: 99%)


def test_calibration_takes_max_abs_per_layer_kv_head_and_channel_times_the_margin_over_127():
    """The rule of docs/quantization.md, on a cache built by hand: per layer, KV head and channel, the largest |k|
    and |v| over every row and position, times the margin 1.5, / 127; a channel never written gets 1e-8."""
    cfg = ModelConfig(arch="llama", vocab_size=16, hidden_size=6, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=3,
                      intermediate_size=4, positions="learned")  # the cache's shape is what matters here
    planted = {  # (row, layer, side, head, position, channel) -> value written into the cache
        (0, 0, "k", 0, 1, 0): 2.54, (1, 0, "k", 0, 2, 0): -1.27,  # the larger |k| is in the first row
        (1, 0, "k", 1, 0, 2): -6.35,  # a negative one
        (0, 1, "v", 1, 2, 1): 12.7, (1, 1, "v", 1, 1, 1): 25.4}

    class Writer(torch.nn.Module):  # writes the planted values of the row it is given (row r starts with token r)
        def __init__(self):
            super().__init__()
            self.cfg, self.w = cfg, torch.nn.Parameter(torch.zeros(1))

        def forward(self, ids, positions, cache, logit_index):
            for (r, layer, side, h, t, d), x in planted.items():
                if r == int(ids[0, 0]):
                    cache[layer][0 if side == "k" else 1][0, h, t, d] = x

    k, v = calibrate_kv_scales(Writer(), torch.tensor([[0, 5, 6], [1, 7, 8]]))
    tiny = 1e-8
    want_k0 = torch.tensor([[2.54 * 1.5 / 127, tiny, tiny], [tiny, tiny, 6.35 * 1.5 / 127]])
    want_v1 = torch.tensor([[tiny, tiny, tiny], [tiny, 25.4 * 1.5 / 127, tiny]])
    assert [t.shape for t in k + v] == [(1, 2, 1, 3)] * 4 and all(t.dtype == torch.float32 for t in k + v)
    torch.testing.assert_close(k[0][0, :, 0], want_k0)
    torch.testing.assert_close(v[1][0, :, 0], want_v1)
    torch.testing.assert_close(k[1], torch.full((1, 2, 1, 3), tiny))
    torch.testing.assert_close(v[0], torch.full((1, 2, 1, 3), tiny))
    k, _ = calibrate_kv_scales(Writer(), torch.tensor([[0, 5, 6], [1, 7, 8]]), margin=1.0)
    torch.testing.assert_close(k[0][0, 1, 0, 2], torch.tensor(6.35 / 127))


def test_the_exported_scales_follow_the_rule_on_transformers_own_cache(int8_export, hf_checkpoint):
    """The export's k_scale_i / v_scale_i initializers against the rule applied to transformers' cache (k after RoPE)
    over the calibration rows: no kvedge model in the reference."""
    out, sidecar = int8_export
    ckpt, hf = hf_checkpoint(CASE)
    rows, _ = calibration_rows(ckpt, sidecar.model, None, 2048)  # the text export calibrates on, as token rows
    with torch.inference_mode():
        caches = [hf(row[None], use_cache=True).past_key_values.layers for row in rows]
    graph = onnx.load(str(out / "model.onnx")).graph
    inits = {t.name: torch.tensor(onnx.numpy_helper.to_array(t)) for t in graph.initializer if "_scale_" in t.name}
    for i in range(sidecar.model.num_layers):
        for side, name in (("keys", "k"), ("values", "v")):
            absmax = torch.stack([getattr(c[i], side)[0].abs().amax(1) for c in caches]).amax(0)  # [Hkv, D]
            got = inits[f"{name}_scale_{i}"]
            torch.testing.assert_close(got.reshape(absmax.shape), absmax * 1.5 / 127, rtol=1e-4, atol=0)


def test_torch_backend_runs_the_int8_reference(int8_export, hf_checkpoint):
    from kvedge.runtime.torch_backend import TorchBackend

    torch_backend = TorchBackend(hf_checkpoint(CASE)[0], max_batch=1, max_seq_len=MAX_SEQ, kv_dtype="int8")
    ort_backend = OrtBackend(int8_export[0], max_batch=1)
    assert all(t.dtype == torch.int8 for t in torch_backend.cache_tensors())
    ids, pos, last = torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(5)[None], torch.tensor([4])
    for _ in range(3):
        ref, got = torch_backend.forward(ids, pos, last), ort_backend.forward(ids, pos, last)
        assert (ref - got).abs().max().item() < 1e-4
        ids, pos, last = ref[:, -1].argmax(-1, keepdim=True), pos[:, -1:] + 1, torch.tensor([0])


def test_session_generates_over_int8_caches_that_stay_put(int8_export):
    backend = OrtBackend(int8_export[0])
    session = Session(backend)
    addresses = [t.data_ptr() for t in backend.cache_tensors()]
    session.prefill([[5, 6, 7, 8], [9, 10]])
    assert [v.data_ptr() for v in backend.binding.get_outputs()[:-1]] == addresses  # present is the cache itself
    for _ in range(12):
        session.decode([11, 12])
    assert [t.data_ptr() for t in backend.cache_tensors()] == addresses
    assert backend.cache_tensors()[0][:2, :, :16].abs().sum() > 0  # written, as int8
    assert session.lengths[:2].tolist() == [16, 14]


@pytest.mark.parametrize("lowering", ["onnx", "decomposed", "trt"])
def test_other_lowerings_refuse_an_int8_cache(lowering, hf_checkpoint, tmp_path):
    with pytest.raises(KvedgeError, match=f"the '{lowering}' lowering cannot export an int8 KV cache: no int8 KV "
                                          f"cache in the '{lowering}' lowering.*use --attention ort"):
        export(hf_checkpoint(CASE)[0], tmp_path / "out", ExportOptions(attention=lowering, kv_dtype="int8"))


@pytest.mark.parametrize("kv_dtype,message", [("int4", "--kv-dtype 'int4': expected one of fp32, fp16, bf16, int8"),
                                              ("fp16", "--kv-dtype fp16 with --dtype fp32: a float cache has the "
                                                       "model's dtype")])
def test_bad_kv_dtypes_are_refused(kv_dtype, message, hf_checkpoint, tmp_path):
    with pytest.raises(KvedgeError, match=message):
        export(hf_checkpoint(CASE)[0], tmp_path / "out", ExportOptions(kv_dtype=kv_dtype))
    assert not (tmp_path / "out").exists()
