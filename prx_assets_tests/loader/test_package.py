"""The loader must stay importable by a training script without Dagster."""

from __future__ import annotations

import ast
from pathlib import Path

import prx_assets.core.skiplists.sidecars
import prx_assets.loader

FILES = [
    Path(prx_assets.core.skiplists.sidecars.__file__),
    *Path(prx_assets.loader.__file__).parent.glob("*.py"),
]


def test_no_dagster_import_anywhere_in_the_loader():
    assert len(FILES) >= 6
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not [n for n in names if n.split(".")[0] == "dagster"], path
