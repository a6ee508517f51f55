"""Debezium archives through the whole job (files -> decode in Spark -> apply
-> gate -> publish, real Iceberg): Kafka tombstone lines, messages archived
without a schema, and every Debezium example of the format specs applied to
a table with golden rows (issues 17, 23, 24.1)."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cdc_apply.archive.files import write_jsonl
from cdc_apply.batch import run_batch
from cdc_apply.config import Settings
from tests.apply_harness import live_rows
from tests.decode.test_debezium_postgres import CASES
from tests.formats.synthetic import SyntheticChange, example_row

pytestmark = [pytest.mark.spark]
UTC = dt.UTC
_n = itertools.count()
ITEMS = {"id": "int", "name": "string", "amount": "decimal(10,2)", "updated_at": "timestamp"}


@contextlib.contextmanager
def source(tmp_path: Path, fmt: str, tables: dict[str, Any] | None = None, **extra: Any) -> Iterator[tuple[Settings, str, Any]]:
    """A fresh source of ``fmt`` (its own namespace) in a sources file of its
    own; yields (settings, name, a function that rewrites its ``tables:``)."""
    name = f"dbz_archive_{fmt}_{next(_n)}"  # its own names: test_formats_apply uses <format>_<n>
    sources_file = tmp_path / f"{name}.yaml"

    def write(tables: dict[str, Any] | None) -> None:
        spec = {"format": fmt, "namespace": name, **extra, **({"tables": tables} if tables else {})}
        sources_file.write_text(yaml.safe_dump({"sources": {name: spec}}))

    write(tables)
    old = os.environ.get("CDC_SOURCES_FILE")
    os.environ["CDC_SOURCES_FILE"] = str(sources_file)
    try:
        yield Settings.from_env(), name, write
    finally:
        if old is None:
            os.environ.pop("CDC_SOURCES_FILE", None)
        else:
            os.environ["CDC_SOURCES_FILE"] = old


def hour(spark, settings: Settings, name: str, h: int, lines: list[str]):
    """Write one archive file of hour ``h`` and apply every pending file."""
    write_jsonl(Path(settings.archive_dir) / name / f"2026/03/01/{h:02d}" / "part-0.jsonl", lines)
    return run_batch(settings, name, spark=spark)


def values_only(lines: list[str], tombstone: str) -> list[str]:
    """A Kafka Connect sink's archive of the value records (``{"schema", "payload"}``
    per line), a tombstone as ``tombstone``: what most archives hold."""
    out = []
    for line in lines:
        value = json.loads(line)["value"]
        out.append(tombstone if value is None else json.dumps(value))
    return out


def writer(fmt: str):
    import importlib

    return importlib.import_module(f"tests.formats.write_{fmt}")


def deleted_rows(spark, settings: Settings, ns: str, table: str) -> int:
    return spark.sql(f"SELECT count(*) AS n FROM {settings.catalog_name}.{ns}.{table} WHERE _cdc_deleted").first()["n"]


# --------------------------------------------------------------------------
# 1. Kafka tombstones (issue 24.1)


@pytest.mark.parametrize("fmt, tombstone", [("debezium_postgres", "null"), ("debezium_sqlserver", '{"schema":null,"payload":null}')])
def test_delete_heavy_first_hour_creates_the_table(fmt, tombstone, spark, tmp_path) -> None:
    t0 = dt.datetime(2026, 3, 1, 0, tzinfo=UTC)
    changes = [SyntheticChange("c", {"id": i}, example_row(i), None, i, i, t0) for i in range(1, 11)]
    changes += [SyntheticChange("d", {"id": i}, None, {"id": i}, 10 + i, 10 + i, t0) for i in range(1, 10)]
    lines = values_only(writer(fmt).write_messages(changes), tombstone)
    assert lines.count(tombstone) == 9 and len(lines) == 28  # a third of the hour is tombstones
    with source(tmp_path, fmt, {"items": {"primary_key": ["id"]}}) as (settings, ns, _rewrite):
        result = hour(spark, settings, ns, 0, lines)
        assert result.status == "complete", result.to_json()
        assert result.messages["read"] == 28 and result.messages.get("quarantined", 0) == 0
        assert result.messages["skipped:kafka-tombstone"] == 9
        assert list(live_rows(spark, settings, ns, "items", ["id"], ITEMS)) == [("10",)]
        assert deleted_rows(spark, settings, ns, "items") == 9


# --------------------------------------------------------------------------
# 2. Messages without a schema (issues 17, 23)


def schemaless_update(key: int, lsn: int, after: dict[str, Any]) -> str:
    """A PostgreSQL update as JsonConverter writes it with schemas.enable=false."""
    source = {
        "version": "2.7.0.Final",
        "connector": "postgresql",
        "name": "pg",
        "ts_ms": 1772330400000,
        "snapshot": "false",
        "db": "shop",
        "schema": "public",
        "table": "items",
        "txId": 900 + lsn,
        "lsn": lsn,
        "sequence": json.dumps([str(lsn - 1), str(lsn)]),
    }
    return json.dumps({"before": None, "after": {"id": key, **after}, "source": source, "op": "u", "ts_ms": 1772330400001})


def b64_unscaled(n: int) -> str:
    return base64.b64encode(n.to_bytes((n.bit_length() + 8) // 8, "big", signed=True)).decode()


def test_schemaless_messages_apply_by_the_stored_column_types(spark, tmp_path) -> None:
    """Before the fix the base64 decimal reached the MERGE as text and failed
    it (CAST_INVALID_INPUT, classed transient): the table was blocked for ever."""
    t0 = dt.datetime(2026, 3, 1, 0, tzinfo=UTC)
    typed = writer("debezium_postgres").write_messages([SyntheticChange("c", {"id": i}, example_row(i), None, i, i, t0) for i in (1, 2)])
    with source(tmp_path, "debezium_postgres", {"items": {"primary_key": ["id"]}}, quarantine_max_share=0.5) as (settings, ns, _rewrite):
        assert hour(spark, settings, ns, 0, typed).status == "complete"
        lines = [
            schemaless_update(1, 10**9, {"name": "x", "amount": b64_unscaled(-1234567), "updated_at": "2026-03-01T01:02:03.456789Z"}),
            schemaless_update(2, 10**9 + 8, {"name": "y", "amount": "12.5", "updated_at": 1772326923456789}),  # epoch: unit unknown
            schemaless_update(2, 10**9 + 16, {"name": "z", "amount": 7}),
        ]
        result = hour(spark, settings, ns, 1, lines)
        assert result.status == "complete", result.to_json()
        assert result.messages.get("quarantined") == 1
        rows = live_rows(spark, settings, ns, "items", ["id"], ITEMS)
        assert rows[("1",)] == {"id": "1", "name": "x", "amount": "-12345.67", "updated_at": "2026-03-01 01:02:03.456789"}
        assert rows[("2",)] == {"id": "2", "name": "z", "amount": "7.00", "updated_at": "2026-01-01 12:00:02.123456"}  # not present: kept
        (q,) = spark.sql(f"SELECT line, reason FROM {settings.catalog_name}.cdc_audit.quarantine WHERE source = '{ns}'").collect()
        assert q["line"] == 2 and "updated_at" in q["reason"] and "unit" in q["reason"]


def test_schemaless_new_table_needs_declared_columns(spark, tmp_path) -> None:
    lines = [
        schemaless_update(1, 100, {"name": "a", "amount": b64_unscaled(150), "updated_at": "2026-03-01T00:00:01Z"}).replace(
            '"op": "u"', '"op": "c"'
        ),
        schemaless_update(2, 108, {"name": "b", "amount": b64_unscaled(-5), "updated_at": None}).replace('"op": "u"', '"op": "c"'),
    ]
    with source(tmp_path, "debezium_postgres") as (settings, ns, rewrite):
        result = hour(spark, settings, ns, 0, lines)
        assert result.status == "failed"
        (tr,) = result.tables
        assert tr.terminal and "missing in" in tr.message and ": primary_key and columns." in tr.message
        assert "columns: {amount: <type>, id: <type>, name: <type>, updated_at: <type>}" in tr.message
        assert "schemas.enable=true" in tr.message
        assert not spark.catalog.tableExists(f"{settings.catalog_name}.{ns}.items")

        rewrite({"public.items": {"primary_key": ["id"]}})
        tr = run_batch(settings, ns, spark=spark).tables[0]
        assert tr.status == "failed" and ": columns." in tr.message and "primary_key: [id]" in tr.message

        rewrite(
            {
                "public.items": {
                    "primary_key": ["id"],
                    "columns": {"id": "int", "name": "string", "amount": "decimal(10,2)", "updated_at": "io.debezium.time.ZonedTimestamp"},
                }
            }
        )
        result = run_batch(settings, ns, spark=spark)
        assert result.status == "complete", result.to_json()
        assert live_rows(spark, settings, ns, "items", ["id"], ITEMS) == {
            ("1",): {"id": "1", "name": "a", "amount": "1.50", "updated_at": "2026-03-01 00:00:01.000000"},
            ("2",): {"id": "2", "name": "b", "amount": "-0.05", "updated_at": None},
        }


# --------------------------------------------------------------------------
# 3. Every Debezium example of the specs applies (issue 17 item 4)

CUSTOMERS = {"id": "int", "first_name": "string", "last_name": "string", "email": "string"}


def case(folder: str, name: str) -> str:
    """A spec example (repaired where the spec text is not JSON) as one line."""
    return json.dumps(json.loads((CASES / folder / name).read_text()))


def test_postgres_spec_examples_apply(spark, tmp_path) -> None:
    """README's pg_inventory configuration (public.customers keyed on id);
    the examples in spec order, one archive hour each."""
    pg = "debezium_postgres"
    steps = [
        (["03_create.repaired.json"], {("1",): {"id": "1", "first_name": "Anne", "last_name": "Kretchmar", "email": "annek@noanswer.org"}}),
        (
            ["04_update.repaired.json"],
            {("1",): {"id": "1", "first_name": "Anne Marie", "last_name": "Kretchmar", "email": "annek@noanswer.org"}},
        ),
        (["06_message_transactional.repaired.json", "07_message_non_transactional.repaired.json", "08_delete.repaired.json"], {}),
    ]
    with source(tmp_path, pg, {"public.customers": {"primary_key": ["id"]}}, quarantine_max_share=0.0) as (settings, ns, _rewrite):
        for h, (names, rows) in enumerate(steps):
            result = hour(spark, settings, ns, h, [case(pg, n) for n in names])
            assert result.status == "complete", result.to_json()
            assert live_rows(spark, settings, ns, "customers", ["id"], CUSTOMERS) == rows, names
        assert result.messages["skipped:logical-message"] == 2
        assert deleted_rows(spark, settings, ns, "customers") == 1
        # the truncate as the spec shows it, then once more after the row came back
        assert hour(spark, settings, ns, 3, [case(pg, "05_truncate.repaired.json")]).status == "complete"
        assert hour(spark, settings, ns, 4, [case(pg, "03_create.repaired.json").replace("24023128", "46523200")]).status == "complete"
        assert len(live_rows(spark, settings, ns, "customers", ["id"], CUSTOMERS)) == 1
        result = hour(spark, settings, ns, 5, [case(pg, "05_truncate.repaired.json").replace("46523128", "46523300")])
        assert result.status == "complete", result.to_json()
        assert live_rows(spark, settings, ns, "customers", ["id"], CUSTOMERS) == {}


def test_sqlserver_spec_examples_apply(spark, tmp_path) -> None:
    ss = "debezium_sqlserver"
    anne = {"id": "1005", "first_name": "john", "last_name": "doe"}
    steps = [
        (
            [
                "13_transaction_begin.json",
                "08_create.repaired.json",
                "14_transaction_end.json",
                "03_schema_change.repaired.json",
                "04_schema_change_key.json",
                "05_schema_change_kafka_wrapper.json",
            ],
            {("1005",): {**anne, "email": "john.doe@example.org"}},
        ),
        (["11_update.repaired.json"], {("1005",): {**anne, "email": "noreply@example.org"}}),
        (["12_delete.repaired.json", "18_kafka_wrapper_tombstone.json"], {}),
    ]
    with source(tmp_path, ss, {"dbo.customers": {"primary_key": ["id"]}}, quarantine_max_share=0.0) as (settings, ns, _rewrite):
        for h, (names, rows) in enumerate(steps):
            result = hour(spark, settings, ns, h, [case(ss, n) for n in names])
            assert result.status == "complete", result.to_json()
            assert live_rows(spark, settings, ns, "customers", ["id"], CUSTOMERS) == rows, names
        assert result.messages["skipped:kafka-tombstone"] == 1


def test_sqlserver_schemaless_spec_examples_apply_with_declared_columns(spark, tmp_path) -> None:
    """The incremental-snapshot read and the transaction-enriched create show
    payloads only, of a customers table with other columns (pk, value / aa):
    a new table, so its columns are declared next to its key."""
    ss = "debezium_sqlserver"
    tables = {"dbo.customers": {"primary_key": ["pk"], "columns": {"pk": "int", "value": "string", "aa": "int"}}}
    # publish: events: the enriched create is one event of a transaction whose END marker is not in the
    # spec (the spec's END example counts 2 events of other tables); under the default, publish:
    # transactions, it is held until its transaction is whole (tests/test_transactions.py)
    with source(tmp_path, ss, tables, quarantine_max_share=0.0, publish="events") as (settings, ns, _rewrite):
        result = hour(
            spark, settings, ns, 0, [case(ss, "02_incremental_snapshot.repaired.json"), case(ss, "15_transaction_enrichment.repaired.json")]
        )
        assert result.status == "complete", result.to_json()
        cols = {"pk": "int", "value": "string", "aa": "int"}
        assert live_rows(spark, settings, ns, "customers", ["pk"], cols) == {
            ("1",): {"pk": "1", "value": "New data", "aa": None},
            ("2",): {"pk": "2", "value": None, "aa": "1"},
        }
