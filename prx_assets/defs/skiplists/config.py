"""Resources of the skip-list stage: the skip policy, and where opt-out lists land.

The policy's fingerprint is part of ``skip_lists``' code version (see
``build_skiplist_assets``), so changing it marks exactly that asset stale; the policy
sensor then reruns it for the partitions decided under another policy.
"""

import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Literal

from dagster import Config, ConfigurableResource
from pydantic import Field

from prx_assets.core.ingest.signals import UsagePolicy, UsagePolicyError
from prx_assets.core.skiplists.intake import MALFORMED_REJECT
from prx_assets.core.skiplists.optouts import DEFAULT_MAX_LINE_BYTES, DEFAULT_SOURCE
from prx_assets.core.skiplists.policy import (
    DEFAULT_EXCLUDED_CLASSES,
    EXCLUDABLE_CLASSES,
    SkipPolicy,
    SkipPolicyError,
)
from prx_assets.core.skiplists.reruns import DEFAULT_MAX_BRIDGE, DEFAULT_PARTITIONS_PER_RUN
from prx_assets.defs.resources import LabResource

DEFAULT_OPTOUTS_DIRNAME = "optouts"
DEFAULT_MAX_NO_CAPTION_SHARE = 0.05
USAGE_POLICY_FILENAME = "usage_policy.json"  # <data_root>/usage_policy.json (build_defs)
MAX_USAGE_POLICY_BYTES = 1024 * 1024


def load_usage_policy(path: str | None) -> UsagePolicy:
    """The per-source usage-signal policy in ``path``; no path or no file: honour every
    signal everywhere (the default). A file that exists but cannot be read or parsed is an
    error, never the default: a broken policy must not quietly change what is honoured."""
    if path is None or not os.path.exists(path):
        return UsagePolicy()
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_USAGE_POLICY_BYTES + 1)
    except OSError as exc:
        raise SkipPolicyError(f"usage policy {path}: unreadable: {exc.strerror}") from None
    if len(raw) > MAX_USAGE_POLICY_BYTES:
        raise SkipPolicyError(f"usage policy {path}: over {MAX_USAGE_POLICY_BYTES:,} bytes")
    try:
        return UsagePolicy.from_json(raw)
    except UsagePolicyError as exc:
        raise SkipPolicyError(f"usage policy {path}: {exc}") from None


class SkipPolicyResource(ConfigurableResource):
    """What, besides opt-outs (always applied, to every copy), removes a written sample."""

    excluded_classes: list[str] = Field(
        default=sorted(DEFAULT_EXCLUDED_CLASSES),
        description=f"Caption classes to skip, from {list(EXCLUDABLE_CLASSES)}.",
    )
    skip_duplicates: bool = Field(
        default=True,
        description=(
            "Train one copy per pHash cluster: the best eligible one by the keeper rule; "
            "the others are skipped as 'duplicate'."
        ),
    )
    skip_low_information: bool = Field(
        default=True,
        description="Skip near-flat images (phash_clusters.low_information) as 'low_information'.",
    )
    usage_policy_file: str | None = Field(
        default=None,
        description=(
            "JSON file of per-source rules for the opt-out signals captured at ingest "
            "(X-Robots-Tag, tdm-reservation, Content-Usage): which a source honours, what a "
            "malformed one means. None or a missing file: every signal honoured, malformed "
            "ones reserve. Its content is part of the policy fingerprint."
        ),
    )
    max_no_caption_share: float = Field(
        default=DEFAULT_MAX_NO_CAPTION_SHARE,
        description=(
            "The caption-coverage check fails (ERROR) when more than this share of a batch's "
            "eligible images has no usable caption. Not a decision setting: changing it "
            "reruns nothing."
        ),
    )

    def policy(self) -> SkipPolicy:
        return SkipPolicy(
            excluded_classes=frozenset(self.excluded_classes),
            skip_duplicates=self.skip_duplicates,
            skip_low_information=self.skip_low_information,
            usage=load_usage_policy(self.usage_policy_file),
        )

    def fingerprint(self) -> str:
        return self.policy().fingerprint()


class OptOutSource(Config):
    """How the lists of one source (a registry, a legal desk) are taken in: its files are
    the ones whose name matches ``pattern``."""

    pattern: str = Field(description="Glob over the list file's name, e.g. 'dntr-*.parquet'.")
    name: str = Field(
        default=DEFAULT_SOURCE,
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9._-]+$",
        description=(
            "The source's name, recorded with each of its lists: a withdrawal withdraws only "
            "opt-outs of lists of the same name."
        ),
    )
    allow_withdrawals: bool = Field(
        default=False,
        description=(
            "Whether this source's lists may withdraw its own earlier opt-outs (an 'action' "
            "column of 'withdraw'); a list with a withdrawal from any other source is rejected."
        ),
    )
    max_list_bytes: int | None = Field(
        default=None,
        ge=1,
        description=(
            "A list file of this source over this size is rejected whole (too_large), "
            "unparsed. None: no limit (the list is streamed; memory follows the chunk)."
        ),
    )
    on_malformed: Literal["reject", "record"] = Field(
        default=MALFORMED_REJECT,
        description=(
            "reject (fail closed): a list with any malformed entry is rejected and none of it "
            "applies. record: only where the source says so (a registry dump): each "
            "malformed entry is recorded with its line in opt_out_problems, the rest applies."
        ),
    )


class OptOutResource(ConfigurableResource):
    """Where the opt-out sensor looks for new lists, and how many it takes per tick."""

    landing_dir: str | None = Field(
        default=None,
        description="Directory of opt-out list files; default <data_root>/optouts.",
    )
    max_lists_per_tick: int = Field(
        default=8, description="New lists handled per tick; the rest wait for the next one."
    )
    max_list_bytes: int | None = Field(
        default=None,
        ge=1,
        description=(
            "For lists no source matches: a file over this size is rejected whole "
            "(too_large), unparsed. None (default): no limit, the list is streamed."
        ),
    )
    sources: list[OptOutSource] = Field(
        default_factory=list,
        description=(
            "Per-source intake settings, the first whose pattern matches a list's file name "
            "wins; other lists get max_list_bytes and on_malformed=reject."
        ),
    )
    max_line_bytes: int = Field(
        default=DEFAULT_MAX_LINE_BYTES,
        description="A txt/CSV line or parquet cell over this rejects the list (entry_too_long).",
    )
    max_partitions_per_run: int = Field(
        default=DEFAULT_PARTITIONS_PER_RUN,
        ge=1,
        description=(
            "skip_lists partitions one run of a list's reruns covers at most: the partitions a "
            "list reaches run as ranges of partitions, each partition its own materialisation."
        ),
    )
    max_bridge: int = Field(
        default=DEFAULT_MAX_BRIDGE,
        ge=0,
        description=(
            "Partitions a list does not reach that one run may rerun between two it reaches "
            "(idempotent: they are re-decided on the current facts) rather than start another run."
        ),
    )

    def source_for(self, file_name: str) -> OptOutSource:
        """The intake settings of the list file ``file_name`` (its printable name)."""
        for source in self.sources:
            if fnmatchcase(file_name, source.pattern):
                return source
        return OptOutSource(pattern="*", max_list_bytes=self.max_list_bytes)

    def directory(self, lab: LabResource) -> Path:
        return Path(self.landing_dir or os.path.join(lab.data_root, DEFAULT_OPTOUTS_DIRNAME))
