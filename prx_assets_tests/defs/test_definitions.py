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
        assert isinstance(pdef, DynamicPartitionsDefinition), key
        assert pdef.name == BATCHES.name, key


def test_lineage_resolution_profile_reads_raw_images():
    graph = defs.resolve_asset_graph()
    assert AssetKey("raw_images") in graph.get(AssetKey("resolution_profile")).parent_keys


def test_jobs_sensors_and_the_maintenance_schedule_is_off_by_default():
    from dagster import DefaultScheduleStatus

    assert defs.resolve_job_def("batch_pipeline") is not None
    assert defs.resolve_job_def("lance_maintenance") is not None
    assert defs.get_sensor_def("landing_sensor") is not None
    schedule = defs.get_schedule_def("lance_maintenance_schedule")
    assert schedule.default_status == DefaultScheduleStatus.STOPPED
