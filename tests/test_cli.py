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
