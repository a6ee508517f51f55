"""Issue 23 probe, apply side, on real Spark + Iceberg through the CLI and the
job functions: colliding source tables, refused table names, half-made tables,
killed maintenance, retried finish / publish, hostile identifiers, and the
quarantine reason classes."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[1]
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _msg(schema: str, table: str, key: int, lsn: int, op: str = "c", name: str = "x") -> str:
    from cdc_apply.demo import pg_message

    after = None if op == "d" else {"id": key, "first_name": name, "last_name": "L", "email": "e", "balance": None, "updated_at": None}
    before = {"id": key, "first_name": name, "last_name": "L", "email": "e", "balance": None, "updated_at": None} if op == "d" else None
    obj = json.loads(pg_message(op, lsn, 1, T0, before, after))
    obj["payload"]["source"].update(schema=schema, table=table)
    return json.dumps(obj, separators=(",", ":"))


def _sources(tmp_path, monkeypatch, name: str, tables: str = "      customers: {primary_key: [id]}\n") -> None:
    path = tmp_path / f"sources_{name}.yaml"
    path.write_text(f"sources:\n  {name}:\n    format: debezium_postgres\n    namespace: {name}\n    tables:\n{tables}")
    monkeypatch.setenv("CDC_SOURCES_FILE", str(path))


def _file(folder: Path, hour: int, lines: list[str], name: str = "f.jsonl") -> Path:
    from cdc_apply.archive.files import write_jsonl

    return write_jsonl(folder / f"2026/01/01/{hour:02d}" / name, lines)


def _apply(capsys, *args: str) -> tuple[int, dict]:
    from cdc_apply import cli

    code = cli.main(["apply", *args])
    out = capsys.readouterr()
    try:
        return code, json.loads(out.out)
    except json.JSONDecodeError:
        return code, {"stderr": out.err, "stdout": out.out}


def _live(spark, ident: str) -> set[int]:
    return {r["id"] for r in spark.sql(f"SELECT id FROM {ident} WHERE NOT _cdc_deleted").collect()}


def _batch_rows(settings, source: str, batch_id: str) -> list[dict]:
    from cdc_apply import ledger

    return [r for r in ledger.Ledger(settings).batch_rows(source) if r["batch_id"] == batch_id and r["table_name"] == "*"]


# -- 1. two source schemas with one table name ------------------------------------------------


def test_two_schemas_with_one_table_name_never_share_a_target(spark, settings, tmp_path, monkeypatch, capsys):
    _sources(tmp_path, monkeypatch, "collide")
    folder = tmp_path / "arch"
    _file(folder, 0, [_msg("shop", "customers", 1, 100), _msg("shop", "customers", 2, 101), _msg("zz", "customers", 3, 102)])
    code, res = _apply(capsys, "--source", "collide", "--dir", str(folder))
    assert code == 2 and res["status"] == "failed"
    assert "shop.customers" in res["message"] and "zz.customers" in res["message"] and "target" in res["message"]
    assert not spark.catalog.tableExists(f"{settings.catalog_name}.collide.customers")  # nothing merged into one table

    # the stable rule: a configured target per source table
    _sources(tmp_path, monkeypatch, "collide", "      customers: {primary_key: [id]}\n      zz.customers: {target: zz_customers}\n")
    code, res = _apply(capsys, "--source", "collide", "--dir", str(folder))
    assert code == 0 and res["status"] == "complete", res
    assert _live(spark, f"{settings.catalog_name}.collide.customers") == {1, 2}
    assert _live(spark, f"{settings.catalog_name}.collide.zz_customers") == {3}

    # a later batch bringing zz.customers without its mapping does not slip into shop's table
    _sources(tmp_path, monkeypatch, "collide")
    _file(folder, 1, [_msg("zz", "customers", 4, 200)])
    code, res = _apply(capsys, "--source", "collide", "--dir", str(folder))
    assert code == 2 and "holds source table inventory.shop.customers" in res["message"] and "inventory.zz.customers" in res["message"]
    assert _live(spark, f"{settings.catalog_name}.collide.customers") == {1, 2}


# -- 6. a refused table name does not block the source -----------------------------------------


def test_refused_table_name_is_quarantined_and_the_batch_completes(spark, settings, tmp_path, monkeypatch, capsys):
    _sources(tmp_path, monkeypatch, "refuse", "      customers: {primary_key: [id]}\n      my-table: {primary_key: [id]}\n")
    folder = tmp_path / "arch"
    _file(folder, 0, [_msg("public", "customers", 1, 100), _msg("public", "my-table", 2, 101), _msg("public", "my-table", 3, 102)])
    code, res = _apply(capsys, "--source", "refuse", "--dir", str(folder))
    assert code == 0 and res["status"] == "complete", res
    assert res["messages"]["quarantined:refused-table"] == 2 and res["messages"]["event"] == 1 and res["messages"]["read"] == 3
    assert "refused" in res["message"] and "my-table" in res["message"]
    refused = [t for t in res["tables"] if t["status"] == "refused"]
    assert [(t["table"], t["counts"]) for t in refused] == [("inventory.public.my-table", {"quarantined": 2})]
    assert _live(spark, f"{settings.catalog_name}.refuse.customers") == {1}
    q = spark.sql(
        f"SELECT line, reason, raw FROM {settings.catalog_name}.{settings.audit_namespace}.quarantine WHERE batch_id = '{res['batch_id']}' ORDER BY line"
    ).collect()
    assert [r["line"] for r in q] == [2, 3] and all("refused table inventory.public.my-table" in r["reason"] for r in q)
    assert all('"my-table"' in r["raw"] for r in q)
    code, res = _apply(capsys, "--source", "refuse", "--dir", str(folder))
    assert code == 0 and res["status"] == "nothing-to-do"


# -- 4. a kill during the first batch's table creation ------------------------------------------


class _Killed(BaseException):
    """Stands for a SIGKILL at that point: nothing after it runs, no except clause catches it."""


def _kill_at(monkeypatch, point: str) -> None:
    from cdc_apply.apply import tables

    def die(*_a, **_k):
        raise _Killed(point)

    target = {"after CREATE TABLE": "finish_table", "before the live view": "refresh_live_view"}.get(point)
    if target:
        monkeypatch.setattr(tables, target, die)
        return
    real = tables.finish_table

    def without_mark(spark, spec):  # every step but the completion mark
        real_sql = spark.sql
        try:
            spark.sql = lambda q, *a, **k: (_ for _ in ()).throw(_Killed(point)) if "cdc.created" in q else real_sql(q, *a, **k)
            real(spark, spec)
        finally:
            del spark.sql

    monkeypatch.setattr(tables, "finish_table", without_mark)


@pytest.mark.parametrize("point", ["after CREATE TABLE", "before the live view", "before the completion mark"])
def test_a_run_killed_while_creating_the_table_is_finished_by_the_rerun(spark, settings, tmp_path, monkeypatch, capsys, point):
    from cdc_apply import ledger

    ns = "half_" + point.replace(" ", "_").lower()
    lines = [_msg("public", "customers", 1, 100), _msg("public", "customers", 2, 101), _msg("public", "customers", 1, 102, op="d")]
    _sources(tmp_path, monkeypatch, "clean_" + ns[:20])
    _file(tmp_path / "clean", 0, lines)
    assert _apply(capsys, "--source", "clean_" + ns[:20], "--dir", str(tmp_path / "clean"))[0] == 0

    _sources(tmp_path, monkeypatch, ns)
    _file(tmp_path / "half", 0, lines)
    with monkeypatch.context() as m:
        _kill_at(m, point)
        with pytest.raises(_Killed):
            _apply(capsys, "--source", ns, "--dir", str(tmp_path / "half"))
    ident = f"{settings.catalog_name}.{ns}.customers"
    assert spark.catalog.tableExists(ident)  # half-made
    code, res = _apply(capsys, "--source", ns, "--dir", str(tmp_path / "half"))
    assert code == 0 and res["status"] == "complete", res

    clean = f"{settings.catalog_name}.clean_{ns[:20]}.customers"
    drop = ("_cdc_batch_id", "_cdc_applied_at")
    assert sorted(map(tuple, spark.table(ident).drop(*drop).collect())) == sorted(map(tuple, spark.table(clean).drop(*drop).collect()))
    assert {r["id"] for r in spark.table(ident + "_live").collect()} == {2}
    table = ledger.Ledger(settings).catalog.load_table(f"{ns}.customers")
    assert [table.schema().find_field(i).name for i in table.schema().identifier_field_ids] == ["id"]
    assert table.properties.get("cdc.created") == "true"


# -- 7, 8. a retried finish, a publish that died after its fast-forward -------------------------


def test_finish_twice_records_the_batch_once(spark, settings, tmp_path, monkeypatch, capsys):
    _sources(tmp_path, monkeypatch, "finish2")
    _file(tmp_path / "arch", 0, [_msg("public", "customers", 1, 100)])
    r = str(tmp_path / "run" / "result.json")
    assert _apply(capsys, "--source", "finish2", "--dir", str(tmp_path / "arch"), "--stage", "write", "--result-file", r)[0] == 0
    assert _apply(capsys, "--stage", "validate", "--result-file", r)[0] == 0
    code, res = _apply(capsys, "--stage", "publish", "--result-file", r)
    assert code == 0 and res["status"] == "complete"
    code, res = _apply(capsys, "--stage", "finish", "--result-file", r)  # an Airflow retry after a kill
    assert code == 0 and res["status"] == "complete"
    assert [row["status"] for row in _batch_rows(settings, "finish2", res["batch_id"])] == ["complete"]


def test_the_write_job_runs_the_gate_and_the_validate_stage_keeps_its_verdict(spark, settings, tmp_path, monkeypatch, capsys):
    """``--stage write+validate`` (the DAG's apply job): the gate runs in the
    write job's session; a table that fails it ends failed with its verdict,
    the job still exits 0 (the table's validate task reports it), and a later
    validate stage leaves the verdict as it is; the passing table publishes."""
    src = "gated"
    _sources(tmp_path, monkeypatch, src, "      customers: {primary_key: [id]}\n      orders: {primary_key: [id]}\n")
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / f"{src}.customers.json").write_text(
        json.dumps({"expectations": [{"type": "expect_column_values_to_be_between", "kwargs": {"column": "id", "min_value": 5}}]})
    )
    monkeypatch.setenv("CDC_EXPECTATIONS_DIR", str(suites))
    _file(tmp_path / "arch", 0, [_msg("public", "customers", 1, 100), _msg("public", "orders", 2, 101)])
    r = str(tmp_path / "run" / "result.json")
    code, res = _apply(capsys, "--source", src, "--dir", str(tmp_path / "arch"), "--stage", "write+validate", "--result-file", r)
    assert code == 0, res
    by_table = {t["table"].rsplit(".", 1)[1]: t for t in res["tables"]}
    assert by_table["customers"]["status"] == "failed" and by_table["customers"]["gate"] == "failed", by_table
    assert "GateFailed" in by_table["customers"]["message"] and by_table["customers"]["terminal"]
    assert by_table["orders"]["status"] == "validated" and by_table["orders"]["gate"] == "passed"
    assert by_table["customers"]["seconds"]["reconcile"] >= 0 and "gate" in by_table["orders"]["seconds"]
    for name, status in (("customers", "failed"), ("orders", "validated")):
        code, tres = _apply(capsys, "--stage", "validate", "--result-file", r, "--table", by_table[name]["table"])
        assert tres["status"] == status and code == (2 if status == "failed" else 0), tres
    code, res = _apply(capsys, "--stage", "publish", "--result-file", r)
    assert code != 0 and res["status"] == "failed"
    assert _live(spark, by_table["orders"]["table"]) == {2}
    assert not spark.sql(f"SELECT * FROM {by_table['customers']['table']}").collect()  # main untouched


@pytest.mark.parametrize("retried", ["publish", "finish"])
def test_a_publish_that_died_after_its_fast_forward_is_recognised(spark, settings, tmp_path, monkeypatch, capsys, retried):
    from cdc_apply import ledger

    src = f"ff_{retried}"
    _sources(tmp_path, monkeypatch, src)
    _file(tmp_path / "arch", 0, [_msg("public", "customers", 1, 100), _msg("public", "customers", 2, 101)])
    r = str(tmp_path / "run" / "result.json")
    code, res = _apply(capsys, "--source", src, "--dir", str(tmp_path / "arch"), "--stage", "write", "--result-file", r)
    assert code == 0
    ident = res["tables"][0]["table"]
    assert _apply(capsys, "--stage", "validate", "--result-file", r, "--table", ident)[0] == 0
    # the publish task's commit, then the kill: its result file never says "published"
    snap = ledger.Ledger(settings).fast_forward(ident.split(".", 1)[1], res["tables"][0]["branch"])
    if retried == "publish":
        code, tres = _apply(capsys, "--stage", "publish", "--result-file", r, "--table", ident)
        assert code == 0 and tres["status"] == "published" and tres["snapshot_id"] == str(snap)  # ids as strings (issue 22)
    code, res = _apply(capsys, "--stage", "finish", "--result-file", r)
    assert code == 0 and res["status"] == "complete", res
    assert res["tables"][0]["status"] == "published" and res["tables"][0]["snapshot_id"] == str(snap)
    assert _live(spark, ident) == {1, 2}
    assert [row["status"] for row in _batch_rows(settings, src, res["batch_id"])] == ["complete"]


# -- 5. killed maintenance --------------------------------------------------------------------

_MAINTAIN_AND_HANG = """
import sys, time
from cdc_apply import maintenance
from cdc_apply.config import Settings
from cdc_apply.runtime.session import get_spark
def hang(*a, **k):
    print("LOCKED", flush=True)
    time.sleep(600)
maintenance._procedures = hang
settings = Settings.from_env()
maintenance.maintain_table(get_spark(settings, app_name="cdc-maint-killed"), settings, sys.argv[1])
"""


def test_a_killed_maintenance_lock_is_recovered_by_apply_and_maintenance(spark, settings, tmp_path, monkeypatch, capsys, caplog):
    from cdc_apply import maintenance
    from cdc_apply.apply.maintenance_lock import LOCK_PREFIX, MAINTENANCE_BRANCH

    _sources(tmp_path, monkeypatch, "maintkill")
    _file(tmp_path / "arch", 0, [_msg("public", "customers", 1, 100)])
    assert _apply(capsys, "--source", "maintkill", "--dir", str(tmp_path / "arch"))[0] == 0
    ident = f"{settings.catalog_name}.maintkill.customers"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'spark_jobs'}:{ROOT}", "CDC_SPARK_MASTER": "local[1]"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAINTAIN_AND_HANG, ident], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.stdout.readline().strip() != "LOCKED":
            assert proc.poll() is None, "the maintenance process died before taking the lock"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    refs = {r["name"] for r in spark.sql(f"SELECT name FROM {ident}.refs").collect()}
    assert MAINTENANCE_BRANCH in refs  # the kill left the lock
    props = {r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES {ident}").collect()}
    assert any(k.startswith(LOCK_PREFIX) and k.endswith(f":{proc.pid}") for k in props)

    # a later maintenance recovers it (loudly) instead of skipping the table for ever
    with caplog.at_level("ERROR"):
        report = maintenance.maintain_table(spark, settings, ident, maintenance.Retention())
    assert "skipped" not in report, report
    assert "recovering the lock of a killed table maintenance" in caplog.text and str(proc.pid) in caplog.text

    # and an apply recovers a lock without a recorded owner (made before owners were recorded)
    spark.sql(f"ALTER TABLE {ident} CREATE BRANCH {MAINTENANCE_BRANCH}")
    _file(tmp_path / "arch", 1, [_msg("public", "customers", 2, 200)])
    code, res = _apply(capsys, "--source", "maintkill", "--dir", str(tmp_path / "arch"))
    assert code == 0 and res["status"] == "complete", res
    assert _live(spark, ident) == {1, 2}
    assert MAINTENANCE_BRANCH not in {r["name"] for r in spark.sql(f"SELECT name FROM {ident}.refs").collect()}


def test_a_live_maintenance_lock_still_holds(spark, settings, tmp_path, monkeypatch, capsys):
    from cdc_apply import maintenance
    from cdc_apply.apply.maintenance_lock import MAINTENANCE_BRANCH, lock_key

    _sources(tmp_path, monkeypatch, "maintlive")
    _file(tmp_path / "arch", 0, [_msg("public", "customers", 1, 100)])
    assert _apply(capsys, "--source", "maintlive", "--dir", str(tmp_path / "arch"))[0] == 0
    ident = f"{settings.catalog_name}.maintlive.customers"
    live_owner = lock_key(pid=os.getppid())  # a live process of this host
    spark.sql(f"ALTER TABLE {ident} SET TBLPROPERTIES ('{live_owner}'='{{\"expires_at\": \"2999-01-01T00:00:00+00:00\"}}')")
    spark.sql(f"ALTER TABLE {ident} CREATE BRANCH {MAINTENANCE_BRANCH}")
    _file(tmp_path / "arch", 1, [_msg("public", "customers", 2, 200)])
    code, res = _apply(capsys, "--source", "maintlive", "--dir", str(tmp_path / "arch"))
    assert code == 1 and "table maintenance is running" in res["message"]
    assert "skipped" in maintenance.maintain_table(spark, settings, ident, maintenance.Retention())


# -- 10. hostile identifiers in table properties -----------------------------------------------


@pytest.mark.parametrize("key", ["k', 'injected'='yes", "id,x", "a\\\\'b", "ключ; DROP TABLE x"])
def test_hostile_key_names_are_stored_exactly_and_inject_nothing(spark, settings, key):
    from cdc_apply.apply import tables
    from cdc_apply.model import ChangeEvent, Column, Op
    from tests.apply_harness import apply_events

    ns = f"hostile_{abs(hash(key)) % 10_000}"
    ev = ChangeEvent(
        format="debezium_postgres",
        database="db",
        schema="public",
        table="items",
        op=Op("c"),
        key_columns=[key],
        after={key: "1", "v": "a"},
        before=None,
        position=f"{1:020d}",
        columns=[Column(key, "int", False), Column("v", "string")],
        file="",
        line=1,
        commit_ts_us=1_700_000_000_000_000,
    )
    res = apply_events(spark, settings, ns, [ev])
    assert res.status == "complete", res.message
    ident = f"{settings.catalog_name}.{ns}.items"
    props = tables.table_properties(spark, ident)
    assert "injected" not in props
    assert tables.existing_schema(spark, ident)[1] == [key]


# -- 12. quarantine reason classes ---------------------------------------------------------------


def test_quarantine_reasons_are_counted_by_class_with_the_detail_kept(spark, settings):
    from cdc_apply.model import Quarantined
    from tests.apply_harness import apply_events, event

    bad = [
        Quarantined(
            reason=f"DecodeError: malformed JSON: unexpected character: line 1 column {i} (char {i - 1})",
            raw="{",
            file="/virtual/qc/f.jsonl",
            line=i,
        )
        for i in range(1, 926)
    ]
    res = apply_events(spark, settings, "qclass", [event("c", 1, {"name": "a"}, pos=1, file="/virtual/qc/f.jsonl", line=2000), *bad])
    assert res.status == "complete"
    assert {k: v for k, v in res.messages.items() if ":" in k} == {"quarantined:malformed-json": 925}
    reasons = spark.sql(
        f"SELECT count(DISTINCT reason) FROM {settings.catalog_name}.{settings.audit_namespace}.quarantine WHERE batch_id = '{res.batch_id}'"
    ).collect()[0][0]
    assert reasons == 925
