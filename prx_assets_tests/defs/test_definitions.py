"""The code location: it loads, every stage is partitioned by batch, and each job, sensor
and schedule runs what it claims to."""

from dagster import AssetKey, Definitions, DynamicPartitionsDefinition

from prx_assets.definitions import defs
from prx_assets.defs.partitions import BATCHES


def test_definitions_load_and_validate():
    Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert {"raw_images", "resolution_profile"} <= keys


def test_every_stage_is_partitioned_by_batch():
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        pdef = graph.get(key).partitions_def
        if key in (AssetKey("training_snapshots"), AssetKey("usage_policy")):
            assert pdef is None  # one snapshot spans every batch; one policy file
            continue
        assert isinstance(pdef, DynamicPartitionsDefinition), key
        # The opt-out intake is partitioned by list (one partition per list received).
        expected = "opt_out_lists" if key == AssetKey("opt_out_lists") else BATCHES.name
        assert pdef.name == expected, key


def test_lineage_resolution_profile_reads_raw_images():
    graph = defs.resolve_asset_graph()
    assert AssetKey("raw_images") in graph.get(AssetKey("resolution_profile")).parent_keys


def test_lineage_draws_what_feeds_training():
    """Opt-out intake and the usage policy feed skip_lists; shards and skip-lists feed
    snapshots. Every list reaches every batch's partition (the mapping), so the graph never
    understates what a skip-list decision read; the sensors still pick the reruns."""
    from dagster import AllPartitionMapping

    graph = defs.resolve_asset_graph()
    skip, snap = graph.get(AssetKey("skip_lists")), graph.get(AssetKey("training_snapshots"))
    assert {AssetKey("opt_out_lists"), AssetKey("usage_policy")} <= skip.parent_keys
    assert {AssetKey("mds_shards"), AssetKey("skip_lists")} <= snap.parent_keys
    mapping = graph.get_partition_mapping(AssetKey("skip_lists"), AssetKey("opt_out_lists"))
    assert isinstance(mapping, AllPartitionMapping)
    for parent in ("mds_shards", "skip_lists"):
        mapping = graph.get_partition_mapping(AssetKey("training_snapshots"), AssetKey(parent))
        assert isinstance(mapping, AllPartitionMapping)
    policy = graph.get(AssetKey("usage_policy"))
    assert policy.is_external and not policy.is_materializable  # a file edited by hand
    assert "only the batches holding a copy" in skip.description
    # Lineage is not automation: no asset here is materialised by a condition.
    assert all(graph.get(k).automation_condition is None for k in graph.get_all_asset_keys())


# Every per-batch stage, by the asset the README names for it.
STAGE_ASSETS = {
    "raw_images",
    "resolution_profile",
    "captions",
    "caption_classes",
    "caption_embeddings",
    "image_hashes",
    "phash_clusters",
    "bucket_assignments",
    "mds_shards",
    "skip_lists",
}


def test_batch_pipeline_runs_every_per_batch_stage_and_nothing_else():
    # One run of it per batch is what the landing sensor requests and the demo executes:
    # a stage missing from its selection would never run for a new batch.
    graph = defs.resolve_asset_graph()
    job = defs.resolve_job_def("batch_pipeline")
    selected = {k.to_user_string() for k in job.asset_layer.selected_asset_keys}
    per_batch = {
        k.to_user_string()
        for k in graph.get_all_asset_keys()
        if getattr(graph.get(k).partitions_def, "name", None) == BATCHES.name
    }
    assert selected == per_batch and STAGE_ASSETS <= selected
    assert job.partitions_def == BATCHES


def test_sensors_and_schedules_target_the_jobs_they_name_and_maintenance_is_off_by_default():
    from dagster import DefaultScheduleStatus

    assert defs.get_sensor_def("landing_sensor").job_name == "batch_pipeline"
    maintenance = defs.resolve_job_def("lance_maintenance")
    assert [node.name for node in maintenance.graph.nodes] == ["compact_lab_tables"]
    audit = defs.resolve_job_def("image_audit")
    assert [node.name for node in audit.graph.nodes] == ["audit_one_image"]
    schedule = defs.get_schedule_def("lance_maintenance_schedule")
    assert schedule.job_name == "lance_maintenance"
    assert schedule.default_status == DefaultScheduleStatus.STOPPED


def test_definitions_load_with_the_k8s_executor(monkeypatch):
    import pytest

    from prx_assets.definitions import build_defs

    monkeypatch.setenv("PRX_EXECUTOR", "k8s")
    monkeypatch.setenv("PRX_K8S_IMAGE", "registry.example.invalid/prx-assets:1")
    k8s_defs = build_defs("s3://bucket/prx")
    Definitions.validate_loadable(k8s_defs)
    job = k8s_defs.resolve_job_def("batch_pipeline")
    assert job.executor_def.name == "k8s_job_executor"
    from prx_assets.defs.executors import k8s_executor_config

    config = k8s_executor_config()
    assert config["job_image"] == "registry.example.invalid/prx-assets:1"
    assert config["per_step_k8s_config"]["captions"]["container_config"]["resources"]["limits"] == {
        "nvidia.com/gpu": "1"
    }
    monkeypatch.setenv("PRX_K8S_GPU_STEPS", "")  # captions from a remote vLLM fleet
    assert k8s_executor_config()["per_step_k8s_config"] == {}
    monkeypatch.setenv("PRX_K8S_GPU_STEPS", "caption_embeddings")
    assert list(k8s_executor_config()["per_step_k8s_config"]) == ["caption_embeddings"]
    monkeypatch.setenv("PRX_K8S_GPU_STEPS", "captions,no_such_step")
    with pytest.raises(ValueError, match="no_such_step"):
        k8s_executor_config()


def test_loading_the_code_location_does_not_import_the_kubernetes_client():
    """Every run and every multiprocess step loads the code location: dagster-k8s (and the
    Kubernetes client, google-auth, cryptography under it) cost ~0.5 s of that, and are
    imported only when PRX_EXECUTOR=k8s builds its executor."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PRX_EXECUTOR"}
    code = (
        "import sys, prx_assets.definitions as d; d.defs; "
        "print(sorted(m for m in ('dagster_k8s', 'kubernetes') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_unknown_executor_is_a_clear_error(monkeypatch):
    import pytest

    from prx_assets.definitions import build_defs

    monkeypatch.setenv("PRX_EXECUTOR", "spark")
    with pytest.raises(ValueError, match="PRX_EXECUTOR"):
        build_defs("data")


def test_the_projects_dagster_yaml_loads_with_pool_and_partition_limits(tmp_path, monkeypatch):
    import shutil
    from pathlib import Path

    from dagster import DagsterInstance

    shutil.copy(Path(__file__).resolve().parents[2] / "dagster.yaml", tmp_path / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    instance = DagsterInstance.get()
    try:
        config = instance.get_concurrency_config()
        assert config.pool_config.default_pool_limit == 1
        limits = config.run_queue_config.tag_concurrency_limits
        assert {
            "key": "dagster/partition",
            "limit": 1,
            "value": {"applyLimitPerUniqueValue": True},
        } in limits
        assert not instance.telemetry_enabled
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        assert str(tmp_path) in instance.run_storage._conn_string
    finally:
        instance.dispose()


def test_gpu_bound_assets_are_in_the_gpu_pool():
    """Defaults: the alt-text captioner runs no model (no pool), the MiniLM classifier
    fallback runs in process (gpu); fleets are tested in test_caption_assets."""
    graph = defs.resolve_asset_graph()
    pools = {k.to_user_string(): graph.get(k).pools for k in graph.get_all_asset_keys()}
    assert not pools["captions"] and pools["caption_classes"] == {"gpu"}
    assert not pools["raw_images"] and not pools["mds_shards"]


def _ray_run_chain():
    """Two ops on the ray_runs executor, at module level: execute_job reconstructs it."""
    import os

    from dagster import job, op

    from prx_assets.defs.executors import ray_run_executor

    @op
    def one():
        return os.getpid()

    @op
    def two(pid):
        return pid

    @job(executor_def=ray_run_executor)
    def chain():
        two(one())

    return chain


def test_definitions_load_with_the_ray_runs_executor_and_run_steps_in_process(
    tmp_path, monkeypatch
):
    """``PRX_EXECUTOR=ray_runs``: the steps of a run execute in the run's own process (on a
    cluster, a Ray job's driver); outside a Ray job the run says so and gets no Ray tags."""
    import os

    from dagster import DagsterEventType, execute_job, instance_for_test, reconstructable

    from prx_assets.definitions import build_defs
    from prx_assets.defs.executors import RAY_NODE_TAG

    monkeypatch.setenv("PRX_EXECUTOR", "ray_runs")
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    ray_defs = build_defs(str(tmp_path))
    Definitions.validate_loadable(ray_defs)
    assert ray_defs.resolve_job_def("batch_pipeline").executor_def.name == "ray_run"

    with instance_for_test() as instance:
        with execute_job(reconstructable(_ray_run_chain), instance=instance) as result:
            assert result.success
            run_id = result.run_id
        assert RAY_NODE_TAG not in instance.get_run_by_id(run_id).tags
        messages = [
            r.dagster_event.message or ""
            for r in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT)
        ]
        assert any(m.endswith(": not in a Ray job") for m in messages), messages
        pids = {
            r.dagster_event.pid
            for r in instance.all_logs(run_id, of_type=DagsterEventType.STEP_START)
        }
        assert pids == {os.getpid()}  # both steps in the run's own process


def test_prx_workers_sizes_the_per_image_pool_and_refuses_nonsense(monkeypatch):
    import pytest

    from prx_assets.defs.resources import lab_resource

    monkeypatch.delenv("PRX_WORKERS", raising=False)
    assert lab_resource("data").workers is None
    monkeypatch.setenv("PRX_WORKERS", "3")
    assert lab_resource("data").workers == 3
    for bad in ("0", "-1", "two", "1.5"):
        monkeypatch.setenv("PRX_WORKERS", bad)
        with pytest.raises(ValueError, match="PRX_WORKERS"):
            lab_resource("data")
