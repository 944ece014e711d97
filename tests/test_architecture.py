"""The package's layers import only downward (docs/architecture.md), checked on the source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torch_tvm_gemm"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules that ``name`` imports, at any depth of its code (lazy imports count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names} & known
            # "from pkg import module" imports the module; "from pkg import name", the package
            found |= subs if len(subs) == len(node.names) else {base} | subs
    return (found & known) - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods) | {"torch_tvm_gemm._C"}
    return {m: _imports(m, p, known) for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_lower_layers_do_not_import_upper_ones():
    upper = {
        "torch_tvm_gemm.kernels": ("schedules", "runtime", "compiler", "ops", "nn", "fusion"),
        "torch_tvm_gemm.schedules": ("runtime", "compiler", "ops", "nn", "fusion"),
        "torch_tvm_gemm.runtime": ("compiler", "ops", "nn", "fusion", "tools", "cli"),
        "torch_tvm_gemm.compiler": ("ops", "nn", "fusion", "tools", "cli"),
    }
    bad = []
    for module, deps in _graph().items():
        for layer, forbidden in upper.items():
            if module == layer or module.startswith(layer + "."):
                bad += [
                    f"{module} -> {d}"
                    for d in deps
                    if any(d.startswith(f"torch_tvm_gemm.{f}") for f in forbidden)
                ]
    assert not bad, bad


def test_import_does_not_load_the_compiler():
    code = "import sys, torch_tvm_gemm; print('tvm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
