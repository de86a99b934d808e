"""Executors: in-process/multiprocess here, one Kubernetes job per step in a cluster.

``PRX_EXECUTOR=k8s`` switches the Definitions to dagster-k8s's ``k8s_job_executor``. Each
step (one asset partition) then runs in its own pod from ``PRX_K8S_IMAGE``; GPU-bound steps
(pool "gpu": captions, caption classes) get a GPU through ``per_step_k8s_config`` so a
fleet of captioning pods scales independently of the CPU stages.

``PRX_EXECUTOR=ray`` keeps the steps in the multiprocess executor here and sends their
per-image work to the Ray cluster ``RAY_ADDRESS`` names, as Ray tasks from the core runners
(``core/workers.py``, ``core/ray_pool.py``); Ray is not imported to build the Definitions.
dagster-ray's executor is not used: it submits every step as a Ray *job*, which needs the
Ray dashboard's job server and a run storage every node reaches.
"""

import os

from dagster import ExecutorDefinition, multiprocess_executor
from dagster_k8s import k8s_job_executor

GPU_STEPS = ("captions", "caption_classes")
KNOWN_STEPS = frozenset(
    ("raw_images", "resolution_profile", "image_hashes", "phash_clusters", "bucket_assignments")
    + ("captions", "caption_classes", "caption_embeddings", "mds_shards", "skip_lists")
)


def gpu_steps() -> tuple[str, ...]:
    """The steps whose pods request a GPU: ``PRX_K8S_GPU_STEPS`` (comma-separated), default
    the in-process model steps. Empty (``PRX_K8S_GPU_STEPS=``) when captions and classes come
    from a remote vLLM fleet: those steps then only make HTTP calls."""
    raw = os.environ.get("PRX_K8S_GPU_STEPS")
    if raw is None:
        return GPU_STEPS
    steps = tuple(s.strip() for s in raw.split(",") if s.strip())
    unknown = sorted(set(steps) - KNOWN_STEPS)
    if unknown:
        raise ValueError(
            f"PRX_K8S_GPU_STEPS names unknown steps {unknown}; known: {sorted(KNOWN_STEPS)}"
        )
    return steps


def k8s_executor_config() -> dict:
    gpu = {
        "container_config": {
            "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "4"}}
        }
    }
    return {
        "job_image": os.environ.get("PRX_K8S_IMAGE", "prx-assets:latest"),
        "job_namespace": os.environ.get("PRX_K8S_NAMESPACE", "prx-data"),
        "env_config_maps": ["prx-assets-env"],
        "env_secrets": ["prx-assets-secrets"],  # API keys live in a Secret, never in config
        "max_concurrent": int(os.environ.get("PRX_K8S_MAX_CONCURRENT", "64")),
        "step_k8s_config": {
            "container_config": {"resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}
        },
        "per_step_k8s_config": {step: gpu for step in gpu_steps()},
    }


def k8s_executor() -> ExecutorDefinition:
    return k8s_job_executor.configured(k8s_executor_config(), name="k8s_job_executor")


def configured_executor() -> ExecutorDefinition:
    kind = os.environ.get("PRX_EXECUTOR", "multiprocess")
    if kind == "k8s":
        return k8s_executor()
    if kind == "multiprocess":
        return multiprocess_executor.configured({"max_concurrent": 2}, name="multiprocess")
    if kind == "ray":
        if not os.environ.get("RAY_ADDRESS"):
            raise ValueError("PRX_EXECUTOR=ray needs RAY_ADDRESS naming a running Ray cluster")
        return multiprocess_executor.configured({"max_concurrent": 2}, name="multiprocess_ray")
    raise ValueError(f"PRX_EXECUTOR must be 'multiprocess', 'k8s' or 'ray', not {kind!r}")
