"""The demo's planted duplicates: how many the dedup stage found, keeper the larger copy.

The demo plants (copy, original) pairs across its batches; the summary is what the demo
prints and what the end-to-end test asserts on, so a regression in hashing, look-ups or the
keeper rule shows as a number, not as a log line.
"""

from __future__ import annotations

from typing import Any, Protocol

import pyarrow as pa

from prx_assets.core.dedup.corpus import lookup_by_keys
from prx_assets.core.lab import Lab, in_list
from prx_assets.core.tables import IMAGE_HASHES, IMAGES, PHASH_CLUSTERS


class _HasPlanted(Protocol):
    planted_duplicates: list[tuple[str, str]]


def _split(ref: str) -> tuple[str, str]:
    batch, sep, path = ref.partition(":")
    if not sep or not batch or not path:
        raise ValueError(f"expected 'batch:path', got {ref!r}")
    return batch, path


def summarise_planted(lab: Lab, manifest: _HasPlanted) -> dict[str, Any]:
    """How many planted (copy, original) pairs ended in one cluster, keeper the larger image.

    A pair counts as *found* when both images have a ``phash_clusters`` row with the same
    ``cluster_id``; *keeper ok* when that cluster's keeper has at least as many pixels as
    either image of the pair. Copies under the training size cutoff are hashed too (never
    trained, but an opt-out naming one must reach its cluster); a pair with an image not
    hashed yet is reported as such rather than as a miss.
    """
    pairs = [(_split(c), _split(o)) for c, o in manifest.planted_duplicates]
    refs = {r for pair in pairs for r in pair}
    batches = sorted({b for b, _ in refs})
    view = lab.view()  # each table opened once for the whole summary
    images = pa.table({})
    if refs:  # an absent table reads as empty
        images = view.read(
            IMAGES.name,
            ["batch", "path", "key", "width", "height"],
            f"{in_list('batch', batches)} AND {in_list('path', [p for _, p in refs])}",
        )
    key_of = {
        (r["batch"], r["path"]): (r["key"], r["width"] * r["height"]) for r in images.to_pylist()
    }
    wanted = [(b, k) for (b, _), (k, _) in key_of.items()]
    decided = lookup_by_keys(
        view,
        PHASH_CLUSTERS.name,
        PHASH_CLUSTERS.schema,
        wanted,
        ["batch", "key", "cluster_id", "keeper_key", "keeper_batch", "is_keeper"],
    )
    hashed = lookup_by_keys(
        view, IMAGE_HASHES.name, IMAGE_HASHES.schema, wanted, ["batch", "key", "phash", "pixels"]
    )
    dec = {(r["batch"], r["key"]): r for r in decided.to_pylist()}
    hsh = {(r["batch"], r["key"]): r for r in hashed.to_pylist()}
    px_of = {(r["batch"], r["key"]): r["pixels"] for r in hashed.to_pylist()}
    out_pairs = []
    for copy, orig in pairs:
        entry: dict[str, Any] = {"copy": ":".join(copy), "original": ":".join(orig)}
        ids = [key_of.get(copy), key_of.get(orig)]
        if None in ids:
            entry["status"] = "not_ingested"
        else:
            members = [(copy[0], ids[0][0]), (orig[0], ids[1][0])]
            if any(m not in hsh for m in members):
                entry["status"] = "not_hashed"
                entry["note"] = "not hashed yet"
            elif any(m not in dec for m in members):
                entry["status"] = "not_decided"
            else:
                a, b = (hsh[m]["phash"] for m in members)
                entry["hamming"] = ((a ^ b) & (2**64 - 1)).bit_count()
                d = [dec[m] for m in members]
                if d[0]["cluster_id"] != d[1]["cluster_id"]:
                    entry["status"] = "missed"
                else:
                    entry["status"] = "found"
                    keeper = (d[0]["keeper_batch"], d[0]["keeper_key"])
                    entry["keeper"] = ":".join(keeper)
                    keeper_px = px_of.get(keeper)
                    if keeper_px is None:  # keeper outside the pair: read its pixels
                        t = lookup_by_keys(
                            view, IMAGE_HASHES.name, IMAGE_HASHES.schema, [keeper], ["pixels"]
                        )
                        keeper_px = t.column("pixels")[0].as_py() if t.num_rows else None
                    entry["keeper_ok"] = keeper_px is not None and keeper_px >= max(
                        px_of[m] for m in members
                    )
        out_pairs.append(entry)
    status = [p["status"] for p in out_pairs]
    return {
        "planted": len(out_pairs),
        "found": status.count("found"),
        "keeper_is_higher_resolution": sum(bool(p.get("keeper_ok")) for p in out_pairs),
        "not_hashed": status.count("not_hashed"),
        "missed": status.count("missed"),
        "not_decided": status.count("not_decided"),
        "not_ingested": status.count("not_ingested"),
        "pairs": out_pairs,
    }
