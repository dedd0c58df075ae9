"""The dependency rule of docs/design.md, checked on the source and in a fresh interpreter.

    errors, dtypes  <-  models  <-  artifact  <-  runtime  <-  { export, tensorrt }

kernels (Triton) sit beside models; bench and serve sit on runtime; cli and doctor sit on top. export and tensorrt
never import each other, and the runtime imports neither (its registry names the TensorRT backend's module
as data, imported when that backend is opened).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvedge

ROOT = Path(kvedge.__file__).parent
LEAVES = {"kvedge", "errors", "dtypes"}  # "kvedge": the package itself (its __version__)
MAY_IMPORT = {  # component -> the components its modules may import (besides itself), anywhere in a module
    "errors": set(),
    "dtypes": {"errors"},
    "models": set(LEAVES),
    "kernels": set(LEAVES),
    "jetson": set(LEAVES),
    "artifact": LEAVES | {"models"},
    "runtime": LEAVES | {"models", "kernels", "artifact"},
    "export": LEAVES | {"models", "kernels", "artifact", "runtime"},
    "tensorrt": LEAVES | {"models", "kernels", "artifact", "runtime"},
    "bench": LEAVES | {"models", "artifact", "runtime", "jetson"},
    "serve": LEAVES | {"models", "artifact", "runtime"},
}
TOP = {"cli", "__main__", "doctor", "__init__"}  # may import anything (lazily)


def component(module: str) -> str:
    parts = module.split(".")
    return "kvedge" if len(parts) == 1 else parts[1]


def kvedge_imports(path: Path) -> set[str]:
    """Every kvedge module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "kvedge"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kvedge":
            found.add(node.module)
    return found


def test_every_module_imports_only_what_its_layer_may():
    broken = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        comp = rel.parts[1] if len(rel.parts) > 1 else "__init__"
        comp = comp.removesuffix(".py")
        if comp in TOP:
            continue
        assert comp in MAY_IMPORT, f"{rel}: kvedge/{comp} has no place in the dependency rule (docs/design.md)"
        for mod in kvedge_imports(path):
            if component(mod) not in MAY_IMPORT[comp] | {comp}:
                broken.append(f"{rel} imports {mod}")
    assert not broken, "the dependency rule is broken:\n" + "\n".join(broken)


def test_the_rule_check_catches_a_runtime_module_importing_export(tmp_path):
    """The scan sees imports inside functions too (where the old runtime reached the exporter)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from kvedge.export.lowerings import LOWERINGS\n    import kvedge.tensorrt.plugin\n")
    assert kvedge_imports(f) == {"kvedge.export.lowerings", "kvedge.tensorrt.plugin"}
    assert not {component(m) for m in kvedge_imports(f)} <= MAY_IMPORT["runtime"]


def _fresh(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_importing_the_runtime_pulls_no_exporter_code():
    mods = _fresh("import kvedge.runtime")
    assert "kvedge.runtime" in mods
    assert not {m for m in mods if m.startswith(("kvedge.export", "kvedge.tensorrt", "onnxscript"))}
    assert "onnx" not in mods  # the runtime needs no graph library to import


@pytest.mark.slow
def test_running_an_export_on_onnxruntime_pulls_no_exporter_code(demo_export):
    """What a Jetson holding only model.onnx + kvedge.json runs: load and generate, no exporter, no onnxscript."""
    _, onnx_dir = demo_export(64, 1)
    mods = _fresh(f"import kvedge; s = kvedge.load({str(onnx_dir)!r}); s.generate('hi', max_new_tokens=2)")
    assert "kvedge.runtime.ort_backend" in mods
    assert not {m for m in mods if m.startswith(("kvedge.export", "kvedge.tensorrt", "onnxscript"))}
