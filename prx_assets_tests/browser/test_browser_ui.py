"""The curation browser as a curator uses it: the documented command, real HTTP, headless
chromium. One caption is replaced by markup to check that lab text is shown, never run."""

from __future__ import annotations

import http.client
import io
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from prx_assets.core.lab import Lab, sql_literal
from prx_assets_tests.browser.conftest import copy_lab
from prx_assets_tests.ops.browser import chrome, screenshot, serve, wait_for_text
from prx_assets_tests.ops.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
HOSTILE = (
    "Hostile galaxies caption <img src=x onerror=\"document.title='pwned'\">"
    "<script>document.title='pwned'</script>"
)


def _galaxy_keys(lab: Lab) -> list[str]:
    rows = lab.read("captions", ["key", "caption"]).to_pylist()
    return sorted(r["key"] for r in rows if "galaxies" in (r["caption"] or ""))


@pytest.fixture(scope="module")
def server(browser_data_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("browser-ui")
    lab = copy_lab(browser_data_root / "lab", root / "lab")
    hostile_key = _galaxy_keys(lab)[-1]
    lab.dataset("captions").update(
        {"caption": sql_literal(HOSTILE)}, where=f"key = {sql_literal(hostile_key)}"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "prx_assets.browser",
        "--data-root",
        str(root),
        "--port",
        str(port),
    ]
    with serve(cmd, f"{url}/api/facets", {"PYTHONPATH": str(REPO)}, "the browser", timeout=60):
        yield url, port, lab, hostile_key


@pytest.fixture(scope="module")
def driver():
    d = chrome()
    try:
        yield d
    finally:
        d.quit()


def _cards(driver, timeout: float = 30) -> list:
    deadline = time.time() + timeout
    while time.time() < deadline:
        cards = driver.find_elements(By.CSS_SELECTOR, "#results .card")
        if cards and "results" in driver.find_element(By.ID, "status").text:
            return cards
        time.sleep(0.2)
    raise AssertionError(f"no result cards; status: {driver.find_element(By.ID, 'status').text}")


def _thumbs_decoded(driver, cards, timeout: float = 30) -> list[int]:
    deadline = time.time() + timeout
    script = "return arguments[0].complete ? arguments[0].naturalWidth : -1"
    while True:
        widths = [
            driver.execute_script(script, c.find_element(By.CSS_SELECTOR, "img.thumb"))
            for c in cards
        ]
        if all(w >= 0 for w in widths) or time.time() > deadline:
            return widths
        time.sleep(0.2)


def test_search_click_audit_and_more_like_this(server, driver):
    url, _, lab, hostile_key = server
    driver.get(url)
    wait_for_text(driver, "results")
    # Later stages have not run in this lab: their filters say so and are off.
    tier = driver.find_element(By.CSS_SELECTOR, 'fieldset[data-filter="tier"]')
    assert tier.get_attribute("disabled") is not None
    assert "shards stage has not written bucket_assignments" in tier.text

    box = driver.find_element(By.ID, "q")
    box.send_keys("galaxies", Keys.ENTER)
    wait_for_text(driver, "full-text")
    cards = _cards(driver)
    keys = [c.get_attribute("data-key") for c in cards]
    assert set(keys) == set(_galaxy_keys(lab))
    widths = _thumbs_decoded(driver, cards)
    assert all(w > 0 for w in widths), widths  # real thumbnails, not broken-image icons
    assert max(widths) == 256
    screenshot(driver, "browser-search")

    # The hostile caption is shown as text and nothing in it ran.
    hostile = next(c for c in cards if c.get_attribute("data-key") == hostile_key)
    assert "<img src=x onerror=" in hostile.find_element(By.CSS_SELECTOR, ".caption").text
    assert "<script>" in hostile.text
    assert driver.title != "pwned"
    assert driver.find_elements(By.CSS_SELECTOR, "#results img:not(.thumb), #results script") == []

    target = next(c for c in cards if c.get_attribute("data-key") != hostile_key)
    key = target.get_attribute("data-key")
    target.click()
    wait_for_text(driver, "Audit trail")
    deadline = time.time() + 30
    while not driver.find_elements(By.CSS_SELECTOR, '#audit section[data-table="images"]'):
        assert time.time() < deadline, driver.find_element(By.ID, "audit").text
        time.sleep(0.2)
    assert driver.find_element(By.ID, "detail-key").text == key
    verdict = httpx.get(f"{url}/api/audit/{key}").json()["verdict"]
    assert driver.find_element(By.ID, "verdict").text == verdict  # the verdict comes first
    assert driver.find_element(By.CSS_SELECTOR, "#audit > :first-child").get_attribute("id") == (
        "verdict"
    )
    images = driver.find_element(By.CSS_SELECTOR, '#audit section[data-table="images"]')
    assert images.text.startswith("images (Lance version")
    assert key in images.text and "public-skimage.000" in images.text
    sections = [
        s.get_attribute("data-table")
        for s in driver.find_elements(By.CSS_SELECTOR, "#audit section")
    ]
    assert sections[:5] == ["images", "rejects", "resolution", "captions", "caption_classes"]
    preview = driver.find_element(By.ID, "preview")
    deadline = time.time() + 30
    while driver.execute_script("return arguments[0].naturalWidth", preview) == 0:
        assert time.time() < deadline
        time.sleep(0.2)
    screenshot(driver, "browser-audit")

    # The hostile caption in the audit trail is text too.
    hostile.click()
    deadline = time.time() + 30
    while driver.find_element(By.ID, "detail-key").text != hostile_key or not (
        driver.find_elements(By.CSS_SELECTOR, '#audit section[data-table="captions"]')
    ):
        assert time.time() < deadline, driver.find_element(By.ID, "audit").text
        time.sleep(0.2)
    captions = driver.find_element(By.CSS_SELECTOR, '#audit section[data-table="captions"]')
    assert HOSTILE in captions.text
    assert driver.find_elements(By.CSS_SELECTOR, "#audit img, #audit script") == []
    assert driver.title != "pwned"
    target.click()
    wait_for_text(driver, key)

    driver.find_element(By.ID, "more-like-this").click()
    wait_for_text(driver, "like " + key[:12])
    cards = _cards(driver)
    first = cards[0]
    assert "distance 0.000" in first.text  # itself or an exact caption duplicate
    self_cards = driver.find_elements(By.CSS_SELECTOR, "#results .badge.self")
    assert len(self_cards) == 1
    screenshot(driver, "browser-similar")


def test_filters_narrow_the_results_in_the_page(server, driver):
    url, _, lab, _ = server
    driver.get(url)
    wait_for_text(driver, "results")
    driver.find_element(By.ID, "q").send_keys("background", Keys.ENTER)
    wait_for_text(driver, "full-text")
    before = len(_cards(driver))
    text_label = driver.find_element(
        By.CSS_SELECTOR, 'fieldset[data-filter="label"] input[value="text"]'
    )
    text_label.click()
    deadline = time.time() + 30
    while True:
        cards = driver.find_elements(By.CSS_SELECTOR, "#results .card")
        if cards and len(cards) < before:
            break
        assert time.time() < deadline, "the label filter did not narrow the results"
        time.sleep(0.2)
    labels = {
        r["key"]: r["label"] for r in lab.read("caption_classes", ["key", "label"]).to_pylist()
    }
    assert {labels[c.get_attribute("data-key")] for c in cards} == {"text"}
    screenshot(driver, "browser-filtered")

    # A filter the server refuses (400): the error, and no card of the earlier query left
    # under it to be read as its answer.
    side = driver.find_element(By.ID, "min_side")
    side.send_keys("-1", Keys.TAB)
    deadline = time.time() + 30
    while "min_side" not in driver.find_element(By.ID, "status").text:
        assert time.time() < deadline, "the refused filter was never reported"
        time.sleep(0.2)
    assert "error" in driver.find_element(By.ID, "status").get_attribute("class")
    assert driver.find_elements(By.CSS_SELECTOR, "#results .card") == []
    side.clear()
    side.send_keys(Keys.TAB)
    assert _cards(driver)  # a valid query shows cards again
    shapes = [
        i.get_attribute("value")
        for i in driver.find_elements(By.CSS_SELECTOR, 'fieldset[data-filter="shape"] input')
    ]
    dims = [tuple(int(x) for x in s.split("x")) for s in shapes]
    assert dims == sorted(dims)  # numeric order, not text


def test_http_guards(server):
    url, port, lab, hostile_key = server
    page = httpx.get(url)
    assert page.status_code == 200
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    # DNS rebinding: the right socket, the wrong name.
    rebound = httpx.get(f"{url}/api/facets", headers={"Host": f"attacker.example:{port}"})
    assert rebound.status_code == 421 and "not one this server answers" in rebound.json()["error"]
    assert httpx.get(f"{url}/api/facets", headers={"Host": f"localhost:{port}"}).status_code == 200
    posted = httpx.post(f"{url}/api/search", data={"q": "x"})
    assert posted.status_code == 405 and posted.headers["allow"] == "GET, HEAD"
    assert httpx.delete(f"{url}/api/audit/{hostile_key}").status_code == 405

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for raw in ("/static/../queries.py", "/static/%2e%2e/queries.py", "/static/app.py"):
        conn.request("GET", raw)
        response = conn.getresponse()
        assert response.status == 404, raw
        assert b"import" not in response.read()
    conn.close()

    search = httpx.get(f"{url}/api/search", params={"q": "galaxies", "batch": "public-sklearn.001"})
    assert search.status_code == 200 and search.json()["hits"] == []
    hostile = httpx.get(f"{url}/api/search", params={"q": "hostile"}).json()["hits"]
    assert [h["caption"] for h in hostile] == [HOSTILE]  # data, as stored
    bad = httpx.get(f"{url}/api/search", params={"q": "x", "label": "cat"})
    assert bad.status_code == 400 and "unknown class label 'cat'" in bad.json()["error"]
    assert httpx.get(f"{url}/api/search", params={"tier": "1"}).status_code == 400
    assert httpx.get(f"{url}/api/image/not-a-key/thumb").status_code == 400
    assert httpx.get(f"{url}/api/image/{'0' * 64}/thumb").status_code == 404
    assert httpx.get(f"{url}/api/audit/{'0' * 64}").status_code == 404

    thumb = httpx.get(f"{url}/api/image/{hostile_key}/thumb", params={"size": 1024})
    assert thumb.headers["content-type"] == "image/jpeg"
    img = Image.open(io.BytesIO(thumb.content))
    row = lab.read("images", ["width", "height"], f"key = {sql_literal(hostile_key)}").to_pylist()[
        0
    ]
    assert img.size[0] <= 1024 and img.size[1] <= 1024
    assert max(img.size) == min(1024, max(row["width"], row["height"]))
    assert httpx.get(f"{url}/api/image/{hostile_key}/thumb", params={"size": 77}).status_code == 400


def test_the_command_refuses_a_missing_lab(tmp_path, capsys):
    from prx_assets.browser.__main__ import main

    assert main(["--data-root", str(tmp_path / "nowhere"), "--port", "0"]) == 2
    assert "no lab at" in capsys.readouterr().err


def test_sigterm_stops_the_browser_cleanly_even_when_its_parent_ignored_it(browser_data_root):
    # What a parent may hand down: SIGTERM ignored (``trap '' TERM``), kept across exec.
    port = free_port()
    cmd = [sys.executable, "-m", "prx_assets.browser", "--data-root", str(browser_data_root)]
    ignoring = ["/bin/sh", "-c", 'trap "" TERM; exec "$@"', "sh", *cmd, "--port", str(port)]
    health = f"http://127.0.0.1:{port}/api/facets"
    with serve([*ignoring, "--quiet"], health, {"PYTHONPATH": str(REPO)}, "the browser") as proc:
        proc.send_signal(signal.SIGTERM)
        # A clean stop: serve_forever returns, the socket is closed, exit status 0.
        assert proc.wait(timeout=15) == 0
