"""Debezium archive shapes both decoders must read: Kafka tombstone lines,
the tie-breakers inside positions, and ``change_id`` pairing the two halves
of a primary-key update (issues 17 and 24)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cdc_apply.decode.base import DecodeContext, decode_all
from cdc_apply.decode.debezium_postgres import DebeziumPostgresDecoder
from cdc_apply.decode.debezium_sqlserver import DebeziumSqlServerDecoder
from cdc_apply.model import ChangeEvent, Op, RawMessage, Skipped

DECODERS = [DebeziumPostgresDecoder, DebeziumSqlServerDecoder]
KEYS = DecodeContext(primary_keys={"items": ["id"]})


def decode(cls, *lines: str, ctx: DecodeContext = KEYS) -> list[Any]:
    return list(decode_all(cls(ctx), [RawMessage("f.jsonl", i, t) for i, t in enumerate(lines, 1)]))


def pg(op: str, key: int, *, lsn: int, tx: int = 7, snapshot: Any = "false", seq: str | None = None, name: str | None = "a") -> str:
    source = {
        "connector": "postgresql",
        "db": "shop",
        "schema": "public",
        "table": "items",
        "txId": tx,
        "lsn": lsn,
        "snapshot": snapshot,
        "ts_ms": 1,
    }
    if seq is not None:
        source["sequence"] = seq
    row = {"id": key, "name": name}
    payload = {"before": row if op == "d" else None, "after": None if op == "d" else row, "source": source, "op": op}
    return json.dumps({"schema": None, "payload": payload})


def ss(op: str, key: int, *, commit: str, change: str | None, serial: int, name: str = "a") -> str:
    source = {
        "connector": "sqlserver",
        "db": "shop",
        "schema": "dbo",
        "table": "items",
        "commit_lsn": commit,
        "change_lsn": change,
        "event_serial_no": serial,
        "ts_ms": 1,
    }
    row = {"id": key, "name": name}
    payload = {"before": row if op == "d" else None, "after": None if op == "d" else row, "source": source, "op": op}
    return json.dumps({"schema": None, "payload": payload})


# --------------------------------------------------------------------------
# 1. Kafka tombstones written as lines of their own


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.format.value)
@pytest.mark.parametrize(
    "line", ["null", " null ", '{"schema":null,"payload":null}', '{"payload": null}', '{"key": {"id": 1}, "value": null}']
)
def test_tombstone_lines_are_skipped(cls, line) -> None:
    (out,) = decode(cls, line)
    assert isinstance(out, Skipped) and out.reason == "kafka-tombstone", out
    assert (out.file, out.line) == ("f.jsonl", 1)


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.format.value)
@pytest.mark.parametrize("line", ["true", "1", '"null"', "[]", '{"schema":{"type":"struct"},"payload":null}'])
def test_other_non_objects_are_still_quarantined(cls, line) -> None:
    (out,) = decode(cls, line)
    assert type(out).__name__ == "Quarantined", out


# --------------------------------------------------------------------------
# 4. Tie-breakers: two events of one key at what would otherwise be one position


def test_sqlserver_same_lsns_are_ordered_by_event_serial_no() -> None:
    lsn = "0000002a:00000358:0003"
    create, delete = decode(
        DebeziumSqlServerDecoder, ss("c", 1, commit=lsn, change=lsn, serial=2), ss("d", 1, commit=lsn, change=lsn, serial=1)
    )
    assert delete.position < create.position
    assert delete.position.startswith(create.position[:46])  # only the serial differs


def test_sqlserver_commit_lsn_orders_before_change_lsn() -> None:
    early, late = decode(
        DebeziumSqlServerDecoder,
        ss("u", 1, commit="0000002a:00000358:0009", change="0000002a:00000358:0008", serial=2, name="old"),
        ss("u", 1, commit="0000002a:00000400:0001", change="0000002a:00000358:0007", serial=2, name="new"),
    )
    assert early.position < late.position  # a later commit wins over a lower change LSN


def test_postgres_snapshot_read_sorts_before_a_streamed_change_at_its_lsn() -> None:
    read, update = decode(DebeziumPostgresDecoder, pg("r", 1, lsn=500, snapshot="true"), pg("u", 1, lsn=500, name="b"))
    assert read.position < update.position
    assert read.position[:20] == update.position[:20] == f"{500:020d}"


def test_postgres_same_lsn_is_ordered_by_the_last_committed_lsn_of_sequence() -> None:
    later, earlier = decode(
        DebeziumPostgresDecoder,
        pg("u", 1, lsn=500, seq='["400","500"]', name="later"),
        pg("u", 1, lsn=500, seq='["300","500"]', name="earlier"),
    )
    assert earlier.position < later.position


def test_postgres_lsn_still_decides_first() -> None:
    a, b = decode(DebeziumPostgresDecoder, pg("u", 1, lsn=499, seq='["900","499"]'), pg("r", 1, lsn=500, snapshot="last"))
    assert a.position < b.position


def test_postgres_spec_create_and_update_at_one_lsn_keep_their_order() -> None:
    """The spec's create (snapshot=true) and update share lsn 24023128."""
    from tests.decode.test_debezium_postgres import CASES

    create = (CASES / "debezium_postgres/03_create.repaired.json").read_text()
    update = (CASES / "debezium_postgres/04_update.repaired.json").read_text()
    c, u = decode(DebeziumPostgresDecoder, create, update, ctx=DecodeContext(primary_keys={"public.customers": ["id"]}))
    assert c.position < u.position


# --------------------------------------------------------------------------
# 5. change_id: the two halves of a primary-key update share it


def test_postgres_pk_update_halves_share_change_id() -> None:
    out = decode(
        DebeziumPostgresDecoder,
        pg("c", 1, lsn=100, tx=5),
        pg("d", 1, lsn=200, tx=6),  # the PK update 1 -> 2
        pg("c", 2, lsn=200, tx=6),
        pg("u", 2, lsn=300, tx=6),
        pg("r", 3, lsn=50, tx=1, snapshot="true"),
        pg("r", 4, lsn=50, tx=1, snapshot="true"),
    )
    ids = [e.change_id for e in out]
    assert all(ids), ids
    assert ids[1] == ids[2]
    assert len({ids[0], ids[1], ids[3], ids[4], ids[5]}) == 5


def test_sqlserver_pk_update_halves_share_change_id() -> None:
    a, b, c = "0000002a:00000358:0003", "0000002a:00000360:0002", "0000002a:00000370:0002"
    out = decode(
        DebeziumSqlServerDecoder,
        ss("d", 1, commit=c, change=b, serial=1),  # the PK update 1 -> 2 (in one file here; any file in life)
        ss("c", 2, commit=c, change=b, serial=2),
        ss("c", 3, commit=c, change=a, serial=1),
        ss("u", 3, commit=c, change=c, serial=2),
        ss("r", 4, commit=a, change=None, serial=0),
        ss("r", 5, commit=a, change=None, serial=0),
    )
    ids = [e.change_id for e in out]
    assert all(ids), ids
    assert ids[0] == ids[1] == f"{c}|{b}"
    assert len({ids[0], ids[2], ids[3], ids[4], ids[5]}) == 5


def test_pk_update_halves_in_different_files_share_change_id() -> None:
    dec = DebeziumPostgresDecoder(KEYS)
    (d,) = dec.decode(RawMessage("partition-0.jsonl", 9, pg("d", 1, lsn=200, tx=6)))
    (c,) = dec.decode(RawMessage("partition-1.jsonl", 3, pg("c", 2, lsn=200, tx=6)))
    assert isinstance(d, ChangeEvent) and d.op == Op.DELETE and c.op == Op.INSERT
    assert d.change_id == c.change_id


# --------------------------------------------------------------------------
# 2. Payload-only (schemaless) messages, typed by the stored table or the configuration

STORED = {
    "items": {
        "id": "int",
        "name": "string",
        "amount": "decimal(12,2)",
        "born": "date",
        "seen": "timestamp_ntz",
        "at": "timestamp",
        "opens": "string",
        "blob": "binary",
        "ok": "boolean",
        "ratio": "double",
    }
}


def schemaless(
    cls, after: dict[str, Any], *, op: str = "c", declared: dict | None = None, stored: dict | None = STORED, wrap: bool = False
) -> Any:
    line = json.loads(
        pg(op, 1, lsn=10)
        if cls is DebeziumPostgresDecoder
        else ss(op, 1, commit="0000002a:00000358:0003", change="0000002a:00000358:0003", serial=1)
    )
    payload = line["payload"]
    payload["after"] = {"id": 1, **after}
    text = json.dumps(payload if wrap else line)
    ctx = DecodeContext(primary_keys={"items": ["id"]}, stored_types=stored or {}, declared_types=declared or {})
    (out,) = decode(cls, text, ctx=ctx)
    return out


def unscaled_b64(text: str) -> int:
    import base64

    return int.from_bytes(base64.b64decode(text), "big", signed=True)


@pytest.mark.parametrize("cls", DECODERS, ids=lambda c: c.format.value)
@pytest.mark.parametrize("wrap", [False, True], ids=["schema-null", "payload-only"])
def test_schemaless_values_decode_by_the_stored_types(cls, wrap) -> None:
    ev = schemaless(
        cls,
        {
            "amount": "+oD1JQ==",
            "born": 19000,
            "seen": "2026-01-02T03:04:05.123456",
            "at": "2026-01-02T03:04:05Z",
            "blob": "AAE=",
            "ok": True,
            "ratio": 0.5,
            "name": "x",
            "opens": "09:00",
        },
        wrap=wrap,
    )
    assert isinstance(ev, ChangeEvent), ev
    assert ev.after == {
        "id": "1",
        "amount": f"{unscaled_b64('+oD1JQ==') / 100:.2f}",
        "born": "2022-01-08",
        "seen": "2026-01-02 03:04:05.123456",
        "at": "2026-01-02 03:04:05.000000",
        "blob": "AAE=",
        "ok": "true",
        "ratio": "0.5",
        "name": "x",
        "opens": "09:00",
    }
    assert {c.name: c.type for c in ev.columns} == STORED["items"]
    assert any("stored or declared" in n for n in ev.notes)


@pytest.mark.parametrize("raw, expected", [("+oD1JQ==", None), ("-12.50", "-12.50"), (12, "12.00"), ("7.5", "7.50")])
def test_schemaless_decimal_forms(raw, expected) -> None:
    ev = schemaless(DebeziumPostgresDecoder, {"amount": raw})
    from decimal import Decimal

    assert ev.after["amount"] == (expected or f"{Decimal(unscaled_b64(raw)).scaleb(-2):.2f}")


def test_schemaless_epoch_timestamp_needs_its_unit() -> None:
    out = schemaless(DebeziumPostgresDecoder, {"seen": 1767225600123456})
    assert type(out).__name__ == "Quarantined" and "io.debezium.time.MicroTimestamp" in out.reason and "seen" in out.reason
    for unit, n in (
        ("io.debezium.time.Timestamp", 1767225600123),
        ("MicroTimestamp", 1767225600123456),
        ("NanoTimestamp", 1767225600123456000),
    ):
        ev = schemaless(DebeziumPostgresDecoder, {"seen": n}, declared={"items": {"seen": unit}})
        assert ev.after["seen"] == ("2026-01-01 00:00:00.123000" if unit.endswith(".Timestamp") else "2026-01-01 00:00:00.123456"), unit


def test_schemaless_time_of_day_in_a_text_column() -> None:
    out = schemaless(DebeziumPostgresDecoder, {"opens": 32400000000})
    assert type(out).__name__ == "Quarantined" and "MicroTime" in out.reason
    ev = schemaless(DebeziumPostgresDecoder, {"opens": 32400000000}, declared={"public.items": {"opens": "MicroTime"}})
    assert ev.after["opens"] == "09:00:00.000000"


def test_schemaless_value_not_fitting_its_stored_type_is_quarantined() -> None:
    out = schemaless(DebeziumSqlServerDecoder, {"amount": "12.345"})
    assert type(out).__name__ == "Quarantined" and "amount" in out.reason
    out = schemaless(DebeziumSqlServerDecoder, {"id": "x"})
    assert type(out).__name__ == "Quarantined"


def test_schemaless_unknown_column_is_quarantined() -> None:
    out = schemaless(DebeziumPostgresDecoder, {"nickname": "z"})
    assert type(out).__name__ == "Quarantined" and "nickname" in out.reason and "columns:" in out.reason


def test_schemaless_types_from_the_declaration_alone() -> None:
    ev = schemaless(
        DebeziumPostgresDecoder, {"amount": "+oD1JQ=="}, stored=None, declared={"items": {"id": "int", "amount": "decimal(12,2)"}}
    )
    assert {c.name: c.type for c in ev.columns} == {"id": "int", "amount": "decimal(12,2)"}


def test_schemaless_without_known_types_stays_untyped() -> None:
    ev = schemaless(DebeziumPostgresDecoder, {"amount": "+oD1JQ=="}, stored=None)
    assert ev.columns is None and ev.after["amount"] == "+oD1JQ==" and "columns unknown" in " ".join(ev.notes)


def test_schemaless_placeholder_still_means_not_present() -> None:
    ev = schemaless(
        DebeziumPostgresDecoder, {"name": "__debezium_unavailable_value", "blob": "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ=="}, op="u"
    )
    assert "name" not in ev.after and "blob" not in ev.after


def test_declared_columns_in_the_sources_file(tmp_path) -> None:
    import dataclasses

    from cdc_apply.config import Settings, load_sources
    from cdc_apply.errors import ConfigError

    f = tmp_path / "sources.yaml"
    settings = dataclasses.replace(Settings.from_env(), sources_file=f)
    f.write_text(
        "sources:\n  s:\n    format: debezium_sqlserver\n    tables:\n      dbo.items:\n        primary_key: [id]\n"
        "        columns: {id: int, amount: 'decimal(12, 2)', seen: io.debezium.time.NanoTimestamp, opens: MicroTime}\n"
    )
    assert load_sources(settings)["s"].columns == {
        "dbo.items": {"id": "int", "amount": "decimal(12,2)", "seen": "io.debezium.time.NanoTimestamp", "opens": "MicroTime"}
    }
    f.write_text(
        "sources:\n  s:\n    format: debezium_sqlserver\n    tables:\n      dbo.items:\n        primary_key: [id]\n        columns: {id: integer}\n"
    )
    with pytest.raises(ConfigError, match=r"column 'id' of table 'dbo.items' of source 's' has unknown type 'integer'; use a Spark type"):
        load_sources(settings)
