"""The per-image audit as a Dagster job: launch it from the UI with any identifier."""

from dagster import Config, MetadataValue, OpExecutionContext, Output, job, op

from prx_assets.core.audit import audit_image
from prx_assets.defs.metadata import bounded
from prx_assets.defs.resources import LabResource


class AuditConfig(Config):
    """Which image to audit."""

    # A content key, an original URL, `source:id`, a landing path or a path inside a batch.
    query: str


@op(
    description=(
        "One image's verdict (in training, or since when and why not) and everything the lab "
        "knows about it, table by table, with Lance versions."
    )
)
def audit_one_image(context: OpExecutionContext, config: AuditConfig, lab: LabResource):
    trail = audit_image(lab.lab(), config.query, landing=lab.landing, shards_root=lab.shards_root)
    context.log.info(f"{bounded(config.query, 200)!r}: {bounded(trail.verdict, 400)}")
    return Output(
        trail.keys,
        metadata={
            "verdict": MetadataValue.text(trail.verdict),
            "status": trail.status,
            "found": trail.found,
            "copies": MetadataValue.json([c.to_dict() for c in trail.copies]),
            "keys": MetadataValue.json(trail.keys),
            "lance_versions": MetadataValue.json(trail.versions),
            "trail": MetadataValue.md(trail.to_markdown()),
        },
    )


@job(description="Per-image audit trail (config: query = key, URL, source:id or landing path).")
def image_audit():
    audit_one_image()
