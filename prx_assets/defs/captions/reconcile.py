"""Model swaps: find the partitions a previous backend made and rerun exactly those.

Why this exists (measured with Dagster 1.13.27): ``AutomationCondition.eager()`` ignores
code-version changes, ``code_version_changed()`` only fires when a tick already saw the old
version, and staleness has no public Python API. The lab itself knows better: every row
records the fingerprint of the backend that made it. :func:`partitions_needing_rerun`
compares those with the configured backends, and :func:`build_model_swap_sensor` requests
one run per affected partition with exactly the assets to rebuild:

- captions made by another captioner: captions and everything downstream of captions;
- classes made by another classifier (or from other captions): caption_classes only;
- embeddings made by another embedder (or from other captions): caption_embeddings only.

Partitions whose caption-stage rows are merely *missing* are left to the batch pipeline
(it may be running them right now); only rows with a different fingerprint count.
"""

from collections.abc import Mapping, Sequence

import pyarrow as pa
from dagster import AssetKey, DefaultSensorStatus, RunRequest, SensorDefinition

from prx_assets.core.captions.swaps import (
    ConfiguredFingerprints,
    StaleBatch,
    plan_reruns,
    reruns_by_batch,
    stale_batches,
    swap_run_key,
)
from prx_assets.core.lab import Lab, sql_literal
from prx_assets.core.tables import CAPTION_CLASSES, CAPTION_EMBEDDINGS, CAPTIONS
from prx_assets.defs.captions.assets import CAPTIONS_ASSET, CLASSES_ASSET, EMBEDDINGS_ASSET
from prx_assets.defs.captions.resources import (
    CaptionerResource,
    ClassifierResource,
    EmbedderResource,
)
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resources import LabResource
from prx_assets.defs.sensor_requests import rerun_sensor
from prx_assets.defs.tags import TRIGGER_TAG

#: Assets rebuilt when a partition's captions are. The lead appends later stages that read
#: captions (e.g. "mds_shards", "skip_lists") via ``build_model_swap_sensor``.
DOWNSTREAM_OF_CAPTIONS: tuple[str, ...] = (CLASSES_ASSET, EMBEDDINGS_ASSET)
ASSET_ORDER: tuple[str, ...] = (CAPTIONS_ASSET, CLASSES_ASSET, EMBEDDINGS_ASSET)


def configured_fingerprints(
    captioner: CaptionerResource, classifier: ClassifierResource, embedder: EmbedderResource
) -> ConfiguredFingerprints:
    return ConfiguredFingerprints(
        captioner=captioner.identity().fingerprint(),
        classifier=classifier.identity().fingerprint(),
        embedder=embedder.identity().fingerprint(),
    )


def _differs(column: str, value: str) -> str:
    return f"({column} != {sql_literal(value)} OR {column} IS NULL)"


def _read_differing(lab: Lab, table: str, expected: Mapping[str, str]) -> pa.Table:
    """Only the rows whose fingerprints differ (pushed down), with the columns compared."""
    if not lab.exists(table):
        return pa.table({})
    where = " OR ".join(_differs(c, v) for c, v in expected.items())
    return lab.read(table, ["batch", "created_at", *expected], filter=where)


def find_stale(lab: Lab, configured: ConfiguredFingerprints) -> dict[str, dict[str, StaleBatch]]:
    """Asset -> batch -> what differs, for the caption-stage tables (no downstream expansion).

    Comparing classes' and embeddings' ``caption_fingerprint`` with the *configured*
    captioner is equivalent to comparing with the partition's current captions: where
    those differ from the configuration the captions are stale and everything downstream
    is rebuilt anyway.
    """
    expected = {
        CAPTIONS_ASSET: (CAPTIONS.name, {"backend_fingerprint": configured.captioner}),
        CLASSES_ASSET: (
            CAPTION_CLASSES.name,
            {
                "backend_fingerprint": configured.classifier,
                "caption_fingerprint": configured.captioner,
            },
        ),
        EMBEDDINGS_ASSET: (
            CAPTION_EMBEDDINGS.name,
            {
                "backend_fingerprint": configured.embedder,
                "caption_fingerprint": configured.captioner,
            },
        ),
    }
    out = {}
    for asset, (table, columns) in expected.items():
        rows = _read_differing(lab, table, columns)
        out[asset] = stale_batches(rows, columns) if rows.num_rows else {}
    return out


def _downstream(
    of_captions: Sequence[str], of_classes: Sequence[str], of_embeddings: Sequence[str]
) -> dict[str, tuple[str, ...]]:
    return {
        CAPTIONS_ASSET: tuple(of_captions),
        CLASSES_ASSET: tuple(of_classes),
        EMBEDDINGS_ASSET: tuple(of_embeddings),
    }


def partitions_needing_rerun(
    lab: Lab,
    configured: ConfiguredFingerprints,
    downstream_of_captions: Sequence[str] = DOWNSTREAM_OF_CAPTIONS,
    downstream_of_classes: Sequence[str] = (),
    downstream_of_embeddings: Sequence[str] = (),
) -> dict[str, list[str]]:
    """Asset name -> sorted batches to rerun; assets with nothing to do are absent."""
    stale = find_stale(lab, configured)
    return plan_reruns(
        {asset: list(batches) for asset, batches in stale.items()},
        _downstream(downstream_of_captions, downstream_of_classes, downstream_of_embeddings),
    )


def build_model_swap_sensor(
    downstream_of_captions: Sequence[str] = DOWNSTREAM_OF_CAPTIONS,
    downstream_of_classes: Sequence[str] = (),
    downstream_of_embeddings: Sequence[str] = (),
    *,
    name: str = "model_swap_sensor",
    max_runs_per_tick: int = 25,
    minimum_interval_seconds: int = 300,
    default_status: DefaultSensorStatus = DefaultSensorStatus.RUNNING,
) -> SensorDefinition:
    """The swap sensor; pass later stages that must follow a re-caption in the lists.

    One run per partition, selecting the union of what is stale there (Dagster orders the
    assets). The run key names the stale materialisations and the configured fingerprints,
    so a swap is requested once; the cursor keeps the keys still pending so that partitions
    beyond ``max_runs_per_tick`` are requested on later ticks. A run that fails is not
    re-requested until its rows or the configuration change: rerun it by hand.
    """
    downstream = _downstream(
        downstream_of_captions, downstream_of_classes, downstream_of_embeddings
    )
    targets = list(dict.fromkeys([*ASSET_ORDER, *(a for d in downstream.values() for a in d)]))

    def wanted(
        context,
        lab: LabResource,
        captioner: CaptionerResource,
        classifier: ClassifierResource,
        embedder: EmbedderResource,
    ) -> list[RunRequest]:
        configured = configured_fingerprints(captioner, classifier, embedder)
        registered = set(context.instance.get_dynamic_partitions(BATCHES.name))
        stale = {
            asset: {b: s for b, s in batches.items() if b in registered}
            for asset, batches in find_stale(lab.lab(), configured).items()
        }
        plan = plan_reruns({a: list(b) for a, b in stale.items()}, downstream)
        requests = []
        for batch, assets in reruns_by_batch(plan, targets).items():
            markers = [f"{a}:{s[batch].marker}" for a, s in stale.items() if batch in s]
            markers.append(f"configured:{configured}")
            requests.append(
                RunRequest(
                    run_key=swap_run_key(batch, assets, markers),
                    partition_key=batch,
                    asset_selection=[AssetKey(a) for a in assets],
                    tags={TRIGGER_TAG: "model_swap"},
                )
            )
        return requests

    return rerun_sensor(
        wanted,
        name=name,
        targets=targets,
        description=(
            "Requests reruns of exactly the caption-stage partitions whose stored rows were "
            "made by a backend other than the configured one (a model/prompt/param swap)."
        ),
        max_runs_per_tick=max_runs_per_tick,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
    )


model_swap_sensor = build_model_swap_sensor()
