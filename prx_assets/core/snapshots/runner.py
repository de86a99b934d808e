"""Make, list and retire training snapshots: the effective training set, frozen and named.

A snapshot is what the default loader would train on at one moment: every bucket x batch
directory under ``<shards root>/mds`` with its ``index.json`` digest and its live skip-list
generation, the Lance version of every lab table it derives from, and the policy, model and
code fingerprints found there. Making one (``create_snapshot``):

1. opens every source table once (``LabView.pin``): the versions recorded are the ones read;
2. per directory, under its lock: loads and verifies the live generation (an unscreened,
   stale or tampered directory refuses the snapshot: the loader would refuse it too), writes
   its pin (core/snapshots/pins.py), and maps the kept (shard, index) slots to images through
   ``shard_samples`` (a directory the lab does not describe exactly refuses the snapshot);
3. refuses when a kept sample is an image an accepted opt-out list names (the list's
   skip-lists have not run yet: a snapshot must never freeze an opted-out image);
4. pins the Lance versions (``Lab.pin_versions``), records the skip-list generations no
   earlier snapshot froze (``skip_generations``, once per generation) and one
   ``snapshot_directories`` row per directory, stages the manifest file
   (``.<id>.json.staged``, atomic), commits the ``training_snapshots`` row (the commit
   point), then publishes the manifest under the name the loader reads (``<id>.json``;
   core/snapshots/manifest.py). Nothing is written per sample: which samples a snapshot
   holds is derived from these rows and ``shard_samples`` at its pinned version
   (core/snapshots/members.py), so a snapshot costs O(directories). The loader reads only
   a published manifest, and one is published only once its row is committed, so every
   snapshot a loader can train on is one that ``snapshot list``, compliance and
   retirement see.

A rerun with an existing name returns the existing snapshot untouched (snapshots are
immutable), publishing its manifest if the run that committed it was killed before that;
one interrupted after its staged manifest but before its row is completed from that file.
Retiring (``retire_snapshot``) removes the pins of its files and of its Lance versions but
those of ``members.MEMBERSHIP_TABLES`` and deletes retained directory copies nobody pins any
more; its rows and those versions stay, marked ``retired``, so the audit, compliance and
diff keep answering which samples it held.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from prx_assets.core.crashpoints import crashpoint
from prx_assets.core.lab import Lab, LabView, in_list, sql_literal
from prx_assets.core.shards.mds import MDS_DIRNAME, moved_away_batches, moved_away_message
from prx_assets.core.skiplists.matching import opt_out_columns, standing_rows
from prx_assets.core.skiplists.sidecars import (
    INDEX_BASENAME,
    Generation,
    SkipListError,
    load_generation,
    read_index_shards,
)
from prx_assets.core.snapshots import pins
from prx_assets.core.snapshots.manifest import (
    PinnedDirectory,
    SnapshotError,
    SnapshotManifest,
    encode_snapshot,
    is_retired,
    manifest_path,
    mark_retired,
    parse_snapshot,
    publish_snapshot_file,
    read_snapshot,
    stage_snapshot_file,
    staged_path,
)
from prx_assets.core.snapshots.members import (
    MEMBER_COLUMNS,
    MEMBERSHIP_TABLES,
    generation_rows,
    holders,
    recorded_generations,
)
from prx_assets.core.snapshots.tables import (
    SKIP_GENERATIONS,
    SNAPSHOT_DIRECTORIES,
    TRAINING_SNAPSHOTS,
)

# The lab tables a snapshot derives from (their versions are recorded and pinned).
SOURCE_TABLES: tuple[str, ...] = (
    "images",
    "resolution",
    "captions",
    "caption_classes",
    "image_hashes",
    "phash_clusters",
    "bucket_assignments",
    "shard_samples",
    "opt_outs",
    "opt_out_lists",
    "skip_audit",
)
MAX_LISTED = 20
BATCHES_PER_READ = 64  # batches whose lab rows a snapshot holds at once


def members_digest(members: Iterable[dict[str, Any]]) -> str:
    """sha256 over ``members``' ``MEMBER_COLUMNS``, in (batch, key) order: equal for two
    snapshots of a directory exactly when they keep the same samples with the same
    captions, classes, sources and buckets (what ``diff_snapshots`` compares)."""
    return _digest_rows([tuple(m[c] for c in MEMBER_COLUMNS) for m in members])


def _digest_rows(rows: list[tuple]) -> str:
    """``members_digest`` of rows already in ``MEMBER_COLUMNS`` order: one JSON array of the
    rows sorted by (batch, key) (one encoder call per directory, not one per sample)."""
    # Sorted by (batch, key) alone: the other values may be None, which does not order.
    rows.sort(key=lambda r: r[:2])
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def holder(snapshot_id: str) -> str:
    """The ``Lab.pin_versions`` holder name of a snapshot."""
    return f"snapshot:{snapshot_id}"


def code_fingerprint() -> str:
    """sha256 over the package's Python sources (path and bytes): which code made the data."""
    base = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for path in sorted(base.rglob("*.py")):
        h.update(path.relative_to(base).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class SnapshotOutcome:
    """What ``create_snapshot`` made (or found already made)."""

    manifest: SnapshotManifest
    created: bool  # False: the snapshot existed and was returned unchanged
    path: str


def _now() -> datetime:
    return datetime.now(UTC)


def _scan(mds_root: Path) -> list[str]:
    """``mds/<tier>/<H>x<W>/<batch>`` of every visible directory with an index (sorted).

    Refuses (``SnapshotError``) while a write has a directory moved away and not back
    (``mds.moved_away_batches``): a snapshot would silently freeze less than the lab lists.
    """
    out, moved = [], []
    if not mds_root.is_dir():
        return out
    for tier in sorted(p for p in mds_root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for shape in sorted(p for p in tier.iterdir() if p.is_dir() and not p.name.startswith(".")):
            entries = sorted(shape.iterdir())
            moved += [
                f"{MDS_DIRNAME}/{tier.name}/{shape.name}/{b}"
                for b in moved_away_batches(p.name for p in entries)
            ]
            for batch in (p for p in entries if p.is_dir() and not p.name.startswith(".")):
                if (batch / INDEX_BASENAME).is_file():
                    out.append(f"{MDS_DIRNAME}/{tier.name}/{shape.name}/{batch.name}")
    if moved:
        raise SnapshotError(moved_away_message(str(mds_root), moved))
    return out


def _distinct(view: LabView, table: str, column: str) -> list[str]:
    rows = view.read(table, [column]) if view.exists(table) else pa.table({})
    if not rows.num_rows:
        return []
    return sorted(v for v in rows.column(column).unique().to_pylist() if v is not None)


def _lookup(
    view: LabView, table: str, columns: list[str], batches: list[str]
) -> dict[tuple[str, str], tuple]:
    if not view.exists(table):
        return {}
    rows = view.read(table, ["batch", "key", *columns], in_list("batch", batches)).to_pydict()
    return {
        (b, k): tuple(rows[c][i] for c in columns)
        for i, (b, k) in enumerate(zip(rows["batch"], rows["key"], strict=True))
    }


def _opted_out_keys(view: LabView) -> dict[str, str]:
    """Image key -> an accepted list naming it (directly matched on arrival), unless its
    source withdrew that opt-out since."""
    if not view.exists("opt_outs") or not view.exists("opt_out_lists"):
        return {}
    accepted = view.read("opt_out_lists", ["list_id"], "status = 'accepted'")
    ids = accepted.column("list_id").to_pylist() if accepted.num_rows else []
    if not ids:
        return {}
    rows = view.read(  # matched rows only: a registry's unmatched millions stay unread
        "opt_outs",
        [*opt_out_columns(view), "matched_key"],
        f"{in_list('list_id', ids)} AND matched_key IS NOT NULL",
    ).to_pylist()
    # An opt-out its registry withdrew later no longer names the image (the skip decision
    # reads the same rule: ``matching.standing_opt_outs``).
    return {r["matched_key"]: r["list_id"] for r in standing_rows(view, rows)}


def existing(lab: Lab, snapshot_id: str) -> dict[str, Any] | None:
    """The ``training_snapshots`` row of ``snapshot_id``, None when there is none."""
    rows = lab.read(TRAINING_SNAPSHOTS.name, None, f"snapshot_id = {sql_literal(snapshot_id)}")
    return rows.to_pylist()[0] if rows.num_rows else None


@dataclass(frozen=True)
class _BatchRows:
    """What the lab says of a few batches, as ``_freeze_directory`` checks it."""

    placed: dict[str, dict[tuple[str, int], tuple]]  # relative_dir -> slot -> sample
    source: dict[tuple[str, str], tuple]
    classes: dict[tuple[str, str], tuple]
    opted_out: dict[str, str]  # image key -> an accepted list naming it


def _freeze_directory(
    root: Path, rel: str, snapshot_id: str, lab_rows: _BatchRows
) -> tuple[PinnedDirectory, dict[str, Any], Generation, dict[str, int]]:
    """Pin one directory's live generation and check the lab describes it exactly: its
    ``PinnedDirectory``, its ``snapshot_directories`` row, the generation and each shard's
    sample count. Refuses (``SnapshotError``) an unverifiable generation, a slot without a
    ``shard_samples`` row, and a kept sample an accepted opt-out names."""
    d = root / rel
    with pins.directory_lock(d):
        try:
            gen = load_generation(d)
        except SkipListError as exc:
            raise SnapshotError(f"{rel}: cannot be frozen: {exc}") from None
        entries = gen.manifest.entries
        pins.write_pin(
            d,
            snapshot_id,
            gen.manifest.index_sha256,
            gen.generation,
            [e.sidecar for e in entries],
            durable=False,  # made durable together by the caller, before the commit
        )
    crashpoint("snapshots.pinned")
    slots = lab_rows.placed.get(rel, {})
    samples = kept = 0
    members: list[tuple] = []  # this directory's, in MEMBER_COLUMNS order, for its digest
    counts = dict(read_index_shards(d))
    for shard, n in counts.items():
        samples += n
        skipped = set(gen.skiplists[shard].indices)
        for index in range(n):
            slot = slots.get((shard, index))
            if slot is None:
                raise SnapshotError(
                    f"{rel}: {shard} #{index} has no shard_samples row: the lab does "
                    "not describe this directory (materialise mds_shards for its batch)"
                )
            if index in skipped:
                continue
            kept += 1
            batch, key, tier, shape, caption_fp = slot
            if key in lab_rows.opted_out:
                raise SnapshotError(
                    f"{rel}: {shard} #{index} is image {key[:16]}…, which opt-out list "
                    f"{lab_rows.opted_out[key][:120]!r} names, yet its skip-lists keep it: "
                    f"run skip_lists for batch {batch[:120]!r} before snapshotting"
                )
            members.append(
                (
                    batch,
                    key,
                    tier,
                    shape,
                    (lab_rows.source.get((batch, key)) or (None,))[0],
                    caption_fp,
                    (lab_rows.classes.get((batch, key)) or (None,))[0],
                )
            )
    if len(slots) != samples:
        raise SnapshotError(
            f"{rel}: shard_samples holds {len(slots)} rows for {samples} samples: the lab "
            "and the shard tree disagree (materialise mds_shards for its batch)"
        )
    row = {
        "snapshot_id": snapshot_id,
        "batch": rel.rsplit("/", 1)[-1],
        "relative_dir": rel,
        "index_sha256": gen.manifest.index_sha256,
        "generation": gen.generation,
        "members_sha256": _digest_rows(members),
        "samples": samples,
        "kept_samples": kept,
    }
    pinned = PinnedDirectory(rel, gen.manifest.index_sha256, gen.generation, entries, samples, kept)
    return pinned, row, gen, counts


def create_snapshot(
    lab: Lab,
    shards_root: str | os.PathLike[str],
    snapshot_id: str,
    *,
    now: datetime | None = None,
    allow_empty: bool = False,
) -> SnapshotOutcome:
    """Freeze the effective training set as snapshot ``snapshot_id`` (see the module doc).

    A training set with no sample kept is refused unless ``allow_empty``: freezing "0 of N
    samples in training" is almost always a mistake (an unsettled pipeline, a policy that
    skips everything) that should not pass as a snapshot made."""
    pins.check_snapshot_id(snapshot_id)
    root = Path(shards_root)
    path = manifest_path(root, snapshot_id)
    staged = staged_path(root, snapshot_id)
    row = existing(lab, snapshot_id)
    if row is not None:
        _publish_committed(root, row)  # a no-op unless killed between its row and publishing
        return SnapshotOutcome(read_snapshot(root, snapshot_id), False, str(path))
    if staged.exists() or path.exists():  # interrupted before its row: finish from the file
        # (a published file without a row is only left by code that published first)
        manifest = read_snapshot(root, snapshot_id, uncommitted=True)
        lab.pin_versions(holder(snapshot_id), manifest.lab_versions)
        _record(lab, root, manifest)
        publish_snapshot_file(root, snapshot_id)
        return SnapshotOutcome(manifest, False, str(path))

    view = lab.view()
    versions = view.pin(SOURCE_TABLES)
    opted_out = _opted_out_keys(view)

    new_generations: list[dict[str, Any]] = []
    total_kept = 0
    pinned: list[Path] = []
    try:
        rels = _scan(root / "mds")
        known = recorded_generations(lab, rels)
        by_batch: dict[str, list[str]] = {}
        for rel in rels:
            by_batch.setdefault(rel.rsplit("/", 1)[-1], []).append(rel)
        by_rel: dict[str, PinnedDirectory] = {}
        row_of: dict[str, dict[str, Any]] = {}
        batches = sorted(by_batch)
        # A few batches at a time: memory bounded by the batches read, not by the tree.
        for first in range(0, len(batches), BATCHES_PER_READ):
            chunk = batches[first : first + BATCHES_PER_READ]
            placed = _placements(view, chunk)
            source = _lookup(view, "images", ["source"], chunk)
            classes = _lookup(view, "caption_classes", ["backend_fingerprint"], chunk)
            lab_rows = _BatchRows(placed, source, classes, opted_out)
            for rel in (r for b in chunk for r in by_batch[b]):
                pinned.append(root / rel)
                frozen_dir, row, gen, counts = _freeze_directory(root, rel, snapshot_id, lab_rows)
                by_rel[rel], row_of[rel] = frozen_dir, row
                total_kept += frozen_dir.kept_samples
                if (rel, gen.generation) not in known:
                    known.add((rel, gen.generation))
                    new_generations += generation_rows(
                        rel, gen.generation, gen.manifest.entries, gen.skiplists, counts
                    )
        directories = [by_rel[r] for r in rels]  # the tree's order, as scanned
        directory_rows = [row_of[r] for r in rels]
        if not directories:
            raise SnapshotError(
                f"no bucket x batch directory under {root / 'mds'}: nothing to freeze"
            )
        if not allow_empty and not total_kept:
            total = sum(d.samples for d in directories)
            raise SnapshotError(
                f"0 of {total} samples are in training (every one is skipped): nothing "
                "frozen; to record an empty training set on purpose, allow it explicitly "
                "(`snapshot create NAME --allow-empty`)"
            )
        fingerprints = {
            "policy": _distinct(view, "skip_audit", "policy_fingerprint"),
            "captioner": _distinct(view, "shard_samples", "caption_fingerprint"),
            "classifier": _distinct(view, "caption_classes", "backend_fingerprint"),
            "code": code_fingerprint(),
        }
        created_at = (now or _now()).isoformat()
        data = encode_snapshot(snapshot_id, created_at, versions, fingerprints, directories)
        manifest = parse_snapshot(data, str(path))
        os.sync()  # every pin durable before anything that commits the snapshot
        lab.pin_versions(holder(snapshot_id), versions)
        # Content-addressed: a generation an earlier (or a killed) attempt recorded is not
        # written twice, and rows of a killed attempt are true for whoever freezes it next.
        lab.insert_missing(
            SKIP_GENERATIONS, pa.Table.from_pylist(new_generations, schema=SKIP_GENERATIONS.schema)
        )
        lab.replace_rows(
            SNAPSHOT_DIRECTORIES,
            "snapshot_id",
            snapshot_id,
            pa.Table.from_pylist(directory_rows, schema=SNAPSHOT_DIRECTORIES.schema),
        )
        stage_snapshot_file(root, snapshot_id, data)
        crashpoint("snapshots.file_written")
    except BaseException:
        if not staged.exists() and not path.exists():  # nothing staged: give back the pins
            for d in pinned:
                pins.remove_pin(d, snapshot_id)
            lab.unpin(holder(snapshot_id))
        raise
    _record(lab, root, manifest)  # the commit point
    crashpoint("snapshots.recorded")
    publish_snapshot_file(root, snapshot_id)  # from here the loader may read it
    return SnapshotOutcome(manifest, True, str(path))


def _publish_committed(root: Path, row: dict[str, Any]) -> None:
    """Publish the staged manifest of a snapshot whose row is committed (a create killed
    between the two), after checking it is the manifest the row recorded."""
    snapshot_id = row["snapshot_id"]
    if manifest_path(root, snapshot_id).exists() or not staged_path(root, snapshot_id).exists():
        return
    staged = read_snapshot(root, snapshot_id, uncommitted=True)
    if staged.sha256 != row["manifest_sha256"]:
        raise SnapshotError(
            f"{staged_path(root, snapshot_id)}: not the manifest training_snapshots recorded "
            f"for {snapshot_id!r} (content hash differs); refusing to publish it"
        )
    publish_snapshot_file(root, snapshot_id)


def _placements(view: LabView, batches: list[str]) -> dict[str, dict[tuple[str, int], tuple]]:
    """relative_dir -> (shard, index) -> (batch, key, tier, shape, caption fingerprint), for
    the directories of ``batches``."""
    if not view.exists("shard_samples"):
        return {}
    cols = ["relative_dir", "shard", "index_in_shard", "batch", "key", "tier", "shape"]
    rows = view.read(
        "shard_samples", [*cols, "caption_fingerprint"], in_list("batch", batches)
    ).to_pydict()
    out: dict[str, dict[tuple[str, int], tuple]] = {}
    for i, rel in enumerate(rows["relative_dir"]):
        out.setdefault(rel, {})[(rows["shard"][i], int(rows["index_in_shard"][i]))] = (
            rows["batch"][i],
            rows["key"][i],
            rows["tier"][i],
            rows["shape"][i],
            rows["caption_fingerprint"][i],
        )
    return out


def _record(lab: Lab, root: Path, manifest: SnapshotManifest) -> None:
    """The ``training_snapshots`` row: the commit point of a snapshot."""
    fp = manifest.fingerprints
    row = {
        "snapshot_id": manifest.snapshot_id,
        "created_at": datetime.fromisoformat(manifest.created_at),
        "status": "retired" if is_retired(root, manifest.snapshot_id) else "live",
        "retired_at": None,
        "manifest_path": manifest_path(root, manifest.snapshot_id).relative_to(root).as_posix(),
        "manifest_sha256": manifest.sha256,
        "directories": len(manifest.directories),
        "samples": manifest.samples,
        "kept_samples": manifest.kept_samples,
        "lab_versions": json.dumps(manifest.lab_versions, sort_keys=True),
        "policy_fingerprints": list(fp.get("policy", [])),
        "captioner_fingerprints": list(fp.get("captioner", [])),
        "classifier_fingerprints": list(fp.get("classifier", [])),
        "code_fingerprint": fp.get("code"),
    }
    lab.replace_rows(
        TRAINING_SNAPSHOTS,
        "snapshot_id",
        manifest.snapshot_id,
        pa.Table.from_pylist([row], schema=TRAINING_SNAPSHOTS.schema),
    )


def list_snapshots(lab: Lab) -> list[dict[str, Any]]:
    """Every recorded snapshot, oldest first."""
    rows = lab.read(TRAINING_SNAPSHOTS.name).to_pylist()
    return sorted(rows, key=lambda r: (r["created_at"], r["snapshot_id"]))


@dataclass(frozen=True)
class RetireOutcome:
    """What retiring a snapshot released."""

    snapshot_id: str
    pins_removed: int
    retained_removed: list[str]
    already_retired: bool


def retire_snapshot(
    lab: Lab, shards_root: str | os.PathLike[str], snapshot_id: str, *, now: datetime | None = None
) -> RetireOutcome:
    """Retire ``snapshot_id``: its files and Lance versions may be cleaned up from now on.

    The marker file is written first, so a loader refuses the snapshot before any of its
    files can go; a rerun finishes an interrupted retirement.
    """
    root = Path(shards_root)
    # An interrupted create (staged manifest only) is retired too: its pins are released.
    manifest = read_snapshot(root, snapshot_id, uncommitted=True)
    row = existing(lab, snapshot_id)
    already = row is not None and row["status"] == "retired"
    when = now or _now()
    if not is_retired(root, snapshot_id):
        mark_retired(root, snapshot_id, when.isoformat())
    if row is not None:
        _publish_committed(root, row)
    removed = 0
    for d in manifest.directories:
        for where in (
            root / d.relative_dir,
            pins.retained_dir(root, d.relative_dir, d.index_sha256),
        ):
            if where.is_dir() and pins.remove_pin(where, snapshot_id):
                removed += 1
    if row is None:  # never committed: nothing to answer for, every version is released
        lab.unpin(holder(snapshot_id))
    else:  # which samples it held stays answerable: the membership versions stay pinned
        lab.pin_versions(
            holder(snapshot_id),
            {t: v for t, v in manifest.lab_versions.items() if t in MEMBERSHIP_TABLES},
        )
    retained = pins.drop_unpinned_retained(root)
    if row is not None and not already:
        row = dict(row)
        row["status"] = "retired"
        row["retired_at"] = when
        lab.replace_rows(
            TRAINING_SNAPSHOTS,
            "snapshot_id",
            snapshot_id,
            pa.Table.from_pylist([row], schema=TRAINING_SNAPSHOTS.schema),
        )
    return RetireOutcome(snapshot_id, removed, retained, already)


def snapshots_containing(lab: Lab, keys: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """Image key -> the snapshots whose training set held it (id, batch, created_at, status),
    derived from each snapshot's frozen directories (``members.holders``)."""
    held = holders(lab, keys)
    if not held:
        return {}
    info = {r["snapshot_id"]: r for r in list_snapshots(lab)}
    out: dict[str, list[dict[str, Any]]] = {}
    for (batch, key), ids in held.items():
        for sid in ids:
            out.setdefault(key, []).append(
                {
                    "snapshot_id": sid,
                    "batch": batch,
                    "created_at": info[sid]["created_at"],
                    "status": info[sid]["status"],
                }
            )
    for v in out.values():
        v.sort(key=lambda r: (r["created_at"], r["snapshot_id"], r["batch"]))
    return out
