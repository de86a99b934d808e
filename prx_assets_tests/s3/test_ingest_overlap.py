"""An ingest worker on object storage overlaps its round trips (landing reads, sidecar reads,
blob writes) with its checks, and decides exactly what it decides one item at a time: the
same checks, refusals, sidecar metadata and problems, rows and stored blobs, in order."""

from __future__ import annotations

import os
import threading

import pytest

from prx_assets.core.ingest import runner as ingest
from prx_assets.core.ingest.remote_landing import RemoteRead
from prx_assets.core.ingest.runner import ChunkTask, RowMeta, check_store_and_write
from prx_assets.core.lab import MANUAL, Lab
from prx_assets.core.tables import IMAGES
from prx_assets.demo.jpegs import solid_jpeg

LIMIT = 10 << 20


def _jpeg(i: int) -> bytes:
    return solid_jpeg((96 + i, 64), (30 * i % 255, 90, 200 - 10 * i))


def _items(server, prefix: str) -> tuple:
    """A chunk of landing objects: photos with and without an alt-text sidecar, an in-chunk
    repeat, a truncated photo, an object that is gone, one that changed since it was
    listed, and a photo whose sidecar is over its limit."""
    bucket, base = server.bucket, prefix.split("/", 3)[3]
    landing = f"{prefix}/landing"
    client = server.client()

    def put(name: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=f"{base}/landing/b/{name}", Body=data)

    def read(name: str, size: int, limit: int = LIMIT) -> RemoteRead:
        return RemoteRead(landing, f"b/{name}", size, limit, os.fsencode(f"/stage/b/{name}"))

    def meta(name: str, sidecars: tuple = ()) -> RowMeta:
        return RowMeta(name, "s", None, None, None, None, None, sidecars)

    items = []
    for i in range(10):
        data = _jpeg(i)
        put(f"p{i:02d}.jpg", data)
        sidecars = ()
        if i % 2 == 0:
            text = f"photo {i} <b>alt</b>".encode()
            put(f"p{i:02d}.txt", text)
            sidecars = ((".txt", f"p{i:02d}.txt", read(f"p{i:02d}.txt", len(text), 4096), None),)
        items.append((read(f"p{i:02d}.jpg", len(data)), meta(f"p{i:02d}.jpg", sidecars)))
    put("p00_copy.jpg", _jpeg(0))
    items.insert(1, (read("p00_copy.jpg", len(_jpeg(0))), meta("p00_copy.jpg")))
    put("broken.jpg", _jpeg(3)[:-20])
    items.append((read("broken.jpg", len(_jpeg(3)) - 20), meta("broken.jpg")))
    items.append((read("gone.jpg", 1234), meta("gone.jpg")))
    put("changed.jpg", _jpeg(11))
    items.append((read("changed.jpg", len(_jpeg(11)) + 5), meta("changed.jpg")))
    put("big_sidecar.jpg", _jpeg(12))
    put("big_sidecar.txt", b"x" * 5000)
    sidecar = ((".txt", "big_sidecar.txt", read("big_sidecar.txt", 5000, 4096), None),)
    items.append((read("big_sidecar.jpg", len(_jpeg(12))), meta("big_sidecar.jpg", sidecar)))
    items.insert(5, None)  # a candidate with nothing to check
    return tuple(items)


def _run(lab: Lab, items: tuple, io_threads: int):
    fragments = lab.partition_fragments(IMAGES, "b", stored_blobs=("image",))
    sink = lab.remote_blobs(IMAGES, "image")
    assert sink is not None
    return check_store_and_write(
        ChunkTask(items, 40_000_000, sink, fragments, io_threads=io_threads)
    )


def _decisions(out) -> tuple:
    return out.checked, out.positions, out.metas, out.sidecar_problems, out.written.rows


@pytest.mark.parametrize("window", [ingest.OVERLAP_WINDOW_BYTES, 1])
def test_overlapped_io_decides_what_one_at_a_time_decides(
    s3_server, s3_prefix, monkeypatch, window
):
    items = _items(s3_server, s3_prefix)
    lab = Lab(f"{s3_prefix}/lab", policy=MANUAL)
    one_at_a_time = _run(lab, items, io_threads=1)
    monkeypatch.setattr(ingest, "OVERLAP_WINDOW_BYTES", window)  # 1: one object held at most
    overlapped = _run(lab, items, io_threads=8)

    assert _decisions(overlapped) == _decisions(one_at_a_time)
    checked = dict(zip([it and it[1].path for it in items], overlapped.checked, strict=True))
    assert overlapped.positions == (0, 2, 3, 4, 6, 7, 8, 9, 10, 11)
    assert checked["p00_copy.jpg"][0] == checked["p00.jpg"][0]  # a repeat: not written
    assert checked["broken.jpg"][1][0] == "truncated"
    assert checked["gone.jpg"][:2] == (None, ("missing_file", "does not exist"))
    assert checked["changed.jpg"][1][0] == "unreadable"
    assert checked["big_sidecar.jpg"] is None  # refused for its sidecar: never checked
    problems = overlapped.sidecar_problems[items.index(items[-1])]
    assert [(p[0], p[1]) for p in problems] == [("big_sidecar.txt", "too_large")]
    metas = {m.path: m for m in overlapped.metas if m is not None}
    assert metas["p04.jpg"].alt_text == "photo 4 <b>alt</b>"
    # Every row written names a blob that is stored, and the fragments commit.
    lab.blobs.check_present(IMAGES.name, [checked[p][0] for p in ("p00.jpg", "p09.jpg")])
    lab.commit_partition(IMAGES, "b", [overlapped.written])
    assert lab.count(IMAGES.name) == 10


def test_reads_run_ahead_of_the_checks(s3_server, s3_prefix, monkeypatch):
    """With ``io_threads`` > 1, several landing reads are in flight at once (each read
    held open here until a second one has started, so one-at-a-time reads would never
    meet; the wait is bounded, and its outcome is what is asserted)."""
    items = tuple(it for it in _items(s3_server, s3_prefix) if it is not None)[:6]
    lab = Lab(f"{s3_prefix}/lab", policy=MANUAL)
    read = RemoteRead.read
    lock = threading.Lock()
    active, peak = [0], [0]
    two = threading.Event()

    def counted(self: RemoteRead) -> bytes:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            if active[0] >= 2:
                two.set()
        try:
            two.wait(timeout=5)
            return read(self)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(RemoteRead, "read", counted)
    out = _run(lab, items, io_threads=4)
    assert peak[0] >= 2
    assert out.written is not None and out.written.rows == 5  # p00..p04 (p00_copy repeats)


@pytest.mark.parametrize("raw", ["0", "65", "eight", "-1", "2.5"])
def test_an_unusable_io_threads_setting_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv(ingest.IO_THREADS_ENV, raw)
    with pytest.raises(ValueError, match="PRX_INGEST_IO_THREADS"):
        ingest.io_threads_from_env()
    monkeypatch.setenv(ingest.IO_THREADS_ENV, " 3 ")
    assert ingest.io_threads_from_env() == 3
    monkeypatch.delenv(ingest.IO_THREADS_ENV)
    assert ingest.io_threads_from_env() == ingest.DEFAULT_IO_THREADS
