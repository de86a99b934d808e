"""The whole graph on the demo data, through the same path `make demo` takes."""

import os
import re

from prx_assets.cli import main as cli_main
from prx_assets.core.tables import IMAGES, RESOLUTION
from prx_assets.defs.resources import LabResource
from prx_assets.demo.build import build_demo_landing


def test_demo_materialises_every_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PRX_DATA_ROOT", str(tmp_path / "data"))
    import torch

    threads = torch.get_num_threads()
    code = cli_main(["demo", "--data-root", str(tmp_path / "data"), "--size", "small"])
    out = capsys.readouterr().out
    assert code == 0, out
    # The demo's training loop runs on one torch thread and gives the count back: a model run
    # later in the same process (the caption classifier) must score as in a fresh one.
    assert torch.get_num_threads() == threads
    assert "newly registered" in out and "public-skimage.000" in out
    assert f"Lance lab: {tmp_path / 'data' / 'lab'}" in out  # nothing outside the data root
    lab = LabResource(data_root=str(tmp_path / "data")).lab()
    assert lab.count(IMAGES.name) > 0
    assert lab.count(RESOLUTION.name) == lab.count(IMAGES.name)

    from dagster import DagsterInstance

    instance = DagsterInstance.get()
    try:
        partitions = instance.get_dynamic_partitions("batches")
        assert sorted(partitions) == sorted(
            [
                "internal-studio.002",
                "public-skimage.000",
                "public-sklearn.001",
                "public-skimage.003",
            ]
        )
        runs = instance.get_run_records()
        assert all(r.dagster_run.is_success for r in runs)
        pipeline = [r for r in runs if r.dagster_run.job_name == "batch_pipeline"]
        assert len(pipeline) == 4
        # Every stage materialised for every partition.
        from prx_assets.definitions import build_defs

        graph = build_defs(str(tmp_path / "data")).resolve_asset_graph()
        for asset_key in graph.get_all_asset_keys():
            if not graph.get(asset_key).is_partitioned:
                continue  # training_snapshots: made on demand, not per batch
            done = instance.get_materialized_partitions(asset_key)
            # opt_out_lists is partitioned by list, and the demo receives none.
            expected = set() if asset_key.to_user_string() == "opt_out_lists" else set(partitions)
            assert done == expected, asset_key
        # Reruns beyond the pipeline are the dedup sensor's: cluster decisions + skip-lists.
        for r in runs:
            if r.dagster_run.job_name != "batch_pipeline":
                selected = {k.to_user_string() for k in r.dagster_run.asset_selection}
                assert selected == {"phash_clusters", "skip_lists"}, selected
    finally:
        instance.dispose()
    assert "no skipped sample appeared" in out
    # Every planted pair is found (copies under the size cutoff are hashed too), and each
    # found pair keeps the larger image: the numbers, not just the sentence.
    planted = len(build_demo_landing(tmp_path / "manifest-only", size="small").planted_duplicates)
    numbers = re.search(
        r"planted duplicate pairs found (\d+) of (\d+) \(keeper = higher resolution: (\d+); "
        r"not hashed yet: (\d+); copies under the size cutoff are hashed too",
        out,
    )
    assert numbers, out
    found, of, keeper_larger, not_hashed = map(int, numbers.groups())
    assert of == planted > 0
    assert found == planted and not_hashed == 0
    assert keeper_larger == found
    for key in partitions:  # the no-caption count per batch (the demo's photos all have one)
        assert f"  {key}: 0 of " in out and "eligible without a caption" in out

    # Running the demo again registers nothing new and changes no counts.
    before = lab.count(IMAGES.name)
    assert cli_main(["demo", "--data-root", str(tmp_path / "data"), "--size", "small"]) == 0
    assert "already registered" in capsys.readouterr().out
    assert lab.count(IMAGES.name) == before
    assert os.environ["DAGSTER_HOME"] == str(tmp_path / "home")


def test_register_batch_by_hand(tmp_path, monkeypatch, capsys, data_root):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home2"))
    monkeypatch.setenv("PRX_DATA_ROOT", str(data_root))
    target = data_root / "landing" / "public-sklearn" / "001.tar"
    assert cli_main(["register-batch", str(target), "--data-root", str(data_root)]) == 0
    assert "public-sklearn.001: registered" in capsys.readouterr().out
    assert cli_main(["register-batch", str(target), "--data-root", str(data_root)]) == 0
    assert "already registered" in capsys.readouterr().out
    bad = data_root / "landing" / "public-sklearn"
    assert cli_main(["register-batch", str(bad), "--data-root", str(data_root)]) == 2
    assert "not a <landing>" in capsys.readouterr().err
