"""The per-image audit as a Dagster job: launch it from the UI with a key, URL or source id."""

from dagster import Config, MetadataValue, OpExecutionContext, Output, job, op

from prx_assets.core.audit import audit_image
from prx_assets.defs.resources import LabResource


class AuditConfig(Config):
    query: str  # a sha256 content key, an original URL or a source-specific id


@op(description="Everything the lab knows about one image, table by table, with Lance versions.")
def audit_one_image(context: OpExecutionContext, config: AuditConfig, lab: LabResource):
    trail = audit_image(lab.lab(), config.query)
    if not trail.found:
        context.log.warning(f"{config.query!r} is not in any lab table")
    return Output(
        trail.keys,
        metadata={
            "found": trail.found,
            "keys": MetadataValue.json(trail.keys),
            "lance_versions": MetadataValue.json(trail.versions),
            "trail": MetadataValue.md(trail.to_markdown()),
        },
    )


@job(description="Per-image audit trail (config: query = key, URL or source id).")
def image_audit():
    audit_one_image()
