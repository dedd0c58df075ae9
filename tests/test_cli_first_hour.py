"""Issue 32, the small things a new user meets in the first hour, each through the command line as they meet it
(a subprocess running `python -m kvedge`): errors name the real cause in one line, numeric options are checked
while the command line is read, a closed pipe ends a command quietly, help and progress lines say what is true."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kvedge.models.demo import write_demo_checkpoint


def kvedge(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvedge", *args], capture_output=True, text=True, timeout=timeout,
                          **kw)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The refusal a user sees: exit 2, nothing on stdout, one line on stderr starting `kvedge: error:`."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == "" and r.stderr.startswith("kvedge: error: ") and r.stderr.count("\n") == 1, r.stderr
    return r.stderr.strip()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("first-hour") / "ckpt")


@pytest.mark.parametrize("argv", [
    ["generate", "{nope}", "--prompt", "hi"],
    ["generate", "{nope}", "--prompt", "hi", "--backend", "native"],
    ["eval", "{nope}"],
    ["parity", "{nope}"],
    ["bench", "{nope}"],
    ["plan", "{nope}"],
    ["info", "{nope}"],
    ["export", "{nope}", "-o", "{out}"],
    ["check", "{nope}", "--trt-version", "10.3"],
    ["import-gguf", "{nope}", "-o", "{out}"],
    ["eval", "{ckpt}", "--reference", "{nope}"],
])
def test_a_missing_path_is_named_as_missing(argv, ckpt, tmp_path):
    """`kvedge generate /nope` said "the torch backend needs the Hugging Face checkpoint ...": the path does not
    exist, and that is what the user should read, whatever the command or backend."""
    nope = tmp_path / "nope"
    argv = [a.format(nope=nope, out=tmp_path / "out", ckpt=ckpt) for a in argv]
    err = one_line_error(kvedge(*argv))
    assert f"no such file or directory: {nope}" in err and "backend" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, flag", [
    (["generate", "{ckpt}", "--prompt", "hi", "--max-seq-len", "0"], "--max-seq-len"),
    (["generate", "{ckpt}", "--prompt", "hi", "--backend", "native", "--max-seq-len", "-5"], "--max-seq-len"),
    (["generate", "{ckpt}", "--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["generate", "{ckpt}", "--prompt", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "{ckpt}", "--prompt", "hi", "--temperature", "-1"], "--temperature"),
    (["serve", "{ckpt}", "--port", "70000"], "--port"),
    (["serve", "{ckpt}", "--max-batch", "0"], "--max-batch"),
    (["serve", "{ckpt}", "--ray", "--autoscale", "3:1"], "--autoscale"),
    (["serve", "{ckpt}", "--ray", "--autoscale", "0:0"], "--autoscale"),
    (["serve", "{ckpt}", "--ray", "--replica-resource", "orin"], "--replica-resource"),
    (["serve", "{ckpt}", "--ray", "--replica-resource", "orin=0"], "--replica-resource"),
    (["serve", "{ckpt}", "--ray", "--replica-gpus", "-1"], "--replica-gpus"),
    (["export", "{ckpt}", "-o", "{out}", "--max-seq-len", "0"], "--max-seq-len"),
    (["export", "{ckpt}", "-o", "{out}", "--max-batch", "0"], "--max-batch"),
    (["export", "{ckpt}", "-o", "{out}", "--group-size", "48"], "--group-size"),
    (["export", "{ckpt}", "-o", "{out}", "--calibration-tokens", "1"], "--calibration-tokens"),
    (["eval", "{ckpt}", "--tokens", "1"], "--tokens"),
    (["eval", "{ckpt}", "--batch", "0"], "--batch"),
    (["bench", "{ckpt}", "--prompt-lens", "128,0"], "--prompt-lens"),
    (["bench", "{ckpt}", "--batch", "x"], "--batch"),
    (["bench", "{ckpt}", "--repeat", "0"], "--repeat"),
    (["parity", "{ckpt}", "--steps", "0"], "--steps"),
    (["plan", "{ckpt}", "--seq-len", "-1"], "--seq-len"),
    (["plan", "{ckpt}", "--memory-gb", "0"], "--memory-gb"),
    (["build", "{ckpt}", "--workspace-gb", "-2"], "--workspace-gb"),
])
def test_numeric_options_are_checked_while_the_command_line_is_read(argv, flag, ckpt, tmp_path):
    """`--max-seq-len 0` was accepted and failed later (the native backend: a torch traceback; with a positive but
    short length, advice for the Python API). The refusal names the flag, before anything is loaded: the
    checkpoint is a real one, so the only thing wrong is the number."""
    argv = [a.format(ckpt=ckpt, out=tmp_path / "out") for a in argv]
    err = one_line_error(kvedge(*argv, timeout=60))
    assert err.startswith(f"kvedge: error: argument {flag}: ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [["--replicas", "2"], ["--autoscale", "1:3"], ["--replica-resource", "orin=1"]])
def test_replica_flags_without_ray_say_to_add_it(flags, ckpt):
    """A replica count or placement means a Ray cluster; without --ray it is refused, not ignored (the single
    server would start as if it had not been asked)."""
    err = one_line_error(kvedge("serve", str(ckpt), *flags, timeout=60))
    assert err.startswith(f"kvedge: error: {flags[0]}") and "--ray" in err


def test_a_too_long_prompt_names_the_flag_that_drops_tokens(ckpt):
    err = one_line_error(kvedge("generate", str(ckpt), "--backend", "torch", "--max-seq-len", "8", "--prompt",
                                "a prompt longer than eight tokens", "--max-new-tokens", "2"))
    assert "--truncate" in err


@pytest.mark.parametrize("argv", [
    ["generate", "{ckpt}", "--backend", "nope", "--prompt", "hi"],
    ["export", "{ckpt}"],
    ["nope"],
    [],
    ["plan", "{ckpt}", "--device", "nope"],
])
def test_a_usage_mistake_is_one_line_not_a_usage_block(argv, ckpt):
    err = one_line_error(kvedge(*[a.format(ckpt=ckpt) for a in argv], timeout=60))
    assert "usage:" not in err


def test_plan_refuses_an_fp8_cache_that_no_backend_has(ckpt):
    """docs/quantization.md says there is no fp8 cache, and none of kvedge's exports or backends has one: plan
    must not plan for it."""
    from kvedge.dtypes import KV_DTYPES

    assert "fp8" not in KV_DTYPES
    err = one_line_error(kvedge("plan", str(ckpt), "--kv-dtype", "fp8", timeout=60))
    assert "--kv-dtype" in err and "fp8" in err


@pytest.mark.parametrize("argv", [["plan", "{ckpt}", "--device", "orin-nano-8gb"], ["info", "{ckpt}"],
                                  ["doctor", "--json"]])
def test_a_closed_pipe_ends_a_command_quietly(argv, ckpt):
    """`kvedge plan ... | head -3` ended in a BrokenPipeError traceback. Here the pipe's reading end is closed before
    the command writes, so its first write fails, whatever its length."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "kvedge", *[a.format(ckpt=ckpt) for a in argv]], stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert r.stderr == "" and r.returncode == 141  # as a shell reports a command ended by SIGPIPE


def test_export_help_says_a_gguf_file_works():
    r = kvedge("export", "--help", timeout=60)
    assert r.returncode == 0
    model = re.search(r"^  model\s+(.*?)\n\S", r.stdout.split("positional arguments:")[1], re.S | re.M)
    assert model and ".gguf" in model.group(1), r.stdout


def test_parity_prints_the_paths_it_wrote(demo_export, tmp_path):
    _, onnx_dir = demo_export(64, 1)
    r = kvedge("parity", str(onnx_dir), "--steps", "2", "--prompt-len", "4", "-o", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    for name in ("parity-onnxruntime.json", "parity-onnxruntime.md"):
        assert str(tmp_path / "rep" / name) in r.stderr and (tmp_path / "rep" / name).is_file()
    assert "*" not in r.stderr


def test_doctor_says_triton_needs_a_gpu_when_it_is_installed():
    """`kvedge doctor` said "needs: pip install triton" with triton installed; it only lacks a GPU."""
    from kvedge import doctor

    f = {**doctor.facts(), "triton": "3.9.0", "cuda_available": False}
    row = next(r for r in doctor.features(f) if r["feature"].startswith("Triton"))
    assert not row["available"] and "pip install triton" not in row["needs"] and "GPU" in row["needs"]
    f = {**f, "triton": None}
    row = next(r for r in doctor.features(f) if r["feature"].startswith("Triton"))
    assert "pip install triton" in row["needs"]


def test_the_demo_numbers_each_step_once(tmp_path):
    """`make demo` printed "[3/4]" twice. The demo of a real GGUF file (`kvedge demo --model`, what make demo runs),
    on a tiny one with a tokenizer and a chat template: its steps are [1/n] .. [n/n], each once, in order."""
    from tests.conftest import ARCH_CASES
    from tests.gguf_files import save_hf_checkpoint, write_gguf

    model_type, overrides = ARCH_CASES["llama-gqa4-llama3rope"]
    save_hf_checkpoint(tmp_path / "hf", model_type, **{**overrides, "max_position_embeddings": 1024})
    gguf = write_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", "Q8_0", extra=lambda w: w.add_chat_template(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    r = kvedge("demo", "--model", str(gguf), "--out", str(tmp_path / "demo"), "--max-new-tokens", "2", "--threads", "2")
    assert r.returncode == 0, r.stderr
    steps = re.findall(r"^\[(\d+)/(\d+)\]", r.stderr, re.M)
    n = len(steps)
    assert n >= 4 and steps == [(str(i), str(n)) for i in range(1, n + 1)], steps
