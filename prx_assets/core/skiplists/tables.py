"""The skip-list stage's lab tables: opt-out lists and entries, skip decisions, the
re-decision queue."""

from __future__ import annotations

import pyarrow as pa

from prx_assets.core.lab import TableSpec

OPT_OUTS = TableSpec(
    name="opt_outs",
    schema=pa.schema(
        [
            pa.field("list_id", pa.string(), nullable=False),
            pa.field("identifier", pa.string(), nullable=False),  # canonical form (see kinds)
            pa.field("identifier_kind", pa.string(), nullable=False),  # key | url | source_id
            pa.field("received_at", pa.timestamp("us", tz="UTC"), nullable=False),
            # One row per image the identifier matched when the list arrived (null: none yet).
            pa.field("matched_key", pa.string()),
            pa.field("matched_batch", pa.string()),
            # "add" (an opt-out) or "withdraw" (a registry's withdrawal of its own earlier
            # opt-out of this identifier); null: add (rows from before withdrawals)
            pa.field("action", pa.string()),
        ]
    ),
    identity=("list_id", "identifier", "action", "matched_batch", "matched_key"),
    indexes=(
        ("identifier", "BTREE"),
        ("list_id", "BTREE"),
        ("matched_key", "BTREE"),
        ("matched_batch", "BITMAP"),
        ("action", "BITMAP"),
    ),
)

OPT_OUT_LISTS = TableSpec(
    name="opt_out_lists",
    schema=pa.schema(
        [
            pa.field("list_id", pa.string(), nullable=False),  # "<file name>@<sha256[:16]>"
            pa.field("path", pa.string(), nullable=False),
            pa.field("format", pa.string()),
            pa.field("sha256", pa.string(), nullable=False),
            pa.field("status", pa.string(), nullable=False),  # accepted | rejected
            pa.field("reason", pa.string()),  # "<code>: <details>" when rejected
            # identifier rows taken (a streamed list: distinct within each chunk of it)
            pa.field("rows", pa.int64()),
            pa.field("matched_images", pa.int64()),  # (batch, key) pairs matched on arrival
            pa.field("batches", pa.list_(pa.string())),  # batches holding a match on arrival
            pa.field("received_at", pa.timestamp("us", tz="UTC"), nullable=False),
            # malformed entries skipped (recorded in opt_out_problems) under a source's
            # on_malformed="record"; 0 otherwise (a malformed entry rejects the list)
            pa.field("malformed", pa.int64()),
            # the source (OptOutResource.sources[].name) the list came from: a withdrawal
            # only withdraws opt-outs of its own source; null: "default"
            pa.field("source", pa.string()),
            # Computed by the intake run after its commit (null: a list recorded before):
            # the batches holding a copy, through the pHash clusters, of an image the list
            # matched, and those of them with such a copy in a shard (what the opt-out
            # sensor reruns), so a registry's reach is never computed inside a sensor tick.
            pa.field("reach_batches", pa.list_(pa.string())),
            pa.field("reach_sharded", pa.list_(pa.string())),
        ]
    ),
    identity=("list_id",),
    indexes=(("list_id", "BTREE"), ("status", "BITMAP")),
)

OPT_OUT_PROBLEMS = TableSpec(
    name="opt_out_problems",
    schema=pa.schema(
        [
            pa.field("list_id", pa.string(), nullable=False),
            pa.field("position", pa.string(), nullable=False),  # "line 12", "row 7"
            pa.field("problem", pa.string(), nullable=False),  # bounded reason
        ]
    ),
    identity=("list_id", "position", "problem"),
    indexes=(("list_id", "BTREE"),),
)

SKIP_AUDIT = TableSpec(
    name="skip_audit",
    schema=pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("batch", pa.string(), nullable=False),
            pa.field("tier", pa.int32()),
            pa.field("shape", pa.string()),
            pa.field("relative_dir", pa.string()),  # "mds/<tier>/<H>x<W>/<batch>"
            pa.field("shard", pa.string()),
            pa.field("index_in_shard", pa.int32()),
            pa.field("excluded", pa.bool_()),
            pa.field("reasons", pa.list_(pa.string())),  # sorted reason codes (empty: kept)
            pa.field("opt_out_list_ids", pa.list_(pa.string())),
            pa.field("class_label", pa.string()),  # the label the decision saw (null: none)
            pa.field("duplicate_of", pa.string()),  # the training copy's key ("duplicate")
            pa.field("decided_at", pa.timestamp("us", tz="UTC")),  # this materialisation
            # Start of the current exclusion: carried over while the sample stays excluded.
            pa.field("first_excluded_at", pa.timestamp("us", tz="UTC")),
            pa.field("policy_fingerprint", pa.string()),
            # Added by policy v2 (appended, so older tables gain them as null columns):
            pa.field("opt_out_via", pa.list_(pa.string())),  # keys of the copies lists named
            pa.field("duplicate_of_batch", pa.string()),  # the training copy's batch
            pa.field("cluster_id", pa.string()),  # the pHash cluster decided (null: none)
            pa.field("pending_on", pa.list_(pa.string())),  # what a "pending" sample awaits
            # Added by policy v3 (appended likewise): machine-readable opt-out signals.
            pa.field("reserved_via", pa.list_(pa.string())),  # keys whose signal reserves
            # "<key>: <signal>: <said>"; a Content-Usage entry ends with the aipref vocabulary
            # revision it was read under, e.g. "(draft-ietf-aipref-vocab-07)".
            pa.field("reserved_signals", pa.list_(pa.string())),
            # Added for per-reason times (appended likewise): when each of ``reasons`` began
            # to apply, in the same order (a later opt-out of a copy already out as a
            # duplicate has its own, later time; ``first_excluded_at`` is the earliest).
            pa.field("reason_since", pa.list_(pa.timestamp("us", tz="UTC"))),
        ]
    ),
    identity=("batch", "key"),
    indexes=(
        ("key", "BTREE"),
        ("batch", "BITMAP"),
        ("excluded", "BITMAP"),
        ("policy_fingerprint", "BITMAP"),
        ("reasons", "LABEL_LIST"),  # the browser's skip-reason filter
    ),
)

SKIP_DIRTY = TableSpec(
    name="skip_dirty",
    schema=pa.schema(
        [
            pa.field("dirty_id", pa.string(), nullable=False),  # digest of the other columns
            pa.field("batch", pa.string(), nullable=False),  # the batch whose audit is stale
            pa.field("key", pa.string(), nullable=False),
            pa.field("cluster_id", pa.string()),
            pa.field("change", pa.string()),  # recorded -> current decision, human-readable
            pa.field("detected_by", pa.string()),  # the batch whose skip_lists saw it
            pa.field("detected_at", pa.timestamp("us", tz="UTC")),
        ]
    ),
    # Other batches whose recorded skip decisions a skip_lists run contradicts (a copy of
    # theirs became, or stopped being, the training copy): skip_dirty_sensor reruns them.
    identity=("dirty_id",),
    indexes=(),  # a handful of pending rows at any time: scans are cheaper than indexes
)
