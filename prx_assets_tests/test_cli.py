"""The CLI alone reaches the settled state: no daemon, no sensor tick.

The finding: ``register-batch --materialize`` of a batch holding a bigger copy of an image
from an earlier batch left the earlier (now duplicate) copy in training until a daemon ran
``dedup_sensor``; a CLI-only user never got there.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from prx_assets.cli import main as cli_main
from prx_assets.core.dedup.decisions import DedupSettings
from prx_assets.core.dedup.reruns import dedup_reruns
from prx_assets.core.tables import IMAGES
from prx_assets.defs.resources import LabResource
from prx_assets.demo.build import load_photo_metadata
from prx_assets.demo.jpegs import encoded
from prx_assets_tests.loader_keys import loader_keys

PHOTOS = Path(__file__).resolve().parents[1] / "prx_assets" / "demo" / "photos"


def _photo(name: str, scale: float = 1.0) -> bytes:
    img = Image.open(PHOTOS / name).convert("RGB")
    if scale != 1.0:
        size = (int(img.width * scale), int(img.height * scale))
        img = img.resize(size, Image.Resampling.LANCZOS)
    return encoded(img, "JPEG", quality=90)


def _batch(landing: Path, chunk: str, files: dict[str, tuple[str, bytes]]) -> Path:
    """A complete landing folder: each image with its alt text, then ``_SUCCESS``."""
    folder = landing / "web" / chunk
    folder.mkdir(parents=True)
    for stem, (alt, data) in files.items():
        (folder / f"{stem}.jpg").write_bytes(data)
        (folder / f"{stem}.txt").write_text(alt)
    (folder / "_SUCCESS").write_text("")
    return folder


def _key(lab, batch: str, path: str) -> str:
    rows = lab.read_batch(IMAGES.name, batch, ["key", "path"]).to_pylist()
    return next(r["key"] for r in rows if r["path"] == path)


def test_register_batch_materialize_settles_cross_batch_dedup(tmp_path, monkeypatch, capsys):
    data_root = tmp_path / "data"
    landing = data_root / "landing"
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PRX_DATA_ROOT", str(data_root))
    alt = {name: m["alt_text"] for name, m in load_photo_metadata().items()}
    galaxy = alt["hubble_deep_field.jpg"]
    first = _batch(
        landing,
        "000",
        {
            "galaxy-small": (galaxy, _photo("hubble_deep_field.jpg", 0.75)),  # 750 x 654
            "astronaut": (alt["astronaut.png"], _photo("astronaut.png")),
        },
    )
    args = ["--data-root", str(data_root), "--materialize"]
    assert cli_main(["register-batch", str(first), *args]) == 0
    capsys.readouterr()

    # A later batch brings the same picture at a higher resolution: it becomes the keeper.
    second = _batch(
        landing,
        "001",
        {
            "galaxy": (galaxy, _photo("hubble_deep_field.jpg")),  # 1000 x 872
            "camera": (alt["camera.png"], _photo("camera.png")),
        },
    )
    assert cli_main(["register-batch", str(second), *args]) == 0
    out = capsys.readouterr().out
    assert "web.000" in out and "phash_clusters" in out, out  # says what it reran

    lab_resource = LabResource(data_root=str(data_root))
    lab = lab_resource.lab()
    small = _key(lab, "web.000", "galaxy-small.jpg")
    large = _key(lab, "web.001", "galaxy.jpg")
    others = {_key(lab, "web.000", "astronaut.jpg"), _key(lab, "web.001", "camera.jpg")}
    yielded = loader_keys(lab_resource.shards_root)
    assert small not in yielded  # the duplicate left training, with no daemon
    assert yielded.count(large) == 1  # the keeper is trained on, once
    assert others <= set(yielded)
    assert not dedup_reruns(lab, DedupSettings(), ("skip_lists",), {"web.000", "web.001"})


def _dirty_lab(tmp_path: Path, batches: list[str]):
    """A real lab whose ``dedup_dirty`` lists one contradicted decision per batch."""
    from datetime import UTC, datetime

    from prx_assets.core.dedup.decisions import DecisionChange
    from prx_assets.core.dedup.dirty import mark_dirty
    from prx_assets.core.lab import Lab

    lab = Lab(tmp_path / "lab")
    changes = [DecisionChange(b, f"k-{b}", "c", "keeper of x", "duplicate of y") for b in batches]
    mark_dirty(lab, changes, "web.new", datetime(2026, 1, 1, tzinfo=UTC))
    return lab


def test_settling_stops_at_a_failed_rerun_and_names_what_is_left(tmp_path):
    from prx_assets.core.dedup.reruns import settle_dedup

    lab = _dirty_lab(tmp_path, ["web.a", "web.b", "web.gone"])
    ran = []
    report = settle_dedup(
        lab, DedupSettings(), {"web.a", "web.b"}, lambda r: ran.append(r.batch) or False
    )
    assert ran == ["web.a"]  # stops at the first failure; web.gone is not registered
    assert not report.settled
    assert [r.batch for r in report.failed] == ["web.a"]
    assert report.still_stale == ["web.a", "web.b"]


def test_settling_is_bounded_in_rounds_when_reruns_change_nothing(tmp_path):
    from prx_assets.core.dedup.reruns import settle_dedup

    lab = _dirty_lab(tmp_path, ["web.a"])
    report = settle_dedup(lab, DedupSettings(), {"web.a"}, lambda r: True, max_rounds=2)
    assert report.rounds == 2 and [r.batch for r in report.reruns] == ["web.a", "web.a"]
    assert not report.settled and report.still_stale == ["web.a"]
    assert report.reruns[0].assets == ("phash_clusters",)


def test_register_batch_materialize_exits_non_zero_when_an_error_check_fails(
    tmp_path, monkeypatch, capsys
):
    """Photos without alt text and no VLM captioner: every image is skipped as no_caption
    and ``skip_lists_caption_coverage`` (severity ERROR) fails. The run itself succeeds;
    the command says which check failed and exits 1, not 0."""
    data_root = tmp_path / "data"
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PRX_DATA_ROOT", str(data_root))
    folder = data_root / "landing" / "web" / "000"
    folder.mkdir(parents=True)
    (folder / "camera.jpg").write_bytes(_photo("camera.png"))
    (folder / "astronaut.jpg").write_bytes(_photo("astronaut.png"))
    (folder / "_SUCCESS").write_text("")
    args = ["register-batch", str(folder), "--data-root", str(data_root), "--materialize"]
    assert cli_main(args) == 1
    captured = capsys.readouterr()
    assert "web.000: materialised" in captured.out  # the run succeeded as a run
    assert "check skip_lists_caption_coverage on skip_lists FAILED (ERROR)" in captured.err
    # Quiet by default: the steps' own lines (summaries, progress), no Dagster event
    # (-v prints those), no Lance fork warning from the pool's forkserver.
    assert "web.000: seen 2, accepted 2, rejected 0" in captured.err
    assert " - DEBUG - " not in captured.err and "STEP_START" not in captured.err
    assert "fork-safe" not in captured.err
    assert len(captured.err.splitlines()) < 30, captured.err

    # Nothing is in training: a snapshot of that is refused unless asked for.
    snap = ["snapshot", "create", "empty", "--data-root", str(data_root)]
    assert cli_main(snap) == 2
    assert "0 of 2 samples are in training" in capsys.readouterr().err
    assert cli_main(["snapshot", "list", "--data-root", str(data_root)]) == 0
    assert "empty" not in capsys.readouterr().out  # nothing was frozen
    assert cli_main([*snap, "--allow-empty"]) == 0
    assert "0 of 2 samples in training" in capsys.readouterr().out
