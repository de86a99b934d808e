"""A partition materialised against a real PostgreSQL-backed Dagster instance."""

from pathlib import Path

import psycopg2
import yaml
from dagster import DagsterInstance, instance_for_test, materialize

from prx_assets.defs.ingest.assets import raw_images
from prx_assets.defs.partitions import BATCHES
from prx_assets.defs.resolution.assets import resolution_profile
from prx_assets_tests.pg_server import dagster_storage


def _postgres_overrides(pg) -> dict:
    """The storage block of dagster_postgres.yaml, with the env indirection resolved."""
    with open(Path(__file__).resolve().parents[2] / "dagster_postgres.yaml") as f:
        config = yaml.safe_load(f)
    assert config["storage"]["custom"]["module"] == "prx_assets.pg_storage"
    db = config["storage"]["custom"]["config"]["postgres_db"]
    assert {v["env"] for v in db.values()} == {
        "PRX_PG_HOST",
        "PRX_PG_PORT",
        "PRX_PG_USER",
        "PRX_PG_PASSWORD",
        "PRX_PG_DB",
    }
    return dagster_storage(pg)


def test_runs_events_and_partitions_land_in_postgres(postgres_server, lab_resource):
    with instance_for_test(overrides=_postgres_overrides(postgres_server)) as instance:
        assert type(instance.run_storage).__name__ == "PrxPostgresRunStorage"
        key = "public-sklearn.001"
        instance.add_dynamic_partitions(BATCHES.name, [key])
        result = materialize(
            [raw_images, resolution_profile],
            partition_key=key,
            instance=instance,
            resources={"lab": lab_resource},
        )
        assert result.success
        run_id = result.run_id
        # Read back through a fresh instance on the same database.
        again = DagsterInstance.from_ref(instance.get_ref())
        assert again.get_run_by_id(run_id).is_success
        assert again.get_dynamic_partitions(BATCHES.name) == [key]

    conn = psycopg2.connect(
        host=postgres_server["host"],
        port=postgres_server["port"],
        user=postgres_server["user"],
        dbname=postgres_server["db"],
    )
    with conn, conn.cursor() as cur:
        cur.execute("SELECT status FROM runs WHERE run_id = %s", (run_id,))
        assert cur.fetchone()[0] == "SUCCESS"
        cur.execute(
            "SELECT asset_key, partition FROM event_logs "
            "WHERE run_id = %s AND dagster_event_type = 'ASSET_MATERIALIZATION' ORDER BY id",
            (run_id,),
        )
        rows = cur.fetchall()
        assert [(a.strip('[]"'), p) for a, p in rows] == [
            ("raw_images", key),
            ("resolution_profile", key),
        ]
        cur.execute(
            "SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'batches'"
        )
        assert [r[0] for r in cur.fetchall()] == [key]
    conn.close()


def test_the_shared_config_monitors_runs_and_judges_only_this_hosts(
    postgres_server, tmp_path, monkeypatch
):
    """dagster_postgres.yaml as deployed: run monitoring on, the checking launcher in place."""
    from prx_assets.instance import LocalProcessRunLauncher, ensure_instance

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_bytes(
        (Path(__file__).resolve().parents[2] / "dagster_postgres.yaml").read_bytes()
    )
    for name, value in {
        "DAGSTER_HOME": str(home),
        "PRX_PG_HOST": postgres_server["host"],
        "PRX_PG_PORT": str(postgres_server["port"]),
        "PRX_PG_USER": postgres_server["user"],
        "PRX_PG_PASSWORD": "",
        "PRX_PG_DB": postgres_server["db"],
    }.items():
        monkeypatch.setenv(name, value)
    instance = ensure_instance(home)
    try:
        assert type(instance.run_storage).__name__ == "PrxPostgresRunStorage"
        assert instance.run_monitoring_enabled
        assert instance.run_monitoring_max_resume_run_attempts == 0
        launcher = instance.run_launcher
        assert isinstance(launcher, LocalProcessRunLauncher)
        assert launcher.supports_check_run_worker_health
        assert not launcher.untagged_runs_are_local  # shared: never assume a run is local
        queue = instance.get_concurrency_config().run_queue_config
        assert queue.max_user_code_failure_retries > 0
    finally:
        instance.dispose()
