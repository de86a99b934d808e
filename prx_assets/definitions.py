"""The single Definitions object that workspace.yaml loads."""

from dagster import Definitions

from prx_assets.defs.audit.jobs import image_audit
from prx_assets.defs.executors import configured_executor
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.ingest.sensors import landing_sensor
from prx_assets.defs.jobs import batch_pipeline_job
from prx_assets.defs.maintenance.jobs import lance_maintenance, lance_maintenance_schedule
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import LabResource, default_data_root


def build_defs(data_root: str) -> Definitions:
    """Definitions bound to one data root (the CLI and tests bind their own)."""
    return Definitions(
        assets=[raw_images, resolution_profile],
        jobs=[batch_pipeline_job, lance_maintenance, image_audit],
        sensors=[landing_sensor],
        schedules=[lance_maintenance_schedule],
        resources={"lab": LabResource(data_root=data_root)},
        executor=configured_executor(),
    )


defs = build_defs(default_data_root())
