"""A throwaway PostgreSQL cluster on 127.0.0.1: the operations tests' fixture and the
benchmarks that measure a Dagster instance on PostgreSQL (what nodes of a cluster share)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin() -> Path:
    """The PostgreSQL server binaries' directory (RuntimeError with how to install them)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError(
            "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin); "
            ".ci/system-deps installs them: apt-get install postgresql"
        )
    return Path(found[-1]).parent


def _as_postgres(cmd: list[str]) -> list[str]:
    # The server refuses to run as root (CI runs as root): drop to the postgres user.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextlib.contextmanager
def postgres_running() -> Iterator[dict]:
    """A PostgreSQL cluster in a temp dir, trust auth, loopback only, with a ``dagster``
    database; yields its connection settings; stopped and removed afterwards."""
    bindir = pg_bin()
    root = Path(tempfile.mkdtemp(prefix="prx-pg-"))
    os.chmod(root, 0o777)
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    port = free_port()
    try:
        subprocess.run(
            _as_postgres(
                [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"]
            ),
            check=True,
            capture_output=True,
        )
        opts = f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off"
        start = [str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "log")]
        subprocess.run(_as_postgres([*start, "-w", "start"]), check=True, capture_output=True)
        import psycopg2

        deadline = time.time() + 30
        while True:
            try:
                conn = psycopg2.connect(
                    host="127.0.0.1", port=port, user="postgres", dbname="postgres"
                )
                break
            except psycopg2.OperationalError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE dagster")
        conn.close()
        yield {"host": "127.0.0.1", "port": port, "user": "postgres", "db": "dagster"}
    finally:
        subprocess.run(
            _as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)


def dagster_storage(pg: dict) -> dict:
    """An instance's ``storage`` block for the server ``pg``: dagster_postgres.yaml's own
    block (the project's storage class), its ``env:`` settings replaced by ``pg``'s."""
    import yaml

    config = yaml.safe_load(
        (Path(__file__).resolve().parents[1] / "dagster_postgres.yaml").read_text()
    )
    storage = config["storage"]
    values = {
        "PRX_PG_HOST": pg["host"],
        "PRX_PG_PORT": pg["port"],
        "PRX_PG_USER": pg["user"],
        "PRX_PG_PASSWORD": "",
        "PRX_PG_DB": pg["db"],
    }
    db = storage["custom"]["config"]["postgres_db"]
    for key, setting in db.items():
        db[key] = values[setting["env"]]
    return {"storage": storage}
