"""The README's pictures, drawn from a demo run's data root (``make pictures``).

    python -m prx_assets.demo.pictures --data-root data --out docs/img [--browser]

Writes ``dedup_gallery.png`` (the duplicate clusters of the batch that shares the most
clusters with others, keeper in green: the picture ``phash_clusters`` puts in its
metadata), ``resolution.png`` (every ingested image's short side, aspect and size: the
``resolution_profile`` picture over the whole lab) and, with ``--browser``, a screenshot
of the curation browser in headless Chromium (Debian's ``chromium`` and ``chromedriver``,
as the browser tests use). Why a script: the pictures show what this code draws from the
bundled photos, so they are made again whenever either changes, never edited by hand.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from prx_assets.core.dedup.gallery import contact_sheet, gallery_groups
from prx_assets.core.lab import Lab, no_lab_at
from prx_assets.core.plots import resolution_histogram
from prx_assets.core.resolution.profile import MIN_SIDE
from prx_assets.core.tables import PHASH_CLUSTERS, RESOLUTION


def dedup_gallery(lab: Lab) -> bytes | None:
    """The contact sheet of the batch sharing the most duplicate clusters with others."""
    decisions = lab.read(PHASH_CLUSTERS.name, ["cluster_id", "batch", "key", "is_keeper"])
    if not decisions.num_rows:
        return None
    batches: dict[str, set[str]] = {}
    members: dict[str, set[str]] = {}
    for r in decisions.to_pylist():
        members.setdefault(r["cluster_id"], set()).add(r["batch"])
        batches.setdefault(r["batch"], set()).add(r["cluster_id"])
    shared = {b: sum(len(members[c]) > 1 for c in cs) for b, cs in batches.items()}
    batch = max(sorted(shared), key=lambda b: shared[b])
    groups = gallery_groups(lab, batch, decisions, max_clusters=4)
    if not groups:
        return None
    return contact_sheet(groups, title=f"{batch}: duplicate clusters (green = kept)")


def resolution_picture(lab: Lab) -> bytes | None:
    """Short side, aspect and size of every profiled image of the lab."""
    rows = lab.read(RESOLUTION.name, ["width", "height"])
    if not rows.num_rows:
        return None
    widths = np.asarray(rows.column("width").to_pylist())
    heights = np.asarray(rows.column("height").to_pylist())
    title = f"{rows.num_rows} ingested images: short side, aspect, size"
    return resolution_histogram(widths, heights, MIN_SIDE, title)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser_screenshot(data_root: Path, out: Path, query: str = "cat") -> None:
    """The curation browser on ``data_root``, searched for ``query``, as a PNG."""
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    port = _free_port()
    cmd = [sys.executable, "-m", "prx_assets.browser", "--data-root", str(data_root)]
    server = subprocess.Popen([*cmd, "--port", str(port)], env=dict(os.environ))
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(
        options=options, service=webdriver.ChromeService(executable_path="/usr/bin/chromedriver")
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                driver.get(f"http://127.0.0.1:{port}/")
                break
            except Exception:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("the curation browser did not start") from None
                time.sleep(0.5)
        box = driver.find_element(By.ID, "q")
        box.send_keys(query, Keys.ENTER)
        while time.time() < deadline:
            cards = driver.find_elements(By.CSS_SELECTOR, "#results .card")
            if cards and "results" in driver.find_element(By.ID, "status").text:
                break
            time.sleep(0.3)
        time.sleep(1.0)  # the thumbnails decode
        driver.save_screenshot(str(out))
    finally:
        driver.quit()
        server.terminate()
        server.wait(timeout=20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", type=Path, default=Path("data"))
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--browser", action="store_true", help="also a browser screenshot")
    args = parser.parse_args(argv)
    lab_root = args.data_root / "lab"
    why = no_lab_at(lab_root)
    if why is not None:
        print(f"{why}: run `make demo` first", file=sys.stderr)
        return 2
    lab = Lab(lab_root)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, png in (
        ("dedup_gallery.png", dedup_gallery(lab)),
        ("resolution.png", resolution_picture(lab)),
    ):
        if png is None:
            print(f"{name}: nothing to draw (has the demo run every stage?)", file=sys.stderr)
            return 1
        (args.out / name).write_bytes(png)
        print(f"wrote {args.out / name}")
    if args.browser:
        browser_screenshot(args.data_root, args.out / "browser.png")
        print(f"wrote {args.out / 'browser.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
