"""Every name a benchmark imports from the project exists (most import inside functions,
so a rename breaks a benchmark only when someone next runs it: ``bench_scaleout`` once
imported ``PIECE_SAMPLES`` from the module it had left)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _project_imports(path: Path) -> list[tuple[int, str, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            ("prx_assets", "benchmarks")
        ):
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_every_project_name_a_benchmark_imports_exists(path: Path) -> None:
    missing = []
    for line, module, name in _project_imports(path):
        mod = importlib.import_module(module)
        if name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ImportError:
                missing.append(f"{path.name}:{line}: {module}.{name}")
    assert not missing, missing
