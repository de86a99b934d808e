"""The Dagster UI in a real browser: graph, partitions, and metadata pictures."""

import pytest
from selenium.webdriver.common.by import By

from prx_assets.cli import main as cli_main
from prx_assets.definitions import defs
from prx_assets_tests.ops.browser import (
    chrome,
    dagster_webserver,
    dismiss_dialogs,
    screenshot,
    wait_for_text,
)
from prx_assets_tests.ops.conftest import free_port


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    env = {"DAGSTER_HOME": str(root / "home"), "PRX_DATA_ROOT": str(root / "data")}
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    assert cli_main(["demo", "--data-root", env["PRX_DATA_ROOT"], "--size", "small"]) == 0
    (root / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with dagster_webserver(free_port(), env) as url:
        driver = chrome()
        try:
            yield url, driver
        finally:
            driver.quit()
            mp.undo()


def test_asset_graph_shows_every_stage(ui):
    url, driver = ui
    graph = defs.resolve_asset_graph()
    groups: dict[str, list[str]] = {}
    for key in graph.get_all_asset_keys():
        groups.setdefault(graph.get(key).group_name, []).append(key.to_user_string())
    # The global lineage shows one node per stage group ...
    driver.get(f"{url}/asset-groups")
    wait_for_text(driver, "Global asset lineage")
    dismiss_dialogs(driver)
    for group in groups:
        wait_for_text(driver, group)
    screenshot(driver, "dagster-asset-graph")
    # ... and each group's graph shows every asset of the stage, with its partitions.
    for group, keys in sorted(groups.items()):
        driver.get(f"{url}/locations/prx_assets/asset-groups/{group}")
        dismiss_dialogs(driver)
        for key in keys:
            wait_for_text(driver, key)
        # optouts: partitioned by opt-out list (the demo receives none); snapshots: made on
        # demand, unpartitioned.
        if group not in ("optouts", "snapshots"):
            wait_for_text(driver, "4 partitions")
        screenshot(driver, f"dagster-group-{group}")


def test_partitioned_asset_lists_its_partitions(ui):
    url, driver = ui
    driver.get(f"{url}/assets/raw_images?view=partitions")
    dismiss_dialogs(driver)
    for key in ("public-skimage.000", "public-sklearn.001", "internal-studio.002"):
        wait_for_text(driver, key)
    wait_for_text(driver, "Materialized (4)")
    screenshot(driver, "dagster-partitions")


def test_metadata_pictures_render(ui):
    url, driver = ui
    driver.get(f"{url}/assets/resolution_profile?view=partitions&partition=public-sklearn.001")
    dismiss_dialogs(driver)
    wait_for_text(driver, "Show Markdown")
    link = driver.find_elements(By.XPATH, "//a[contains(text(),'Show Markdown')]")[-1]
    driver.execute_script("arguments[0].scrollIntoView(); arguments[0].click();", link)
    wait_for_text(driver, "histogram")
    imgs = driver.find_elements(By.CSS_SELECTOR, "img[src^='data:image/png']")
    assert imgs, "the histogram picture is not on the page"
    widths = [driver.execute_script("return arguments[0].naturalWidth", i) for i in imgs]
    assert max(widths) > 300  # decoded, not a broken-image icon
    screenshot(driver, "dagster-resolution-histogram")
