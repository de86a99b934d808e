"""Which images an opt-out list names, and which lists name an image.

Both directions go through Lance scalar indexes, so their cost follows the list or the
partition, never the corpus:

- at intake, a list's identifiers are resolved to the (batch, key) pairs they name now
  (``images.key``, ``images.url``, ``images.source_id`` BTREEs, declared by the ``images``
  spec), which tells the opt-out sensor which partitions to rerun;
- at decision time, ``skip_lists`` asks, for the images of its partition and their copies,
  which accepted lists name any of them (``opt_outs.identifier`` BTREE): matching from the
  partition side, so a list received before a batch was ingested still applies to it.

Aliases: a file ingest refused as a byte-identical repeat of one it kept
(``rejects.reason = ALIAS_REASON``) carried its own URL and ``source:id``; the same bytes
train under the kept copy's name. Both directions match those names exactly like the kept
copy's own (``rejects.url`` / ``rejects.source_id`` BTREEs): a list naming the repeat
matches the kept (batch, key).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
from prx_assets.core.tables import IMAGES, OPT_OUTS, REJECTS, SHARD_SAMPLES

LOOKUP_CHUNK = 512  # values per ``IN (...)`` probe: each is one scalar-index lookup


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
        for chunk in chunked(probe, LOOKUP_CHUNK):
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
    for chunk in chunked(values, LOOKUP_CHUNK):
        rows = view.read(
            OPT_OUTS.name,
            ["list_id", "identifier", "identifier_kind"],
            in_list("identifier", chunk),
        )
        for list_id, ident, kind in zip(
            *(rows.column(c).to_pylist() for c in ("list_id", "identifier", "identifier_kind")),
            strict=True,
        ):
            for key in candidates.get((kind, ident), ()):
                hits.setdefault(key, set()).add(list_id)
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
