"""Leftovers of issues 23 and 24, on real Spark + Iceberg through the job:
one table arriving under two names (a CockroachDB topic without
``full_table_name`` next to an enriched ``source``), and events whose key
has no value (quarantined with a reason, never blocking the source)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml

from cdc_apply.archive.files import write_jsonl
from cdc_apply.batch import run_batch
from cdc_apply.config import Settings
from tests.apply_harness import apply_events, event, live_rows
from tests.test_cockroachdb_envelopes_apply import example, kafka

pytestmark = pytest.mark.spark
_n = itertools.count()

LAMP, SPEAKER, MOUSE = (
    "32856ed8-34d3-45a3-a449-412bdeaa277c",
    "58390d92-2472-43e1-86bc-1642395e8dad",
    "cb1a3e43-dccf-422f-a27d-ea027c233682",
)
PRODUCT_COLS = {"id": "string", "name": "string"}


@pytest.fixture
def source(monkeypatch, tmp_path):
    """A fresh CockroachDB source with the given options: (settings, name, archive folder)."""

    def make(**options):
        name = f"crdb_left_{next(_n)}"
        spec = {
            "format": "cockroachdb",
            "namespace": name,
            "quarantine_max_share": 0.0,
            "tables": {"products": {"primary_key": ["id"]}, "items": {"primary_key": ["id"]}},
            **options,
        }
        sources_file = tmp_path / f"{name}.yaml"
        sources_file.write_text(yaml.safe_dump({"sources": {name: spec}}))
        monkeypatch.setenv("CDC_SOURCES_FILE", str(sources_file))
        s = Settings.from_env()
        return s, name, Path(s.archive_dir) / name

    return make


def _names(spark, s, ns: str) -> set[tuple[str, ...]]:
    return set(live_rows(spark, s, ns, "products", ["id"], PRODUCT_COLS))


def _item(key: int, name: str, topic: str, updated: int) -> str:
    return json.dumps({"after": {"id": key, "name": name}, "key": [key], "topic": topic, "updated": f"{updated}.0000000000"})


# -- (a) one table under two names -------------------------------------------------------------


def test_a_table_under_a_bare_topic_and_its_qualified_name_in_one_batch_is_one_target(spark, source):
    """The products topic (no full_table_name) carrying an enriched message
    without source (04), and an enriched message naming test.public.products
    (06): one table, one target, both rows."""
    s, name, root = source(ordering="arrival")
    write_jsonl(root / "kafka" / "04.jsonl", [kafka("04_enriched_op", "products")])
    write_jsonl(root / "kafka" / "06.jsonl", [example("06_enriched_source")])
    result = run_batch(s, name, spark=spark)
    assert result.status == "complete", result.to_json()
    assert [t.table for t in result.tables] == [f"{s.catalog_name}.{name}.products"]
    assert _names(spark, s, name) == {(LAMP,), (SPEAKER,)}


def test_a_table_under_two_names_across_batches_stays_one_target(spark, source):
    """Batch 1 names it ``products`` only, batch 2 ``test.public.products``
    only, batch 3 ``products`` again: one target throughout."""
    s, name, root = source(ordering="arrival")
    write_jsonl(root / "kafka" / "a04.jsonl", [kafka("04_enriched_op", "products")])
    assert run_batch(s, name, spark=spark).status == "complete"
    write_jsonl(root / "kafka" / "b06.jsonl", [example("06_enriched_source")])
    result = run_batch(s, name, spark=spark)
    assert result.status == "complete", result.to_json()
    write_jsonl(root / "kafka" / "c13.jsonl", [kafka("13_enriched_kafka", "products")])
    result = run_batch(s, name, spark=spark)
    assert result.status == "complete", result.to_json()
    assert _names(spark, s, name) == {(LAMP,), (SPEAKER,), (MOUSE,)}
    assert (
        spark.sql(f"SHOW TABLES IN {s.catalog_name}.{name}")
        .where("tableName LIKE 'products%' AND NOT tableName LIKE '%_live' AND NOT tableName LIKE '%_changes'")
        .count()
        == 1
    )


def test_a_bare_name_matching_two_qualified_tables_is_refused_once_naming_them(spark, source):
    """``items`` next to ``db.a.items`` and ``db.b.items`` (each mapped to its
    own target): which one the bare name means cannot be known — refused,
    terminal, naming all three; nothing applied."""
    s, name, root = source(
        tables={"items": {"primary_key": ["id"]}, "db.a.items": {"target": "a_items"}, "db.b.items": {"target": "b_items"}}
    )
    write_jsonl(root / "kafka" / "1.jsonl", [_item(1, "x", "items", 1), _item(2, "y", "db.a.items", 2), _item(3, "z", "db.b.items", 3)])
    result = run_batch(s, name, spark=spark)
    assert result.status == "failed"
    bare = [t for t in result.tables if t.status == "failed"]
    assert bare and all(t.terminal for t in bare), result.to_json()
    text = " ".join(t.message for t in bare)
    assert "db.a.items" in text and "db.b.items" in text and "source table items is named without" in text, text
    assert not spark.catalog.tableExists(f"{s.catalog_name}.{name}.items")


# -- (c) events without a key value ----------------------------------------------------------------


def test_an_event_whose_key_has_no_value_is_quarantined_and_the_batch_completes(spark, settings):
    """The key is the table's (not the message's): only the job can tell the
    value is missing. The event is quarantined with its file, line and a
    reason naming the key column; the others apply; a later batch runs."""
    good = event("c", 1, {"name": "a"}, pos=1, file="/virtual/nullkey/f.jsonl", line=1)
    bad = event("c", 2, {"name": "b"}, pos=2, file="/virtual/nullkey/f.jsonl", line=2)
    bad.after["id"] = None
    res = apply_events(spark, settings, "nullkey", [good, bad])
    assert res.status == "complete", res.message
    assert res.messages["read"] == 2 and res.messages["event"] == 1 and res.messages["quarantined"] == 1, res.messages
    assert res.messages["quarantined:null-key"] == 1, res.messages
    q = spark.sql(
        f"SELECT file, line, reason, raw FROM {settings.catalog_name}.{settings.audit_namespace}.quarantine WHERE batch_id = '{res.batch_id}'"
    ).collect()
    assert [(r["file"], r["line"]) for r in q] == [("/virtual/nullkey/f.jsonl", 2)]
    assert "key column" in q[0]["reason"] and "id" in q[0]["reason"] and '"name":"b"' in q[0]["raw"]
    assert set(live_rows(spark, settings, "nullkey", "items", ["id"], {"id": "int", "name": "string"})) == {("1",)}
    table = res.tables[0]
    assert table.counts["inserted"] == 1 and table.counts["quarantined"] == 1
    later = apply_events(spark, settings, "nullkey", [event("u", 1, {"name": "c"}, pos=3)])
    assert later.status == "complete", later.message


def test_an_event_without_the_key_column_is_quarantined(spark, settings):
    """A payload-only message with no key of its own (no Kafka key archived,
    none configured) for a table in the lake: the stored key applies, and an
    event that does not carry it is quarantined, never a blocked table."""
    from cdc_apply.model import Column

    first = apply_events(spark, settings, "nokey", [event("c", 1, {"name": "a"}, pos=1)])
    assert first.status == "complete", first.message
    keyless = event("u", 2, {"name": "b"}, pos=2, file="/virtual/nokey/g.jsonl", line=7, columns=[Column("name", "string")])
    keyless.key_columns, keyless.after = [], {"name": "b"}
    res = apply_events(spark, settings, "nokey", [keyless, event("u", 1, {"name": "z"}, pos=3, file="/virtual/nokey/g.jsonl", line=8)])
    assert res.status == "complete", res.message
    assert res.messages["quarantined:null-key"] == 1 and res.messages["event"] == 1, res.messages
    assert live_rows(spark, settings, "nokey", "items", ["id"], {"id": "int", "name": "string"}) == {("1",): {"id": "1", "name": "z"}}


# -- (b) zstd archives end to end --------------------------------------------------------------------


def test_a_zstd_cloud_storage_file_is_applied(spark, source):
    """CockroachDB's cloud-storage sink with compression=zstd: the table from
    the file name, the lines from the zstd stream, decoded in Spark."""
    s, name, root = source()
    lines = [
        json.dumps({"after": {"id": k, "name": f"n{k}"}, "key": [k], "updated": f"{1700000000000000000 + k}.0000000000"}) for k in (1, 2, 3)
    ]
    path = write_jsonl(
        root / "2025-04-24" / "202504241459289627550000000000000-56087568dba1e6b8-1-72-00000000-items-1.ndjson.zst", lines, compress="zstd"
    )
    assert path.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"
    result = run_batch(s, name, spark=spark)
    assert result.status == "complete", result.to_json()
    assert result.messages == {"read": 3, "event": 3}
    assert set(live_rows(spark, s, name, "items", ["id"], {"id": "bigint", "name": "string"})) == {("1",), ("2",), ("3",)}
