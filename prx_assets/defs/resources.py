"""Where the platform keeps its data; configured once, shared by every stage."""

import os
from pathlib import Path

from dagster import ConfigurableResource, InitResourceContext

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS
from prx_assets.core.ingest.sources import DEFAULT_MAX_FILE_BYTES
from prx_assets.core.lab import Lab
from prx_assets.core.storage import check_bucket


def default_data_root() -> str:
    return os.environ.get("PRX_DATA_ROOT", str(Path.cwd() / "data"))


class LabResource(ConfigurableResource):
    """Paths of the landing zone, the Lance lab and the shard tree, and ingest limits.

    ``lab_uri``, ``shards_uri`` and ``landing_dir`` may be ``s3://`` URIs on any
    S3-compatible endpoint (endpoint, region and credentials from the environment, never
    from here: ``core/storage.py``); the landing sensor lists a remote landing zone.
    """

    data_root: str
    landing_dir: str | None = None
    lab_uri: str | None = None
    shards_uri: str | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    # Per input file (and per WebDataset sample), checked before reading: over it a file is
    # rejected as too_large. Default 512 MB.
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    # Processes for the per-image work of a partition (ingest validation, pHash, shard
    # rendering); None = every CPU the run's process may use. Output is the same for any.
    workers: int | None = None

    @property
    def landing(self) -> Path:
        return Path(self.landing_dir or os.path.join(self.data_root, "landing"))

    @property
    def landing_uri(self) -> str:
        """The landing zone as given: a local path or an ``s3://`` prefix (``landing`` is
        its local ``Path`` form, meaningless for a URI)."""
        return self.landing_dir or os.path.join(self.data_root, "landing")

    @property
    def lab_root(self) -> str:
        return self.lab_uri or os.path.join(self.data_root, "lab")

    @property
    def shards_root(self) -> str:
        return self.shards_uri or os.path.join(self.data_root, "shards")

    def lab(self) -> Lab:
        return Lab(self.lab_root)

    def setup_for_execution(self, context: InitResourceContext) -> None:
        """Refuse at set-up a deployment whose bucket was never created (``BucketMissing``
        names it and says how to create it), before any step reads or writes."""
        for uri in (self.landing_uri, self.lab_root, self.shards_root):
            check_bucket(uri)


LANDING_URI_VAR = "PRX_LANDING_URI"
LAB_URI_VAR = "PRX_LAB_URI"
SHARDS_URI_VAR = "PRX_SHARDS_URI"
WORKERS_VAR = "PRX_WORKERS"


def workers_from_env() -> int | None:
    """``PRX_WORKERS``: processes for a run's per-image work (unset: every CPU the run may
    use). Where several runs share a node (``PRX_EXECUTOR=ray_runs``, the launcher's
    ``num_cpus`` below the node's cores) it is that ``num_cpus``, so the runs placed on a
    node do not oversubscribe it. Anything but a positive integer is refused."""
    raw = os.environ.get(WORKERS_VAR, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{WORKERS_VAR} must be a positive integer, not {raw!r}")
    return int(raw)


def lab_resource(data_root: str) -> LabResource:
    """The lab resource of a deployment: ``data_root``, with the landing zone, the lab and
    the shard tree moved wherever ``PRX_LANDING_URI`` / ``PRX_LAB_URI`` / ``PRX_SHARDS_URI``
    say (local paths or ``s3://`` URIs; credentials stay in the environment), and the
    per-image pool sized by ``PRX_WORKERS``."""
    return LabResource(
        data_root=data_root,
        landing_dir=os.environ.get(LANDING_URI_VAR) or None,
        lab_uri=os.environ.get(LAB_URI_VAR) or None,
        shards_uri=os.environ.get(SHARDS_URI_VAR) or None,
        workers=workers_from_env(),
    )
