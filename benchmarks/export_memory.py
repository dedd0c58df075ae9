"""Resident memory of `kvedge export`, step by step.

    python benchmarks/export_memory.py MODEL [--attention ort] [--max-seq-len 512] [--out DIR]

For each step of the export (the progress lines), prints the peak resident memory while it ran and the
resident memory (anonymous + file-backed) when it ended. The peak is the kernel's high-water mark,
reset at each step (`/proc/self/clear_refs`), so a short spike between two samples is not missed.
Linux only. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in MB."""
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    lines = (line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(v.split()[0]) // 1024 for k, v in lines if k in keys}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--attention", default="ort")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--out", help="output folder (default: a new temporary one)")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="kvedge-export-memory-"))
    _reset_peak()
    from kvedge.export import ExportOptions, export

    step = ["imports"]

    def report(msg: str) -> None:
        s = _status()
        print(f"{step[0][:72]:72s} peak {s['VmHWM']:6d} MB | after: rss {s['VmRSS']:6d} MB "
              f"(anon {s['RssAnon']}, file {s['RssFile']})", flush=True)
        step[0] = msg
        _reset_peak()

    export(a.model, out, ExportOptions(attention=a.attention, max_seq_len=a.max_seq_len, force=True),
           progress=report)
    report("end")
    files = {f.name: f.stat().st_size // 2**20 for f in sorted(out.iterdir()) if f.name.startswith("model.onnx")}
    print(f"output {out}: " + ", ".join(f"{name} {mb} MB" for name, mb in files.items()))


if __name__ == "__main__":
    main()
