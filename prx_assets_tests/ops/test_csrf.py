"""Stored CSRF through metadata: data rendered in the real Dagster UI stays text.

An alt text ``![](/graphql?query=mutation{...})`` ingested as a caption used to reach the
``image_audit`` trail verbatim; opening it in the UI made the browser GET that URL, and
Dagster's GraphQL endpoint runs mutations sent by GET (the auto-materialize switch flipped).
Here the payloads go through the real stages and the real job into a real instance, the
webserver serves it, headless chromium opens the trail, and the switch must not move.
"""

from __future__ import annotations

import json
import time

import pytest
from dagster import DagsterInstance, materialize
from dagster._daemon.asset_daemon import get_auto_materialize_paused
from PIL import Image
from selenium.webdriver.common.by import By

from prx_assets.definitions import build_defs
from prx_assets.defs.captions.assets import build_caption_assets
from prx_assets.defs.captions.resources import (
    CaptionerResource,
    ClassifierResource,
    EmbedderResource,
)
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource
from prx_assets.demo.jpegs import encoded
from prx_assets_tests.conftest import PHOTOS
from prx_assets_tests.ops.browser import (
    chrome,
    dagster_webserver,
    dismiss_dialogs,
    screenshot,
    wait_for_text,
)
from prx_assets_tests.ops.conftest import free_port

BATCH = "hostile.000"
MUTATION = "mutation{setAutoMaterializePaused(paused:false)}"
ALT_TEXT = (
    f"![]({'/graphql?query=' + MUTATION}) <img src=/graphql?query={MUTATION}> "
    "[click](javascript:alert(1)) https://evil.example/a www.evil.example"
)
LICENSE = f"![](</graphql?query={MUTATION}>) <iframe src=/graphql?query={MUTATION}>"
NAME = "![](x)<img src=x>"  # a legal file name; markup in the landing path
END = "created_at"  # the last column of the last table (captions): the trail has rendered


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """A real instance holding an ``image_audit`` run over an image whose every text field
    is a payload (alt text, hence the fallback caption; licence; URL; file name)."""
    root = tmp_path_factory.mktemp("csrf")
    home, data = root / "home", root / "data"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    folder = data / "landing" / "hostile" / "000"
    folder.mkdir(parents=True)
    photo = encoded(Image.open(PHOTOS / "rocket.jpg").convert("RGB"), "JPEG", quality=85)
    (folder / f"{NAME}.jpg").write_bytes(photo)
    (folder / f"{NAME}.txt").write_text(ALT_TEXT)
    meta = {"license": LICENSE, "url": f"https://evil.example/{MUTATION}", "id": ALT_TEXT}
    (folder / f"{NAME}.json").write_text(json.dumps(meta))
    (folder / "_SUCCESS").write_bytes(b"")

    mp = pytest.MonkeyPatch()
    mp.setenv("DAGSTER_HOME", str(home))
    instance = DagsterInstance.get()
    try:
        lab = LabResource(data_root=str(data))
        instance.add_dynamic_partitions(BATCHES.name, [BATCH])
        captioner = CaptionerResource()
        captions = build_caption_assets(captioner, ClassifierResource(), EmbedderResource())[0]
        assert materialize(
            [raw_images, resolution_profile, captions],
            partition_key=BATCH,
            instance=instance,
            resources={"lab": lab, "captioner": captioner},
        ).success
        (row,) = lab.lab().read("captions", ["key", "caption"]).to_pylist()
        assert row["caption"] == ALT_TEXT  # the payload is the caption (alt-text fallback)
        job = build_defs(str(data)).resolve_job_def("image_audit")
        query = row["key"]
        result = job.execute_in_process(
            instance=instance,
            run_config={"ops": {"audit_one_image": {"config": {"query": query}}}},
        )
        assert result.success
        assert get_auto_materialize_paused(instance)  # the default: paused
        yield {"home": home, "data": data, "run_id": result.run_id, "instance": instance}
    finally:
        instance.dispose()
        mp.undo()


def test_the_audit_trail_renders_payloads_as_text_and_runs_no_mutation(hostile_run):
    env = {"DAGSTER_HOME": str(hostile_run["home"]), "PRX_DATA_ROOT": str(hostile_run["data"])}
    with dagster_webserver(free_port(), env) as url:
        driver = chrome()
        try:
            driver.get(f"{url}/runs/{hostile_run['run_id']}")
            dismiss_dialogs(driver)
            wait_for_text(driver, "Show Markdown")
            link = driver.find_elements(By.XPATH, "//a[contains(text(),'Show Markdown')]")[-1]
            driver.execute_script("arguments[0].scrollIntoView(); arguments[0].click();", link)
            wait_for_text(driver, END)
            markdown = driver.find_elements(By.CSS_SELECTOR, ".dagster-markdown")[-1]
            # Wait until every image the page holds has finished loading (or failed): by
            # then any GET a payload caused has been answered by the server.
            deadline = time.time() + 30
            script = "return Array.from(document.images).every(i => i.complete)"
            while not driver.execute_script(script):
                assert time.time() < deadline, "images still loading"
                time.sleep(0.2)
            screenshot(driver, "dagster-csrf-trail")
            fetched = driver.execute_script(
                "return performance.getEntriesByType('resource').map(e => e.name)"
                ".filter(n => n.includes('query=mutation'))"
            )
            html = markdown.get_attribute("innerHTML")
            text = markdown.text
        finally:
            driver.quit()
    instance = hostile_run["instance"]
    assert get_auto_materialize_paused(instance), f"the mutation ran; fetched {fetched}"
    assert fetched == []
    rendered = [t for t in ("<img", "<a ", "<iframe", "<script") if t in html]
    assert rendered == [], f"data became markup: {rendered}"
    # ... and the payloads are on the page, as text.
    for payload in (ALT_TEXT, LICENSE, f"{NAME}.jpg"):
        assert payload in text
