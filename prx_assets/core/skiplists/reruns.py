"""What the skip-list stage's sensors request, decided from the landing files and the lab.

Plain functions (no Dagster): the sensors in ``defs/skiplists/sensors.py`` turn these
answers into run requests and never write a table.

- Opt-out lists (:func:`plan_opt_out_tick`), in two steps over ticks: a new list file is
  requested for intake (the ``opt_out_lists`` asset records it, see
  :mod:`prx_assets.core.skiplists.intake`); once intake has recorded it, ``skip_lists`` is
  requested for exactly the partitions holding any copy (its pHash cluster, any batch) of an
  image it names, and only those that have shards and are still partitions.
- The skip policy (:func:`stale_policy_batches`): partitions decided under another policy.
- ``skip_dirty`` (:func:`skip_dirty_reruns`): partitions whose recorded decisions another
  batch's ``skip_lists`` run found contradicted.
- Batching (:func:`plan_partition_runs`): the partitions a list or a policy change reaches,
  as a bounded number of runs over ranges of partitions instead of one run each.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prx_assets.core.dedup.dirty import read_dirty
from prx_assets.core.lab import Lab, in_list, sql_literal
from prx_assets.core.skiplists.decisions import cluster_copies, read_skip_dirty
from prx_assets.core.skiplists.intake import STATUS_ACCEPTED, ListFile
from prx_assets.core.skiplists.matching import sharded_batches
from prx_assets.core.skiplists.optouts import OptOutListError, discover_lists
from prx_assets.core.tables import OPT_OUT_LISTS, OPT_OUTS, SKIP_AUDIT

# --------------------------------------------------------------------------- opt-out lists


@dataclass
class OptOutCursor:
    """The opt-out sensor's memory between ticks.

    ``applied``: lists recorded and acted on (their partitions requested, or rejected);
    ``awaiting``: lists whose intake was requested and is not recorded yet (a failed intake
    stays here until a rerun of its ``opt_out_lists`` partition records it); ``seen``: file
    name -> (size, mtime_ns, list id), so unchanged files are not re-hashed every tick.
    A lost cursor is safe: files are found again, lists already recorded are not taken in
    again, and their partitions are requested again (``skip_lists`` is idempotent).
    """

    applied: set[str] = field(default_factory=set)
    awaiting: set[str] = field(default_factory=set)
    seen: dict[str, tuple[int, int, str]] = field(default_factory=dict)

    @classmethod
    def load(cls, raw: str | None) -> OptOutCursor:
        if not raw:
            return cls()
        obj = json.loads(raw)
        if isinstance(obj, list):  # a bare list of ids is accepted too
            return cls(applied=set(obj))
        return cls(
            applied=set(obj.get("processed", [])),  # the name cursors before intake runs used
            awaiting=set(obj.get("awaiting", [])),
            seen={k: (int(v[0]), int(v[1]), str(v[2])) for k, v in obj.get("seen", {}).items()},
        )

    def dump(self) -> str:
        return json.dumps(
            {
                "processed": sorted(self.applied),
                "awaiting": sorted(self.awaiting),
                "seen": {k: list(v) for k, v in sorted(self.seen.items())},
            },
            separators=(",", ":"),
        )


def scan_new_lists(directory: Path, cursor: OptOutCursor, limit: int) -> list[ListFile]:
    """Up to ``limit`` list files the cursor does not know, by name, hashed as a stream
    (never read whole: a 200 MB file costs a 1 MiB buffer)."""
    known = cursor.applied | cursor.awaiting
    out: list[ListFile] = []
    present = set()
    for path in discover_lists(directory):
        present.add(path.name)
        try:
            st = path.stat()
            cached = cursor.seen.get(path.name)
            if cached and cached[:2] == (st.st_size, st.st_mtime_ns) and cached[2] in known:
                continue
            if len(out) >= limit:
                continue
            item = ListFile.of(path)
        except (FileNotFoundError, OptOutListError):  # renamed away, or no longer a file
            continue
        cursor.seen[path.name] = (st.st_size, st.st_mtime_ns, item.list_id)
        if item.list_id not in known:
            out.append(item)
    for name in set(cursor.seen) - present:
        del cursor.seen[name]
    return out


@dataclass(frozen=True)
class RecordedList:
    """A list intake has recorded (its ``opt_out_lists`` row)."""

    list_id: str
    status: str
    reason: str | None
    # What the intake computed (``intake.list_reach``); None: a list recorded before it did,
    # whose reach the sensor computes itself (``affected_copies``).
    reach_batches: tuple[str, ...] | None = None
    reach_sharded: tuple[str, ...] | None = None

    @property
    def accepted(self) -> bool:
        return self.status == STATUS_ACCEPTED


def recorded_lists(lab: Lab, list_ids: Iterable[str]) -> dict[str, RecordedList]:
    """The ``opt_out_lists`` rows of these lists that exist (list_id BTREE)."""
    ids = sorted(set(list_ids))
    if not ids:
        return {}
    schema = lab.view().schema(OPT_OUT_LISTS.name)
    reach = [c for c in ("reach_batches", "reach_sharded") if schema and c in schema.names]
    rows = lab.read(
        OPT_OUT_LISTS.name, ["list_id", "status", "reason", *reach], in_list("list_id", ids)
    )
    out = {}
    for r in rows.to_pylist():
        got = {c: (None if r.get(c) is None else tuple(r[c])) for c in reach}
        out[r["list_id"]] = RecordedList(r["list_id"], r["status"], r["reason"], **got)
    return out


@dataclass(frozen=True)
class Affected:
    """The copies recorded lists reach, and the batches they are in."""

    copies: set[tuple[str, str]]  # (batch, key): the images named and every pHash copy
    lists_by_batch: dict[str, set[str]]  # batch -> the lists reaching one of its copies


def affected_copies(lab: Lab, list_ids: Iterable[str]) -> Affected:
    """What intake recorded for these lists (``opt_outs`` matches), widened to the pHash
    clusters: a list naming one copy excludes every copy of the picture, in any batch."""
    ids = sorted(set(list_ids))
    copies: set[tuple[str, str]] = set()
    by_batch: dict[str, set[str]] = {}
    if not ids:
        return Affected(copies, by_batch)
    rows = lab.read(
        OPT_OUTS.name,
        ["list_id", "matched_batch", "matched_key"],
        f"{in_list('list_id', ids)} AND matched_key IS NOT NULL",
    )
    matched: dict[str, set[tuple[str, str]]] = {}
    for r in rows.to_pylist():
        matched.setdefault(r["list_id"], set()).add((r["matched_batch"], r["matched_key"]))
    for list_id in ids:
        reached = cluster_copies(lab, matched.get(list_id, set()))
        copies |= reached
        for batch, _ in reached:
            by_batch.setdefault(batch, set()).add(list_id)
    return Affected(copies, by_batch)


@dataclass(frozen=True)
class OptOutTick:
    """What one tick of the opt-out sensor asks for, and what it noticed."""

    intake: list[ListFile]  # new lists: request their intake
    recorded: list[RecordedList]  # recorded since the last tick: acted on now
    skip_lists: dict[str, list[str]]  # batch -> the recorded lists it must apply
    waiting: list[str]  # batches matched but not requested (no shards yet, not a partition)
    awaiting: list[str]  # lists whose intake was requested and is not recorded yet


def plan_opt_out_tick(
    lab: Lab, directory: Path, cursor: OptOutCursor, limit: int, registered: set[str]
) -> OptOutTick:
    """One tick: new files to take in, recorded lists to apply (``cursor`` is updated).

    Only partitions holding a reached copy in a shard, and in ``registered``, are requested;
    ``skip_lists`` applies the lists to the others when they reach it (it matches from the
    partition side).
    """
    found = scan_new_lists(directory, cursor, limit)
    candidates = cursor.awaiting | {f.list_id for f in found}
    recorded = recorded_lists(lab, candidates)
    intake = [f for f in found if f.list_id not in recorded]
    cursor.awaiting |= {f.list_id for f in intake}
    ready = [recorded[i] for i in sorted(candidates & set(recorded))]
    for r in ready:
        cursor.awaiting.discard(r.list_id)
        cursor.applied.add(r.list_id)

    accepted = [r for r in ready if r.accepted]
    # A list's reach is the intake run's (computed there, out of the tick's time limit); a
    # list recorded before intakes computed it is reached here, as before.
    legacy = [r.list_id for r in accepted if r.reach_batches is None or r.reach_sharded is None]
    affected = affected_copies(lab, legacy)
    lists_by_batch = {b: set(ls) for b, ls in affected.lists_by_batch.items()}
    sharded = sharded_batches(lab, affected.copies)
    for r in accepted:
        if r.reach_batches is None or r.reach_sharded is None:
            continue
        for b in r.reach_batches:
            lists_by_batch.setdefault(b, set()).add(r.list_id)
        sharded |= set(r.reach_sharded)
    batches = set(lists_by_batch)
    wanted = batches & sharded & registered
    return OptOutTick(
        intake=intake,
        recorded=ready,
        skip_lists={b: sorted(lists_by_batch[b]) for b in sorted(wanted)},
        waiting=sorted(batches - wanted),
        awaiting=sorted(cursor.awaiting),
    )


def opt_out_run_key(list_ids: Iterable[str], batch: str) -> str:
    """One run per (lists, partition): Dagster never launches the same key twice."""
    return f"opt_out:{'+'.join(sorted(list_ids))}:{batch}"


# --------------------------------------------------------------------------- batching

#: Partitions one ``skip_lists`` run covers at most (its range, wanted and bridged).
DEFAULT_PARTITIONS_PER_RUN = 100
#: Partitions nobody asked for that a run may cover between two wanted ones rather than
#: start another run: rerunning one costs its decision work (idempotent, it re-decides on
#: the current facts), a run of its own the run's fixed cost (a run worker loading the code
#: location, the run's events), which is several times a partition's decision work.
DEFAULT_MAX_BRIDGE = 16


@dataclass(frozen=True)
class PartitionRun:
    """One run over a range of partitions: ``first``..``last`` in the partitions' order.

    ``batches`` is every partition of the range (what the run materialises); ``wanted`` the
    ones it was requested for, the rest are bridged (between two wanted ones).
    """

    first: str
    last: str
    batches: tuple[str, ...]
    wanted: tuple[str, ...]

    @property
    def bridged(self) -> tuple[str, ...]:
        wanted = set(self.wanted)
        return tuple(b for b in self.batches if b not in wanted)

    def digest(self) -> str:
        """Names exactly the partitions the run covers (for run keys)."""
        return hashlib.sha256("\0".join(self.batches).encode()).hexdigest()[:16]


def plan_partition_runs(
    ordered: Sequence[str],
    wanted: Collection[str],
    max_per_run: int = DEFAULT_PARTITIONS_PER_RUN,
    max_bridge: int = DEFAULT_MAX_BRIDGE,
) -> list[PartitionRun]:
    """``wanted`` partitions as runs over contiguous ranges of ``ordered``.

    ``ordered`` is every partition key in the partitions definition's order (a range run
    materialises every key between its two ends in that order). A run covers at most
    ``max_per_run`` keys and bridges a gap of at most ``max_bridge`` unwanted keys; a wanted
    key not in ``ordered`` is not planned (it is no partition). Deterministic: the same
    inputs give the same runs, hence the same run keys.
    """
    if max_per_run < 1 or max_bridge < 0:
        raise ValueError(f"max_per_run {max_per_run} must be >= 1 and max_bridge {max_bridge} >= 0")
    want = set(wanted)
    runs: list[PartitionRun] = []
    current: list[str] = []  # the open run's keys, ending with a wanted one
    gap: list[str] = []  # unwanted keys since the open run's last wanted one

    def close() -> None:
        if current:
            picked = tuple(k for k in current if k in want)
            runs.append(PartitionRun(current[0], current[-1], tuple(current), picked))
            current.clear()

    for key in ordered:
        if key not in want:
            if current:
                gap.append(key)
                if len(gap) > max_bridge:
                    close()
                    gap.clear()
            continue
        if current and len(current) + len(gap) + 1 > max_per_run:
            close()
            gap.clear()
        current.extend(gap)
        gap.clear()
        current.append(key)
    close()
    return runs


def opt_out_range_run_key(list_ids: Iterable[str], run: PartitionRun) -> str:
    """One run per (lists, exact set of partitions): a lost cursor requests the same keys."""
    lists = "+".join(sorted(list_ids))
    if len(lists) > 200:  # many lists in one tick: named by digest, listed in the run's tags
        lists = "lists-" + hashlib.sha256(lists.encode()).hexdigest()[:16]
    return f"opt_out:{lists}:{run.first}..{run.last}:{run.digest()}"


def intake_run_key(list_id: str) -> str:
    return f"opt_out_intake:{list_id}"


# --------------------------------------------------------------------------- policy


def stale_policy_batches(lab: Lab, fingerprint: str) -> dict[str, str]:
    """Batch -> marker of its audit rows decided under another policy (pushed-down filter)."""
    if not lab.exists(SKIP_AUDIT.name):
        return {}
    rows = lab.read(
        SKIP_AUDIT.name,
        ["batch", "policy_fingerprint", "decided_at"],
        filter=f"policy_fingerprint != {sql_literal(fingerprint)} OR policy_fingerprint IS NULL",
    )
    found: dict[str, set[str]] = {}
    for batch, fp, at in zip(
        *(rows.column(c).to_pylist() for c in ("batch", "policy_fingerprint", "decided_at")),
        strict=True,
    ):
        found.setdefault(batch, set()).add(f"{fp}@{at.isoformat() if at else None}")
    return {
        b: hashlib.sha256("\0".join(sorted(m)).encode()).hexdigest()[:12]
        for b, m in sorted(found.items())
    }


# --------------------------------------------------------------------------- skip_dirty


@dataclass(frozen=True)
class SkipRerun:
    """One partition's skip_lists rerun: its run key digests the marks it answers."""

    batch: str
    run_key: str
    marks: int
    reason: str  # human-readable, for the run's tags and the log


def skip_dirty_reruns(
    lab: Lab, registered: set[str] | None = None, defer_to_dedup: bool = True
) -> dict[str, SkipRerun]:
    """Batch -> its skip_lists rerun, for every partition with ``skip_dirty`` marks.

    ``defer_to_dedup``: a partition with pending ``dedup_dirty`` marks is left to the dedup
    sensor, whose rerun includes skip_lists (and clears these marks too). ``registered``:
    the partitions that exist (a deleted partition's leftover marks resurrect nothing).
    """
    waiting_for_dedup = (
        {r["batch"] for r in read_dirty(lab).to_pylist()} if defer_to_dedup else set()
    )
    by_batch: dict[str, list[dict]] = {}
    for row in read_skip_dirty(lab).to_pylist():
        by_batch.setdefault(row["batch"], []).append(row)
    out = {}
    for batch, rows in sorted(by_batch.items()):
        if batch in waiting_for_dedup or (registered is not None and batch not in registered):
            continue
        ids = sorted(r["dirty_id"] for r in rows)
        digest = hashlib.sha256("\0".join(ids).encode()).hexdigest()[:16]
        by = ", ".join(sorted({r["detected_by"] for r in rows}))
        out[batch] = SkipRerun(
            batch=batch,
            run_key=f"skip_dirty:{batch}:{digest}",
            marks=len(rows),
            reason=f"{len(rows)} recorded decision(s) contradicted by {by}",
        )
    return out
