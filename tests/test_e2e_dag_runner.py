"""End to end with Airflow's own runner (`airflow dags test cdc_apply`) over
demo archive files in two tables: a gate failure fails only its table,
without retry; a forced run publishes; the tables are read back with
pyiceberg; a run with nothing pending changes nothing.  In CI with the
embedded default (the Spark tasks as clients of the home's warm driver); in
the full suite (``CDC_TEST_FULL=1``) also with the tasks as clients of a
Spark Connect server (a ``spark_connect`` spark_default) and with a
spark-submit job per Spark task."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from decimal import Decimal
from pathlib import Path

import pytest

from tests.airflow_env import airflow, airflow_env, stop_warm_driver
from tests.servers import running_connect_server

pytestmark = [pytest.mark.airflow, pytest.mark.spark, pytest.mark.slow]

EXPECTED = {  # the demo's three hours, applied in order
    1: ("Anne-Marie", Decimal("12.34"), "u"),
    2: ("Bob", Decimal("21.50"), "u"),
    4: ("Dee", Decimal("100.00"), "c"),
    5: ("Eve", Decimal("-5.25"), "c"),
    6: ("Faye", Decimal("2.00"), "u"),
}


def table_rows(env, name: str = "pg_inventory.customers"):
    """The table ``name`` of the catalog under env's CDC_HOME, and its rows."""
    import os

    from cdc_apply.config import Settings
    from cdc_apply.ledger import Ledger

    old = {k: os.environ.get(k) for k in ("CDC_HOME",)}
    os.environ["CDC_HOME"] = env["CDC_HOME"]
    try:
        settings = Settings.from_env()
        table = Ledger(settings).catalog.load_table(name)
        return table, table.scan().to_arrow().to_pylist()
    finally:
        for k, v in old.items():
            if v is not None:
                os.environ[k] = v


def check_demo_table(env):
    table, rows = table_rows(env)
    live = {r["id"]: r for r in rows if not r["_cdc_deleted"]}
    assert {i: (r["first_name"], r["balance"], r["_cdc_op"]) for i, r in live.items()} == EXPECTED
    tomb = [r for r in rows if r["_cdc_deleted"]]
    # a tombstone keeps the row as it was just before the delete (docs/apply-semantics.md rule 3)
    assert [(r["id"], r["first_name"], r["_cdc_op"]) for r in tomb] == [(3, "Cid", "d")]
    for r in live.values():
        assert r["_cdc_position"] and r["_cdc_batch_id"].startswith("pg_inventory_")
        assert isinstance(r["updated_at"], dt.datetime) and r["updated_at"].tzinfo is not None
        assert r["email"] == f"c{r['id']}@example.com"
    return table


def _orders_file(settings) -> None:
    """A second table in the same source: public.orders (hour 00)."""
    import datetime as dt
    import json
    from pathlib import Path

    from cdc_apply.archive.files import write_jsonl
    from cdc_apply.demo import demo_changes

    lines = []
    for line in demo_changes(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))[dt.datetime(2026, 1, 1, tzinfo=dt.UTC)]:
        msg = json.loads(line)
        msg["payload"]["source"]["table"] = "orders"
        lines.append(json.dumps(msg))
    write_jsonl(Path(settings.archive_dir) / "pg_inventory" / "2026/01/01/00" / "orders-0000.jsonl", lines)


@pytest.fixture(
    params=["warm-driver", pytest.param("spark-connect", marks=pytest.mark.full), pytest.param("spark-submit", marks=pytest.mark.full)]
)
def attach_spark(request, tmp_path):
    """How the DAG's Spark tasks run: ``attach(env)`` leaves spark_default a
    spark connection on a local master, whose tasks attach to the home's warm
    driver (the embedded default) or, with CDC_WARM_DRIVER_IDLE_SECONDS=0,
    spark-submit a job each; or starts a Spark Connect server with env's
    settings and points a spark_connect spark_default at it.  The other two
    variants are the full suite's: a task on a Spark Connect server runs the
    warm-driver variant's client path (the connection's URL is checked in
    ``test_dag_integrity``), and the DAG's spark-submit jobs run in CI on a
    cluster (``test_spark_cluster``)."""
    with contextlib.ExitStack() as stack:

        def attach(env: dict[str, str]) -> None:
            if request.param == "spark-connect":
                url = stack.enter_context(running_connect_server(tmp_path / "connect.log", env=env))
                host, port = url.removeprefix("sc://").rsplit(":", 1)
                env["AIRFLOW_CONN_SPARK_DEFAULT"] = json.dumps({"conn_type": "spark_connect", "host": host, "port": int(port)})
            elif request.param == "spark-submit":
                env["CDC_WARM_DRIVER_IDLE_SECONDS"] = "0"
            else:
                stack.callback(stop_warm_driver, env)

        attach.mode = request.param  # type: ignore[attr-defined]
        yield attach


def test_gate_failure_fails_only_its_table_without_retry_then_a_forced_run_publishes(tmp_path, monkeypatch, attach_spark):
    """Two tables, one violating a user expectation (a negative balance in
    customers): the gate fans out per table; customers' validate task fails on
    its first try (terminal: no retry) and its main stays empty, orders
    publishes and emits its Asset; the ledger has both.  An operator's forced
    run then publishes customers, records why, and emits its Asset."""
    import sqlite3

    from cdc_apply import ledger
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "pg_inventory.customers.json").write_text(
        json.dumps({"expectations": [{"type": "expect_column_values_to_be_between", "kwargs": {"column": "balance", "min_value": 0}}]})
    )
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        "sources:\n  pg_inventory:\n    format: debezium_postgres\n    namespace: pg_inventory\n"
        "    tables:\n      public.customers: {primary_key: [id]}\n      public.orders: {primary_key: [id]}\n"
    )
    env = airflow_env(tmp_path / "airflow", tmp_path / "cdc", CDC_EXPECTATIONS_DIR=str(suites), CDC_SOURCES_FILE=str(sources))
    attach_spark(env)
    monkeypatch.setenv("CDC_HOME", env["CDC_HOME"])
    monkeypatch.setenv("CDC_SOURCES_FILE", str(sources))
    settings = Settings.from_env()
    write_demo_archive(settings)
    _orders_file(settings)
    airflow(env, "db", "migrate")
    failed = airflow(env, "dags", "test", "cdc_apply", "2026-01-01T03:00:00+00:00", timeout=900, check=False)
    assert failed.returncode != 0
    db = sqlite3.connect(tmp_path / "airflow" / "airflow.db")
    states = {(t, m): (s, n) for t, m, s, n in db.execute("SELECT task_id, map_index, state, try_number FROM task_instance")}
    tables = json.loads(db.execute("SELECT value FROM xcom WHERE task_id = 'tables'").fetchone()[0])
    assert tables == ["lake.pg_inventory.customers", "lake.pg_inventory.orders"]
    bad, good = tables.index("lake.pg_inventory.customers"), tables.index("lake.pg_inventory.orders")
    assert states[("table.validate", bad)] == ("failed", 1)  # terminal: failed on its first try, no retry
    assert states[("table.publish", bad)][0] == "upstream_failed"
    assert states[("table.validate", good)][0] == states[("table.publish", good)][0] == "success"  # the other table goes on
    assert states[("finish", -1)][0] == "failed"  # ran anyway (all_done), recorded the attempt, failed the run
    catalog = ledger.Ledger(settings).catalog
    customers = catalog.load_table("pg_inventory.customers")
    assert customers.scan().to_arrow().num_rows == 0  # main untouched: readers see nothing of the batch
    assert any(name.startswith("audit_") for name in customers.metadata.refs)  # branch kept for inspection
    assert catalog.load_table("pg_inventory.orders").scan().to_arrow().num_rows == 5
    rows = {r["table_name"]: r for r in ledger.Ledger(settings).batch_rows("pg_inventory")}
    assert rows["lake.pg_inventory.customers"]["status"] == "failed"
    assert rows["lake.pg_inventory.customers"]["failed_expectations"][0].startswith("expect_column_values_to_be_between")
    assert rows["lake.pg_inventory.orders"]["status"] == "published" and rows["*"]["status"] == "failed"
    assert ledger.Ledger(settings).applied_files("pg_inventory") == {}  # the batch is not complete: its files come again

    conf = json.dumps({"override": "force", "override_reason": "negative balances are refunds; suite fix in review"})
    airflow(env, "dags", "test", "cdc_apply", "2026-01-01T04:00:00+00:00", "--conf", conf, timeout=900)
    check_demo_table(env)
    assert catalog.load_table("pg_inventory.orders").scan().to_arrow().num_rows == 5  # not applied twice
    rows = [r for r in ledger.Ledger(settings).batch_rows("pg_inventory") if r["table_name"] == "lake.pg_inventory.customers"]
    assert rows[-1]["status"] == "forced" and "refunds" in rows[-1]["message"]
    assert len(ledger.Ledger(settings).applied_files("pg_inventory")) == 4
    events = db.execute("SELECT a.name, a.uri, e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id ORDER BY e.id").fetchall()
    assert [(n, u) for n, u, _ in events] == [
        ("lake.pg_inventory.orders", "iceberg://lake/pg_inventory/orders"),
        ("lake.pg_inventory.customers", "iceberg://lake/pg_inventory/customers"),
    ]
    assert json.loads(events[1][2])["batch_id"] == rows[-1]["batch_id"]
    table = check_demo_table(env)
    summary = table.current_snapshot().summary.additional_properties
    assert summary["cdc.batch-id"] == rows[-1]["batch_id"] and len(json.loads(summary["cdc.files"])) == 4

    # the same interval again: nothing pending, no Spark job, no new snapshot, no new asset event
    again = airflow(env, "dags", "test", "cdc_apply", "2026-01-01T04:00:00+00:00", timeout=900)
    assert "nothing to submit" in again.stdout + again.stderr
    assert check_demo_table(env).current_snapshot().snapshot_id == table.current_snapshot().snapshot_id
    assert db.execute("SELECT count(*) FROM asset_event").fetchone()[0] == 2
    # the embedded default's Spark tasks, of both runs, ran on one warm driver; the others started none
    started = list((Path(env["CDC_HOME"]) / "warm-driver").glob("server-*.log"))
    assert len(started) == (1 if attach_spark.mode == "warm-driver" else 0), started
