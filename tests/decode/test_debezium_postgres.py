"""Debezium PostgreSQL decoder: golden spec examples, logical types, positions,
keys, quarantines and skips.  The golden helpers here are shared with the
SQL Server tests."""

from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_apply.decode import debezium_common as dc
from cdc_apply.decode import decoder_class
from cdc_apply.decode.base import DecodeContext, Decoder, decode_all
from cdc_apply.decode.debezium_common import PLACEHOLDER, PLACEHOLDER_B64
from cdc_apply.decode.debezium_postgres import DebeziumPostgresDecoder, parse_sequence
from cdc_apply.model import ChangeEvent, DecodeError, Op, Quarantined, RawMessage, Skipped
from tests.decode import outcome_dict

CASES = Path(__file__).parent / "cases"
REGEN = os.environ.get("DEBEZIUM_GOLDEN_REGEN") == "1"


# --------------------------------------------------------------------------
# Golden helpers (shared)


def golden_inputs(folder: str) -> list[Path]:
    return sorted(
        p
        for p in (CASES / folder).iterdir()
        if p.is_file() and p.suffix in (".json", ".jsonl", ".txt") and not p.name.endswith(".expected.json")
    )


def expected_path(path: Path) -> Path:
    return path.with_name(path.name.rsplit(".", 1)[0] + ".expected.json")


def messages_of(path: Path) -> list[RawMessage]:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [RawMessage(path.name, i, line) for i, line in enumerate(text.split("\n"), 1) if line.strip()]
    return [RawMessage(path.name, 1, text)]  # one (possibly pretty-printed) message per file


def check_golden(decoder_cls: type[Decoder], path: Path) -> list[Any]:
    exp_file = expected_path(path)
    spec = json.loads(exp_file.read_text()) if exp_file.exists() else {}
    ctx = DecodeContext(**spec.get("context", {}))
    msgs = messages_of(path)
    outcomes = list(decode_all(decoder_cls(ctx), msgs))
    # every message accounted for, raw text preserved for quarantines
    assert len(outcomes) >= len(msgs)
    for o in outcomes:
        assert o.file == path.name
        if isinstance(o, Quarantined):
            assert o.raw == msgs[o.line - 1].text
    got = [outcome_dict(o) for o in outcomes]
    if REGEN:
        data = {"context": spec["context"]} if "context" in spec else {}
        data["outcomes"] = got
        exp_file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    assert exp_file.exists(), f"no expected output for {path.name}"
    assert got == spec["outcomes"]
    if path.name.endswith(".verbatim.txt"):
        assert all(isinstance(o, Quarantined) for o in outcomes), "verbatim spec text must quarantine"
    return outcomes


# --------------------------------------------------------------------------
# Message builders

SOURCE = {
    "version": "2.7.0.Final",
    "connector": "postgresql",
    "name": "pg",
    "ts_ms": 1767225600000,
    "snapshot": "false",
    "db": "shop",
    "schema": "public",
    "table": "items",
    "txId": 42,
    "lsn": 24023128,
    "sequence": '["24023000","24023128"]',
}


def row_schema(fields: list[dict[str, Any]]) -> dict[str, Any]:
    row = {"type": "struct", "fields": fields, "optional": True, "name": "pg.public.items.Value"}
    return {
        "type": "struct",
        "name": "pg.public.items.Envelope",
        "optional": False,
        "fields": [
            {**row, "field": "before"},
            {**row, "field": "after"},
            {"type": "struct", "fields": [], "optional": False, "name": "io.debezium.connector.postgresql.Source", "field": "source"},
            {"type": "string", "optional": False, "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
        ],
    }


ID = {"type": "int32", "optional": False, "field": "id"}


def message(
    after: dict[str, Any] | None,
    fields: list[dict[str, Any]] | None = None,
    *,
    op: str = "c",
    before: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
    key: Any = "absent",
) -> str:
    payload = {"before": before, "after": after, "source": {**SOURCE, **(source or {})}, "op": op, "ts_ms": 1767225601000}
    value: Any = payload if fields is None else {"schema": row_schema(fields), "payload": payload}
    if key != "absent":
        value = {"key": key, "value": value}
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def decode(text: str, ctx: DecodeContext | None = None) -> list[Any]:
    return DebeziumPostgresDecoder(ctx).decode(RawMessage("t.jsonl", 1, text))


def one_event(text: str, ctx: DecodeContext | None = None) -> ChangeEvent:
    out = decode(text, ctx)
    assert len(out) == 1 and isinstance(out[0], ChangeEvent), out
    return out[0]


def quarantined(text: str, ctx: DecodeContext | None = None) -> str:
    out = decode(text, ctx)
    assert len(out) == 1 and isinstance(out[0], Quarantined), out
    return out[0].reason


def b64_unscaled(n: int) -> str:
    length = max(1, (n.bit_length() + 8) // 8)
    return base64.b64encode(n.to_bytes(length, "big", signed=True)).decode()


def dec_field(name: str, scale: int, precision: int | None = None) -> dict[str, Any]:
    params = {"scale": str(scale)}
    if precision is not None:
        params["connect.decimal.precision"] = str(precision)
    return {
        "type": "bytes",
        "optional": True,
        "name": "org.apache.kafka.connect.data.Decimal",
        "version": 1,
        "parameters": params,
        "field": name,
    }


def typed(name: str, literal: str, logical: str | None = None) -> dict[str, Any]:
    f = {"type": literal, "optional": True, "field": name}
    if logical:
        f["name"] = logical
    return f


# --------------------------------------------------------------------------
# Golden cases


@pytest.mark.parametrize("path", golden_inputs("debezium_postgres"), ids=lambda p: p.name)
def test_golden(path: Path) -> None:
    check_golden(DebeziumPostgresDecoder, path)


def test_golden_covers_every_spec_example() -> None:
    names = {p.name for p in golden_inputs("debezium_postgres")}
    spec = Path("/work/shared/formats/debezium-postgresql-events.txt")
    if spec.exists():
        n_examples = sum(1 for line in spec.read_text().splitlines() if line.startswith("{"))
        assert sum(1 for n in names if n.endswith(".verbatim.txt")) == n_examples


def test_golden_create_is_fully_typed() -> None:
    [ev] = check_golden(DebeziumPostgresDecoder, CASES / "debezium_postgres" / "03_create.repaired.json")
    assert [c.type for c in ev.columns] == ["int", "string", "string", "string"]
    assert ev.position == "00000000000024023128|0|00000000000024023119" and ev.tx_id == "555"  # snapshot: true


def test_a_transactions_changes_and_its_end_marker_share_the_txid_not_the_whole_id() -> None:
    """Real Debezium 3 with pgoutput writes ``transaction.id`` ``<txId>:<LSN>``
    with one LSN on the changes and another on the END marker (seen in the
    real-source capture): the group is the txId, or no PostgreSQL transaction
    would ever be complete."""
    create = json.loads((CASES / "debezium_postgres" / "03_create.repaired.json").read_text())
    payload = create.get("payload", create)
    payload["transaction"] = {"id": "757:26472928", "total_order": 1, "data_collection_order": 1}
    end = {"status": "END", "id": "757:26473112", "event_count": 1, "data_collections": [], "ts_ms": 1}
    dec = DebeziumPostgresDecoder(DecodeContext())
    [ev] = dec.decode_message(RawMessage("f", 1, json.dumps(create)))
    [marker] = dec.decode_message(RawMessage("f", 2, json.dumps({"payload": end})))
    assert (ev.tx_group, ev.tx_order, marker.tx_group, marker.tx_total) == ("757", 1, "757", 1)


@pytest.mark.parametrize("order,count", [(2**63, 1), (1, 2**63), (-1, 1), (1, -1)])
def test_a_transaction_order_or_count_outside_bigint_is_quarantined_naming_it(order, count) -> None:
    """``total_order`` and an END marker's ``event_count`` are carried as
    bigint: outside 0..2^63-1 the message is quarantined naming the field
    (before, the decode task died building its Arrow columns: the nemesis'
    hostile kind, Debezium SQL Server; the rule is the shared Debezium one)."""
    from cdc_apply.decode.base import decode_all
    from cdc_apply.model import Quarantined

    create = json.loads((CASES / "debezium_postgres" / "03_create.repaired.json").read_text())
    payload = create.get("payload", create)
    payload["transaction"] = {"id": "757:1", "total_order": order, "data_collection_order": 1}
    end = {"payload": {"status": "END", "id": "757:2", "event_count": count, "data_collections": [], "ts_ms": 1}}
    out = list(
        decode_all(DebeziumPostgresDecoder(DecodeContext()), [RawMessage("f", 1, json.dumps(create)), RawMessage("f", 2, json.dumps(end))])
    )
    field = "transaction.total_order" if order != 1 else "event_count"
    bad = [o for o in out if isinstance(o, Quarantined)]
    assert len(bad) == 1 and f"{field} {order if order != 1 else count} is out of range" in bad[0].reason, out


@pytest.mark.parametrize("field,value", [("ts_ms", 10**300), ("ts_us", 2**63), ("ts_ns", -(10**30)), ("ts_ms", 253402300800000)])
def test_a_commit_time_outside_the_timestamp_range_is_quarantined_naming_it(field, value) -> None:
    """A commit time beyond what a timestamp holds (0001..9999) is a damaged
    message, quarantined naming its field; before, the decode task died
    building its Arrow columns (the nemesis' hostile kind, seed 20,
    Debezium SQL Server, ``source.ts_ms`` of 301 digits)."""
    from cdc_apply.decode.base import decode_all
    from cdc_apply.model import Quarantined

    create = json.loads((CASES / "debezium_postgres" / "03_create.repaired.json").read_text())
    source = create.get("payload", create)["source"]
    for f in ("ts_ns", "ts_us", "ts_ms"):
        source.pop(f, None)
    source[field] = value
    [out] = decode_all(DebeziumPostgresDecoder(DecodeContext()), [RawMessage("f", 1, json.dumps(create))])
    assert isinstance(out, Quarantined) and f"source.{field} gives a commit time outside 0001-01-01..9999-12-31" in out.reason


# --------------------------------------------------------------------------
# Logical types


@pytest.mark.parametrize(
    "unscaled,scale,precision,expected_type,expected",
    [
        (150, 2, 10, "decimal(10,2)", "1.50"),
        (-150, 2, 10, "decimal(10,2)", "-1.50"),
        (-1, 2, 10, "decimal(10,2)", "-0.01"),
        (0, 3, 5, "decimal(5,3)", "0.000"),
        (-128, 0, 3, "decimal(3,0)", "-128"),
        (128, 0, 3, "decimal(3,0)", "128"),
        (10**38 - 1, 10, None, "decimal(38,10)", "9999999999999999999999999999.9999999999"),
        (-(10**38 - 1), 0, 38, "decimal(38,0)", "-" + "9" * 38),
        (12345, -2, 5, "decimal(7,0)", "1234500"),
    ],
)
def test_decimal(unscaled, scale, precision, expected_type, expected) -> None:
    ev = one_event(message({"id": 1, "amount": b64_unscaled(unscaled)}, [ID, dec_field("amount", scale, precision)]))
    assert ev.after["amount"] == expected
    assert ev.columns[1].type == expected_type


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decimal_shortcut_equals_the_decimal_path(data) -> None:
    """The no-Decimal shortcut for in-range decimal(p,s) values gives exactly
    the text of ``canonical(type, Decimal(unscaled).scaleb(-s))``."""
    precision = data.draw(st.integers(1, 38))
    scale = data.draw(st.integers(0, precision))
    unscaled = data.draw(st.integers(-(10**precision) + 1, 10**precision - 1) | st.integers(-300, 300))
    raw = b64_unscaled(unscaled)
    exact = dc._decimal_from_bytes(raw, scale, "c")
    assert dc._scaled_text(dc._unscaled(raw, "c"), scale) == f"{exact:f}"
    spec = dc.field_spec(dec_field("c", scale, precision))
    if abs(unscaled) < 10**precision:
        assert dc.convert_value(spec, raw, []) == dc.canonical(spec.spark_type, exact)


def test_decimal_that_does_not_fit_is_quarantined() -> None:
    reason = quarantined(message({"id": 1, "amount": b64_unscaled(10**10)}, [ID, dec_field("amount", 2, 10)]))
    assert "amount" in reason and "decimal(10,2)" in reason
    assert "decimal(39,2)" in quarantined(message({"id": 1, "amount": "AA=="}, [ID, dec_field("amount", 2, 39)]))
    assert "base64" in quarantined(message({"id": 1, "amount": "not base64!"}, [ID, dec_field("amount", 2, 10)]))


def test_decimal_numeric_json_stays_exact() -> None:
    """decimal.format=NUMERIC writes JSON numbers: never through float."""
    text = message({"id": 1, "amount": 0}, [ID, dec_field("amount", 2, 20)]).replace('"amount":0', '"amount":123456789012345678.91')
    assert one_event(text).after["amount"] == "123456789012345678.91"


def test_variable_scale_decimal() -> None:
    f = {
        "type": "struct",
        "optional": True,
        "name": "io.debezium.data.VariableScaleDecimal",
        "version": 1,
        "fields": [{"type": "int32", "field": "scale"}, {"type": "bytes", "field": "value"}],
        "field": "n",
    }
    ev = one_event(message({"id": 1, "n": {"scale": 5, "value": b64_unscaled(-123456789)}}, [ID, f]))
    assert ev.after["n"] == "-1234.56789"
    assert ev.columns[1].type == "string"
    assert any("VariableScaleDecimal" in n for n in ev.notes)


@pytest.mark.parametrize(
    "field,raw,expected_type,expected",
    [
        (typed("d", "int32", "io.debezium.time.Date"), 20454, "date", "2026-01-01"),
        (typed("d", "int32", "io.debezium.time.Date"), -1, "date", "1969-12-31"),
        (typed("d", "int32", "org.apache.kafka.connect.data.Date"), 0, "date", "1970-01-01"),
        (typed("d", "int32", "io.debezium.time.Time"), 45_296_789, "string", "12:34:56.789000"),
        (typed("d", "int64", "io.debezium.time.MicroTime"), 45_296_789_012, "string", "12:34:56.789012"),
        (typed("d", "int64", "io.debezium.time.MicroTime"), 86_400_000_000, "string", "24:00:00.000000"),
        (typed("d", "int64", "io.debezium.time.NanoTime"), 45_296_789_012_000, "string", "12:34:56.789012"),
        (typed("d", "int64", "io.debezium.time.NanoTime"), 45_296_789_012_300, "string", "12:34:56.789012300"),
        (typed("d", "int64", "io.debezium.time.Timestamp"), 1529507596945, "timestamp_ntz", "2018-06-20 15:13:16.945000"),
        (typed("d", "int64", "io.debezium.time.MicroTimestamp"), 1529507596945104, "timestamp_ntz", "2018-06-20 15:13:16.945104"),
        (typed("d", "int64", "io.debezium.time.MicroTimestamp"), -1, "timestamp_ntz", "1969-12-31 23:59:59.999999"),
        (typed("d", "int64", "io.debezium.time.NanoTimestamp"), 1529507596945104000, "timestamp_ntz", "2018-06-20 15:13:16.945104"),
        (typed("d", "int64", "org.apache.kafka.connect.data.Timestamp"), 0, "timestamp_ntz", "1970-01-01 00:00:00.000000"),
        (
            typed("d", "string", "io.debezium.time.ZonedTimestamp"),
            "2018-06-20T15:13:16.945104+02:00",
            "timestamp",
            "2018-06-20 13:13:16.945104",
        ),
        (typed("d", "string", "io.debezium.time.ZonedTimestamp"), "2018-06-20T15:13:16Z", "timestamp", "2018-06-20 15:13:16.000000"),
        (typed("d", "int8"), -128, "tinyint", "-128"),
        (typed("d", "int16"), 32767, "smallint", "32767"),
        (typed("d", "int32"), -(2**31), "int", "-2147483648"),
        (typed("d", "INT64"), 2**63 - 1, "bigint", str(2**63 - 1)),
        (typed("d", "float32"), 1.5, "float", "1.5"),
        (typed("d", "float64"), 0.1, "double", "0.1"),
        (typed("d", "boolean"), True, "boolean", "true"),
        (typed("d", "string"), "héllo\n", "string", "héllo\n"),
        (typed("d", "bytes"), "AAEC", "binary", "AAEC"),
        (typed("d", "string", "io.debezium.data.Json"), '{"a": 1}', "string", '{"a": 1}'),
        (
            typed("d", "string", "io.debezium.data.Uuid"),
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "string",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        ),
        (typed("d", "string", "io.debezium.data.Xml"), "<a/>", "string", "<a/>"),
        (typed("d", "int32", "io.debezium.time.Year"), 2026, "int", "2026"),
    ],
)
def test_logical_types(field, raw, expected_type, expected) -> None:
    ev = one_event(message({"id": 1, "d": raw}, [ID, field]))
    assert ev.after["d"] == expected
    assert ev.columns[1].type == expected_type
    assert ev.columns[1].nullable is True and ev.columns[0].nullable is False


def test_nano_timestamp_truncation_is_noted() -> None:
    ev = one_event(message({"id": 1, "d": 1529507596945104321}, [ID, typed("d", "int64", "io.debezium.time.NanoTimestamp")]))
    assert ev.after["d"] == "2018-06-20 15:13:16.945104"
    assert any("sub-microsecond" in n for n in ev.notes)


def test_unknown_types_become_text_with_a_note() -> None:
    fields = [
        ID,
        typed("g", "struct", "io.debezium.data.geometry.Point"),
        typed("a", "array"),
        typed("i", "int64", "io.debezium.time.MicroDuration"),
    ]
    ev = one_event(message({"id": 1, "g": {"x": 1.5, "y": 2}, "a": ["x", "y"], "i": 3600}, fields))
    assert ev.after == {"id": "1", "g": '{"x":1.5,"y":2}', "a": '["x","y"]', "i": "3600"}
    assert [c.type for c in ev.columns] == ["int", "string", "string", "string"]
    assert len([n for n in ev.notes if "unsupported type" in n]) == 3


@pytest.mark.parametrize(
    "field,raw",
    [
        (typed("d", "int8"), 300),
        (typed("d", "int32"), 2**31),
        (typed("d", "int32"), "x"),
        (typed("d", "int32"), True),
        (typed("d", "boolean"), "maybe"),
        (typed("d", "bytes"), "@@@"),
        (typed("d", "string"), 5),
        (typed("d", "float64"), "abc"),
        (typed("d", "int32", "io.debezium.time.Date"), 10**9),
        (typed("d", "int64", "io.debezium.time.MicroTime"), -5),
        (typed("d", "int64", "io.debezium.time.MicroTimestamp"), 10**20),
        (typed("d", "string", "io.debezium.time.ZonedTimestamp"), "yesterday"),
    ],
)
def test_value_not_fitting_its_type_is_quarantined(field, raw) -> None:
    reason = quarantined(message({"id": 1, "d": raw}, [ID, field]))
    assert "column d" in reason


def test_placeholder_means_not_present() -> None:
    fields = [ID, typed("s", "string"), typed("b", "bytes"), typed("a", "array"), typed("n", "string")]
    after = {"id": 1, "s": PLACEHOLDER, "b": PLACEHOLDER_B64, "a": [PLACEHOLDER], "n": None}
    ev = one_event(message(after, fields, op="u", before={"id": 1, "s": None, "b": None, "a": None, "n": None}))
    assert ev.after == {"id": "1", "n": None}
    assert "s" not in ev.after and "b" not in ev.after and "a" not in ev.after
    # the base64 form is only a placeholder for bytes columns
    ev = one_event(message({"id": 1, "s": PLACEHOLDER_B64}, [ID, typed("s", "string")]))
    assert ev.after["s"] == PLACEHOLDER_B64


def test_placeholder_in_a_key_column_is_quarantined() -> None:
    key = {
        "schema": {"type": "struct", "fields": [{"type": "string", "optional": False, "field": "code"}]},
        "payload": {"code": PLACEHOLDER},
    }
    assert "key column code" in quarantined(message({"code": "x"}, [typed("code", "string")], key=key))


def test_schemaless_values() -> None:
    text = message({"id": 7, "price": 0, "ok": False, "tags": ["a"], "s": "x", "z": None}).replace(
        '"price":0', '"price":12345678901234567890.125'
    )
    ev = one_event(text, DecodeContext(primary_keys={"items": ["id"]}))
    assert ev.columns is None
    assert ev.after == {"id": "7", "price": "12345678901234567890.125", "ok": "false", "tags": '["a"]', "s": "x", "z": None}
    assert ev.key_columns == ["id"]
    assert any("no schema" in n for n in ev.notes)


# --------------------------------------------------------------------------
# Keys


KEY = {
    "schema": {
        "type": "struct",
        "name": "pg.public.items.Key",
        "optional": False,
        "fields": [{"type": "int32", "optional": False, "field": "id"}],
    },
    "payload": {"id": 1},
}


def test_key_from_kafka_key_wins_over_configuration() -> None:
    ctx = DecodeContext(primary_keys={"public.items": ["name"]})
    ev = one_event(message({"id": 1, "name": "a"}, [ID, typed("name", "string")], key=KEY), ctx)
    assert ev.key_columns == ["id"]


def test_key_as_json_text_and_value_as_json_text() -> None:
    inner = json.loads(message({"id": 1, "name": "a"}, [ID, typed("name", "string")]))
    text = orjson.dumps({"key": orjson.dumps(KEY).decode(), "value": orjson.dumps(inner).decode(), "topic": "pg.public.items"}).decode()
    ev = one_event(text)
    assert ev.key_columns == ["id"] and ev.after == {"id": "1", "name": "a"}


def test_schemaless_kafka_key_uses_value_types() -> None:
    ev = one_event(message({"id": 1}, [ID], key={"id": "1"}))
    assert ev.key_columns == ["id"] and ev.after == {"id": "1"}


def test_key_and_row_disagree_is_quarantined() -> None:
    assert "key says" in quarantined(message({"id": 2}, [ID], key=KEY))


def test_configured_key_and_keyless() -> None:
    text = message({"id": 1, "name": "a"}, [ID, typed("name", "string")])
    assert one_event(text, DecodeContext(primary_keys={"shop.public.items": ["id"]})).key_columns == ["id"]
    assert one_event(text, DecodeContext(primary_keys={"items": ["id", "name"]})).key_columns == ["id", "name"]
    assert one_event(text).key_columns == []  # never guessed
    assert "configured key column code" in quarantined(text, DecodeContext(primary_keys={"items": ["code"]}))


def test_delete_puts_key_values_in_before() -> None:
    ev = one_event(message(None, [ID, typed("name", "string")], op="d", before={"id": 5, "name": None}, key={**KEY, "payload": {"id": 5}}))
    assert ev.op is Op.DELETE and ev.after == {} and ev.before == {"id": "5", "name": None}
    # a delete with no before image (REPLICA IDENTITY NOTHING) still has its key
    ev = one_event(message(None, [ID], op="d", key={**KEY, "payload": {"id": 5}}))
    assert ev.before == {"id": "5"}
    assert "delete without" in quarantined(message(None, [ID], op="d"))


def test_snapshot_read_and_update() -> None:
    ev = one_event(message({"id": 1}, [ID], op="r", key=KEY))
    assert ev.op is Op.READ and ev.after == {"id": "1"} and ev.before is None
    ev = one_event(message({"id": 1}, [ID], op="u", before={"id": 1}, key=KEY))
    assert ev.op is Op.UPDATE and ev.before == {"id": "1"}


# --------------------------------------------------------------------------
# Positions, transaction, commit time


def test_position_is_padded_lsn_and_orders_like_the_lsn() -> None:
    rng = random.Random(7)
    lsns = [rng.randrange(0, 2**64) for _ in range(300)] + [0, 9, 10, 99, 100, 2**64 - 1]
    events = [one_event(message({"id": 1}, [ID], source={"lsn": n, "sequence": None})) for n in lsns]
    assert all(len(e.position) == 43 for e in events)
    assert sorted(events, key=lambda e: e.position) == sorted(events, key=lambda e: int(e.position[:20]))
    assert [int(e.position[:20]) for e in events] == lsns


def test_lsn_as_digit_string_is_accepted() -> None:
    assert (
        one_event(message({"id": 1}, [ID], source={"lsn": "123", "sequence": None})).position
        == "00000000000000000123|1|00000000000000000000"
    )


def test_sequence_is_parsed_as_integers() -> None:
    assert parse_sequence('["9","10"]') == (9, 10)  # as text "9" > "10"
    assert parse_sequence('[null,"10"]') == (None, 10)
    assert parse_sequence(None) is None
    for bad in ('["a","1"]', '["1"]', "[1,2", 5, '["-1","2"]'):
        with pytest.raises(DecodeError):
            parse_sequence(bad)
    assert "source.sequence" in quarantined(message({"id": 1}, [ID], source={"sequence": "[1,2"}))


def test_sequence_disagreeing_with_lsn_is_noted() -> None:
    ev = one_event(message({"id": 1}, [ID], source={"lsn": 100, "sequence": '["50","99"]'}))
    assert ev.position == "00000000000000000100|1|00000000000000000050" and any("differs" in n for n in ev.notes)


def test_tx_and_commit_time() -> None:
    ev = one_event(message({"id": 1}, [ID]))
    assert ev.tx_id == "42" and ev.commit_ts_us == 1767225600000 * 1000
    ev = one_event(message({"id": 1}, [ID], source={"ts_us": 1767225600000123}))
    assert ev.commit_ts_us == 1767225600000123
    ev = one_event(message({"id": 1}, [ID], source={"ts_us": 1, "ts_ns": 1767225600000123456}))
    assert ev.commit_ts_us == 1767225600000123


def test_truncate() -> None:
    text = message(None, None, op="t")
    [ev] = decode(text)
    assert ev.op is Op.TRUNCATE and ev.key_columns == [] and ev.after == {} and ev.table == "items"
    assert ev.position == "00000000000024023128|1|00000000000024023000" and ev.tx_id == "42"


# --------------------------------------------------------------------------
# Quarantines and skips


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"payload": {"op": "c",', "malformed JSON"),
        ("[1, 2]", "not a JSON object"),
        (message({"id": 1}, [ID], op="x"), "unknown op 'x'"),
        (message({"id": 1}, [ID], source={"lsn": None}), "source.lsn is missing"),
        (message({"id": 1}, [ID], source={"lsn": -5}), "negative"),
        (message({"id": 1}, [ID], source={"lsn": 2**70}), "wider than 20"),
        (message({"id": 1}, [ID], source={"lsn": "0x10"}), "source.lsn"),
        (message({"id": 1}, [ID], source={"table": ""}), "table name is empty"),
        (message({"id": 1}, [ID], source={"table": "a\x00b"}), "control character"),
        (message({"id": 1}, [ID], source={"schema": 5}), "schema name must be a string"),
        (message({"id": 1, "x\ty": 2}, None), "control character"),
        (message({"id": 1, "zz": 2}, [ID]), "not declared in the schema"),
        (message({"id": 1}, [ID], source={"connector": "sqlserver"}), "expected 'postgresql'"),
        (message(None, [ID]), "without an after image"),
        (
            '{"schema": {"type": "struct", "name": "pg.public.items.Key", "fields": [{"type": "int32", "field": "id"}]}, "payload": {"id": 1}}',
            "key record",
        ),
        ('{"hello": "world"}', "no 'op'"),
        ('{"key": "not json", "value": null}', "Kafka key"),
    ],
)
def test_quarantine(text, needle) -> None:
    assert needle in quarantined(text)


@pytest.mark.parametrize(
    "text,reason",
    [
        ('{"key": {"id": 1}, "value": null}', "kafka-tombstone"),
        ('{"key": "{\\"id\\": 1}", "value": null, "topic": "pg.public.items", "partition": 0, "offset": 9}', "kafka-tombstone"),
        ('{"status": "BEGIN", "id": "571:53195832", "ts_ms": 1, "event_count": null, "data_collections": null}', "transaction-marker"),
        (
            '{"schema": null, "payload": {"status": "END", "id": "571:53195832", "ts_ms": 1, "event_count": 2, "data_collections": []}}',
            "transaction-marker",
        ),
        (message(None, None, op="m").replace('"after":null', '"message":{"prefix":"p","content":"eA=="}'), "logical-message"),
        ('{"ts_ms": 1767225600000}', "heartbeat"),
        ('{"payload": {"source": {}, "databaseName": "shop", "ddl": "ALTER TABLE t ADD c int", "tableChanges": []}}', "schema-change"),
    ],
)
def test_skip(text, reason) -> None:
    [out] = decode(text)
    assert isinstance(out, Skipped) and out.reason == reason


def test_every_message_accounted_for() -> None:
    lines = [message({"id": 1}, [ID], key=KEY), '{"key": {"id": 1}, "value": null}', "not json", "", message(None, None, op="t")]
    out = list(decode_all(DebeziumPostgresDecoder(), [RawMessage("f", i, t) for i, t in enumerate(lines, 1)]))
    assert [type(o).__name__ for o in out] == ["ChangeEvent", "Skipped", "Quarantined", "ChangeEvent"]
    assert [o.line for o in out] == [1, 2, 3, 5]


def test_registry_and_sniff() -> None:
    assert decoder_class("debezium_postgres") is DebeziumPostgresDecoder
    text = message({"id": 1}, [ID])
    assert DebeziumPostgresDecoder.sniff(text)
    assert not DebeziumPostgresDecoder.sniff(text.replace("postgresql", "sqlserver"))
