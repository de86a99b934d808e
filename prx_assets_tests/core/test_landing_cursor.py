"""The landing sensor's cursor: an exact, compact set of partition keys."""

import json
import random
import string

import pytest

from prx_assets.core.ingest.cursor import (
    CursorError,
    RegisteredKeys,
    decode_keys,
    encode_keys,
)


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


def test_registered_keys_answer_and_grow_exactly_as_the_decoded_set():
    """The sensor's look-up structure (ranges bisected, never expanded) against the plain
    decoded set: the same answers for members, near misses and other widths, and the same
    cursor text after random additions."""
    rng = random.Random(3)
    truth: set[str] = set()
    reg = RegisteredKeys()
    for _ in range(2000):
        width = rng.choice([2, 3])
        key = rng.choice(
            [f"s{rng.randint(0, 2)}.{rng.randint(0, 80):0{width}d}", f"web.{rng.random():.4f}x"]
        )
        reg.add([key])
        truth.add(key)
        probe = f"s{rng.randint(0, 3)}.{rng.randint(0, 90):0{rng.choice([1, 2, 3])}d}"
        assert (probe in reg) == (probe in truth)
    assert len(reg) == len(truth)
    assert decode_keys(reg.to_text()) == truth
    again = RegisteredKeys.from_text(encode_keys(truth))
    assert all(k in again for k in truth) and again.to_text() == reg.to_text()


def test_registered_keys_refuse_a_damaged_cursor():
    import base64
    import zlib

    def v2(body: object) -> str:
        raw = json.dumps(body).encode()
        return "v2:" + base64.b64encode(zlib.compress(raw)).decode()

    for damaged in (
        "v2:not-base64!",
        v2({"runs": [], "keys": "abc"}),
        v2({"runs": [["s.", "2", [[0, 1]]]], "keys": []}),
        v2({"runs": [["s.", 2, [[3, 1]]]], "keys": []}),
        v2({"runs": [["s.", 2, [[-1, 1]]]], "keys": []}),
        v2({"keys": []}),
    ):
        with pytest.raises(CursorError):
            RegisteredKeys.from_text(damaged)
