"""Real servers for the operations tests: a throwaway PostgreSQL cluster on 127.0.0.1."""

from __future__ import annotations

import pytest

from prx_assets_tests.pg_server import free_port, postgres_running

__all__ = ["free_port", "postgres_server"]


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL cluster in a temp dir, trust auth, loopback only; removed afterwards."""
    with postgres_running() as pg:
        yield pg
