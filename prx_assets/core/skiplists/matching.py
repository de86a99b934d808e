"""Which images an opt-out list names, and which lists name an image.

Both directions go through Lance scalar indexes, so their cost follows the list or the
partition, never the corpus:

- at intake, a list's identifiers are resolved to the (batch, key) pairs they name now
  (``images.key``, ``images.url``, ``images.source_id`` BTREEs, declared by the ``images``
  spec), which tells the opt-out sensor which partitions to rerun;
- at decision time, ``skip_lists`` asks, for the images of its partition and their copies,
  which accepted lists name any of them (``opt_outs.identifier`` BTREE): matching from the
  partition side, so a list received before a batch was ingested still applies to it.

Withdrawals: a registry allowed to withdraw records ``withdraw`` rows like opt-outs (with
the images they matched, so the sensor reruns those partitions); which opt-outs stand is
decided where rows are read (``standing_opt_outs``): an opt-out stands unless a withdrawal
of the same identifier, from an accepted list of the same source received strictly later,
takes it back. Nothing else withdraws, and anything unknown leaves the opt-out standing.

Aliases: a file ingest refused as a byte-identical repeat of one it kept
(``rejects.reason = ALIAS_REASON``) carried its own URL and ``source:id``; the same bytes
train under the kept copy's name. Both directions match those names exactly like the kept
copy's own (``rejects.url`` / ``rejects.source_id`` BTREEs): a list naming the repeat
matches the kept (batch, key).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import pyarrow as pa

from prx_assets.core.batching import chunked
from prx_assets.core.ingest.tables import ALIAS_REASON
from prx_assets.core.lab import Lab, LabView, in_list, sql_literal
from prx_assets.core.skiplists.identifiers import (
    KIND_KEY,
    KIND_SOURCE_ID,
    KIND_URL,
    KINDS,
    OptOutIdentifier,
)
from prx_assets.core.skiplists.optouts import ACTION_ADD, ACTION_WITHDRAW, DEFAULT_SOURCE
from prx_assets.core.tables import IMAGES, OPT_OUT_LISTS, OPT_OUTS, REJECTS, SHARD_SAMPLES

LOOKUP_CHUNK = 512  # values per ``IN (...)`` probe: each is one scalar-index lookup
#: Values per probe when resolving a list's identifiers at intake (a registry's chunk of
#: 100k): larger probes cost less per value (50k keys + 50k URLs against 10^5 images:
#: 1.17 s at 8,192 a probe, 1.89 s at 512; measured in a one-off script, not a benchmark).
RESOLVE_CHUNK = 8192


def match_filter(kind: str, values: Sequence[str]) -> str:
    """The ``images`` predicate for one chunk of identifiers of one kind (index-served)."""
    if kind == KIND_KEY:
        return in_list("key", values)
    if kind == KIND_URL:
        return in_list("url", values)
    if kind == KIND_SOURCE_ID:
        return in_list("source_id", values)
    raise ValueError(f"unknown identifier kind {kind!r}; expected one of {KINDS}")


ALIAS_FILTER = f"reason = {sql_literal(ALIAS_REASON)} AND key IS NOT NULL"


def has_aliases(view: LabView) -> bool:
    """Whether ``rejects`` records aliases (a table from before them has no ``url`` column:
    its batches are ingested again, ``raw_images`` v4, before their aliases are known)."""
    schema = view.schema(REJECTS.name)
    return schema is not None and "url" in schema.names and "source_id" in schema.names


def resolve_identifiers(
    lab: Lab, identifiers: Sequence[OptOutIdentifier]
) -> dict[OptOutIdentifier, list[tuple[str, str]]]:
    """Identifier -> sorted (batch, key) pairs of the images it names (empty: none yet):
    by the images' own identifiers and by their aliases (a refused byte-identical repeat's
    URL or ``source:id`` names the copy kept)."""
    out: dict[OptOutIdentifier, list[tuple[str, str]]] = {i: [] for i in identifiers}
    view = lab.view()
    if not identifiers:
        return out
    tables = [t for t in (IMAGES.name,) if view.exists(t)]
    if has_aliases(view):
        tables.append(REJECTS.name)
    for table in tables:
        _resolve_in(view, table, identifiers, out)
    return {i: sorted(set(m)) for i, m in out.items()}


def _resolve_in(
    view: LabView,
    table: str,
    identifiers: Sequence[OptOutIdentifier],
    out: dict[OptOutIdentifier, list[tuple[str, str]]],
) -> None:
    """Add the (batch, key) pairs ``table``'s rows give the identifiers (``rejects``: its
    alias rows only, each naming the copy its batch kept)."""
    alias = table == REJECTS.name
    for kind in KINDS:
        if alias and kind == KIND_KEY:
            continue  # a repeat's key is the kept copy's: matched in ``images``
        group = [i for i in identifiers if i.kind == kind]
        if kind == KIND_SOURCE_ID:
            by_value: dict[tuple[str | None, str], list[OptOutIdentifier]] = {}
            for i in group:
                by_value.setdefault((i.source, i.source_id or ""), []).append(i)
            probe = sorted({i.source_id or "" for i in group})
            columns = ["batch", "key", "source", "source_id"]
        else:
            by_value = {(None, i.value): [i] for i in group}
            probe = sorted(i.value for i in group)
            column = {KIND_KEY: "key", KIND_URL: "url"}[kind]
            columns = list(dict.fromkeys(["batch", "key", column]))
        for chunk in chunked(probe, RESOLVE_CHUNK):
            flt = match_filter(kind, chunk)
            if alias:
                flt = f"{ALIAS_FILTER} AND {flt}"
            rows = view.read(table, columns, flt).to_pylist()
            for r in rows:
                if kind == KIND_SOURCE_ID:
                    hits = by_value.get((r["source"], r["source_id"]), [])
                else:
                    hits = by_value.get((None, r[column]), [])
                for i in hits:
                    out[i].append((r["batch"], r["key"]))


def sharded_batches(lab: Lab, pairs: Iterable[tuple[str, str]]) -> set[str]:
    """Batches where at least one of these (batch, key) images is in an MDS shard."""
    wanted = set(pairs)
    view = lab.view()
    if not wanted or not view.exists(SHARD_SAMPLES.name):
        return set()
    keys = sorted({k for _, k in wanted})
    found: set[str] = set()
    for chunk in chunked(keys, LOOKUP_CHUNK):
        rows = view.read(SHARD_SAMPLES.name, ["batch", "key"], in_list("key", chunk))
        for b, k in zip(
            rows.column("batch").to_pylist(), rows.column("key").to_pylist(), strict=True
        ):
            if (b, k) in wanted:
                found.add(b)
    return found


def alias_rows(view: LabView, keys: Iterable[str]) -> pa.Table:
    """The alias rows (key, url, source, source_id) of these image keys: the refused
    byte-identical repeats of them (empty when ``rejects`` records no aliases)."""
    wanted = sorted(set(keys))
    columns = ["key", "url", "source", "source_id"]
    parts = []
    if wanted and has_aliases(view):
        for chunk in chunked(wanted, LOOKUP_CHUNK):
            flt = f"{ALIAS_FILTER} AND {in_list('key', chunk)}"
            parts.append(view.read(REJECTS.name, columns, flt))
    schema = pa.schema([(c, pa.string()) for c in columns])
    return pa.concat_tables(
        [p.select(columns).cast(schema) for p in parts] or [schema.empty_table()]
    )


def candidate_identifiers(images: pa.Table) -> dict[tuple[str, str], set[str]]:
    """(kind, canonical identifier) -> image keys, for ``images`` rows (key, url, source,
    source_id): every way an opt-out list could name these images. Alias rows
    (``alias_rows``) have the same columns: their names map to the kept copy's key."""
    out: dict[tuple[str, str], set[str]] = {}
    cols = {c: images.column(c).to_pylist() for c in ("key", "url", "source", "source_id")}
    for key, url, source, sid in zip(*cols.values(), strict=True):
        out.setdefault((KIND_KEY, key), set()).add(key)
        if url:
            out.setdefault((KIND_URL, url.strip()), set()).add(key)
        if source and sid:
            out.setdefault((KIND_SOURCE_ID, f"{source.strip()}:{sid.strip()}"), set()).add(key)
    return out


def list_arrivals(view: LabView, list_ids: Iterable[str]) -> dict[str, tuple[str, datetime]]:
    """list id -> (source, received_at) of the *accepted* lists among ``list_ids`` (a table
    from before sources: every list's source is the default one)."""
    ids = sorted(set(list_ids))
    if not ids or not view.exists(OPT_OUT_LISTS.name):
        return {}
    schema = view.schema(OPT_OUT_LISTS.name)
    has_source = schema is not None and "source" in schema.names
    columns = ["list_id", "received_at", *(["source"] if has_source else [])]
    out: dict[str, tuple[str, datetime]] = {}
    for chunk in chunked(ids, LOOKUP_CHUNK):
        flt = f"{in_list('list_id', chunk)} AND status = 'accepted'"
        for r in view.read(OPT_OUT_LISTS.name, columns, flt).to_pylist():
            out[r["list_id"]] = (r.get("source") or DEFAULT_SOURCE, r["received_at"])
    return out


def standing_opt_outs(view: LabView, rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The opt-out rows of ``rows`` (``opt_outs`` rows with ``list_id``, ``identifier``,
    ``identifier_kind`` and, where the table has it, ``action``) that stand: every opt-out
    (``action`` add or null) unless a withdrawal of the same identifier, from an accepted
    list of the *same source* received *strictly later*, takes it back. ``rows`` must hold
    every row of the identifiers it names (withdrawals included).

    Fail closed: an opt-out whose own list is not recorded as accepted still stands (its
    source and arrival are unknown), a withdrawal whose list is not recorded as accepted
    withdraws nothing, and within one list an opt-out is never withdrawn."""
    adds = [r for r in rows if (r.get("action") or ACTION_ADD) != ACTION_WITHDRAW]
    pulls = [r for r in rows if r.get("action") == ACTION_WITHDRAW]
    if not pulls:
        return adds
    arrivals = list_arrivals(view, {r["list_id"] for r in rows})
    latest: dict[tuple[str, str, str], datetime] = {}  # (kind, identifier, source) -> at
    for r in pulls:
        known = arrivals.get(r["list_id"])
        if known is None:
            continue
        slot = (r["identifier_kind"], r["identifier"], known[0])
        if slot not in latest or known[1] > latest[slot]:
            latest[slot] = known[1]
    standing = []
    for r in adds:
        known = arrivals.get(r["list_id"])
        if known is not None:
            source, at = known
            withdrawn_at = latest.get((r["identifier_kind"], r["identifier"], source))
            if withdrawn_at is not None and withdrawn_at > at:
                continue
        standing.append(r)
    return standing


def opt_out_columns(view: LabView) -> list[str]:
    """The ``opt_outs`` columns a withdrawal-aware reader needs (no ``action`` in a table
    from before withdrawals: every row is an opt-out)."""
    schema = view.schema(OPT_OUTS.name)
    columns = ["list_id", "identifier", "identifier_kind"]
    return columns + (["action"] if schema is not None and "action" in schema.names else [])


def has_withdrawals(view: LabView) -> bool:
    """Whether any list recorded a withdrawal (``action`` BITMAP index): until one does,
    every opt-out stands and nothing more is read."""
    return view.count(OPT_OUTS.name, f"action = {sql_literal(ACTION_WITHDRAW)}") > 0


def standing_rows(view: LabView, rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The opt-out rows among ``rows`` (any subset of ``opt_outs``, e.g. one list's matched
    rows) that stand (``standing_opt_outs``), every row of their identifiers read to know."""
    adds = [r for r in rows if (r.get("action") or ACTION_ADD) != ACTION_WITHDRAW]
    if "action" not in opt_out_columns(view) or not adds or not has_withdrawals(view):
        return adds
    identifiers = sorted({r["identifier"] for r in adds})
    standing: set[tuple[str, str, str]] = set()
    columns = opt_out_columns(view)
    for chunk in chunked(identifiers, LOOKUP_CHUNK):
        every = view.read(OPT_OUTS.name, columns, in_list("identifier", chunk)).to_pylist()
        standing |= {
            (r["list_id"], r["identifier_kind"], r["identifier"])
            for r in standing_opt_outs(view, every)
        }
    return [r for r in adds if (r["list_id"], r["identifier_kind"], r["identifier"]) in standing]


def opted_out_keys(lab: Lab, images: pa.Table) -> dict[str, tuple[str, ...]]:
    """Image key -> sorted ids of the accepted lists that name it, matched from the images'
    side (``identifier IN (...)`` probes on the ``opt_outs`` BTREE index), by the images'
    own identifiers and by their aliases' (``alias_rows``). No table: none."""
    view = lab.view()
    if images.num_rows == 0 or not view.exists(OPT_OUTS.name):
        return {}
    ids = images.select(["key", "url", "source", "source_id"])
    aliases = alias_rows(view, ids.column("key").to_pylist())
    if aliases.num_rows:
        ids = pa.concat_tables([ids.cast(aliases.schema), aliases])
    candidates = candidate_identifiers(ids)
    hits: dict[str, set[str]] = {}
    values = sorted({v for _, v in candidates})
    columns = opt_out_columns(view)
    for chunk in chunked(values, LOOKUP_CHUNK):
        rows = view.read(OPT_OUTS.name, columns, in_list("identifier", chunk)).to_pylist()
        for r in standing_opt_outs(view, rows):
            for key in candidates.get((r["identifier_kind"], r["identifier"]), ()):
                hits.setdefault(key, set()).add(r["list_id"])
    return {k: tuple(sorted(v)) for k, v in sorted(hits.items())}


def alias_signals(view: LabView, refs: Iterable[tuple[str, str]]) -> dict[tuple[str, str], tuple]:
    """(batch, key) -> the captured opt-out headers of that image's refused byte-identical
    repeats (each alias row's ``usage_signals``): a reservation any of them carries reserves
    the copy kept. Empty where ``rejects`` records no signals (a table from before them)."""
    wanted = sorted({k for _, k in refs})
    schema = view.schema(REJECTS.name)
    if not wanted or schema is None or "usage_signals" not in schema.names:
        return {}
    asked = set(refs)
    out: dict[tuple[str, str], list[str]] = {}
    for chunk in chunked(wanted, LOOKUP_CHUNK):
        flt = f"{ALIAS_FILTER} AND usage_signals IS NOT NULL AND {in_list('key', chunk)}"
        for r in view.read(REJECTS.name, ["batch", "key", "usage_signals"], flt).to_pylist():
            if (r["batch"], r["key"]) in asked:
                out.setdefault((r["batch"], r["key"]), []).append(r["usage_signals"])
    return {ref: tuple(sorted(v)) for ref, v in out.items()}
