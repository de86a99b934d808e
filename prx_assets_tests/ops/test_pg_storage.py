"""The project's PostgreSQL storage (``prx_assets/pg_storage.py``) on a real server: the
same answers as Dagster's own storage, without a catalog query per call once the schema
is known nor a new connection per call, and every process handed the instance reference
builds the same classes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import sqlalchemy as db
from dagster import DagsterInstance, instance_for_test, materialize

from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.pg_storage import (
    PrxPostgresEventLogStorage,
    PrxPostgresRunStorage,
    PrxPostgresScheduleStorage,
    _RemembersSchema,
    pool_size_from_env,
)
from prx_assets_tests.pg_server import dagster_storage


@contextlib.contextmanager
def _catalog_queries(*storages) -> Iterator[list[str]]:  # noqa: ANN002
    """Statements the storages' engines send that read PostgreSQL's catalog."""
    seen: list[str] = []

    def record(conn, cursor, statement, *args) -> None:  # noqa: ANN001, ANN002
        if "pg_catalog" in statement or "information_schema" in statement:
            seen.append(statement)

    # the storages' engines (the project's share one per process; Dagster's have three)
    engines = list({id(s._engine): s._engine for s in storages}.values())  # noqa: SLF001
    for engine in engines:
        db.event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        for engine in engines:
            db.event.remove(engine, "before_cursor_execute", record)


def _calls(instance: DagsterInstance, run_id: str) -> list:
    """Calls whose Dagster implementation probes the schema each time."""
    return [
        instance.get_run_records(limit=5),
        instance.get_run_records(limit=5),
        instance.get_dynamic_partitions(BATCHES.name),
        instance.get_dynamic_partitions(BATCHES.name),
        instance.get_latest_materialization_event(raw_images.key),
        instance.run_storage.has_backfill_id_column(),
        instance.run_storage.has_bulk_actions_selector_cols(),
        instance.schedule_storage.has_secondary_index_table(),
        instance.get_run_by_id(run_id).status,
    ]


def test_answers_match_dagster_and_the_catalog_is_asked_once(postgres_database, lab_resource):
    overrides = dagster_storage(postgres_database)
    with instance_for_test(overrides=overrides) as instance:
        assert isinstance(instance.run_storage, PrxPostgresRunStorage)
        assert isinstance(instance.event_log_storage, PrxPostgresEventLogStorage)
        assert isinstance(instance.schedule_storage, PrxPostgresScheduleStorage)
        key = "public-sklearn.001"
        instance.add_dynamic_partitions(BATCHES.name, [key])
        result = materialize(
            [raw_images], partition_key=key, instance=instance, resources={"lab": lab_resource}
        )
        assert result.success

        # Every process given the instance's reference (run workers, code servers) builds
        # the project's classes, on the same database.
        again = DagsterInstance.from_ref(instance.get_ref())
        assert isinstance(again.run_storage, PrxPostgresRunStorage)
        assert isinstance(again.event_log_storage, PrxPostgresEventLogStorage)
        assert isinstance(again.schedule_storage, PrxPostgresScheduleStorage)

        storages = (again.run_storage, again.event_log_storage, again.schedule_storage)
        with _catalog_queries(*storages) as first:
            answers = _calls(again, result.run_id)
        with _catalog_queries(*storages) as repeated:
            assert _calls(again, result.run_id) == answers
        assert first, "the first calls ask the catalog (the probes run once)"
        assert repeated == [], repeated

    # Dagster's own storage on the same database: the same answers, and the catalog asked
    # again on every call (what the project's classes save; if Dagster stops asking, this
    # module can go).
    plain = {"storage": {"postgres": overrides["storage"]["custom"]["config"]}}
    with instance_for_test(overrides=plain) as theirs:
        assert type(theirs.run_storage).__name__ == "PostgresRunStorage"
        storages = (theirs.run_storage, theirs.event_log_storage, theirs.schedule_storage)
        _calls(theirs, result.run_id)
        with _catalog_queries(*storages) as repeated:
            assert _calls(theirs, result.run_id) == answers
        assert len(repeated) >= 4, repeated


def test_only_a_yes_is_remembered() -> None:
    """A missing column or table (an instance before a migration) is asked again every
    time, so the answer turns to yes once ``dagster instance migrate`` added it."""

    class Probe(_RemembersSchema):
        def __init__(self) -> None:  # no storage behind it: the memo alone
            pass

    answers = iter([False, False, True])
    asked = []

    def probe() -> bool:
        asked.append(1)
        return next(answers)

    storage = Probe()
    assert [storage._present(("runs", "x"), probe) for _ in range(5)] == [  # noqa: SLF001
        False,
        False,
        True,
        True,
        True,
    ]
    assert len(asked) == 3


@contextlib.contextmanager
def _new_connections(engine) -> Iterator[list[int]]:  # noqa: ANN001
    """Connections the engine opens to the server while the block runs."""
    opened: list[int] = []

    def record(dbapi_conn, record) -> None:  # noqa: ANN001
        opened.append(1)

    db.event.listen(engine, "connect", record)
    try:
        yield opened
    finally:
        db.event.remove(engine, "connect", record)


def _terminate_other_backends(pg: dict) -> int:
    """What a server restart does to the pool's connections: every other backend ends."""
    import psycopg2

    conn = psycopg2.connect(host=pg["host"], port=pg["port"], user=pg["user"], dbname=pg["db"])
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (pg["db"],),
        )
        (ended,) = cur.fetchone()
    conn.close()
    return ended


def test_one_pooled_connection_per_process_survives_a_restart_and_a_fork(
    postgres_database, monkeypatch
):
    monkeypatch.delenv("PRX_PG_POOL_SIZE", raising=False)
    overrides = dagster_storage(postgres_database)
    with instance_for_test(overrides=overrides) as instance:
        engines = {
            id(s._engine)  # noqa: SLF001
            for s in (instance.run_storage, instance.event_log_storage, instance.schedule_storage)
        }
        again = DagsterInstance.from_ref(instance.get_ref())
        assert {id(again.run_storage._engine)} == engines  # noqa: SLF001 - one per process
        engine = again.run_storage._engine  # noqa: SLF001
        assert isinstance(engine.pool, db.pool.QueuePool)
        instance.add_dynamic_partitions(BATCHES.name, ["k.1"])

        with _new_connections(engine) as opened:
            for _ in range(20):
                assert again.get_dynamic_partitions(BATCHES.name) == ["k.1"]
                again.get_run_records(limit=1)
        assert len(opened) <= 1, opened  # Dagster's own storage opens one per call

        # The server drops every connection (as a restart does): the next call reconnects.
        assert _terminate_other_backends(postgres_database) >= 1
        assert again.get_dynamic_partitions(BATCHES.name) == ["k.1"]

        # A forked child uses connections of its own; the parent's keep working after it.
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports by exit status
            code = 1
            try:
                child = DagsterInstance.from_ref(instance.get_ref())
                child.add_dynamic_partitions(BATCHES.name, ["k.2"])
                code = 0 if len(child.get_dynamic_partitions(BATCHES.name)) == 2 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert again.get_dynamic_partitions(BATCHES.name) == ["k.1", "k.2"]


def test_pool_size_zero_is_dagsters_connection_per_call_and_bad_values_are_refused(
    postgres_database, monkeypatch
):
    monkeypatch.setenv("PRX_PG_POOL_SIZE", "0")
    with instance_for_test(overrides=dagster_storage(postgres_database)) as instance:
        assert isinstance(instance.run_storage._engine.pool, db.pool.NullPool)  # noqa: SLF001
    monkeypatch.setenv("PRX_PG_POOL_SIZE", "-1")
    with pytest.raises(ValueError, match="PRX_PG_POOL_SIZE"):
        pool_size_from_env()
