"""A shard tree's files as training reads them, for comparing two runs' trees."""

from __future__ import annotations

import hashlib
from pathlib import Path

from prx_assets.core.skiplists.sidecars import SIDECAR_SUFFIX, load_generation


def live_tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` but superseded sidecars (kept for their retention, as many
    as generations were published in that directory, which differs between a run and its
    rerun): relative path -> sha256 of its bytes."""
    live: dict[Path, frozenset[str]] = {}

    def superseded(p: Path) -> bool:
        if not p.name.endswith(SIDECAR_SUFFIX):
            return False
        if p.parent not in live:
            live[p.parent] = load_generation(p.parent).manifest.sidecars
        return p.name not in live[p.parent]

    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not superseded(p)
    }
