"""The per-directory members digest a snapshot diff skips unchanged batches by."""

from __future__ import annotations

from prx_assets.core.snapshots.runner import MEMBER_COLUMNS, members_digest


def _member(key: str, **changes: object) -> dict[str, object]:
    row: dict[str, object] = {
        "batch": "src.000",
        "key": key,
        "tier": 1024,
        "shape": "1024x1024",
        "source": None,
        "caption_fingerprint": "qwen3-vl-8b:abc",
        "class_fingerprint": None,
    }
    row.update(changes)
    return row


def test_the_digest_ignores_order_and_sees_every_compared_column():
    members = [_member("k2"), _member("k1", source="web"), _member("k3")]
    base = members_digest(members)
    assert members_digest(list(reversed(members))) == base  # None values never compared
    assert members_digest(members[:2]) != base  # a sample fewer
    for column in MEMBER_COLUMNS:
        if column == "key":
            continue
        changed = [_member("k2", **{column: "other"}), members[1], members[2]]
        assert members_digest(changed) != base, column
    assert members_digest([]) == members_digest([])  # a directory keeping nothing
