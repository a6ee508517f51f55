"""Debezium SQL Server decoder: golden spec examples, positions (commit LSN,
change LSN, serial), placeholder, quarantines and skips.  Logical types are
shared with PostgreSQL (debezium_common) and tested there; the SQL Server
type table (datetime2 -> Nano/MicroTimestamp, datetimeoffset ->
ZonedTimestamp, money -> Decimal, tinyint -> INT16) is spot-checked here."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from cdc_apply.decode import decoder_class
from cdc_apply.decode.base import DecodeContext, decode_all
from cdc_apply.decode.debezium_common import PLACEHOLDER, PLACEHOLDER_B64
from cdc_apply.decode.debezium_sqlserver import DebeziumSqlServerDecoder, normalise_lsn
from cdc_apply.model import ChangeEvent, DecodeError, Quarantined, RawMessage, Skipped
from tests.decode.test_debezium_postgres import CASES, b64_unscaled, check_golden, dec_field, golden_inputs, typed

SOURCE = {
    "version": "2.7.0.Final",
    "connector": "sqlserver",
    "name": "server1",
    "ts_ms": 1559729468470,
    "snapshot": "false",
    "db": "testDB",
    "schema": "dbo",
    "table": "customers",
    "change_lsn": "00000027:00000758:0003",
    "commit_lsn": "00000027:00000758:0005",
    "event_serial_no": 1,
}
ID = {"type": "int32", "optional": False, "field": "id"}


def row_schema(fields: list[dict[str, Any]]) -> dict[str, Any]:
    row = {"type": "struct", "fields": fields, "optional": True, "name": "server1.testDB.dbo.customers.Value"}
    return {
        "type": "struct",
        "name": "server1.testDB.dbo.customers.Envelope",
        "fields": [
            {**row, "field": "before"},
            {**row, "field": "after"},
            {"type": "struct", "fields": [], "name": "io.debezium.connector.sqlserver.Source", "field": "source"},
            {"type": "string", "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
        ],
    }


def message(after, fields=None, *, op="c", before=None, source=None, key: Any = "absent", transaction=None) -> str:
    payload = {"before": before, "after": after, "source": {**SOURCE, **(source or {})}, "op": op, "ts_ms": 1559729471739}
    if transaction is not None:
        payload["transaction"] = transaction
    value: Any = payload if fields is None else {"schema": row_schema(fields), "payload": payload}
    if key != "absent":
        value = {"key": key, "value": value}
    return json.dumps(value, separators=(",", ":"))


def decode(text: str, ctx: DecodeContext | None = None) -> list[Any]:
    return DebeziumSqlServerDecoder(ctx).decode(RawMessage("t.jsonl", 1, text))


def one_event(text: str, ctx: DecodeContext | None = None) -> ChangeEvent:
    out = decode(text, ctx)
    assert len(out) == 1 and isinstance(out[0], ChangeEvent), out
    return out[0]


def quarantined(text: str) -> str:
    out = decode(text)
    assert len(out) == 1 and isinstance(out[0], Quarantined), out
    return out[0].reason


KEY = {"schema": {"type": "struct", "fields": [ID], "optional": False, "name": "server1.testDB.dbo.customers.Key"}, "payload": {"id": 1}}


# --------------------------------------------------------------------------
# Golden


@pytest.mark.parametrize("path", golden_inputs("debezium_sqlserver"), ids=lambda p: p.name)
def test_golden(path: Path) -> None:
    check_golden(DebeziumSqlServerDecoder, path)


def test_golden_positions_follow_the_spec() -> None:
    [create] = check_golden(DebeziumSqlServerDecoder, CASES / "debezium_sqlserver" / "08_create.repaired.json")
    assert create.position == "00000027:00000758:0005|00000027:00000758:0003|0000000001"
    assert create.tx_id == "00000027:00000758:0005"
    [update] = check_golden(DebeziumSqlServerDecoder, CASES / "debezium_sqlserver" / "11_update.repaired.json")
    [delete] = check_golden(DebeziumSqlServerDecoder, CASES / "debezium_sqlserver" / "12_delete.repaired.json")
    assert create.position < update.position < delete.position
    [enriched] = check_golden(DebeziumSqlServerDecoder, CASES / "debezium_sqlserver" / "15_transaction_enrichment.repaired.json")
    assert enriched.tx_id == "00000025:00000d08:0025"


# --------------------------------------------------------------------------
# Positions


def test_position_layout_and_snapshot() -> None:
    ev = one_event(
        message(
            {"id": 1}, [ID], source={"commit_lsn": "0000002A:00000358:0003", "change_lsn": "0000002a:00000358:0002", "event_serial_no": "2"}
        )
    )
    assert ev.position == "0000002a:00000358:0003|0000002a:00000358:0002|0000000002"
    snap = one_event(message({"id": 1}, [ID], op="r", source={"change_lsn": None, "event_serial_no": None, "snapshot": "true"}))
    assert snap.position == "00000027:00000758:0005|00000000:00000000:0000|0000000000"
    assert snap.tx_id is None


def _lsn(n: int) -> str:
    v, rest = divmod(n, 2**48)
    b, s = divmod(rest, 2**16)
    return f"{v:08x}:{b:08x}:{s:04x}"


def test_position_string_order_is_lsn_order_in_either_case() -> None:
    rng = random.Random(11)
    triples = [(rng.randrange(2**80), rng.randrange(2**80), rng.randrange(5)) for _ in range(300)]
    triples += [(5, 5, 1), (5, 5, 2), (5, 6, 1), (2**80 - 1, 0, 0)]
    events = []
    for commit, change, serial in triples:
        upper = rng.random() < 0.5
        c, ch = _lsn(commit), _lsn(change)
        if upper:
            c, ch = c.upper(), ch.upper()
        events.append(
            (
                (commit, change, serial),
                one_event(message({"id": 1}, [ID], source={"commit_lsn": c, "change_lsn": ch, "event_serial_no": serial})),
            )
        )
    assert [t for t, _ in sorted(events, key=lambda te: te[1].position)] == sorted(t for t, _ in events)
    assert all(len(e.position) == 56 and e.position == e.position.lower() for _, e in events)


def test_pk_update_delete_sorts_before_create() -> None:
    src = {"commit_lsn": "00000027:00000ac0:0007", "change_lsn": "00000027:00000ac0:0002"}
    d = one_event(message(None, [ID], op="d", before={"id": 1}, source={**src, "event_serial_no": 1}, key=KEY))
    c = one_event(message({"id": 2}, [ID], op="c", source={**src, "event_serial_no": 2}, key={**KEY, "payload": {"id": 2}}))
    assert d.position < c.position


@pytest.mark.parametrize("bad", ["27:758:3", "00000027:00000758", "0000002g:00000758:0003", "00000027-00000758-0003", 5, ""])
def test_malformed_lsn(bad) -> None:
    with pytest.raises(DecodeError):
        normalise_lsn(bad, "x")
    assert "commit_lsn" in quarantined(message({"id": 1}, [ID], source={"commit_lsn": bad}))
    assert "change_lsn" in quarantined(message({"id": 1}, [ID], source={"change_lsn": bad}))


# --------------------------------------------------------------------------
# Values


def test_sqlserver_type_table_spot_checks() -> None:
    fields = [
        ID,
        typed("tiny", "int16"),
        typed("dt2", "int64", "io.debezium.time.NanoTimestamp"),
        typed("dt", "int64", "io.debezium.time.Timestamp"),
        typed("dto", "string", "io.debezium.time.ZonedTimestamp"),
        dec_field("money", 4, 19),
        typed("t7", "int64", "io.debezium.time.NanoTime"),
        typed("x", "string", "io.debezium.data.Xml"),
    ]
    after = {
        "id": 1,
        "tiny": 255,
        "dt2": 1529507596945104700,
        "dt": 1529507596947,
        "dto": "2019-01-17T10:11:14.924+01:00",
        "money": b64_unscaled(-922337203685477),
        "t7": 45_296_789_012_300,
        "x": "<a/>",
    }
    ev = one_event(message(after, fields))
    assert ev.after == {
        "id": "1",
        "tiny": "255",
        "dt2": "2018-06-20 15:13:16.945104",
        "dt": "2018-06-20 15:13:16.947000",
        "dto": "2019-01-17 09:11:14.924000",
        "money": "-92233720368.5477",
        "t7": "12:34:56.789012300",
        "x": "<a/>",
    }
    assert [c.type for c in ev.columns] == [
        "int",
        "smallint",
        "timestamp_ntz",
        "timestamp_ntz",
        "timestamp",
        "decimal(19,4)",
        "string",
        "string",
    ]


def test_unavailable_placeholder_for_max_columns_means_not_present() -> None:
    fields = [ID, typed("notes", "string"), typed("blob", "bytes")]
    ev = one_event(
        message(
            {"id": 1, "notes": PLACEHOLDER, "blob": PLACEHOLDER_B64},
            fields,
            op="u",
            before={"id": 1, "notes": "old", "blob": "AA=="},
            key=KEY,
        )
    )
    assert ev.after == {"id": "1"}
    assert ev.before == {"id": "1", "notes": "old", "blob": "AA=="}


def test_keys() -> None:
    ev = one_event(message({"id": 1, "name": "a"}, [ID, typed("name", "string")], key=KEY))
    assert ev.key_columns == ["id"]
    ev = one_event(message(None, [ID], op="d", before={"id": 1}), DecodeContext(primary_keys={"testDB.dbo.customers": ["id"]}))
    assert ev.key_columns == ["id"] and ev.before == {"id": "1"} and ev.after == {}
    assert one_event(message({"id": 1}, [ID])).key_columns == []


# --------------------------------------------------------------------------
# Quarantines and skips


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"payload": ', "malformed JSON"),
        (message({"id": 1}, [ID], op="t"), "unknown op 't'"),
        (message({"id": 1}, [ID], op="m"), "unknown op 'm'"),
        (message({"id": 1}, [ID], op="x"), "unknown op 'x'"),
        (message({"id": 1}, [ID], source={"commit_lsn": None}), "source.commit_lsn is missing"),
        (message({"id": 1}, [ID], source={"event_serial_no": "two"}), "event_serial_no"),
        (message({"id": 1}, [ID], source={"event_serial_no": 10**10}), "wider than 10"),
        (message({"id": 1}, [ID], source={"connector": "postgresql"}), "expected 'sqlserver'"),
        (message({"id": 2**31}, [ID]), "does not fit int"),
        (message({"id": 1}, [ID], source={"table": "cust\u0007omers"}), "control character"),
        (message({"id": 1}, [ID], source={"db": "   "}), "database name is empty"),
        (message({"id": 1}, [ID], transaction={"id": "00000025:00000d08:0025"}).replace('"source":', '"src":'), "payload.source"),
    ],
)
def test_quarantine(text, needle) -> None:
    assert needle in quarantined(text)


@pytest.mark.parametrize(
    "text,reason",
    [
        ('{"key": {"schema": null, "payload": {"id": 1005}}, "value": null}', "kafka-tombstone"),
        (
            '{"status": "BEGIN", "id": "00000025:00000d08:0025", "ts_ms": 1486500577125, "event_count": null, "data_collections": null}',
            "transaction-marker",
        ),
        (
            '{"schema": {"type": "struct", "name": "io.debezium.connector.common.TransactionMetadataValue", "fields": []}, "payload": {"status": "END", "id": "x", "ts_ms": 1, "event_count": 2, "data_collections": []}}',
            "transaction-marker",
        ),
        (
            '{"payload": {"source": {"commit_lsn": "00000025:00000d98:00a2"}, "databaseName": "testDB", "schemaName": "dbo", "ddl": null, "tableChanges": []}}',
            "schema-change",
        ),
        (
            '{"key": {"databaseName": "testDB"}, "value": {"source": {}, "databaseName": "testDB", "ddl": null, "tableChanges": []}, "topic": "server1"}',
            "schema-change",
        ),
        ('{"key": {"serverName": "server1"}, "value": {"ts_ms": 1}, "topic": "__debezium-heartbeat.server1"}', "heartbeat"),
    ],
)
def test_skip(text, reason) -> None:
    [out] = decode(text)
    assert isinstance(out, Skipped) and out.reason == reason


def test_every_message_accounted_for() -> None:
    lines = [
        message({"id": 1}, [ID], key=KEY),
        '{"key": {"id": 1}, "value": null}',
        "{oops",
        message({"id": 1}, [ID], op="z"),
        '{"status": "END", "id": "a", "ts_ms": 1, "event_count": 1, "data_collections": []}',
    ]
    out = list(decode_all(DebeziumSqlServerDecoder(), [RawMessage("f", i, t) for i, t in enumerate(lines, 1)]))
    assert [type(o).__name__ for o in out] == ["ChangeEvent", "Skipped", "Quarantined", "Quarantined", "Skipped"]


def test_registry_and_sniff() -> None:
    assert decoder_class("debezium_sqlserver") is DebeziumSqlServerDecoder
    text = message({"id": 1}, [ID])
    assert DebeziumSqlServerDecoder.sniff(text)
    assert not DebeziumSqlServerDecoder.sniff(text.replace("sqlserver", "postgresql"))
