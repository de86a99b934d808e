"""Real servers for the operations tests: a throwaway PostgreSQL cluster on 127.0.0.1."""

from __future__ import annotations

import pytest

from prx_assets_tests.pg_server import free_port, postgres_running

__all__ = ["free_port", "postgres_database", "postgres_server"]


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL cluster in a temp dir, trust auth, loopback only; removed afterwards."""
    with postgres_running() as pg:
        yield pg


@pytest.fixture
def postgres_database(postgres_server):
    """``postgres_server`` with a database of this test's own (no state shared between
    tests that run on the same server)."""
    import uuid

    import psycopg2

    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = psycopg2.connect(
        host=postgres_server["host"],
        port=postgres_server["port"],
        user=postgres_server["user"],
        dbname="postgres",
    )
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
    conn.close()
    return {**postgres_server, "db": name}
