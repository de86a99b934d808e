"""A settled demo lab with one hostile batch and one opted-out keeper, built once.

Shared by the audit and metadata tests: ``make demo``'s own path (``prx-assets demo``), then a
batch whose alt text, URL, licence, source id and file names are markup and CSRF payloads,
registered and materialised with ``register-batch --materialize``, then an opt-out list
naming the keeper of a duplicate cluster, applied through the opt-out sensor's requests.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from prx_assets.demo.jpegs import encoded
from prx_assets_tests.conftest import PHOTOS

HOSTILE_BATCH = "hostile.000"
CSRF = "![](/graphql?query=mutation{setAutoMaterializePaused(paused:false)})"
HOSTILE_ALT = (
    f"{CSRF} <img src=/graphql?query=x onerror=alert(1)> [click](javascript:alert(1)) "
    "https://evil.example/a www.evil.example me@evil.example `code` | pipe **bold**"
)
HOSTILE_URL = "https://evil.example/x.jpg?<b>![](/graphql?query=y)"
HOSTILE_LICENSE = "<script>alert(1)</script> [CC](https://evil.example/licence)"
HOSTILE_ID = "![](</graphql?query=mutation { setAutoMaterializePaused(paused: false) }>)"
HOSTILE_IMAGE_NAME = "<img src=x>[a](b)"  # + ".jpg": a legal file name
HOSTILE_REJECT_NAME = "![](x) [y](javascript:z).jpg"
PAYLOADS = (HOSTILE_ALT, HOSTILE_URL, HOSTILE_LICENSE, HOSTILE_ID, f"{HOSTILE_IMAGE_NAME}.jpg")


@dataclass
class World:
    root: Path
    data_root: Path
    landing: Path
    home: Path
    keeper: str  # opted out: the keeper of a duplicate cluster ...
    keeper_batch: str
    duplicate: str  # ... whose other member is this key
    duplicate_batch: str
    list_id: str

    def lab(self):
        from prx_assets.defs.resources import LabResource

        return LabResource(data_root=str(self.data_root)).lab()

    @property
    def shards_root(self) -> str:
        """The shard tree the loader (and so the audit's verdicts) reads."""
        return str(self.data_root / "shards")

    def instance(self):
        """The world's own Dagster instance (not the process's DAGSTER_HOME); dispose it."""
        from dagster import DagsterInstance
        from dagster._core.instance.ref import InstanceRef

        return DagsterInstance.from_ref(InstanceRef.from_dir(str(self.home)))


def _hostile_batch(landing: Path) -> None:
    folder = landing / "hostile" / "000"
    folder.mkdir(parents=True)
    photo = Image.open(PHOTOS / "rocket.jpg").convert("RGB")  # 640x427: eligible
    mirrored = encoded(photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT), "JPEG", quality=88)
    (folder / f"{HOSTILE_IMAGE_NAME}.jpg").write_bytes(mirrored)
    (folder / f"{HOSTILE_IMAGE_NAME}.txt").write_text(HOSTILE_ALT)
    meta = {"url": HOSTILE_URL, "license": HOSTILE_LICENSE, "id": HOSTILE_ID}
    (folder / f"{HOSTILE_IMAGE_NAME}.json").write_text(json.dumps(meta))
    (folder / HOSTILE_REJECT_NAME).write_bytes(b"not an image at all")
    (folder / "_SUCCESS").write_bytes(b"")


@pytest.fixture(scope="session")
def audit_world(tmp_path_factory) -> World:
    from dagster import AssetKey, DagsterInstance

    from prx_assets.cli import main as cli_main
    from prx_assets.definitions import build_defs
    from prx_assets.defs.run_requests import evaluate_sensor, execute_run_request

    root = tmp_path_factory.mktemp("audit-world")
    data_root, home = root / "data", root / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("DAGSTER_HOME", str(home))
    mp.setenv("PRX_DATA_ROOT", str(data_root))
    try:
        assert cli_main(["demo", "--data-root", str(data_root), "--size", "small"]) == 0
        landing = data_root / "landing"
        _hostile_batch(landing)
        args = ["register-batch", str(landing / "hostile" / "000"), "--data-root", str(data_root)]
        assert cli_main([*args, "--materialize"]) == 0

        world = World(root, data_root, landing, home, "", "", "", "", "")
        clusters = world.lab().read(
            "phash_clusters", ["key", "batch", "keeper_key", "keeper_batch"], "is_keeper = false"
        )
        dup = min(
            (r for r in clusters.to_pylist() if r["keeper_key"] != r["key"]),
            key=lambda r: (r["batch"], r["key"]),
        )
        world.duplicate, world.duplicate_batch = dup["key"], dup["batch"]
        world.keeper, world.keeper_batch = dup["keeper_key"], dup["keeper_batch"]

        optouts = data_root / "optouts"
        optouts.mkdir(exist_ok=True)
        (optouts / "takedown.txt").write_text(f"# a takedown request\n{world.keeper}\n")
        defs = build_defs(str(data_root))
        instance = DagsterInstance.get()
        try:
            # Two ticks: the list's intake run, then the skip_lists runs it affects.
            cursor, asked = None, []
            for _ in range(2):
                requests, cursor = evaluate_sensor(defs, instance, "opt_out_sensor", cursor)
                asked += [r.asset_selection for r in requests]
                for request in requests:
                    assert execute_run_request(defs, instance, request, None)
            assert asked[0] == [AssetKey("opt_out_lists")]
            assert [AssetKey("skip_lists")] in asked[1:], "no skip_lists run was requested"
        finally:
            instance.dispose()
        lists = world.lab().read("opt_out_lists", ["list_id", "status"]).to_pylist()
        assert [r["status"] for r in lists] == ["accepted"]
        world.list_id = lists[0]["list_id"]
        assert os.environ["DAGSTER_HOME"] == str(home)
    finally:
        mp.undo()
    return world
