"""The single Definitions object that workspace.yaml loads."""

import os

from dagster import Definitions

from prx_assets.defs.audit.jobs import image_audit
from prx_assets.defs.captions.assets import build_caption_assets
from prx_assets.defs.captions.reconcile import build_model_swap_sensor
from prx_assets.defs.captions.resources import (
    CaptionerResource,
    ClassifierResource,
    EmbedderResource,
)
from prx_assets.defs.dedup.assets import build_dedup_assets
from prx_assets.defs.dedup.config import DedupConfigResource
from prx_assets.defs.dedup.sensors import build_dedup_sensor
from prx_assets.defs.executors import configured_executor
from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.ingest.sensors import landing_sensor
from prx_assets.defs.jobs import batch_pipeline_job
from prx_assets.defs.maintenance.jobs import lance_maintenance, lance_maintenance_schedule
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets.defs.resources import default_data_root, lab_resource
from prx_assets.defs.shards.assets import bucket_assignments, mds_shards
from prx_assets.defs.skiplists.assets import build_skiplist_assets
from prx_assets.defs.skiplists.config import (
    USAGE_POLICY_FILENAME,
    OptOutResource,
    SkipPolicyResource,
)
from prx_assets.defs.skiplists.intake import opt_out_lists, usage_policy
from prx_assets.defs.skiplists.jobs import opt_out_intake_job, opt_out_skip_lists_job
from prx_assets.defs.skiplists.sensors import (
    build_opt_out_sensor,
    build_skip_dirty_sensor,
    build_skip_policy_sensor,
)
from prx_assets.defs.snapshots.assets import opt_out_compliance, training_snapshots
from prx_assets.defs.snapshots.jobs import retire_training_snapshot, snapshot_diff


def backends_from_env() -> tuple[CaptionerResource, ClassifierResource]:
    """Choose the model backends from the environment (defaults: the offline fallbacks).

    PRX_CAPTIONER=alt_text|openai|transformers, PRX_CAPTION_MODEL, PRX_CAPTION_BASE_URL;
    PRX_CLASSIFIER=embedding|openai|transformers, PRX_CLASSIFIER_MODEL,
    PRX_CLASSIFIER_BASE_URL. API keys are read by the backends from PRX_CAPTION_API_KEY /
    PRX_CLASSIFIER_API_KEY (or OPENAI_API_KEY) at run time and never stored.
    """
    env = os.environ
    captioner = CaptionerResource(
        backend=env.get("PRX_CAPTIONER", "alt_text"),
        model=env.get("PRX_CAPTION_MODEL") or None,
        base_url=env.get("PRX_CAPTION_BASE_URL") or None,
    )
    classifier = ClassifierResource(
        backend=env.get("PRX_CLASSIFIER", "embedding"),
        model=env.get("PRX_CLASSIFIER_MODEL") or None,
        base_url=env.get("PRX_CLASSIFIER_BASE_URL") or None,
    )
    return captioner, classifier


# What each kind of change must rerun, besides the asset it changes (lineage for swaps).
DOWNSTREAM_OF_CAPTIONS = ("caption_classes", "caption_embeddings", "mds_shards", "skip_lists")
DOWNSTREAM_OF_CLASSES = ("skip_lists",)
DOWNSTREAM_OF_DEDUP = ("skip_lists",)


def build_defs(
    data_root: str,
    captioner: CaptionerResource | None = None,
    classifier: ClassifierResource | None = None,
    embedder: EmbedderResource | None = None,
    dedup: DedupConfigResource | None = None,
    skip_policy: SkipPolicyResource | None = None,
    optouts: OptOutResource | None = None,
) -> Definitions:
    """Definitions bound to one data root, one set of model backends and one policy.

    Each configuration's fingerprint becomes the code version of the assets it drives and
    is stored on every row they write, so a swap (a different resource here) makes exactly
    those assets stale, and the project's sensors rerun exactly the partitions whose rows
    were made otherwise. Defaults are the offline fallbacks (alt text, embedding zero-shot,
    bundled MiniLM), dedup at Hamming radius 0, and excluding the text and nsfw classes.
    """
    env_captioner, env_classifier = backends_from_env()
    captioner = captioner or env_captioner
    classifier = classifier or env_classifier
    embedder = embedder or EmbedderResource()
    dedup = dedup or DedupConfigResource()
    skip_policy = skip_policy or SkipPolicyResource(
        usage_policy_file=os.path.join(data_root, USAGE_POLICY_FILENAME)
    )
    return Definitions(
        assets=[
            raw_images,
            resolution_profile,
            *build_caption_assets(captioner, classifier, embedder),
            *build_dedup_assets(dedup),
            bucket_assignments,
            mds_shards,
            *build_skiplist_assets(skip_policy),
            opt_out_lists,
            usage_policy,
            training_snapshots,
        ],
        asset_checks=[opt_out_compliance],
        jobs=[
            batch_pipeline_job,
            opt_out_intake_job,
            opt_out_skip_lists_job,
            lance_maintenance,
            image_audit,
            retire_training_snapshot,
            snapshot_diff,
        ],
        sensors=[
            landing_sensor,
            build_model_swap_sensor(
                downstream_of_captions=DOWNSTREAM_OF_CAPTIONS,
                downstream_of_classes=DOWNSTREAM_OF_CLASSES,
            ),
            build_dedup_sensor(downstream=DOWNSTREAM_OF_DEDUP),
            build_opt_out_sensor(),
            build_skip_policy_sensor(),
            build_skip_dirty_sensor(),
        ],
        schedules=[lance_maintenance_schedule],
        resources={
            "lab": lab_resource(data_root),  # PRX_*_URI may move parts to s3://
            "captioner": captioner,
            "classifier": classifier,
            "embedder": embedder,
            "dedup": dedup,
            "skip_policy": skip_policy,
            "optouts": optouts or OptOutResource(),
        },
        executor=configured_executor(),
    )


defs = build_defs(default_data_root())
