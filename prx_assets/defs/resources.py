"""Where the platform keeps its data; configured once, shared by every stage."""

import os
from pathlib import Path

from dagster import ConfigurableResource

from prx_assets.core.ingest.decode import DEFAULT_MAX_PIXELS
from prx_assets.core.ingest.sources import DEFAULT_MAX_FILE_BYTES
from prx_assets.core.lab import Lab


def default_data_root() -> str:
    return os.environ.get("PRX_DATA_ROOT", str(Path.cwd() / "data"))


class LabResource(ConfigurableResource):
    """Paths of the landing zone, the Lance lab and the shard tree, and ingest limits.

    ``lab_uri`` and ``shards_uri`` may be object-store URIs (s3://, gs://) in a shared
    deployment; the landing zone is a local or mounted directory watched by a sensor.
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
    def lab_root(self) -> str:
        return self.lab_uri or os.path.join(self.data_root, "lab")

    @property
    def shards_root(self) -> str:
        return self.shards_uri or os.path.join(self.data_root, "shards")

    def lab(self) -> Lab:
        return Lab(self.lab_root)
