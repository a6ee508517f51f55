"""SQL Server CES and Qlik Replicate through the whole job (files -> decode in
Spark -> apply -> publish -> ledger), on real Spark + Iceberg:

* every message example of the two specs applies to a table with golden rows,
  under a source configured as the README documents (format + namespace);
* held messages (an incomplete CES split group, Qlik data waiting for its
  metadata) are applied once released, in a later batch, even when the table
  was written from the same file in the batch that held them, with nothing
  counted or quarantined twice;
* a re-sent segment of an already-applied split message does not keep its file
  pending.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from cdc_apply.archive.files import write_jsonl
from cdc_apply.batch import pending_files, run_batch
from tests.apply_harness import live_rows
from tests.decode import test_qlik as qlik
from tests.decode import test_sqlserver_ces as ces

pytestmark = [pytest.mark.spark]
_n = itertools.count()
CES_CASES = Path(__file__).parent / "decode" / "cases" / "sqlserver_ces"
QLIK_CASES = Path(__file__).parent / "decode" / "cases" / "qlik"


@pytest.fixture
def source(settings, tmp_path, monkeypatch):
    """A fresh source of a format, configured like include/sources.yaml's
    ``ces_shop`` / ``qlik_shop`` (format and namespace only; extra options per test)."""

    def make(fmt: str, **options: Any):
        from cdc_apply.config import Settings

        name = f"{fmt}_{next(_n)}_{tmp_path.name[-8:].lower()}".replace("-", "_")
        path = tmp_path / "sources.yaml"
        path.write_text(yaml.safe_dump({"sources": {name: {"format": fmt, "namespace": name, **options}}}))
        monkeypatch.setenv("CDC_SOURCES_FILE", str(path))
        return name, Settings.from_env()

    return make


def put(s, name: str, hour: int, lines: list[str]) -> Path:
    return write_jsonl(Path(s.archive_dir) / name / f"2026/03/01/{hour:02d}" / "part-0.jsonl", lines)


def quarantine_rows(spark, s, name: str) -> list[tuple[str, int]]:
    ident = f"{s.catalog_name}.{s.audit_namespace}.quarantine"
    if not spark.catalog.tableExists(ident):
        return []
    return sorted((r.file, r.line) for r in spark.sql(f"SELECT file, line FROM {ident} WHERE source = '{name}'").collect())


# --------------------------------------------------------------------------
# Every spec example applies


PURCHASES = {
    "purchase_id": "int",
    "customer_name": "string",
    "product_id": "int",
    "product_name": "string",
    "price_per_item": "int",
    "quantity": "int",
    "purchase_date": "timestamp_ntz",
    "payment_method": "string",
}
INSERTED = {
    "purchase_id": "105",
    "customer_name": "Anna Doe",
    "product_id": "101",
    "product_name": "Game 2077",
    "price_per_item": "60",
    "quantity": "1",
    "purchase_date": "2025-03-14 16:45:01.000000",
    "payment_method": "Credit Card",
}
UPDATED = {**INSERTED, "product_id": "100", "product_name": "Game 2066", "price_per_item": "50", "quantity": "2"}


def test_ces_spec_examples_apply_verbatim(spark, source):
    """The spec's insert, update and delete, as printed (no eventsource.transaction),
    one hourly file each: the table goes through the rows they describe."""
    name, s = source("sqlserver_ces")
    expected = [{("105",): INSERTED}, {("105",): UPDATED}, {}]
    for hour, (example, rows) in enumerate(zip(("01_insert", "02_update", "03_delete"), expected)):
        put(s, name, hour, [(CES_CASES / f"{example}.verbatim.jsonl").read_text().strip()])
        result = run_batch(s, name, spark=spark)
        assert result.status == "complete", result.to_json()
        assert result.messages == {"read": 1, "event": 1}, result.messages
        assert live_rows(spark, s, name, "purchases", ["purchase_id"], PURCHASES) == rows
    # the delete left a tombstone at its logicalid position
    [tomb] = spark.sql(f"SELECT _cdc_position, _cdc_deleted FROM {s.catalog_name}.{name}.purchases").collect()
    assert (tomb._cdc_position, tomb._cdc_deleted) == ("0000002c000003600019|00000000000000000001", True)


def test_ces_spec_examples_apply_in_one_batch_in_any_order(spark, source):
    name, s = source("sqlserver_ces")
    put(s, name, 0, [(CES_CASES / f"{e}.verbatim.jsonl").read_text().strip() for e in ("02_update", "03_delete", "01_insert")])
    assert run_batch(s, name, spark=spark).status == "complete"
    assert live_rows(spark, s, name, "purchases", ["purchase_id"], PURCHASES) == {}
    put(s, name, 1, [(CES_CASES / f"{e}.verbatim.jsonl").read_text().strip() for e in ("02_update", "01_insert")])
    result = run_batch(s, name, spark=spark)  # late re-deliveries cannot resurrect the deleted row
    assert result.status == "complete" and result.tables[0].counts["superseded"] == 2, result.to_json()
    assert live_rows(spark, s, name, "purchases", ["purchase_id"], PURCHASES) == {}


def golden_lines(case: str) -> list[str]:
    return [t for t in (QLIK_CASES / f"{case}.jsonl").read_text().split("\n") if t.strip()]


def orders(spark, s, name: str) -> dict[tuple, dict[str, str | None]]:
    """SALES.ORDERS' live rows as text (binary as base64, as the decoder's canonical text)."""
    table = spark.table(f"{s.catalog_name}.{name}.orders").where("NOT _cdc_deleted")
    cols = [c for c in table.columns if not c.startswith("_cdc_")]
    sel = [
        f"CASE WHEN `{c}` IS NULL THEN NULL ELSE "
        + {"binary": f"base64(`{c}`)", "timestamp_ntz": f"date_format(`{c}`, 'yyyy-MM-dd HH:mm:ss.SSSSSS')"}.get(
            dict(table.dtypes)[c], f"CAST(`{c}` AS string)"
        )
        + f" END AS `{c}`"
        for c in cols
    ]
    return {(r["ORDER_ID"], r["LINE_NO"]): r.asDict() for r in table.selectExpr(*sel).collect()}


ROW = {
    "ORDER_ID": "1001",
    "LINE_NO": "1",
    "CUSTOMER": "Zoë Ångström",
    "AMOUNT": "1234.50",
    "PRICE": "19.99",
    "ACTIVE": "true",
    "ORDER_DATE": "2026-03-01",
    "UPDATED_AT": "2026-03-02 09:20:11.123456",
    "NOTE": "gift wrap",
    "PHOTO": "iVBORw==",
    "BIG_COUNTER": "18446744073709551615",
    "PICKUP_TIME": "14:30:00",
}
ROW_UPDATED = {**ROW, "AMOUNT": "1300.00", "ACTIVE": "false", "UPDATED_AT": "2026-03-02 09:21:00.000000"}
QLIK_STEPS = [  # golden case -> the live rows it leaves
    ("02_refresh", {("1001", "1"): ROW}),
    ("03_insert", {("1001", "1"): ROW}),
    ("04_update_before", {("1001", "1"): ROW_UPDATED}),
    # columnMask: NOTE and PHOTO not present (kept), CUSTOMER present as NULL
    ("05_update_partial_mask", {("1001", "1"): {**ROW_UPDATED, "CUSTOMER": None}}),
    ("06_delete", {}),
    # UPDATE of LINE_NO 1 -> 2 (after the delete: the old key stays deleted, the new key appears)
    ("07_pk_change_update", {("1001", "2"): {**ROW_UPDATED, "LINE_NO": "2"}}),
]


def test_qlik_cases_apply_with_golden_rows(spark, source):
    """The Qlik spec has field tables but no JSON examples: its hand-built golden
    cases (one per operation and mask rule the spec describes, see
    tests/decode/cases/qlik/README.md) applied as hourly files, each with the
    rows it must leave."""
    # publish: events: the hand-built cases share one transactionId with counters that do not make
    # a whole transaction per case (03 is event 1, not the last); transactions: tests/test_transactions.py
    name, s = source("qlik", publish="events")
    meta = golden_lines("01_metadata")
    for hour, (case, expected) in enumerate(QLIK_STEPS):
        lines = golden_lines(case)
        put(s, name, hour, lines if hour == 0 else [line for line in lines if line not in meta])
        result = run_batch(s, name, spark=spark)
        assert result.status == "complete", result.to_json()
        assert not result.held_files and "quarantined" not in result.messages, result.messages
        assert orders(spark, s, name) == expected, case


# --------------------------------------------------------------------------
# Held messages are applied once released, exactly once


def ces_event(key: int, seq: int, name: str = "a", op: str = "INS", **kw: Any) -> str:
    return ces.message(
        op,
        id=f"e{key}-{seq}",
        current={"id": str(key), "name": name},
        pkkey=[{"columnname": "id", "value": str(key)}],
        tx={**ces.TX, "sequencenumber": seq},
        **kw,
    )


def split_insert() -> tuple[str, str]:
    """The two segments of a CES insert of key 2 split in two (logical id ``split-1``)."""
    big = ces.message(
        "INS",
        id="big",
        logicalid="split-1",
        current={"id": "2", "name": "x" * 300},
        pkkey=[{"columnname": "id", "value": "2"}],
        tx={**ces.TX, "sequencenumber": 5},
    )
    seg0, seg1 = ces.segments(big, 2, id_prefix="big")
    return seg0, seg1


def test_ces_split_across_two_hourly_files_is_applied(spark, source):
    """Segment 0 of a split insert lands next to complete events of the same
    table; segment 1 an hour later. The first batch holds the file, the second
    reassembles the event from it and must apply it (not filter it out as a file
    the table has seen), without counting or quarantining the first file's other
    lines again."""
    from cdc_apply.config import get_source

    name, s = source("sqlserver_ces", quarantine_max_share=1.0)
    seg0, seg1 = split_insert()
    first = put(s, name, 0, [ces_event(1, 1), seg0, "{not json", ces_event(3, 3)])
    r1 = run_batch(s, name, spark=spark)
    assert r1.status == "complete" and r1.held_files == [str(first)], r1.to_json()
    assert (r1.messages["read"], r1.messages["event"], r1.messages["held:incomplete-split"], r1.messages["quarantined"]) == (4, 2, 1, 1)
    assert set(live_rows(spark, s, name, "items", ["id"], {"id": "int", "name": "string"})) == {("1",), ("3",)}
    assert [f.path for f in pending_files(s, get_source(s, name))] == [str(first)]

    put(s, name, 1, [seg1])
    r2 = run_batch(s, name, spark=spark)
    assert r2.status == "complete" and not r2.held_files, r2.to_json()
    rows = live_rows(spark, s, name, "items", ["id"], {"id": "int", "name": "string"})
    assert set(rows) == {("1",), ("2",), ("3",)} and rows[("2",)]["name"] == "x" * 300
    # the second batch accounts for the held segment and its new partner only
    assert r2.messages["read"] == 2 and r2.messages["event"] == 1 and r2.messages.get("skipped") == 1, r2.messages
    assert "quarantined" not in r2.messages
    assert r2.tables[0].counts["inserted"] == 1 and r2.tables[0].counts.get("duplicates", 0) == 0, r2.tables[0].counts
    assert quarantine_rows(spark, s, name) == [(str(first), 3)]
    assert run_batch(s, name, spark=spark).status == "nothing-to-do"


def test_qlik_data_one_batch_before_its_metadata_is_applied(spark, source):
    """Table S.T is known at version 1; a row of version 2 (a new column w)
    arrives one batch before the version-2 metadata, in a file whose other rows
    the first batch applies to the same table."""
    name, s = source("qlik")
    v1 = {"id": ("INT4", 1), "v": ("STRING", 0)}
    v2 = {**v1, "w": ("STRING", 0)}
    first = put(
        s, name, 0, [qlik.meta(v1, version=1), qlik.data({"id": 1, "v": "a"}, seq=1), qlik.data({"id": 2, "v": "b", "w": "x"}, seq=2)]
    )
    r1 = run_batch(s, name, spark=spark)
    assert r1.status == "complete" and r1.held_files == [str(first)], r1.to_json()
    assert r1.messages.get("held:missing-table-metadata") == 1
    assert set(live_rows(spark, s, name, "t", ["id"], {"id": "int", "v": "string"})) == {("1",)}

    put(s, name, 1, [qlik.meta(v2, version=2), qlik.data({"id": 1, "v": "c", "w": "y"}, "UPDATE", seq=3)])
    r2 = run_batch(s, name, spark=spark)
    assert r2.status == "complete" and not r2.held_files, r2.to_json()
    cols = {"id": "int", "v": "string", "w": "string"}
    assert live_rows(spark, s, name, "t", ["id"], cols) == {
        ("1",): {"id": "1", "v": "c", "w": "y"},
        ("2",): {"id": "2", "v": "b", "w": "x"},
    }
    # the first file's metadata and applied row are not read into the second batch's accounts again
    assert r2.messages["read"] == 3 and r2.messages["event"] == 2, r2.messages
    assert r2.tables[0].counts["inserted"] == 1 and r2.tables[0].counts["updated"] == 1, r2.tables[0].counts
    assert run_batch(s, name, spark=spark).status == "nothing-to-do"


def test_resent_segment_of_an_applied_split_message_does_not_stay_pending(spark, source):
    """Issue 24.2: a file with a copy of an applied segment (same source + id)
    next to a new event is applied, the copy counted as a duplicate segment."""
    from cdc_apply.config import get_source

    name, s = source("sqlserver_ces")
    big = ces.message(
        "INS",
        id="big",
        logicalid="split-9",
        current={"id": "2", "name": "x" * 300},
        pkkey=[{"columnname": "id", "value": "2"}],
        tx={**ces.TX, "sequencenumber": 5},
    )
    seg0, seg1 = ces.segments(big, 2, id_prefix="big")
    put(s, name, 0, [seg0, seg1])
    assert run_batch(s, name, spark=spark).status == "complete"
    second = put(s, name, 1, [seg1, ces_event(1, 9)])
    r2 = run_batch(s, name, spark=spark)
    assert r2.status == "complete" and not r2.held_files, r2.to_json()
    assert r2.messages.get("skipped:duplicate-segment") == 1 and r2.messages["event"] == 1, r2.messages
    assert pending_files(s, get_source(s, name)) == []
    assert str(second) not in [f.path for f in pending_files(s, get_source(s, name))]
    assert set(live_rows(spark, s, name, "items", ["id"], {"id": "int", "name": "string"})) == {("1",), ("2",)}


def test_a_rerun_after_the_change_log_s_publish_logs_a_held_file_s_lines_once(spark, source):
    """A file with a held message is in no ledger's ``cdc.files`` until it is
    released (held.py).  A run publishes the change log, then dies before the
    table's publish; its batch runs again (the same files: the same batch
    id).  The change log cannot tell by the file that it holds the file's
    other lines already: it tells by the batch, and logs nothing again.  The
    released message is logged once, by the batch that releases it."""
    from cdc_apply import ledger
    from cdc_apply.apply import changelog

    name, s = source("sqlserver_ces", quarantine_max_share=1.0)
    seg0, seg1 = split_insert()
    first = put(s, name, 0, [ces_event(1, 1), seg0, ces_event(3, 3)])
    r1 = run_batch(s, name, spark=spark, stages=("write", "validate"))
    tr = r1.tables[0]
    assert tr.status == "validated" and tr.changelog and r1.held_files == [str(first)], r1.to_json()
    changelog.publish(ledger.Ledger(s), tr)  # the kill lands after this

    def logged() -> list[tuple[str, int, str]]:
        rows = spark.table(tr.changelog).select("file", "line", "position").collect()
        return sorted((Path(r["file"]).name, r["line"], r["position"]) for r in rows)

    assert len(logged()) == 2
    r2 = run_batch(s, name, spark=spark)
    assert r2.batch_id == r1.batch_id and r2.status == "complete", r2.to_json()
    assert len(logged()) == 2, logged()
    put(s, name, 1, [seg1])
    assert run_batch(s, name, spark=spark).status == "complete"
    assert len(logged()) == 3 == len(set(logged())), logged()
    assert set(live_rows(spark, s, name, "items", ["id"], {"id": "int", "name": "string"})) == {("1",), ("2",), ("3",)}
