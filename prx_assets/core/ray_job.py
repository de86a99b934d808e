"""Where this process runs when it is a submitted Ray job's driver (``PRX_EXECUTOR=ray_runs``).

With dagster-ray's ``RayRunLauncher`` each Dagster run is a Ray job: Ray's job supervisor
(an actor, placed on whichever node has the CPUs the launcher reserves) starts the run
worker as a subprocess on its own node. That subprocess is told its job (the submission id,
in ``RAY_JOB_CONFIG_JSON_ENV_VAR``) and the cluster (``RAY_ADDRESS``), not its node; the
supervisor wrote the node into the job's record in the cluster's key-value store before it
started the subprocess. Reading that record is one small request to the head, not a
``ray.init`` (which would make this process a second driver with its own worker process).

Only used to *record* placement (a run's engine event and tags): nothing decides anything
from it, so an unreadable record is ``node_id=None``, never an error.

Imports Ray only when this process is a Ray job's driver.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for the driver
ADDRESS_ENV = "RAY_ADDRESS"


@dataclass(frozen=True)
class RayJobPlacement:
    """A Ray job driver's identity: its submission id and the node it runs on."""

    submission_id: str
    node_id: str | None  # None: the cluster's record could not be read


def submission_id() -> str | None:
    """The Ray job submission id of this process, or None when it is not a submitted job's
    driver (a local run, a test, a notebook)."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        value = json.loads(raw).get("metadata", {}).get("job_submission_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def current_placement(timeout: float = 10.0) -> RayJobPlacement | None:
    """The submission id and node of this Ray job driver; None when not one.

    The node id is what the job supervisor recorded (``JobInfo.driver_node_id``); it is
    written before the driver starts, so one read normally suffices; a few retries cover a
    head that is slow to answer.
    """
    sid = submission_id()
    address = os.environ.get(ADDRESS_ENV)
    if sid is None or not address or "://" in address or address == "auto":
        return None if sid is None else RayJobPlacement(sid, None)
    try:
        from ray._private import ray_constants
        from ray._raylet import GcsClient
        from ray.dashboard.modules.job.common import JobInfoStorageClient

        gcs = GcsClient(address=address)
        key = JobInfoStorageClient.JOB_DATA_KEY.format(job_id=sid).encode()
        deadline = time.monotonic() + timeout
        while True:
            raw = gcs.internal_kv_get(key, ray_constants.KV_NAMESPACE_JOB, timeout=timeout)
            node = json.loads(raw).get("driver_node_id") if raw else None
            if node or time.monotonic() > deadline:
                return RayJobPlacement(sid, node if isinstance(node, str) else None)
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - a record only: an unreadable one is "unknown"
        return RayJobPlacement(sid, None)
