"""The landing sensor's cursor: an exact, compact set of partition keys."""

import json
import random
import string

import pytest

from prx_assets.core.ingest.cursor import CursorError, decode_keys, encode_keys


def _random_key(rng: random.Random) -> str:
    stem = "".join(rng.choice(string.ascii_lowercase + "-_.") for _ in range(rng.randrange(1, 8)))
    tail = "".join(rng.choice(string.digits) for _ in range(rng.randrange(0, 5)))
    return stem + tail


def test_any_key_set_round_trips_exactly():
    rng = random.Random(12)
    for _ in range(200):
        keys = {_random_key(rng) for _ in range(rng.randrange(0, 60))}
        assert decode_keys(encode_keys(keys)) == keys
    # Same number, different widths, leading zeros, huge digit runs: all distinct keys.
    tricky = {"a.7", "a.07", "a.007", "a.8", "b.0", "b.", "9", "x" + "1" * 40, "c.1", "c.3"}
    assert decode_keys(encode_keys(tricky)) == tricky


def test_numbered_batches_cost_a_few_bytes_per_source():
    keys = {f"{src}.{i:06d}" for src in ("laion", "cc12m", "internal") for i in range(10_000)}
    keys -= {"laion.004242", "cc12m.000000"}  # gaps are ranges too
    cursor = encode_keys(keys)
    assert decode_keys(cursor) == keys
    assert len(cursor) < 200 < len(json.dumps(sorted(keys))) // 1000


def test_the_previous_format_is_read_and_damage_is_refused():
    assert decode_keys(json.dumps(["a.1", "b"])) == {"a.1", "b"}
    assert decode_keys(None) == set() == decode_keys("")
    for damaged in ("[1, 2]", "not json", "v2:AAAA", "v2:" + "x" * 10):
        with pytest.raises(CursorError):
            decode_keys(damaged)
