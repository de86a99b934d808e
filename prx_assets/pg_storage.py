"""PostgreSQL instance storage that stops asking the server about its own schema.

Every partition run of a cluster deployment (``dagster_ray_cluster.yaml``,
``dagster_postgres.yaml``) goes through one PostgreSQL server, so its CPU per run caps how
many nodes the cluster can feed (``benchmarks/bench_cluster_ceiling.py``). The server's
statement log of that benchmark (``--pg-statements``) showed Dagster's PostgreSQL storages
(dagster-postgres 0.29.27, pinned) spending about half of the server's statement time on
*catalog* queries: SQLAlchemy's reflection of the ``runs`` and ``asset_keys`` columns on
every run-records query and every stored asset event (``has_run_stats_index_cols``,
``_has_asset_key_col_on_connection``: four catalog queries each, the column query
9.6-11.2 ms of logged server time on average in two such logs), and a ``has_table``
catalog query before every dynamic-partition, asset check and event-tag query. Dagster
asks because an instance may predate a migration.

This module's storages are Dagster's own with those probes remembered: an answer of *yes*
(the column or table exists) is kept for the life of the storage object, an answer of *no*
is asked again every time. That is exact, not a cache that can go stale: Dagster's
migrations only ever add tables and columns (``dagster instance migrate``), so a yes stays
true under a running process, while a no may become a yes after a migration and is
re-checked as before. Everything else, queries and connections included, is Dagster's
code unchanged.

The same log showed the other cost: Dagster's storages open a new connection for every call
(``NullPool``: every stored event, every query; 2,758 connections in 93 s of a four-run
window), and a connection costs the server its backend's fork, start and exit (4.0 ms of
CPU in ``bench_cluster_ceiling --quick``, a line of its output). These storages share
one pooled engine per process and database instead (``PRX_PG_POOL_SIZE`` connections kept
open, default 1; more are opened for concurrent calls and closed after; 0 restores
Dagster's connection per call). Connections are checked before reuse (a restarted server
costs a reconnect, not an error) and recycled hourly; a forked child never uses its
parent's (the pool is replaced in the child). Each process of a deployment (the daemon,
the code server, the webserver, every running run worker) then holds ``PRX_PG_POOL_SIZE``
connections while idle: PostgreSQL's ``max_connections`` must exceed the run queue's
``max_concurrent_runs`` plus a few (docs/deploy.md). A deployment that authenticates with
a token provider keeps Dagster's connection per call (a token may expire).

Configured in ``dagster.yaml`` as ``storage: custom`` with the same ``postgres_db`` block as
``storage: postgres``; the instance reference handed to run workers and code servers names
these classes too, so every process of the deployment uses them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import sqlalchemy
from dagster._config.config_schema import UserConfigSchema
from dagster._core.storage.config import pg_config
from dagster._serdes import ConfigurableClassData
from dagster_postgres import (
    DagsterPostgresStorage,
    PostgresEventLogStorage,
    PostgresRunStorage,
    PostgresScheduleStorage,
)
from dagster_postgres.utils import (
    create_pg_engine,
    get_token_provider_from_config,
    pg_url_from_config,
)

MODULE = __name__
POOL_SIZE_ENV = "PRX_PG_POOL_SIZE"
DEFAULT_POOL_SIZE = 1
MAX_OVERFLOW = 32  # connections beyond the kept ones while calls run at once (closed after)
RECYCLE_S = 3600

_engines: dict[str, sqlalchemy.engine.Engine] = {}
_engines_lock = threading.Lock()


def pool_size_from_env() -> int:
    """``PRX_PG_POOL_SIZE``: connections each process keeps open (0: one per call, as
    Dagster does). Anything but a non-negative integer is refused."""
    raw = os.environ.get(POOL_SIZE_ENV, "").strip()
    if not raw:
        return DEFAULT_POOL_SIZE
    if not raw.isdigit():
        raise ValueError(f"{POOL_SIZE_ENV} must be a non-negative integer, not {raw!r}")
    return int(raw)


def shared_engine(postgres_url: str, pool_size: int) -> sqlalchemy.engine.Engine:
    """The process's pooled engine for ``postgres_url`` (one for every storage and every
    instance the process opens, so the connections it keeps are bounded)."""
    with _engines_lock:
        engine = _engines.get(postgres_url)
        if engine is None:
            engine = create_pg_engine(
                postgres_url,
                None,
                isolation_level="AUTOCOMMIT",  # as Dagster's: transactions are explicit
                poolclass=sqlalchemy.pool.QueuePool,
                pool_size=pool_size,
                max_overflow=MAX_OVERFLOW,
                pool_pre_ping=True,
                pool_recycle=RECYCLE_S,
            )
            _engines[postgres_url] = engine
        return engine


def _new_pools_in_child() -> None:
    """A forked child gets fresh pools; the parent's connections stay the parent's (and a
    lock another thread held at the fork is not inherited held)."""
    global _engines_lock
    _engines_lock = threading.Lock()
    for engine in _engines.values():
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_new_pools_in_child)


def _from_config(cls: type, inst_data: ConfigurableClassData | None, config_value: Any) -> Any:
    """``cls`` built from a ``postgres_db`` block (Dagster's own ``from_config_value``
    builds Dagster's class, whatever class it is called on)."""
    return cls(
        inst_data=inst_data,
        postgres_url=pg_url_from_config(config_value),
        should_autocreate_tables=config_value.get("should_autocreate_tables", True),
        token_provider=get_token_provider_from_config(config_value),
    )


class _RemembersSchema:
    """Remembers which schema probes answered yes and shares the process's pooled engine
    (see the module docstring). First in each storage's bases: Dagster's storage class
    comes after it."""

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
        token_provider: Any = None,
    ) -> None:
        super().__init__(postgres_url, should_autocreate_tables, inst_data, token_provider)  # type: ignore[call-arg]
        self._share_engine(postgres_url, token_provider)

    @classmethod
    def from_config_value(cls, inst_data, config_value):  # noqa: ANN001, ANN206
        return _from_config(cls, inst_data, config_value)

    def _share_engine(self, postgres_url: str, token_provider: Any) -> None:
        size = pool_size_from_env()
        if size == 0 or token_provider is not None:
            return  # Dagster's engine: a connection per call
        unpooled = self._engine  # type: ignore[has-type] - Dagster's NullPool engine
        self._engine = shared_engine(postgres_url, size)
        unpooled.dispose()

    def _present(self, what: tuple, probe: Callable[[], bool]) -> bool:
        known: set[tuple] = self.__dict__.setdefault("_prx_schema_present", set())
        if what in known:
            return True
        answer = bool(probe())
        if answer:
            known.add(what)
        return answer


class PrxPostgresRunStorage(_RemembersSchema, PostgresRunStorage):
    """Dagster's run storage; its column and table probes remembered once present."""

    def has_run_stats_index_cols(self) -> bool:
        return self._present(("runs", "start_time"), super().has_run_stats_index_cols)

    def has_backfill_id_column(self) -> bool:
        return self._present(("runs", "backfill_id"), super().has_backfill_id_column)

    def has_bulk_actions_selector_cols(self) -> bool:
        return self._present(
            ("bulk_actions", "selector_id"), super().has_bulk_actions_selector_cols
        )

    def has_bulk_action_job_name_column(self) -> bool:
        return self._present(("bulk_actions", "job_name"), super().has_bulk_action_job_name_column)

    def has_backfill_tags_table(self) -> bool:
        return self._present(("backfill_tags",), super().has_backfill_tags_table)


class PrxPostgresEventLogStorage(_RemembersSchema, PostgresEventLogStorage):
    """Dagster's event log storage; its column and table probes remembered once present."""

    def has_table(self, table_name: str) -> bool:
        probe = super().has_table
        return self._present((table_name,), lambda: probe(table_name))

    def _has_asset_key_col_on_connection(self, conn, column_name: str) -> bool:  # noqa: ANN001
        probe = super()._has_asset_key_col_on_connection
        return self._present(("asset_keys", column_name), lambda: probe(conn, column_name))


class PrxPostgresScheduleStorage(_RemembersSchema, PostgresScheduleStorage):
    """Dagster's schedule storage; its table probes remembered once present."""

    def _has_instigators_table(self, conn) -> bool:  # noqa: ANN001
        probe = super()._has_instigators_table
        return self._present(("instigators",), lambda: probe(conn))

    def _has_asset_daemon_asset_evaluations_table(self, conn) -> bool:  # noqa: ANN001
        probe = super()._has_asset_daemon_asset_evaluations_table
        return self._present(("asset_daemon_asset_evaluations",), lambda: probe(conn))

    def has_secondary_index_table(self) -> bool:
        return self._present(("secondary_indexes",), super().has_secondary_index_table)


class PrxPostgresStorage(DagsterPostgresStorage):
    """``storage: custom`` for a shared deployment: the three storages above, one database.

    Its instance reference names the three classes, so run workers, code servers and the
    daemon all build them from the same ``postgres_db`` block."""

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
        token_provider: Any = None,
    ) -> None:
        # Not DagsterPostgresStorage.__init__: it would build (and connect) Dagster's own three.
        self.postgres_url = postgres_url
        self.should_autocreate_tables = should_autocreate_tables
        self._inst_data = inst_data
        kw = {
            "should_autocreate_tables": should_autocreate_tables,
            "token_provider": token_provider,
        }
        self._run_storage = PrxPostgresRunStorage(postgres_url, **kw)
        self._event_log_storage = PrxPostgresEventLogStorage(postgres_url, **kw)
        self._schedule_storage = PrxPostgresScheduleStorage(postgres_url, **kw)
        super(DagsterPostgresStorage, self).__init__()

    @classmethod
    def config_type(cls) -> UserConfigSchema:
        return pg_config()

    # the same classmethod as the three storages' (it builds the class it is called on)
    from_config_value = _RemembersSchema.__dict__["from_config_value"]

    def _data(self, class_name: str) -> ConfigurableClassData | None:
        if self.inst_data is None:
            return None
        return ConfigurableClassData(MODULE, class_name, self.inst_data.config_yaml)

    @property
    def event_storage_data(self) -> ConfigurableClassData | None:
        return self._data(PrxPostgresEventLogStorage.__name__)

    @property
    def run_storage_data(self) -> ConfigurableClassData | None:
        return self._data(PrxPostgresRunStorage.__name__)

    @property
    def schedule_storage_data(self) -> ConfigurableClassData | None:
        return self._data(PrxPostgresScheduleStorage.__name__)
