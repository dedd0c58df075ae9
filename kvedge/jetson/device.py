"""Jetson facts: the module (device tree), the L4T release, JetPack -> CUDA / TensorRT, power mode, memory.

Everything degrades to "not a Jetson" elsewhere: no function here raises on a desktop or in CI.
File paths are arguments so tests can feed recorded contents.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

# L4T release -> (JetPack, CUDA, TensorRT), from NVIDIA's JetPack release notes. The CUDA and
# TensorRT columns are what each JetPack installs; CUDA can be upgraded on JetPack >= 5.
JETPACK = {
    "35.3.1": ("5.1.1", "11.4", "8.5.2"),
    "35.4.1": ("5.1.2", "11.4", "8.5.2"),
    "35.5.0": ("5.1.3", "11.4", "8.5.2"),
    "35.6.0": ("5.1.4", "11.4", "8.5.2"),
    "35.6.1": ("5.1.5", "11.4", "8.5.2"),
    "36.3.0": ("6.0", "12.2", "8.6.2"),
    "36.4.0": ("6.1", "12.6", "10.3.0"),
    "36.4.3": ("6.2", "12.6", "10.3.0"),
    "36.4.4": ("6.2.1", "12.6", "10.3.0"),
    "38.2.0": ("7.0", "13.0", "10.13.3"),
}

# substrings of the device-tree model string, most specific first
MODULES = ["AGX Thor", "Thor", "AGX Orin", "Orin NX", "Orin Nano", "Xavier NX", "AGX Xavier"]


@dataclass
class JetsonInfo:
    is_jetson: bool
    model: str | None = None  # the device-tree string
    module: str | None = None  # "Orin Nano", "AGX Orin", "AGX Thor", ...
    l4t: str | None = None  # "36.4.3"
    jetpack: str | None = None  # "6.2"
    cuda: str | None = None  # CUDA that JetPack ships
    tensorrt: str | None = None  # TensorRT that JetPack ships
    power_mode: str | None = None  # nvpmodel's mode name, e.g. "MAXN"
    clocks_pinned: bool | None = None  # jetson_clocks applied

    def to_dict(self) -> dict:
        return asdict(self)


def parse_model(text: str) -> str | None:
    text = text.replace("\x00", "").strip()
    return next((name for name in MODULES if name in text), None)


def parse_l4t(text: str) -> str | None:
    """'# R36 (release), REVISION: 4.3, GCID: ...' -> '36.4.3'."""
    m = re.search(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)\.(\d+)", text)
    return f"{m.group(1)}.{m.group(2)}.{m.group(3)}" if m else None


def jetpack_for(l4t: str | None) -> tuple[str | None, str | None, str | None]:
    return JETPACK.get(l4t or "", (None, None, None))


def parse_nvpmodel(text: str) -> str | None:
    """`nvpmodel -q` prints 'NV Power Mode: MAXN' (then the mode number)."""
    m = re.search(r"NV Power Mode:\s*(\S+)", text)
    return m.group(1) if m else None


def parse_jetson_clocks(text: str) -> bool | None:
    """`jetson_clocks --show`: pinned when every CPU's MinFreq equals its MaxFreq and the GPU's too."""
    pairs = re.findall(r"MinFreq=(\d+)\s+MaxFreq=(\d+)", text)
    if not pairs:
        return None
    return all(lo == hi for lo, hi in pairs)


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def detect(model_path: str | Path = "/proc/device-tree/model",
           release_path: str | Path = "/etc/nv_tegra_release", query_power: bool = True) -> JetsonInfo:
    def read(p) -> str | None:
        try:
            return Path(p).read_text(errors="replace")
        except OSError:
            return None

    model_text, release = read(model_path), read(release_path)
    module = parse_model(model_text) if model_text else None
    l4t = parse_l4t(release) if release else None
    if module is None and l4t is None:
        return JetsonInfo(False)
    jp, cuda, trt = jetpack_for(l4t)
    info = JetsonInfo(True, model_text.replace("\x00", "").strip() if model_text else None, module, l4t, jp, cuda, trt)
    if query_power:
        q = _run(["nvpmodel", "-q"])
        info.power_mode = parse_nvpmodel(q) if q else None
        c = _run(["jetson_clocks", "--show"])
        info.clocks_pinned = parse_jetson_clocks(c) if c else None
    return info


def usable_memory_bytes(meminfo: str | None = None, reserve_bytes: int = 1536 * 2**20) -> int | None:
    """On unified-memory boards the GPU allocates from system RAM: what is available now (MemAvailable)
    minus a reserve for the CUDA context and the OS's working set (1.5 GiB by default)."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return None
    m = re.search(r"MemAvailable:\s+(\d+)\s+kB", meminfo)
    return max(int(m.group(1)) * 1024 - reserve_bytes, 0) if m else None
