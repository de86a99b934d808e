"""The one partitioning of the graph: an ingest batch (a source x a chunk)."""

from dagster import DynamicPartitionsDefinition

BATCHES = DynamicPartitionsDefinition(name="batches")
