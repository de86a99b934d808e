"""The dedup_dirty queue and the configuration sweep on a real lab."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from prx_assets.core.dedup import decisions as D
from prx_assets.core.dedup import dirty as Q
from prx_assets.core.dedup import reruns as R
from prx_assets.core.lab import Lab
from prx_assets.core.tables import DEDUP_DIRTY, DEDUP_STATE, IMAGE_HASHES
from prx_assets_tests.core.dedup_rows import S0, hash_table, run_batch


def test_dirty_rows_are_appended_read_and_cleared_exactly(tmp_path):
    lab = Lab(tmp_path / "lab")
    assert Q.read_dirty(lab).num_rows == 0 and Q.clear_dirty(lab, ["x"]) == 0
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    ch = [D.DecisionChange("b0", "k", "c", "keeper of b0:k", "duplicate of b2:z")]
    assert Q.mark_dirty(lab, ch, "b2", t0) == 1
    assert Q.mark_dirty(lab, ch, "b3", t0 + timedelta(seconds=1)) == 1
    assert Q.mark_dirty(lab, [], "b3") == 0
    dirty = Q.read_dirty(lab, "b0")
    assert dirty.schema == DEDUP_DIRTY.schema and dirty.num_rows == 2
    first = [r["dirty_id"] for r in dirty.to_pylist() if r["detected_by"] == "b2"]
    assert Q.clear_dirty(lab, first) == 1
    left = Q.read_dirty(lab).to_pylist()
    assert [r["detected_by"] for r in left] == ["b3"]
    assert left[0]["change"] == "keeper of b0:k -> duplicate of b2:z"
    with pytest.raises(ValueError, match="timezone-aware"):
        Q.dirty_rows(ch, "b2", datetime(2026, 1, 1))


def test_stale_decisions_come_from_the_state_rows(tmp_path):
    lab = Lab(tmp_path / "lab")
    assert R.stale_decisions(lab, S0) == {}
    lab.replace_partition(IMAGE_HASHES, "b0", hash_table("b0", [("o", 5, 100, 9)]))
    plan = run_batch(lab, "b0")
    t = datetime(2026, 1, 1, tzinfo=UTC)
    lab.replace_partition(DEDUP_STATE, "b0", R.state_row("b0", plan, S0, t))
    (state,) = lab.read(DEDUP_STATE.name).to_pylist()
    assert state["images"] == state["kept"] == 1 and state["duplicates"] == 0
    assert R.stale_decisions(lab, S0) == {}
    r3 = R.stale_decisions(lab, D.DedupSettings(radius=3))
    assert r3 == {"b0": R.StaleDecision("b0", S0.fingerprint(), "fast-v1", needs_rehash=False)}
    ref = R.stale_decisions(lab, D.DedupSettings(phash_mode="reference"))
    assert ref["b0"].needs_rehash
    k1 = R.dedup_run_key("b0", ["phash_clusters"], ["a", "b"])
    assert k1 == R.dedup_run_key("b0", ["phash_clusters"], ["b", "a"])
    assert k1 != R.dedup_run_key("b0", ["phash_clusters"], ["a", "c"])
