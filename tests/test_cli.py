"""The command line: the demo runs end to end, info reports the config, errors are one clean line."""

import json

from kvedge.cli import main


def test_demo_runs_and_prints_throughput(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--max-new-tokens", "8", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "output:" in out and "tokens/s" in out and "parity: onnxruntime tokens == torch tokens" in out
    assert (tmp_path / "onnx" / "kvedge.json").is_file()
    assert (tmp_path / "checkpoint" / "model.safetensors").is_file()


def test_info_json(tmp_path, capsys):
    main(["make-demo", str(tmp_path / "m")])
    capsys.readouterr()
    assert main(["info", str(tmp_path / "m"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # demo: 4 layers, 2 kv heads, head_dim 32, fp16 -> 2 * 4 * 2 * 32 * 2 bytes
    assert info["kv_bytes_per_token"] == 1024 and info["attention"] == "GQA"


def test_error_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvedge: error:") and "config.json" in err and "Traceback" not in err


def test_an_onnxruntime_failure_is_one_line_and_exit_code_2(exported, tmp_path, capsys):
    """Issue 17, item 11: an error raised inside ONNX Runtime while a command runs reaches the user as one line
    naming the library, exit 2; --debug keeps the traceback. A real failure: GroupQueryAttention told its query has
    16 heads of 4 (64 / 16) refuses at run time ("head_size must be a multiple of 8"); onnxruntime 1.32 raises it as
    a plain RuntimeError from InferenceSession.run_with_iobinding, so the CLI knows it by where it was raised."""
    import shutil

    import onnx
    import pytest

    src, _ = exported("llama-gqa4-llama3rope", "ort")
    out = tmp_path / "broken"
    shutil.copytree(src, out)
    model = onnx.load(str(out / "model.onnx"))
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    next(a for a in gqa.attribute if a.name == "num_heads").i = 16
    onnx.save(model, str(out / "model.onnx"))
    argv = ["generate", str(out), "--ids", "1,2,3", "--max-new-tokens", "2"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvedge: error: onnxruntime: ") and "head_size must be a multiple of 8" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(RuntimeError, match="head_size must be a multiple of 8"):
        main(["--debug", *argv])


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    """Only kvedge's own errors and those raised by onnxruntime or TensorRT become one line: anything else is a bug
    and keeps its traceback."""
    import pytest

    import kvedge.cli

    def broken(args):
        return 1 // 0

    monkeypatch.setattr(kvedge.cli, "cmd_info", broken)
    with pytest.raises(ZeroDivisionError):
        main(["info", str(tmp_path)])
