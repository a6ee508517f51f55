"""Issue 23 "wrong types coerced silently", decided per format and type
(docs/apply-semantics.md §10): a format whose JSON carries numbers and
booleans natively (Debezium's JsonConverter, CockroachDB's changefeed JSON)
gets no text or fraction in an integer column and no text or number in a
boolean column — the message is quarantined naming the column.  Formats that
send every value as text (SQL Server CES, Qlik) keep their text forms."""

from __future__ import annotations

import pytest

from cdc_apply.decode.base import DecodeContext
from cdc_apply.model import ChangeEvent, DecodeError, canonical_value
from tests.decode import test_cockroachdb as crdb
from tests.decode import test_debezium_postgres as pg

ID = pg.ID


@pytest.mark.parametrize(
    "field, value, reason",
    [
        (ID, "42", "int must be a JSON integer"),
        (ID, "+7", "int must be a JSON integer"),
        (ID, 5.0, "int must be a JSON integer"),
        (pg.typed("n", "int64"), "9007199254740993", "bigint must be a JSON integer"),
        (pg.typed("ok", "boolean"), "t", "boolean must be JSON true or false"),
        (pg.typed("ok", "boolean"), "true", "boolean must be JSON true or false"),
        (pg.typed("ok", "boolean"), 1, "boolean must be JSON true or false"),
        (pg.typed("ok", "boolean"), "yes", "boolean must be JSON true or false"),
        (pg.typed("born", "int32", "io.debezium.time.Date"), "19000", "must be a JSON integer"),
        (pg.typed("seen", "int64", "io.debezium.time.MicroTimestamp"), "1700000000000000", "must be a JSON integer"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else v["field"],
)
def test_debezium_values_of_the_wrong_json_type_are_quarantined(field, value, reason):
    fields = [ID] if field is ID else [ID, field]
    after = {"id": value} if field is ID else {"id": 1, field["field"]: value}
    assert reason in pg.quarantined(pg.message(after, fields))


@pytest.mark.parametrize(
    "field, value, expected",
    [
        (ID, 42, "42"),
        (pg.typed("ok", "boolean"), True, "true"),
        (pg.typed("born", "int32", "io.debezium.time.Date"), 19000, "2022-01-08"),
        (pg.typed("n", "int64"), None, None),
    ],
    ids=["int", "boolean", "date", "null"],
)
def test_debezium_values_as_the_converter_writes_them_are_read(field, value, expected):
    fields = [ID] if field is ID else [ID, field]
    after = {"id": value} if field is ID else {"id": 1, field["field"]: value}
    ev = pg.one_event(pg.message(after, fields))
    assert ev.after[field["field"]] == expected


def test_the_spec_key_example_with_digit_text_is_still_read():
    """The PostgreSQL connector spec's key example writes the INT32 key as "1":
    a Kafka key's integer field may be digit text (checked against the row)."""
    key = {"schema": {"type": "struct", "fields": [{"type": "int32", "optional": False, "field": "id"}]}, "payload": {"id": "1"}}
    ev = pg.one_event(pg.message({"id": 1}, [ID], key=key))
    assert ev.after == {"id": "1"} and ev.key_columns == ["id"]
    assert "key says" in pg.quarantined(pg.message({"id": 2}, [ID], key=key))


def test_schemaless_debezium_values_are_checked_by_the_stored_types():
    """Payloads without a schema: integers also as digit text (the SQL Server
    spec's schemaless examples write ``"pk": "1"``), booleans only as JSON booleans."""
    ctx = DecodeContext(stored_types={"items": {"id": "int", "ok": "boolean"}})
    assert pg.one_event(pg.message({"id": "1", "ok": True}), ctx).after == {"id": "1", "ok": "true"}
    assert "int must be a JSON integer" in pg.quarantined(pg.message({"id": "1.0", "ok": True}), ctx)
    assert "int must be a JSON integer" in pg.quarantined(pg.message({"id": 1.0, "ok": True}), ctx)
    assert "boolean must be JSON true or false" in pg.quarantined(pg.message({"id": 1, "ok": "t"}), ctx)
    assert pg.one_event(pg.message({"id": 1, "ok": False}), ctx).after == {"id": "1", "ok": "false"}


@pytest.mark.parametrize(
    "after, reason",
    [
        ('{"id": "7", "price": 1.00}', "bigint must be a JSON integer"),
        ('{"id": 7.0, "price": 1.00}', "bigint must be a JSON integer"),
        ('{"id": 7, "price": 1.00, "ok": "true"}', "boolean must be JSON true or false"),
        ('{"id": 7, "price": 1.00, "ok": 1}', "boolean must be JSON true or false"),
    ],
)
def test_cockroachdb_typed_values_of_the_wrong_json_type_are_quarantined(after, reason):
    assert reason in crdb.quarantined(crdb.enriched_with_schema(after))


def test_cockroachdb_typed_values_as_the_changefeed_writes_them_are_read():
    ev = crdb.one_event(crdb.enriched_with_schema('{"id": 7, "price": 1.00, "ok": false}'))
    assert isinstance(ev, ChangeEvent) and (ev.after["id"], ev.after["ok"]) == ("7", "false")


@pytest.mark.parametrize("typ, value, expected", [("int", "105", "105"), ("boolean", "1", "true"), ("boolean", "False", "false")])
def test_text_formats_keep_their_text_forms(typ, value, expected):
    """CES and Qlik send every value as text (the CES spec's ``"purchase_id": "105"``)."""
    assert canonical_value(typ, value) == expected


@pytest.mark.parametrize("typ, value", [("int", "1e3"), ("int", " "), ("boolean", "yes"), ("boolean", "on"), ("smallint", "40000")])
def test_text_formats_refuse_garbage_text(typ, value):
    with pytest.raises(DecodeError):
        canonical_value(typ, value)


def test_a_ces_value_that_does_not_fit_its_column_is_quarantined():
    """The CES spec's insert with quantity "many": quarantined naming the column."""
    from pathlib import Path

    from cdc_apply.decode.sqlserver_ces import SqlServerCesDecoder
    from cdc_apply.model import Quarantined, RawMessage

    line = (Path(__file__).parent / "cases" / "sqlserver_ces" / "01_insert.repaired.jsonl").read_text().splitlines()[0]
    one = '\\\\\\"quantity\\\\\\": \\\\\\"1\\\\\\"'
    assert one in line
    out = SqlServerCesDecoder(DecodeContext()).decode(RawMessage("f", 1, line.replace(one, one.replace('"1', '"many'))))
    assert len(out) == 1 and isinstance(out[0], Quarantined) and "quantity" in out[0].reason, out
    assert isinstance(SqlServerCesDecoder(DecodeContext()).decode(RawMessage("f", 1, line))[0], ChangeEvent)
