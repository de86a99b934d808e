"""The logic layers stay free of Dagster: core/, loader/ and browser/ run without it.

Why two checks: the source walk names the file and line of any ``import dagster`` (at module
level or inside a function, which ruff's TID253 does not see); importing every module in a
fresh interpreter also catches Dagster pulled in indirectly (a core module importing
``prx_assets.defs``, or a helper that imports it).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "prx_assets"
LAYERS = ("core", "loader", "browser")
# Packages that are Dagster or need it: dagster, dagster_k8s, dagster_postgres, ...
BANNED_PREFIXES = ("dagster",)
# Modules above the logic layers: importing them imports Dagster.
UPWARD = ("prx_assets.defs", "prx_assets.definitions", "prx_assets.cli", "prx_assets.demo")


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source`` (a module of ``package``),
    wherever it sits."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
    return found


def _is_banned(name: str) -> bool:
    top = name.split(".", 1)[0]
    return top.startswith(BANNED_PREFIXES) or name.startswith(UPWARD)


def _modules(layer: str) -> list[tuple[Path, str, str]]:
    """(path, module name, package name) of every module under ``prx_assets/<layer>``."""
    out = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        package = ".".join(rel.parts[:-1])
        out.append((path, package if rel.name == "__init__" else ".".join(rel.parts), package))
    return out


def test_the_walk_sees_imports_anywhere_in_a_module():
    source = (
        "import os\n"
        "from prx_assets.core import lab\n"
        "def f():\n"
        "    import dagster_k8s\n"
        "    from dagster import asset\n"
        "class C:\n"
        "    from ...defs import jobs\n"
    )
    found = imported_modules(source, "prx_assets.core.stage")
    banned = [(line, name) for line, name in found if _is_banned(name)]
    assert banned == [(4, "dagster_k8s"), (5, "dagster"), (7, "prx_assets.defs")]


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_of_the_layer_imports_dagster(layer):
    modules = _modules(layer)
    assert len(modules) >= 3, f"prx_assets/{layer} has no modules: the walk looks elsewhere"
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path, _, package in modules
        for line, name in imported_modules(path.read_text(), package)
        if _is_banned(name)
    ]
    assert offenders == []


def test_importing_every_module_of_the_layers_loads_no_dagster():
    names = [module for layer in LAYERS for _, module, _ in _modules(layer)]
    probe = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0].startswith('dagster'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []
