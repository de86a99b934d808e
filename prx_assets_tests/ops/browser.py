"""Headless Debian chromium driven by Selenium, and a Dagster webserver on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.common.by import By

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROME_FLAGS = (
    "--headless=new --no-sandbox --disable-gpu --disable-quic --no-first-run "
    "--disable-background-networking --disable-component-update --disable-sync "
    "--window-size=1500,1000"
).split()


def chrome() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path="/usr/bin/chromedriver")
    return webdriver.Chrome(options=options, service=service)


def screenshot(driver: webdriver.Chrome, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def wait_for_text(driver: webdriver.Chrome, text: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in driver.find_element(By.TAG_NAME, "body").text:
            return
        time.sleep(0.5)
    raise AssertionError(f"{text!r} never appeared; page says:\n{driver.page_source[:2000]}")


def dismiss_dialogs(driver: webdriver.Chrome) -> None:
    """The first visit shows a community sign-up dialog; skip it like a person would."""
    for button in driver.find_elements(By.XPATH, "//button[normalize-space()='Skip']"):
        button.click()


@contextmanager
def serve(cmd: list[str], health_url: str, env: dict[str, str], name: str, timeout: float = 120):
    """Run a local server process until ``health_url`` answers 200; stop it afterwards."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        cmd, cwd=repo, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.time() + timeout
        while True:
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                out = proc.stdout.read().decode() if proc.stdout else ""
                raise RuntimeError(f"{name} did not start:\n{out[-3000:]}")
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            # Say why it outlived SIGTERM (an ignored or blocked signal shows here), then kill.
            try:
                lines = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
            except OSError:
                lines = []
            sig = "; ".join(x for x in lines if x.startswith("Sig"))
            warnings.warn(f"{name} outlived SIGTERM for 20 s ({sig}); killed", stacklevel=2)
            proc.kill()
            proc.wait()


@contextmanager
def dagster_webserver(port: int, env: dict[str, str]):
    """`dagster-webserver` on 127.0.0.1 over this project's workspace.yaml."""
    repo = Path(__file__).resolve().parents[2]
    exe = Path(sys.executable).parent / "dagster-webserver"
    cmd = [str(exe), "-h", "127.0.0.1", "-p", str(port), "-w", str(repo / "workspace.yaml")]
    url = f"http://127.0.0.1:{port}"
    with serve(cmd, f"{url}/server_info", env, "dagster-webserver"):
        yield url
