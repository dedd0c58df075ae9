"""Issue 32, item 3: `kvedge plan` and `kvedge check` end with what deploys on the device's TensorRT (the precision,
lowering and runtime), or a plain statement that nothing does and why. A recipe is proved as far as this machine
can: its export is made and `kvedge check` finds nothing blocking for that TensorRT (no TensorRT here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvedge.cli import main
from kvedge.tensorrt.check import check
from kvedge.tensorrt.recipe import recipe
from tests.conftest import MAX_SEQ


def kvedge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvedge", *args], capture_output=True, text=True, timeout=300)


def test_what_each_tensorrt_builds_by_weights():
    assert recipe("10.3", "fp16").export == "--attention decomposed --dtype fp16"
    assert recipe("10.15", "fp16").export == "--attention onnx --dtype fp16"
    r = recipe("8.6", "int4")  # INT4 DequantizeLinear from 10.0 (onnx-tensorrt docs/operators.md 10.0)
    assert r.export is None and "TensorRT >= 10.0" in r.why and "none deploys" in r.line()
    for version in ("10.0", "10.3", "10.13", "10.16", "11.0"):  # issue 31: the DequantizeLinear form, any lowering
        assert recipe(version, "int4").export == f"--trt-version {version} --quantize int4 --dtype fp16"
    # weight-only INT8 builds but is no memory recipe: "Weight-only quantization is supported for INT4" (TensorRT docs)
    assert all(recipe(v, "int8").export is None and "INT4 only" in recipe(v, "int8").why
               for v in ("8.6", "10.3", "10.15", "11.0"))


@pytest.fixture(scope="module")
def llama128(tmp_path_factory):
    """A checkpoint whose projections take blocks of 128 (TensorRT's INT4 block sizes are 64 and 128)."""
    from tests.conftest import save_hf_model

    ckpt = tmp_path_factory.mktemp("recipe") / "llama128"
    save_hf_model(ckpt, "llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=1)
    return ckpt


@pytest.mark.parametrize("version,weights", [("10.3", "fp16"), ("10.15", "fp16"), ("10.3", "int4"),
                                             ("10.15", "int4"), ("11.0", "int4")])
def test_a_recipe_exports_a_graph_its_tensorrt_passes(version, weights, llama128, tmp_path, capsys):
    r = recipe(version, weights)
    out = tmp_path / "out"
    # --allow-degraded: the random tiny model's int4 is far from its float self; what is proved here is the form
    assert main(["export", str(llama128), "-o", str(out), *r.export.split(), "--max-seq-len", str(MAX_SEQ),
                 "--verify-steps", "2", "--calibration-tokens", "64", "--allow-degraded", "--quiet"]) == 0
    rep = check(out / "model.onnx", version)
    assert rep.buildable, [f.message for f in rep.findings]


@pytest.fixture(scope="module")
def three_b(tmp_path_factory):
    """Llama-3.2-3B's shape (config only): its fp16 weights (5.7 GiB) do not fit an Orin Nano 8GB's 5.5 usable."""
    from kvedge.models.demo import PRESETS

    folder = tmp_path_factory.mktemp("3b")
    (folder / "config.json").write_text(json.dumps(PRESETS["llama3.2-3b-shape"]))
    return folder


def test_plan_says_which_quantization_fits_with_its_context_and_what_deploys(three_b):
    """`kvedge plan CFG --device orin-nano-8gb --seq-len 4096` said DOES NOT FIT and "largest context 0 tokens", and
    nothing of --quantize int4. Now each weight choice is planned, and the last line says what the device's
    TensorRT (JetPack 6: 10.3) builds of what fits, or why nothing does and what runs on the CPU instead."""
    r = kvedge("plan", str(three_b), "--device", "orin-nano-8gb", "--seq-len", "4096")
    assert r.returncode == 1, r.stderr  # the fp16 plan asked for does not fit
    lines = r.stdout.splitlines()
    int4 = next(ln for ln in lines if ln.strip().startswith("--quantize int4"))
    assert "-> fits; largest context" in int4 and int(int4.split("largest context ")[1].split()[0]) >= 4096
    assert any(ln.strip().startswith("fp16") and "DOES NOT FIT" in ln for ln in lines)
    # JetPack 6's TensorRT 10.3 builds int4 (issue 31: INT4 DequantizeLinear from 10.0); int8 fits too, but TensorRT's
    # weight-only path is INT4 only, so the recipe passes over it
    assert lines[-1].startswith(f"recipe: int4 on TensorRT 10.3: kvedge export {three_b} -o OUT --trt-version 10.3 "
                                "--quantize int4 --dtype fp16, then on the device kvedge build OUT --precision fp16")
    r = kvedge("plan", str(three_b), "--device", "orin-nano-8gb", "--seq-len", "4096", "--trt-version", "8.6")
    recipe_line, cpu = r.stdout.splitlines()[-2:]
    assert recipe_line.startswith("recipe: none deploys on TensorRT 8.6: fp16 does not fit") and \
        "TensorRT >= 10.0" in recipe_line and "int8 fits, but TensorRT's weight-only quantization is INT4 only" \
        in recipe_line
    assert cpu.startswith("on the CPU instead: kvedge export") and "--quantize int8" in cpu
    info = json.loads(kvedge("plan", str(three_b), "--device", "orin-nano-8gb", "--json").stdout)
    assert info["weight_options"]["int4"]["fits"] and not info["weight_options"]["fp16"]["fits"]
    assert info["tensorrt"] == "10.3" and info["recipe"][0].startswith("recipe: int4 on TensorRT 10.3")


def test_check_does_not_offer_lowerings_that_cannot_carry_the_weights(exported, llama128, tmp_path):
    """`kvedge check` of an int4 export for TensorRT 10.3 suggested `--attention decomposed` and `--attention onnx`;
    neither carried int4 weights there then. It now ends with the recipe for those weights: the DequantizeLinear form
    `--trt-version` writes (issue 31), or none and why; a float export gets the lowering that builds."""
    out, _ = exported("llama-gqa4-llama3rope", "ort", quantize="int4", allow_degraded=True)
    r = kvedge("check", str(out / "model.onnx"), "--trt-version", "10.3")
    assert r.returncode == 1 and "--attention" not in r.stdout.split("TensorRT 10.3: NOT buildable")[0]  # findings
    assert r.stdout.splitlines()[-1].startswith("recipe: int4 on TensorRT 10.3: kvedge export ") and \
        "--trt-version 10.3 --quantize int4 --dtype fp16" in r.stdout.splitlines()[-1]
    r = kvedge("check", str(out / "model.onnx"), "--trt-version", "8.6")
    last = r.stdout.splitlines()
    assert last[-2].startswith("recipe: int4 on TensorRT 8.6: none deploys") and "TensorRT >= 10.0" in last[-2]
    assert last[-1].startswith("on the CPU instead:")
    float_out, _ = exported("llama-gqa4-llama3rope", "ort")
    r = kvedge("check", str(float_out / "model.onnx"), "--trt-version", "10.3")
    assert r.stdout.splitlines()[-1].startswith("recipe: fp32 on TensorRT 10.3: kvedge export ") and \
        "--attention decomposed --dtype fp32" in r.stdout
