"""Jetson detection, version mapping and tegrastats, on recorded file contents and a fake tegrastats."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from kvedge.cli import main
from kvedge.jetson import Sampler, detect, parse_line, summarize, usable_memory_bytes
from kvedge.jetson.device import parse_jetson_clocks, parse_nvpmodel

RELEASE_JP62 = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025\n"
RELEASE_JP512 = "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug  1 19:57:35 UTC 2023\n"
RELEASE_JP7 = "# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64, DATE: Fri Aug 22 00:53:35 UTC 2025\n"


def write(tmp_path, model: str | None, release: str | None):
    m, r = tmp_path / "model", tmp_path / "nv_tegra_release"
    if model is not None:
        m.write_bytes(model.encode() + b"\x00")  # device-tree strings end with a NUL
    if release is not None:
        r.write_text(release)
    return m, r


@pytest.mark.parametrize("model,release,module,l4t,jetpack,cuda,trt", [
    ("NVIDIA Jetson Orin Nano Developer Kit", RELEASE_JP62, "Orin Nano", "36.4.3", "6.2", "12.6", "10.3.0"),
    ("NVIDIA Jetson Orin Nano Developer Kit", RELEASE_JP512, "Orin Nano", "35.4.1", "5.1.2", "11.4", "8.5.2"),
    ("NVIDIA Jetson AGX Orin Developer Kit", RELEASE_JP62, "AGX Orin", "36.4.3", "6.2", "12.6", "10.3.0"),
    ("NVIDIA Jetson AGX Thor Developer Kit", RELEASE_JP7, "AGX Thor", "38.2.0", "7.0", "13.0", "10.13.3"),
])
def test_detection_and_version_mapping(tmp_path, model, release, module, l4t, jetpack, cuda, trt):
    info = detect(*write(tmp_path, model, release), query_power=False)
    assert info.is_jetson and info.model == model
    assert (info.module, info.l4t, info.jetpack, info.cuda, info.tensorrt) == (module, l4t, jetpack, cuda, trt)


def test_not_a_jetson_degrades_quietly(tmp_path):
    info = detect(tmp_path / "missing-model", tmp_path / "missing-release")
    assert not info.is_jetson and info.module is None
    assert detect(*write(tmp_path, "QEMU Virtual Machine", None), query_power=False).is_jetson is False
    unknown = detect(*write(tmp_path, "NVIDIA Jetson AGX Orin", "# R99 (release), REVISION: 1.0"), query_power=False)
    assert unknown.is_jetson and unknown.l4t == "99.1.0" and unknown.jetpack is None


def test_power_mode_and_clocks_parsers():
    assert parse_nvpmodel("NV Power Mode: MAXN\n0\n") == "MAXN"
    assert parse_nvpmodel("NV Power Mode: 15W\n1\n") == "15W"
    pinned = "cpu0: Online=1 Governor=schedutil MinFreq=1728000 MaxFreq=1728000 CurrentFreq=1728000\n" \
             "GPU MinFreq=1020000000 MaxFreq=1020000000 CurrentFreq=1020000000\n"
    free = "cpu0: Online=1 Governor=schedutil MinFreq=115200 MaxFreq=1728000 CurrentFreq=729600\n"
    assert parse_jetson_clocks(pinned) is True and parse_jetson_clocks(free) is False
    assert parse_jetson_clocks("nothing here") is None


OLD = ("RAM 2458/7620MB (lfb 1129x4MB) SWAP 0/3810MB (cached 0MB) CPU [2%@729,1%@729,0%@729,0%@729,off,off] "
       "EMC_FREQ 0% GR3D_FREQ 17% CV0@-256C CPU@45.093C SOC2@44.468C VDD_IN 4008mW/4008mW "
       "VDD_CPU_GPU_CV 495mW/490mW VDD_SOC 1288mW/1280mW")
NEW = ("11-14-2024 10:21:19 RAM 2166/7620MB (lfb 6x4MB) SWAP 0/3810MB (cached 0MB) CPU [0%@729,0%@729,0%@729,"
       "0%@729,0%@729,0%@729] EMC_FREQ 0%@2133 GR3D_FREQ 64%@[624] NVENC off NVDEC off NVJPG off NVJPG1 off VIC off "
       "OFA off APE 200 cpu@46.5C soc2@45.25C VDD_IN 7931mW/5931mW VDD_CPU_GPU_CV 2473mW/1473mW VDD_SOC 1221mW/1221mW")
XAVIER = "RAM 1905/7765MB (lfb 896x4MB) SWAP 0/3882MB CPU [1%@1190] GR3D_FREQ 0%@114 POM_5V_IN 3161/3161 POM_5V_GPU 0/0"


def test_tegrastats_parser_old_and_new_formats():
    a = parse_line(OLD)
    assert (a.ram_used_mb, a.ram_total_mb, a.gr3d_percent, a.gr3d_mhz) == (2458, 7620, 17, None)
    assert a.rails_mw == {"VDD_IN": (4008, 4008), "VDD_CPU_GPU_CV": (495, 490), "VDD_SOC": (1288, 1280)}
    b = parse_line(NEW)
    assert (b.ram_used_mb, b.ram_total_mb, b.gr3d_percent, b.gr3d_mhz) == (2166, 7620, 64, 624)
    assert b.rails_mw == {"VDD_IN": (7931, 5931), "VDD_CPU_GPU_CV": (2473, 1473), "VDD_SOC": (1221, 1221)}
    c = parse_line(XAVIER)
    assert c.gr3d_mhz == 114 and c.rails_mw == {"POM_5V_IN": (3161, 3161), "POM_5V_GPU": (0, 0)}
    assert parse_line("garbage") is None
    s = summarize([a, b])
    assert s["ram_used_mb"] == {"mean": (2458 + 2166) / 2, "max": 2458} and s["ram_total_mb"] == 7620
    assert s["gr3d_percent"]["max"] == 64 and s["rails_mw"]["VDD_IN"] == {"mean": (4008 + 7931) / 2, "max": 7931}


@pytest.fixture
def fake_tegrastats(tmp_path, monkeypatch):
    """A `tegrastats` on PATH that prints sample lines at its --interval, forever (or N lines)."""
    def make(lines: int | None = None):
        script = tmp_path / "bin" / "tegrastats"
        script.parent.mkdir(exist_ok=True)
        count = "" if lines is None else f"n=$((n+1)); [ $n -ge {lines} ] && exit 3;"
        script.write_text(f"""#!/bin/sh
ms=1000; [ "$1" = "--interval" ] && ms=$2
n=0
while true; do
  echo "{NEW}"
  echo "{OLD}"
  {count}
  sleep $(awk "BEGIN {{print $ms/1000}}")
done
""")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
        return script

    return make


def test_sampler_start_stop_and_summary(fake_tegrastats):
    fake_tegrastats()
    s = Sampler(interval_ms=50)
    assert s.start()
    time.sleep(0.6)
    samples = s.stop()
    assert len(samples) >= 4 and s.error is None
    summary = s.summary()
    assert summary["ram_total_mb"] == 7620 and summary["rails_mw"]["VDD_IN"]["max"] == 7931
    assert samples[0].t <= samples[-1].t
    n = len(samples)
    time.sleep(0.2)
    assert len(s.samples) == n  # stopped means stopped


def test_sampler_missing_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    s = Sampler()
    assert s.start() is False and "tegrastats not found" in s.error
    assert s.stop() == [] and s.summary()["samples"] == 0


def test_sampler_process_dying_early(fake_tegrastats):
    fake_tegrastats(lines=2)  # exits with status 3 after two rounds
    s = Sampler(interval_ms=20)
    assert s.start()
    time.sleep(0.5)
    samples = s.stop()
    assert len(samples) == 4 and "exited early with status 3" in s.error


def test_sampler_killed(fake_tegrastats):
    fake_tegrastats()
    s = Sampler(interval_ms=20)
    s.start()
    time.sleep(0.2)
    s._proc.kill()
    time.sleep(0.2)
    s.stop()
    assert s.samples and "exited early with status -9" in s.error


def test_usable_memory_from_meminfo():
    meminfo = "MemTotal:        7803248 kB\nMemFree:          512000 kB\nMemAvailable:    6291456 kB\n"
    assert usable_memory_bytes(meminfo) == 6291456 * 1024 - 1536 * 2**20
    assert usable_memory_bytes("nothing") is None


def test_doctor_on_this_machine(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    facts, feats = report["facts"], {f["feature"]: f for f in report["features"]}
    assert facts["onnxruntime"] and "CPUExecutionProvider" in facts["onnxruntime_providers"]
    assert feats["onnxruntime backend (CPU)"]["available"] and feats["export to ONNX"]["available"]
    import torch

    has_gpu = torch.cuda.is_available()
    assert facts["cuda_available"] == has_gpu and feats["torch backend (CUDA)"]["available"] == has_gpu
    try:
        import tensorrt  # noqa: F401
        has_trt = True
    except ImportError:
        has_trt = False
    assert (facts["tensorrt"] is not None) == has_trt
    if not has_trt:
        assert not feats["TensorRT engines"]["available"] and "TensorRT" in feats["TensorRT engines"]["needs"]
    import os
    import shutil

    has_cc = bool(shutil.which(os.environ["CC"]) if os.environ.get("CC") else shutil.which("cc") or shutil.which("gcc"))
    assert feats["native backend (CPU, kvedge's C engine)"]["available"] == has_cc
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "features:" in text and ("not a Jetson" in text) == (not facts["jetson"]["is_jetson"])
