"""Executors: in-process/multiprocess here, one Kubernetes job per step in a cluster.

By default (``PRX_EXECUTOR=multiprocess``) each step of a run is a process of its own,
forked from a server that loaded the code location once per run (``PRX_STEP_START``), and
a run of exactly one step runs it in the run's own process (``PRX_ONE_STEP_IN_RUN``):
``StepProcessExecutor``.

``PRX_EXECUTOR=k8s`` switches the Definitions to dagster-k8s's ``k8s_job_executor``. Each
step (one asset partition) then runs in its own pod from ``PRX_K8S_IMAGE``; GPU-bound steps
(pool "gpu": captions, caption classes) get a GPU through ``per_step_k8s_config`` so a
fleet of captioning pods scales independently of the CPU stages.

``PRX_EXECUTOR=ray`` keeps the steps in the multiprocess executor here and sends their
per-image work to the Ray cluster ``RAY_ADDRESS`` names, on its long-lived worker actors
(``core/workers.py``, ``core/ray_pool.py``), which each step's process finds warm; Ray is
not imported to build the Definitions.
dagster-ray's executor is not used: it submits every step as a Ray *job*, which needs the
Ray dashboard's job server and a run storage every node reaches.

``PRX_EXECUTOR=ray_runs`` spreads *partitions* over the cluster's nodes: the instance's run
launcher is dagster-ray's ``RayRunLauncher`` (``dagster_ray_cluster.yaml``), so each run
(one partition) is a Ray job whose driver runs on whichever node has the CPUs the launcher
reserves, and this executor runs that run's steps in that process, one after another
(``ray_run_executor``). Dagster keeps the graph, lineage and run queue (PostgreSQL, which
every node reaches); Ray places runs. A step costs no job, no process and no node probe:
that is the measured choice (``benchmarks/bench_ray_runs.py``: a Ray job per step, as
dagster-ray's executor does, costs seconds; a step inside a run costs its own work). The
per-image work of a step runs on the node's process pool (``core/workers.py``, sized by
``PRX_WORKERS``, which should match the launcher's ``num_cpus``). The run records where it
ran: tags ``prx/ray_node_id`` and ``prx/ray_submission_id`` and an engine event with the
run worker's pid, the pid every step event of the run carries.
"""

import os
from collections.abc import Iterator

from dagster import ExecutorDefinition, MetadataValue, executor
from dagster._core.definitions.executor_definition import (
    IN_PROC_CONFIG,
    MULTI_PROC_CONFIG,
    _core_in_process_executor_creation,
    _core_multiprocess_executor_creation,
    multiple_process_executor_requirements,
)
from dagster._core.events import DagsterEvent, EngineEventData
from dagster._core.execution.context.system import PlanOrchestrationContext
from dagster._core.execution.plan.plan import ExecutionPlan
from dagster._core.execution.retries import RetryMode
from dagster._core.executor.base import Executor
from dagster._core.executor.in_process import InProcessExecutor

from prx_assets.core.ray_job import current_placement

RAY_NODE_TAG = "prx/ray_node_id"
RAY_SUBMISSION_TAG = "prx/ray_submission_id"
PLACEMENT_MESSAGE = "Steps run in this run worker"  # the engine event naming the node

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
    # Imported here, not at module level: dagster-k8s brings the Kubernetes client (and
    # google-auth, cryptography): ~0.5 s of every process that loads the code location (a
    # run, each multiprocess step) when the executor is not Kubernetes.
    from dagster_k8s import k8s_job_executor

    return k8s_job_executor.configured(k8s_executor_config(), name="k8s_job_executor")


class RayRunExecutor(InProcessExecutor):
    """The in-process executor, plus a record of the Ray node and job the run ran in."""

    def execute(
        self, plan_context: PlanOrchestrationContext, execution_plan: ExecutionPlan
    ) -> Iterator[DagsterEvent]:
        placement = current_placement()
        node = (placement.node_id if placement else None) or "unknown"
        submission = placement.submission_id if placement else "not a Ray job"
        if placement is not None:
            plan_context.instance.add_run_tags(
                plan_context.run_id, {RAY_NODE_TAG: node, RAY_SUBMISSION_TAG: submission}
            )
        where = f"Ray job {submission} on Ray node {node}" if placement else "not in a Ray job"
        yield DagsterEvent.engine_event(
            plan_context,
            f"{PLACEMENT_MESSAGE} (pid {os.getpid()}): {where}",
            event_specific_data=EngineEventData(
                metadata={
                    "ray_node_id": MetadataValue.text(node),
                    "ray_submission_id": MetadataValue.text(submission),
                    "pid": MetadataValue.int(os.getpid()),
                    "steps": MetadataValue.json(list(execution_plan.step_keys_to_execute)),
                }
            ),
        )
        yield from super().execute(plan_context, execution_plan)


@executor(name="ray_run", config_schema=IN_PROC_CONFIG)
def ray_run_executor(init_context) -> RayRunExecutor:  # noqa: ANN001 - Dagster's init context
    """Steps in the run's own process (a Ray job's driver under ``RayRunLauncher``)."""
    base = _core_in_process_executor_creation(init_context.executor_config)
    return RayRunExecutor(
        retries=base.retries,
        step_dependency_config=base.step_dependency_config,
        marker_to_close=base.marker_to_close,
    )


def one_step_in_run() -> bool:
    """``PRX_ONE_STEP_IN_RUN`` (default 1): a one-step run runs its step in the run's own
    process; 0 keeps a process per step for every run."""
    raw = os.environ.get("PRX_ONE_STEP_IN_RUN", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"PRX_ONE_STEP_IN_RUN must be 0 or 1, not {raw!r}")
    return raw == "1"


class StepProcessExecutor(Executor):
    """Dagster's multiprocess executor, except that a run of exactly one step runs it in
    the run's own process.

    Why: a step process loads the code location before its first line of work (~2 s here,
    ``benchmarks/bench_code_location.py``), and a one-step run (an opt-out's ``skip_lists``
    rerun of one partition, a model swap's rerun of one asset) has nothing to run beside
    it: the run worker has loaded the code location already. Pools (the "gpu" pool's
    limit) and retries apply the same way in process (Dagster's in-process executor holds
    the instance's concurrency slots too); runs of several steps keep a process per step."""

    def __init__(self, many: Executor, one: InProcessExecutor) -> None:
        self._many, self._one = many, one

    @property
    def retries(self) -> RetryMode:
        return self._many.retries

    def execute(
        self, plan_context: PlanOrchestrationContext, execution_plan: ExecutionPlan
    ) -> Iterator[DagsterEvent]:
        if len(execution_plan.step_keys_to_execute) == 1 and one_step_in_run():
            yield DagsterEvent.engine_event(
                plan_context,
                f"One step: run in the run's own process (pid {os.getpid()})",
                event_specific_data=EngineEventData(
                    metadata={"pid": MetadataValue.int(os.getpid())}
                ),
            )
            yield from self._one.execute(plan_context, execution_plan)
        else:
            yield from self._many.execute(plan_context, execution_plan)


@executor(
    name="multiprocess",
    config_schema=MULTI_PROC_CONFIG,
    requirements=multiple_process_executor_requirements(),
)
def step_process_executor(init_context) -> StepProcessExecutor:  # noqa: ANN001 - Dagster's
    """A process per step (``multiprocess_config``); a one-step run in the run's process."""
    config = init_context.executor_config
    one = _core_in_process_executor_creation(
        {
            "retries": config["retries"],
            "step_dependency_config": config.get("step_dependency_config"),
        }
    )
    return StepProcessExecutor(_core_multiprocess_executor_creation(config), one)


# What the step processes' forkserver imports before it forks any: the Lance fork warning
# silenced first (core/forkserver_init.py), then the code location itself.
STEP_PRELOAD = ("prx_assets.core.forkserver_init", "prx_assets.definitions")


def multiprocess_config() -> dict:
    """Two steps at a time; each step a fork of a server that has loaded the code location.

    Why: with Dagster's default (``spawn``) every step is a fresh interpreter that imports
    Dagster and the code location before its first line of work (~2.2 s of CPU here,
    ``python -m benchmarks.bench_code_location``), paid by every step of every run. The
    forkserver imports them once per run; it never opens a Lance dataset or starts a
    thread, so what each step forks is an interpreter with no runtime state (the per-image
    pool has used the same start since ``core/workers.py``). ``PRX_STEP_START=spawn`` goes
    back to Dagster's default."""
    start = os.environ.get("PRX_STEP_START", "forkserver")
    if start not in ("forkserver", "spawn"):
        raise ValueError(f"PRX_STEP_START must be 'forkserver' or 'spawn', not {start!r}")
    config: dict = {"max_concurrent": 2}
    if start == "forkserver":
        config["start_method"] = {"forkserver": {"preload_modules": list(STEP_PRELOAD)}}
    return config


def configured_executor() -> ExecutorDefinition:
    kind = os.environ.get("PRX_EXECUTOR", "multiprocess")
    if kind == "k8s":
        return k8s_executor()
    if kind in ("multiprocess", "ray"):
        one_step_in_run()  # a bad setting is an error when the code location loads
    if kind == "multiprocess":
        return step_process_executor.configured(multiprocess_config(), name="multiprocess")
    if kind == "ray":
        if not os.environ.get("RAY_ADDRESS"):
            raise ValueError("PRX_EXECUTOR=ray needs RAY_ADDRESS naming a running Ray cluster")
        return step_process_executor.configured(multiprocess_config(), name="multiprocess_ray")
    if kind == "ray_runs":
        return ray_run_executor
    raise ValueError(
        f"PRX_EXECUTOR must be 'multiprocess', 'k8s', 'ray' or 'ray_runs', not {kind!r}"
    )
