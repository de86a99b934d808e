import json

from dagster import materialize

from prx_assets.cli import main as cli_main
from prx_assets.core.audit import audit_image
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile


def _ingest(instance, lab_resource, keys):
    instance.add_dynamic_partitions(BATCHES.name, keys)
    for key in keys:
        assert materialize(
            [raw_images, resolution_profile],
            partition_key=key,
            instance=instance,
            resources={"lab": lab_resource},
        ).success


def test_trail_by_key_url_and_for_a_rejected_file(instance, lab_resource):
    _ingest(instance, lab_resource, ["internal-studio.002", "public-skimage.000"])
    lab = lab_resource.lab()
    row = lab.read("images", ["key", "url", "batch"], "url IS NOT NULL").to_pylist()[0]

    by_key = audit_image(lab, row["key"])
    assert by_key.found and by_key.keys == [row["key"]]
    assert by_key.tables["images"][0]["batch"] == row["batch"]
    assert "image" not in by_key.tables["images"][0]  # bytes never printed
    assert by_key.tables["resolution"][0]["key"] == row["key"]
    assert by_key.versions["images"] == lab.dataset("images").version

    by_url = audit_image(lab, row["url"])
    assert by_url.keys == [row["key"]]

    truncated = lab.read("rejects", ["key"], "reason = 'truncated'").column("key")[0].as_py()
    rejected = audit_image(lab, truncated)
    assert rejected.tables["rejects"][0]["reason"] == "truncated"
    assert rejected.tables["images"] == []

    assert not audit_image(lab, "https://nowhere.invalid/x.jpg").found


def test_audit_command_and_job(instance, lab_resource, capsys):
    from prx_assets.definitions import build_defs

    _ingest(instance, lab_resource, ["public-sklearn.001"])
    key = lab_resource.lab().read("images", ["key"]).column("key")[0].as_py()
    assert cli_main(["audit", key, "--data-root", lab_resource.data_root, "--json"]) == 0
    trail = json.loads(capsys.readouterr().out)
    assert trail["keys"] == [key] and trail["images"][0]["key"] == key
    assert cli_main(["audit", "0" * 64, "--data-root", lab_resource.data_root]) == 1

    job = build_defs(lab_resource.data_root).resolve_job_def("image_audit")
    result = job.execute_in_process(
        instance=instance,
        run_config={"ops": {"audit_one_image": {"config": {"query": key}}}},
    )
    md = result.output_for_node("audit_one_image")
    assert md == [key]
    event = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"][0]
    text = event.step_output_data.metadata["trail"].value
    assert key in text and "## images" in text and "## resolution" in text
