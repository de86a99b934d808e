"""Which samples a training snapshot holds, derived when asked instead of stored per sample.

A snapshot records, per directory it froze, the directory's index digest, its skip-list
generation and its sample counts (``snapshot_directories``); once per generation, the skip
indices of each shard (``skip_generations``, shared by every snapshot that froze it); and it
pins the Lance versions it read (``Lab.pin_versions``). So a snapshot costs O(directories) in
the lab, and a sample ``(batch, key)`` is in snapshot S exactly when ``shard_samples`` at S's
pinned version places it at (directory, shard, index) in a directory S froze, and that
directory's frozen generation does not skip the index.

Every derivation fails closed (``SnapshotError``): a frozen generation without its rows, a
slot outside its shard, or a whole directory whose derived counts differ from the counts the
snapshot recorded never become an answer of "not in training". Retiring a snapshot keeps the
versions of ``MEMBERSHIP_TABLES`` pinned, so its history stays answerable.

Snapshots made before this scheme listed their samples in ``snapshot_samples``; those are
read from there (``Frozen.legacy``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prx_assets.core.lab import Lab, LabView, in_list, sql_literal
from prx_assets.core.snapshots.manifest import SnapshotError
from prx_assets.core.snapshots.tables import (
    SKIP_GENERATIONS,
    SNAPSHOT_DIRECTORIES,
    SNAPSHOT_SAMPLES,
    TRAINING_SNAPSHOTS,
)

# The lab tables a snapshot's membership and its diff reasons are derived from: their pinned
# versions outlive the snapshot's retirement (the other tables' are released then).
MEMBERSHIP_TABLES: tuple[str, ...] = ("shard_samples", "images", "caption_classes", "skip_audit")
# What a diff compares of a sample both snapshots hold, and so what a directory's
# ``members_sha256`` covers.
MEMBER_COLUMNS: tuple[str, ...] = (
    "batch",
    "key",
    "tier",
    "shape",
    "source",
    "caption_fingerprint",
    "class_fingerprint",
)
SLOT_COLUMNS: tuple[str, ...] = ("relative_dir", "shard", "index_in_shard")
# Values per ``IN (...)`` probe of a look-up by key or directory.
PROBE_CHUNK = 8192


@dataclass(frozen=True)
class Frozen:
    """A committed snapshot as the lab recorded it."""

    snapshot_id: str
    created_at: datetime
    status: str
    versions: dict[str, int]
    legacy: bool  # its samples are listed in ``snapshot_samples`` (an older version made it)


def _chunks(values: Sequence[Any], size: int = PROBE_CHUNK) -> Iterator[Sequence[Any]]:
    for i in range(0, len(values), size):
        yield values[i : i + size]


def _is_legacy(lab: Lab, snapshot_id: str) -> bool:
    if not lab.exists(SNAPSHOT_SAMPLES.name):
        return False
    return lab.count(SNAPSHOT_SAMPLES.name, f"snapshot_id = {sql_literal(snapshot_id)}") > 0


def _frozen(lab: Lab, row: dict[str, Any]) -> Frozen:
    """``row``'s snapshot, after checking the lab still holds every directory row it
    recorded (a derived snapshot's membership is only as complete as those rows)."""
    sid = row["snapshot_id"]
    legacy = _is_legacy(lab, sid)
    if not legacy:
        where = f"snapshot_id = {sql_literal(sid)}"
        found = (
            lab.count(SNAPSHOT_DIRECTORIES.name, where)
            if lab.exists(SNAPSHOT_DIRECTORIES.name)
            else 0
        )
        if found != row["directories"]:
            raise SnapshotError(
                f"snapshot {sid!r} froze {row['directories']} directories but the lab holds "
                f"{found} snapshot_directories rows for it: which samples it held cannot be "
                "established"
            )
    return Frozen(
        sid,
        row["created_at"],
        row["status"],
        {t: int(v) for t, v in json.loads(row["lab_versions"] or "{}").items()},
        legacy,
    )


def committed(lab: Lab) -> list[Frozen]:
    """Every snapshot whose ``training_snapshots`` row is committed, oldest first (an
    attempt killed before its row is not a snapshot, whatever rows it left)."""
    if not lab.exists(TRAINING_SNAPSHOTS.name):
        return []
    rows = lab.read(
        TRAINING_SNAPSHOTS.name,
        ["snapshot_id", "created_at", "status", "lab_versions", "directories"],
    ).to_pylist()
    rows.sort(key=lambda r: (r["created_at"], r["snapshot_id"]))
    return [_frozen(lab, r) for r in rows]


def _committed_ids(lab: Lab) -> set[str]:
    if not lab.exists(TRAINING_SNAPSHOTS.name):
        return set()
    return set(lab.read(TRAINING_SNAPSHOTS.name, ["snapshot_id"]).column(0).to_pylist())


def frozen(lab: Lab, snapshot_id: str) -> Frozen:
    """The committed snapshot ``snapshot_id``; ``SnapshotError`` when there is none."""
    rows = (
        lab.read(
            TRAINING_SNAPSHOTS.name,
            ["snapshot_id", "created_at", "status", "lab_versions", "directories"],
            f"snapshot_id = {sql_literal(snapshot_id)}",
        ).to_pylist()
        if lab.exists(TRAINING_SNAPSHOTS.name)
        else []
    )
    if not rows:
        raise SnapshotError(f"no training snapshot {snapshot_id!r} in the lab")
    return _frozen(lab, rows[0])


# --------------------------------------------------------------------------- generations


def generation_rows(
    relative_dir: str,
    generation: str,
    entries: Iterable[Any],
    skiplists: dict[str, Any],
    samples: dict[str, int],
) -> list[dict[str, Any]]:
    """The ``skip_generations`` rows of one verified generation (``sidecars.Generation``'s
    manifest entries and skip-lists; ``samples``: each shard's count in ``index.json``),
    one per shard."""
    return [
        {
            "relative_dir": relative_dir,
            "generation": generation,
            "shard": e.shard,
            "sidecar_sha256": e.sha256,
            "samples": int(samples[e.shard]),
            "skipped": sorted(int(i) for i in skiplists[e.shard].indices),
        }
        for e in entries
    ]


def recorded_generations(lab: Lab, relative_dirs: Sequence[str]) -> set[tuple[str, str]]:
    """The (relative_dir, generation) pairs ``skip_generations`` already holds for these
    directories (what a new snapshot need not write again)."""
    out: set[tuple[str, str]] = set()
    if not lab.exists(SKIP_GENERATIONS.name):
        return out
    for chunk in _chunks(sorted(set(relative_dirs))):
        rows = lab.read(
            SKIP_GENERATIONS.name, ["relative_dir", "generation"], in_list("relative_dir", chunk)
        )
        out.update(
            zip(
                rows.column("relative_dir").to_pylist(),
                rows.column("generation").to_pylist(),
                strict=True,
            )
        )
    return out


Skips = dict[str, tuple[int, frozenset[int]]]  # shard -> (samples, skipped indices)


def generation_skips(lab: Lab, pairs: Iterable[tuple[str, str]]) -> dict[tuple[str, str], Skips]:
    """(relative_dir, generation) -> its shards' sample counts and skipped indices, for each
    pair; a pair without rows raises (a snapshot froze it, so its rows must be there)."""
    wanted = set(pairs)
    out: dict[tuple[str, str], Skips] = {}
    if wanted and lab.exists(SKIP_GENERATIONS.name):
        generations = {g for _, g in wanted}
        for chunk in _chunks(sorted({r for r, _ in wanted})):
            rows = lab.read(
                SKIP_GENERATIONS.name,
                ["relative_dir", "generation", "shard", "samples", "skipped"],
                in_list("relative_dir", chunk),
            ).to_pylist()
            for r in rows:
                pair = (r["relative_dir"], r["generation"])
                if r["generation"] in generations and pair in wanted:
                    out.setdefault(pair, {})[r["shard"]] = (
                        int(r["samples"]),
                        frozenset(r["skipped"]),
                    )
    missing = sorted(wanted - out.keys())
    if missing:
        rel, gen = missing[0]
        raise SnapshotError(
            f"{len(missing)} frozen skip-list generation(s) have no skip_generations rows "
            f"(first: {rel[:200]!r} generation {gen[:12]}): which samples the snapshot held "
            "there cannot be established"
        )
    return out


def _kept(skips: Skips, rel: str, shard: str, index: int) -> bool:
    entry = skips.get(shard)
    if entry is None or not 0 <= index < entry[0]:
        raise SnapshotError(
            f"{rel[:200]}: {shard[:120]} #{index} is outside the frozen generation's shards: "
            "which samples the snapshot held there cannot be established"
        )
    return index not in entry[1]


# --------------------------------------------------------------------------- by batch


def _directories(lab: Lab, snapshot_id: str, batches: Sequence[str]) -> dict[str, dict[str, Any]]:
    """relative_dir -> its ``snapshot_directories`` row, for the snapshot's directories of
    ``batches``."""
    out: dict[str, dict[str, Any]] = {}
    for chunk in _chunks(list(batches)):
        rows = lab.read(
            SNAPSHOT_DIRECTORIES.name,
            ["relative_dir", "batch", "generation", "samples", "kept_samples"],
            f"snapshot_id = {sql_literal(snapshot_id)} AND {in_list('batch', chunk)}",
        ).to_pylist()
        out.update({r["relative_dir"]: r for r in rows})
    return out


def _by_ident(view: LabView, snap: Frozen, table: str, column: str, where: str) -> dict:
    if table not in snap.versions or not view.exists(table):
        return {}
    rows = view.read(table, ["batch", "key", column], where)
    return dict(
        zip(
            zip(rows.column("batch").to_pylist(), rows.column("key").to_pylist(), strict=True),
            rows.column(column).to_pylist(),
            strict=True,
        )
    )


def members_of_batches(
    lab: Lab, snap: Frozen, batches: Sequence[str], view: LabView | None = None
) -> list[dict[str, Any]]:
    """The samples ``snap`` holds in ``batches`` (``MEMBER_COLUMNS`` and the slot), in
    (batch, key) order. ``view``: the lab at the snapshot's pinned versions, when the caller
    has one open. Each directory's derived counts must equal the ones the snapshot
    recorded (else ``SnapshotError``)."""
    if not batches:
        return []
    if snap.legacy:
        where = f"snapshot_id = {sql_literal(snap.snapshot_id)} AND {in_list('batch', batches)}"
        rows = lab.read(SNAPSHOT_SAMPLES.name, [*MEMBER_COLUMNS, *SLOT_COLUMNS], where)
        return sorted(rows.to_pylist(), key=lambda r: (r["batch"], r["key"]))
    dirs = _directories(lab, snap.snapshot_id, batches)
    if not dirs:
        return []
    own = view is None
    view = view or lab.view(snap.versions)
    try:
        where = in_list("batch", batches)
        slots = view.read(
            "shard_samples",
            ["batch", "key", "tier", "shape", "caption_fingerprint", *SLOT_COLUMNS],
            where,
        ).to_pylist()
        sources = _by_ident(view, snap, "images", "source", where)
        classes = _by_ident(view, snap, "caption_classes", "backend_fingerprint", where)
    finally:
        if own:
            view.close()
    skips = generation_skips(lab, {(rel, d["generation"]) for rel, d in dirs.items()})
    counts = {rel: [0, 0] for rel in dirs}
    out = []
    for s in slots:
        rel = s["relative_dir"]
        if rel not in dirs:
            continue
        counts[rel][0] += 1
        gen = dirs[rel]["generation"]
        if not _kept(skips[(rel, gen)], rel, s["shard"], int(s["index_in_shard"])):
            continue
        counts[rel][1] += 1
        ident = (s["batch"], s["key"])
        s["source"] = sources.get(ident)
        s["class_fingerprint"] = classes.get(ident)
        out.append(s)
    for rel, (samples, kept) in counts.items():
        d = dirs[rel]
        if (samples, kept) != (d["samples"], d["kept_samples"]):
            raise SnapshotError(
                f"{rel[:200]}: snapshot {snap.snapshot_id!r} recorded {d['samples']} samples, "
                f"{d['kept_samples']} kept, but its pinned lab versions give {samples} and "
                f"{kept}: its membership cannot be established"
            )
    out.sort(key=lambda r: (r["batch"], r["key"]))
    return out


def frozen_batches(lab: Lab, snapshot_id: str) -> list[str]:
    """The batches of the directories ``snapshot_id`` froze, sorted."""
    rows = lab.read(
        SNAPSHOT_DIRECTORIES.name, ["batch"], f"snapshot_id = {sql_literal(snapshot_id)}"
    )
    return sorted(set(rows.column("batch").to_pylist()))


def iter_members(
    lab: Lab, snap: Frozen, batches_per_read: int = 64
) -> Iterator[list[dict[str, Any]]]:
    """Every sample ``snap`` holds, a few batches at a time (bounded memory), in batch
    order."""
    if snap.legacy and not lab.exists(SNAPSHOT_DIRECTORIES.name):
        yield members_of_batches(lab, snap, _legacy_batches(lab, snap.snapshot_id))
        return
    batches = frozen_batches(lab, snap.snapshot_id)
    if snap.legacy and not batches:
        batches = _legacy_batches(lab, snap.snapshot_id)
    with lab.view(snap.versions) as view:
        for chunk in _chunks(batches, batches_per_read):
            yield members_of_batches(lab, snap, chunk, view)


def _legacy_batches(lab: Lab, snapshot_id: str) -> list[str]:
    rows = lab.read(SNAPSHOT_SAMPLES.name, ["batch"], f"snapshot_id = {sql_literal(snapshot_id)}")
    return sorted(set(rows.column("batch").to_pylist()))


# --------------------------------------------------------------------------- by key


def holders(
    lab: Lab, keys: Iterable[str], snapshots: Iterable[str] | None = None
) -> dict[tuple[str, str], set[str]]:
    """(batch, key) -> the committed snapshots holding it, for every sample of ``keys``
    some snapshot holds (of ``snapshots`` only, when given: a name that is not a committed
    snapshot holds nothing). Costs one indexed look-up of the keys per distinct pinned
    ``shard_samples`` version, plus the frozen directories and generations they land in."""
    keys = sorted(set(keys))
    out: dict[tuple[str, str], set[str]] = {}
    if not keys:
        return out
    if snapshots is None:
        snaps = committed(lab)
    else:
        wanted = set(snapshots)
        snaps = [frozen(lab, sid) for sid in sorted(wanted & _committed_ids(lab))]
    legacy = [s.snapshot_id for s in snaps if s.legacy]
    for chunk in _chunks(keys):
        if legacy:
            rows = lab.read(
                SNAPSHOT_SAMPLES.name,
                ["snapshot_id", "batch", "key"],
                f"{in_list('snapshot_id', legacy)} AND {in_list('key', chunk)}",
            ).to_pylist()
            for r in rows:
                out.setdefault((r["batch"], r["key"]), set()).add(r["snapshot_id"])
    by_version: dict[int, list[str]] = {}
    for s in snaps:
        if s.legacy:
            continue
        if "shard_samples" not in s.versions:  # ``create_snapshot`` never commits one
            raise SnapshotError(
                f"snapshot {s.snapshot_id!r} pinned no shard_samples version: which samples "
                "it held cannot be established"
            )
        by_version.setdefault(s.versions["shard_samples"], []).append(s.snapshot_id)
    for version, ids in sorted(by_version.items()):
        slots: list[dict[str, Any]] = []
        with lab.view({"shard_samples": version}) as view:
            for chunk in _chunks(keys):
                slots += view.read(
                    "shard_samples", ["batch", "key", *SLOT_COLUMNS], in_list("key", chunk)
                ).to_pylist()
        if not slots:
            continue
        frozen_dirs: dict[tuple[str, str], str] = {}  # (snapshot, relative_dir) -> generation
        rels = sorted({s["relative_dir"] for s in slots})
        for chunk in _chunks(rels):
            rows = lab.read(
                SNAPSHOT_DIRECTORIES.name,
                ["snapshot_id", "relative_dir", "generation"],
                f"{in_list('snapshot_id', ids)} AND {in_list('relative_dir', chunk)}",
            ).to_pylist()
            frozen_dirs.update(
                {(r["snapshot_id"], r["relative_dir"]): r["generation"] for r in rows}
            )
        skips = generation_skips(lab, {(rel, gen) for (_, rel), gen in frozen_dirs.items()})
        for s in slots:
            rel = s["relative_dir"]
            for sid in ids:
                gen = frozen_dirs.get((sid, rel))
                if gen is None:
                    continue
                if _kept(skips[(rel, gen)], rel, s["shard"], int(s["index_in_shard"])):
                    out.setdefault((s["batch"], s["key"]), set()).add(sid)
    return out
