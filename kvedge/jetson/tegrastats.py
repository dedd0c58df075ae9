"""tegrastats: parse its lines (JetPack 5 and 6/7 formats) and sample it in the background.

    RAM 2458/7620MB (lfb 1129x4MB) SWAP 0/3810MB ... GR3D_FREQ 0% ... VDD_IN 4008mW/4008mW ...   (JetPack 5)
    11-14-2024 10:21:19 RAM 2166/7620MB ... GR3D_FREQ 0%@[305] ... VDD_IN 3931mW/3931mW ...      (JetPack 6+)

Each VDD_* (and the older POM_*) rail gives its current and average power in mW.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_GR3D = re.compile(r"\bGR3D_FREQ (\d+)%(?:@\[?(\d+)(?:,\d+)*\]?)?")
_RAIL = re.compile(r"\b((?:VDD|POM)_[A-Z0-9_]+) (\d+)(?:mW)?/(\d+)(?:mW)?")


@dataclass
class Sample:
    t: float  # seconds since the sampler started
    ram_used_mb: int | None
    ram_total_mb: int | None
    gr3d_percent: int | None
    gr3d_mhz: int | None
    rails_mw: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (current, average)


def parse_line(line: str, t: float = 0.0) -> Sample | None:
    ram, gr3d = _RAM.search(line), _GR3D.search(line)
    rails = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RAIL.finditer(line)}
    if ram is None and gr3d is None and not rails:
        return None
    return Sample(t, int(ram.group(1)) if ram else None, int(ram.group(2)) if ram else None,
                  int(gr3d.group(1)) if gr3d else None,
                  int(gr3d.group(2)) if gr3d and gr3d.group(2) else None, rails)


def summarize(samples: list[Sample]) -> dict:
    """Mean and max of RAM used and GR3D load, mean/max of each rail's current power."""
    def stats(xs):
        xs = [x for x in xs if x is not None]
        return {"mean": statistics.fmean(xs), "max": max(xs)} if xs else None

    rails = sorted({k for s in samples for k in s.rails_mw})
    return {
        "samples": len(samples),
        "ram_used_mb": stats([s.ram_used_mb for s in samples]),
        "ram_total_mb": next((s.ram_total_mb for s in samples if s.ram_total_mb), None),
        "gr3d_percent": stats([s.gr3d_percent for s in samples]),
        "rails_mw": {r: stats([s.rails_mw[r][0] for s in samples if r in s.rails_mw]) for r in rails},
    }


class Sampler:
    """Run `tegrastats --interval MS` in the background and collect parsed samples.

    start() returns False (with `error` set) when the binary is missing; stop() returns the samples and
    records in `error` if the process died before it was stopped. Neither raises.
    """

    def __init__(self, interval_ms: int = 200, binary: str = "tegrastats"):
        self.interval_ms, self.binary = interval_ms, binary
        self.samples: list[Sample] = []
        self.error: str | None = None
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> bool:
        path = shutil.which(self.binary)
        if path is None:
            self.error = f"{self.binary} not found on PATH (not a Jetson, or JetPack tools not installed)"
            return False
        try:
            self._proc = subprocess.Popen([path, "--interval", str(self.interval_ms)], stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, bufsize=1)
        except OSError as e:
            self.error = f"could not start {path}: {e}"
            return False
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return True

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            s = parse_line(line, time.perf_counter() - self._t0)
            if s is not None:
                self.samples.append(s)
        code = self._proc.wait()
        if not self._stopping:
            self.error = f"{self.binary} exited early with status {code}"

    def stop(self) -> list[Sample]:
        if self._proc is not None:
            self._stopping = self._proc.poll() is None
            if self._stopping:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
            if self._thread is not None:
                self._thread.join(timeout=5)
        return self.samples

    def summary(self) -> dict:
        return {**summarize(self.samples), "error": self.error}
