"""The small-bucket rule: when a bucket is too small to train on cleanly with streaming.

One rule, two readers: ``mds_shards`` reports it per bucket when it writes (every sample
written counts), the loader warns with it when it loads (kept samples only). Each states
the problem in the words of its own settings (``RuleTerms``), so a data lead reads
``canonical nodes x device batch`` in the shard metadata and a trainer reads
``num_canonical_nodes × batch_size`` in the warning, from the same thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuleTerms:
    """How a reader names what the rule counts and the settings it is judged against."""

    samples: str
    shards: str
    nodes: str
    batch: str
    times: str


SHARD_TERMS = RuleTerms("samples", "shards", "canonical nodes", "device batch", "x")


def small_bucket_problems(
    samples: int,
    shards: int,
    canonical_nodes: int,
    batch_size: int = 1,
    terms: RuleTerms = SHARD_TERMS,
) -> list[str]:
    """Why a bucket is too small to train on cleanly (empty: fine).

    A bucket needs at least ``canonical_nodes x batch_size`` samples, else streaming
    repeats samples to give every canonical node a full device batch, and at least
    ``canonical_nodes`` shards, else canonical nodes share shards and the shard locality
    that makes elastic resumption cheap (each node downloading only its share) is lost.
    """
    if canonical_nodes < 1 or batch_size < 1:
        raise ValueError(
            f"{terms.nodes} and {terms.batch} must be >= 1, got {canonical_nodes} and {batch_size}"
        )
    problems = []
    if samples < canonical_nodes * batch_size:
        problems.append(
            f"{samples} {terms.samples} < {terms.nodes} {terms.times} {terms.batch} = "
            f"{canonical_nodes} {terms.times} {batch_size}"
        )
    if shards < canonical_nodes:
        problems.append(f"{shards} {terms.shards} < {terms.nodes} = {canonical_nodes}")
    return problems
