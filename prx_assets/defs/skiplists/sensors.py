"""The skip-list stage's sensors, each requesting ``skip_lists`` for exactly the partitions
a change affects:

- the opt-out sensor: each new list once -> the partitions holding a copy it names, or any
  other copy of that picture (its pHash cluster, any batch);
- the skip-policy sensor: partitions decided under another policy;
- the skip-dirty sensor: partitions whose recorded decisions another batch's ``skip_lists``
  run found contradicted (``skip_dirty``: e.g. their copy became the training copy because
  the keeper was reclassified).

Why a sensor and one run per partition (measured with Dagster 1.13.27): with the opt-outs as
an upstream asset of ``skip_lists`` under eager automation every new list reran
``skip_lists`` for every partition; a sensor that resolves the affected batches and requests
``skip_lists`` for those partition keys ran exactly those. Each affected partition gets its
own ``RunRequest`` (``asset_selection=[skip_lists]``) whose run key names the list ids it
applies, so every run is traceable to the lists that caused it and Dagster never requests
the same (lists, partition) twice, even when the cursor is lost.

Opt-out formats and rules: see :mod:`prx_assets.core.skiplists.optouts`.
"""

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from dagster import (
    AssetKey,
    AssetSelection,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from prx_assets.core.dedup.dirty import read_dirty
from prx_assets.core.lab import Lab, sql_literal
from prx_assets.core.skiplists.decisions import cluster_copies, read_skip_dirty
from prx_assets.core.skiplists.optouts import (
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_LIST_BYTES,
    OptOutListError,
    discover_lists,
    ensure_image_lookup_indexes,
    file_sha256,
    list_row,
    make_list_id,
    opt_out_rows,
    parse_list_file,
    recorded_list,
    replace_rows,
    resolve_identifiers,
    sharded_batches,
)
from prx_assets.core.tables import OPT_OUT_LISTS, OPT_OUTS, SKIP_AUDIT
from prx_assets.core.text import printable_name
from prx_assets.defs.metadata import bounded
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.skiplists.assets import SKIP_LISTS_ASSET
from prx_assets.defs.skiplists.config import OptOutResource, SkipPolicyResource
from prx_assets.defs.tags import TRIGGER_TAG

LISTS_TAG = "prx/opt_out_lists"


@dataclass
class Cursor:
    """Processed list ids, plus file name -> (size, mtime_ns, list id) so unchanged files
    are not re-hashed on every tick."""

    processed: set[str] = field(default_factory=set)
    seen: dict[str, tuple[int, int, str]] = field(default_factory=dict)

    @classmethod
    def load(cls, raw: str | None) -> "Cursor":
        if not raw:
            return cls()
        obj = json.loads(raw)
        if isinstance(obj, list):  # a bare list of ids is accepted too
            return cls(processed=set(obj))
        return cls(
            processed=set(obj.get("processed", [])),
            seen={k: (int(v[0]), int(v[1]), str(v[2])) for k, v in obj.get("seen", {}).items()},
        )

    def dump(self) -> str:
        return json.dumps(
            {
                "processed": sorted(self.processed),
                "seen": {k: list(v) for k, v in sorted(self.seen.items())},
            },
            separators=(",", ":"),
        )


@dataclass(frozen=True)
class NewList:
    path: Path
    sha256: str
    list_id: str


@dataclass(frozen=True)
class Intake:
    list_id: str
    accepted: bool
    reason: str | None
    identifiers: int
    matched: frozenset[tuple[str, str]]  # (batch, key)


def new_lists(directory: Path, cursor: Cursor, limit: int) -> list[NewList]:
    """Up to ``limit`` unprocessed list files, by name, hashed as a stream (never read whole:
    a 200 MB file costs a 1 MiB buffer); ``intake`` parses them from the file."""
    out: list[NewList] = []
    present = set()
    for path in discover_lists(directory):
        present.add(path.name)
        try:
            st = path.stat()
            cached = cursor.seen.get(path.name)
            if (
                cached
                and cached[:2] == (st.st_size, st.st_mtime_ns)
                and cached[2] in cursor.processed
            ):
                continue
            if len(out) >= limit:
                continue
            sha = file_sha256(path)
        except (FileNotFoundError, OptOutListError):  # renamed away, or no longer a file
            continue
        list_id = make_list_id(path.name, sha)
        cursor.seen[path.name] = (st.st_size, st.st_mtime_ns, list_id)
        if list_id not in cursor.processed:
            out.append(NewList(path, sha, list_id))
    for name in set(cursor.seen) - present:
        del cursor.seen[name]
    return out


def intake(
    lab: Lab,
    item: NewList,
    now: datetime,
    max_list_bytes: int = DEFAULT_MAX_LIST_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Intake:
    """Parse (as a stream, within the size caps), resolve and record one list (idempotent:
    a replay rewrites the same rows)."""
    prior = recorded_list(lab, item.list_id)
    received_at = prior["received_at"] if prior else now
    shown = printable_name(os.fsencode(item.path))
    try:
        parsed = parse_list_file(
            item.path,
            max_list_bytes=max_list_bytes,
            max_line_bytes=max_line_bytes,
            expected_sha256=item.sha256,
        )
    except OptOutListError as exc:
        replace_rows(
            lab,
            OPT_OUT_LISTS,
            "list_id",
            item.list_id,
            list_row(item.list_id, shown, item.sha256, received_at, fmt=None, error=exc),
        )
        return Intake(item.list_id, False, exc.reason, 0, frozenset())
    matches = resolve_identifiers(lab, parsed.identifiers)
    pairs = frozenset(p for ms in matches.values() for p in ms)
    replace_rows(
        lab, OPT_OUTS, "list_id", item.list_id, opt_out_rows(item.list_id, matches, received_at)
    )
    replace_rows(
        lab,
        OPT_OUT_LISTS,
        "list_id",
        item.list_id,
        list_row(
            item.list_id,
            shown,
            item.sha256,
            received_at,
            fmt=parsed.format,
            rows=len(parsed.identifiers),
            matched_images=len(pairs),
            batches=sorted({b for b, _ in pairs}),
        ),
    )
    return Intake(item.list_id, True, None, len(parsed.identifiers), pairs)


def opt_out_run_key(list_ids: Sequence[str], batch: str) -> str:
    return f"opt_out:{'+'.join(sorted(list_ids))}:{batch}"


def build_opt_out_sensor(
    *,
    name: str = "opt_out_sensor",
    minimum_interval_seconds: int = 60,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """The opt-out sensor; ``minimum_interval_seconds`` is how often it looks for lists."""

    @sensor(
        name=name,
        target=AssetSelection.assets(SKIP_LISTS_ASSET),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=(
            "Records each new opt-out list once (opt_outs, opt_out_lists; malformed lists are "
            "rejected with a reason), resolves the images it names and their pHash clusters "
            "through Lance scalar indexes, and requests skip_lists for the partitions holding "
            "any copy of them, only."
        ),
    )
    def _opt_out_sensor(
        context: SensorEvaluationContext, lab: LabResource, optouts: OptOutResource
    ) -> SensorResult:
        cursor = Cursor.load(context.cursor)
        directory = optouts.directory(lab)
        found = new_lists(directory, cursor, max(1, optouts.max_lists_per_tick))
        if not found:
            return SensorResult(
                skip_reason=SkipReason(f"no new opt-out lists in {directory}"),
                cursor=cursor.dump(),
            )
        store = lab.lab()
        ensure_image_lookup_indexes(store)
        now = datetime.now(UTC)
        results = []
        for item in found:
            result = intake(store, item, now, optouts.max_list_bytes, optouts.max_line_bytes)
            results.append(result)
            cursor.processed.add(item.list_id)
            if result.accepted:
                context.log.info(
                    f"opt-out list {item.list_id}: {result.identifiers} identifier(s), "
                    f"{len(result.matched)} image(s) matched"
                )
            else:
                reason = bounded(result.reason or "", 400)
                context.log.warning(f"opt-out list {item.list_id} rejected: {reason}")

        registered = set(context.instance.get_dynamic_partitions(BATCHES.name))
        # A list naming one copy excludes every copy of the picture: add the clusters.
        affected: set[tuple[str, str]] = set()
        lists_by_batch: dict[str, set[str]] = {}
        for r in results:
            copies = cluster_copies(store, r.matched)
            affected |= copies
            for batch, _ in copies:
                lists_by_batch.setdefault(batch, set()).add(r.list_id)
        sharded = sharded_batches(store, affected)
        waiting = sorted(b for b in lists_by_batch if b not in sharded or b not in registered)
        if waiting:
            context.log.info(
                f"matched but not requested (no shards yet or not a partition): {waiting}; "
                "skip_lists applies the lists when those batches reach it"
            )
        requests = [
            RunRequest(
                run_key=opt_out_run_key(sorted(lists_by_batch[batch]), batch),
                partition_key=batch,
                asset_selection=[AssetKey(SKIP_LISTS_ASSET)],
                tags={
                    TRIGGER_TAG: "opt_out",
                    LISTS_TAG: ",".join(sorted(lists_by_batch[batch])),
                },
            )
            for batch in sorted(set(lists_by_batch) & sharded & registered)
        ]
        if not requests:
            return SensorResult(
                skip_reason=SkipReason(
                    f"{len(results)} list(s) recorded "
                    f"({sum(r.accepted for r in results)} accepted); no sharded partition affected"
                ),
                cursor=cursor.dump(),
            )
        return SensorResult(run_requests=requests, cursor=cursor.dump())

    return _opt_out_sensor


opt_out_sensor = build_opt_out_sensor()


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


def build_skip_policy_sensor(
    *,
    name: str = "skip_policy_sensor",
    minimum_interval_seconds: int = 300,
    max_runs_per_tick: int = 50,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """Reruns skip_lists (only) where ``skip_audit`` was decided under another policy.

    Eager automation ignores code-version changes, so the policy fingerprint in the code
    version marks the asset stale in the UI but reruns nothing; this sensor does. The run
    key names the configured policy and the stale rows' own marker, so a policy switched
    back and forth is requested again, and each stale state only once.
    """

    @sensor(
        name=name,
        target=AssetSelection.assets(SKIP_LISTS_ASSET),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Reruns skip_lists for partitions decided under another skip policy.",
    )
    def _skip_policy_sensor(
        context: SensorEvaluationContext, lab: LabResource, skip_policy: SkipPolicyResource
    ) -> SensorResult | SkipReason:
        fp = skip_policy.fingerprint()
        registered = set(context.instance.get_dynamic_partitions(BATCHES.name))
        stale = {b: m for b, m in stale_policy_batches(lab.lab(), fp).items() if b in registered}
        if not stale:
            return SkipReason(f"every audited partition is decided under policy {fp}")
        requests = [
            RunRequest(
                run_key=f"skip_policy:{fp}:{batch}:{marker}",
                partition_key=batch,
                asset_selection=[AssetKey(SKIP_LISTS_ASSET)],
                tags={TRIGGER_TAG: "skip_policy"},
            )
            for batch, marker in list(stale.items())[:max_runs_per_tick]
        ]
        return SensorResult(run_requests=requests)

    return _skip_policy_sensor


skip_policy_sensor = build_skip_policy_sensor()


# --------------------------------------------------------------------------- skip_dirty


@dataclass(frozen=True)
class SkipRerun:
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


def build_skip_dirty_sensor(
    *,
    name: str = "skip_dirty_sensor",
    max_runs_per_tick: int = 25,
    minimum_interval_seconds: int = 60,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """Reruns skip_lists of exactly the partitions ``skip_dirty`` lists (see the module doc).

    One run per partition; the run key digests its marks, so the same state is requested
    once and a new mark gives a new request. The cursor keeps the keys still marked, so
    partitions beyond ``max_runs_per_tick`` are requested on later ticks. A failed rerun is
    not requested again until its marks change: rerun it by hand.
    """
    if max_runs_per_tick < 1:
        raise ValueError(f"max_runs_per_tick must be >= 1, got {max_runs_per_tick}")

    @sensor(
        name=name,
        target=AssetSelection.assets(SKIP_LISTS_ASSET),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description=(
            "Reruns skip_lists for the partitions whose recorded skip decisions another "
            "batch's skip_lists run contradicts (skip_dirty): e.g. a copy that must now be "
            "the training copy because its cluster's keeper was excluded, or stop being it."
        ),
    )
    def _skip_dirty_sensor(context: SensorEvaluationContext, lab: LabResource) -> SensorResult:
        registered = set(context.instance.get_dynamic_partitions(BATCHES.name))
        wanted = skip_dirty_reruns(lab.lab(), registered)
        keys = {r.run_key for r in wanted.values()}
        pending = set(json.loads(context.cursor)) & keys if context.cursor else set()
        requests = []
        for rerun in wanted.values():
            if rerun.run_key in pending:
                continue
            if len(requests) == max_runs_per_tick:
                break
            requests.append(
                RunRequest(
                    run_key=rerun.run_key,
                    partition_key=rerun.batch,
                    asset_selection=[AssetKey(SKIP_LISTS_ASSET)],
                    tags={TRIGGER_TAG: "skip_dirty", "prx/skip_dirty_reason": rerun.reason[:200]},
                )
            )
            pending.add(rerun.run_key)
        cursor = json.dumps(sorted(pending))
        if not requests:
            why = f"{len(wanted)} marked partition(s), all requested" if wanted else "none marked"
            return SensorResult(skip_reason=SkipReason(why), cursor=cursor)
        for r in requests:
            context.log.info(
                f"skip_lists rerun of {r.partition_key}: {r.tags['prx/skip_dirty_reason']}"
            )
        return SensorResult(run_requests=requests, cursor=cursor)

    return _skip_dirty_sensor


skip_dirty_sensor = build_skip_dirty_sensor()
