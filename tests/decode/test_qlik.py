"""Qlik Replicate (Event Hubs) decoder: golden fixtures, mask decoding, type
mapping, metadata versions and persisted state, held and quarantined messages.

Regenerate the expected outputs with ``QLIK_GOLDEN_REGEN=1`` (then review the diff)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc_apply.decode import decoder_class
from cdc_apply.decode.base import DecodeContext, decode_all
from cdc_apply.decode.qlik import REFRESH_SEQUENCE, QlikDecoder, mask_bits, qlik_type
from cdc_apply.model import ChangeEvent, DecodeError, Format, Held, Op, Quarantined, RawMessage, Skipped
from tests.decode import outcome_dict as decoded_dict

CASES = Path(__file__).parent / "cases" / "qlik"
REGEN = os.environ.get("QLIK_GOLDEN_REGEN") == "1"


# --------------------------------------------------------------------------
# Golden fixtures


def outcome_dict(outcome: Any) -> dict[str, Any]:
    return decoded_dict(outcome, ("file", "raw"))


def messages_of(path: Path) -> list[RawMessage]:
    return [RawMessage(path.name, i, t) for i, t in enumerate(path.read_text().split("\n"), 1) if t.strip()]


GOLDEN = sorted(p for p in CASES.glob("*.jsonl"))


def test_golden_fixtures_exist() -> None:
    assert len(GOLDEN) >= 10


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_golden(path: Path) -> None:
    exp = path.with_suffix(".expected.json")
    msgs = messages_of(path)
    outcomes = list(decode_all(QlikDecoder(), msgs))
    # every message accounted for (a PK-change UPDATE yields two events)
    assert {o.line for o in outcomes} == {m.line for m in msgs}
    by_line = {m.line: m.text for m in msgs}
    for o in outcomes:
        assert o.file == path.name
        if isinstance(o, Quarantined):
            assert o.raw == by_line[o.line]
    got = [outcome_dict(o) for o in outcomes]
    if REGEN:
        exp.write_text(json.dumps({"outcomes": got}, indent=2, ensure_ascii=False) + "\n")
    assert got == json.loads(exp.read_text())["outcomes"]


def golden_events(name: str) -> list[ChangeEvent]:
    outcomes = list(decode_all(QlikDecoder(), messages_of(CASES / f"{name}.jsonl")))
    return [o for o in outcomes if isinstance(o, ChangeEvent)]


def test_golden_semantics() -> None:
    """Spot checks of the fixtures' meaning (the golden files pin everything)."""
    (refresh,) = golden_events("02_refresh")
    (insert,) = golden_events("03_insert")
    assert refresh.op is Op.READ and refresh.position.startswith(REFRESH_SEQUENCE + "|")
    assert refresh.tx_id is None and refresh.commit_ts_us is None
    assert refresh.position < insert.position
    assert insert.key_columns == ["ORDER_ID", "LINE_NO"]
    assert insert.after["AMOUNT"] == "1234.50" and insert.after["BIG_COUNTER"] == "18446744073709551615"
    assert insert.after["PHOTO"] == "iVBORw==" and insert.after["UPDATED_AT"] == "2026-03-02 09:20:11.123456"
    assert insert.after["PICKUP_TIME"] == "14:30:00" and insert.after["ACTIVE"] == "true"
    assert insert.position == "20260302092011120000000000000000005|00000000000000000001|1"
    assert insert.commit_ts_us == 1772443211123000
    types = {c.name: c.type for c in insert.columns}
    assert types["BIG_COUNTER"] == "decimal(20,0)" and types["UPDATED_AT"] == "timestamp_ntz"
    assert types["PICKUP_TIME"] == "string" and types["PHOTO"] == "binary" and types["AMOUNT"] == "decimal(12,2)"

    (partial,) = golden_events("05_update_partial_mask")
    assert "NOTE" not in partial.after and "PHOTO" not in partial.after  # not present
    assert "CUSTOMER" in partial.after and partial.after["CUSTOMER"] is None  # present NULL
    assert "NOTE" not in partial.before

    (delete,) = golden_events("06_delete")
    assert delete.op is Op.DELETE and delete.after == {}
    assert (delete.before["ORDER_ID"], delete.before["LINE_NO"]) == ("1001", "1")

    old, new = golden_events("07_pk_change_update")
    assert (old.op, new.op) == (Op.DELETE, Op.INSERT)
    assert old.before["LINE_NO"] == "1" and old.after == {} and new.after["LINE_NO"] == "2"
    assert old.position[:-1] == new.position[:-1] and old.position < new.position


def test_golden_quarantine_reasons() -> None:
    outcomes = list(decode_all(QlikDecoder(), messages_of(CASES / "11_quarantines.jsonl")))
    reasons = [o.reason for o in outcomes if isinstance(o, Quarantined)]
    assert len(reasons) == 8 and len(outcomes) == 9
    expected = [
        "unknown operation 'UPSERT'",
        "is not a 35-digit string",
        "is not hexadecimal",
        "sets ordinal 13 but the table's last ordinal is 12",
        "malformed JSON",
        "has more than 2 decimal places",
        "does not fit smallint",
        "DELETE without a value for key column",
    ]
    for reason, text in zip(reasons, expected):
        assert text in reason, (reason, text)


# --------------------------------------------------------------------------
# Masks


def test_mask_spec_example_0B() -> None:
    """The spec: '0B hexadecimal, which is 1011 binary - the columns at ordinals
    1, 2 and 4 were changed'.  Bit i <-> ordinal i+1."""
    assert mask_bits("0B") == {0, 1, 3}
    assert sorted(b + 1 for b in mask_bits("0B")) == [1, 2, 4]
    assert mask_bits("0b") == {0, 1, 3}


def test_mask_little_endian_byte_order() -> None:
    """Little-endian = byte order: the first hex byte is bits 0-7, the second
    bits 8-15.  Worked example, 12 columns with ordinals 9 and 10 missing:
    bits 0-7 set -> byte 0 = 0xFF; bits 10, 11 (ordinals 11, 12) -> byte 1 =
    0b00001100 = 0x0C; so the mask text is 'FF0C' (not '0CFF')."""
    assert mask_bits("FF0C") == set(range(8)) | {10, 11}
    assert mask_bits("0001") == {8}  # ordinal 9 only
    assert mask_bits("0100") == {0}  # ordinal 1 only
    assert mask_bits("") == set()


@pytest.mark.parametrize("bad", ["0G", "F", "0B1", " x", "0x0B"])
def test_mask_malformed(bad: str) -> None:
    with pytest.raises(DecodeError):
        mask_bits(bad)


# --------------------------------------------------------------------------
# Builders for unit tests


def meta(
    columns: dict[str, tuple[str, int]],
    version: int = 1,
    *,
    schema_id: str | None = None,
    table: str = "T",
    schema: str = "S",
    precision: dict[str, tuple[int, int]] | None = None,
) -> str:
    """columns: name -> (Qlik type, primaryKeyPosition); ordinals in dict order."""
    precision = precision or {}
    cols = {
        name: {
            "ordinal": i,
            "type": t,
            "length": 0,
            "precision": precision.get(name, (0, 0))[0],
            "scale": precision.get(name, (0, 0))[1],
            "primaryKeyPosition": pk,
        }
        for i, (name, (t, pk)) in enumerate(columns.items(), 1)
    }
    msg = {
        "schemaId": schema_id or f"sid-{schema}-{table}-{version}",
        "lineage": {
            "server": "srv",
            "task": "task",
            "schema": schema,
            "table": table,
            "tableVersion": version,
            "timestamp": "2026-01-01T00:00:00.000",
        },
        "tableStructure": {"tableColumns": cols},
        "dataSchema": "{}",
    }
    return orjson.dumps(msg).decode()


def data(
    row: dict[str, Any],
    op: str = "INSERT",
    *,
    seq: int = 1,
    before: dict[str, Any] | None = None,
    table: str = "T",
    schema: str = "S",
    **headers: Any,
) -> str:
    h = {
        "operation": op,
        "changeSequence": "2026010100000000" + f"{seq:019d}",
        "timestamp": "2026-01-01T00:00:00.000",
        "streamPosition": "x",
        "transactionId": "tx1",
        "changeMask": None,
        "columnMask": None,
        "transactionEventCounter": 1,
        "transactionLastEvent": True,
        **headers,
    }
    return orjson.dumps({"schema": schema, "table": table, "data": row, "beforeData": before, "headers": h}).decode()


BASIC = {"id": ("INT4", 1), "v": ("STRING", 0)}


def run(*texts: str, ctx: DecodeContext | None = None) -> list[Any]:
    return list(decode_all(QlikDecoder(ctx), [RawMessage("f.jsonl", i, t) for i, t in enumerate(texts, 1)]))


def only_event(outcomes: list[Any]) -> ChangeEvent:
    events = [o for o in outcomes if isinstance(o, ChangeEvent)]
    assert len(events) == 1, outcomes
    return events[0]


def quarantine_reason(*texts: str) -> str:
    out = run(*texts)
    q = [o for o in out if isinstance(o, Quarantined)]
    assert len(q) == 1, out
    return q[0].reason


# --------------------------------------------------------------------------
# Column masks in decoded rows


def test_column_mask_absent_vs_null() -> None:
    cols = {"id": ("INT4", 1), "a": ("STRING", 0), "b": ("STRING", 0), "c": ("STRING", 0)}
    # columnMask 0B: ordinals 1, 2, 4 present (id, a, c); b (ordinal 3) not present
    ev = only_event(run(meta(cols), data({"id": 1, "a": None, "b": None, "c": "x"}, columnMask="0B")))
    assert ev.after == {"id": "1", "a": None, "c": "x"}
    # no columnMask: everything present
    ev = only_event(run(meta(cols), data({"id": 1, "a": None, "b": None, "c": "x"})))
    assert ev.after == {"id": "1", "a": None, "b": None, "c": "x"}


def test_column_mask_second_byte() -> None:
    cols = {f"c{i}": ("INT4", 1 if i == 1 else 0) for i in range(1, 11)}
    row = {f"c{i}": i for i in range(1, 11)}
    # ordinals 1..8 and 10 present, 9 not: bits 0-7 -> FF, bit 9 -> 0x02
    ev = only_event(run(meta(cols), data(row, columnMask="FF02")))
    assert set(ev.after) == set(row) - {"c9"}
    assert "ordinal 11" in quarantine_reason(meta(cols), data(row, columnMask="FF04"))


def test_change_mask_validated() -> None:
    assert "changeMask" in quarantine_reason(meta(BASIC), data({"id": 1, "v": "a"}, changeMask="zz"))
    only_event(run(meta(BASIC), data({"id": 1, "v": "a"}, changeMask="02")))


# --------------------------------------------------------------------------
# Operations, keys, positions


def test_operations_and_positions() -> None:
    out = run(
        meta(BASIC),
        data({"id": 1, "v": "r"}, "REFRESH", changeSequence="", timestamp="", transactionId="", transactionEventCounter=0),
        data({"id": 1, "v": "a"}, "INSERT", seq=3, transactionEventCounter=2),
        data({"id": 1, "v": "b"}, "UPDATE", seq=4, before={"id": 1, "v": "a"}),
        data({"id": 1, "v": "b"}, "DELETE", seq=5),
    )
    assert isinstance(out[0], Skipped) and out[0].reason == "table-metadata"
    events = out[1:]
    assert [e.op for e in events] == [Op.READ, Op.INSERT, Op.UPDATE, Op.DELETE]
    assert [e.position for e in events] == sorted(e.position for e in events)
    assert events[0].position == "0" * 35 + "|" + "0" * 20 + "|1"
    assert events[1].position == "20260101000000000000000000000000003|00000000000000000002|1"
    assert events[2].before == {"id": "1", "v": "a"} and events[2].tx_id == "tx1"
    assert events[3].after == {} and events[3].before == {"id": "1", "v": "b"}
    assert all(e.schema == "S" and e.table == "T" and e.database is None and e.format == "qlik" for e in events)


def test_delete_key_from_before_data() -> None:
    ev = only_event(run(meta(BASIC), data({"id": None, "v": None}, "DELETE", before={"id": 7, "v": "z"})))
    assert ev.before == {"id": "7", "v": "z"}


def test_composite_key_ordered_by_primary_key_position() -> None:
    cols = {"a": ("INT4", 2), "b": ("STRING", 0), "c": ("INT4", 1)}
    ev = only_event(run(meta(cols), data({"a": 1, "b": "x", "c": 2})))
    assert ev.key_columns == ["c", "a"]


def test_no_primary_key_uses_configured_key_or_quarantines() -> None:
    cols = {"id": ("INT4", 0), "v": ("STRING", 0)}
    ctx = DecodeContext(primary_keys={"S.T": ["id"]})
    assert only_event(run(meta(cols), data({"id": 1, "v": "a"}), ctx=ctx)).key_columns == ["id"]
    assert "no primaryKeyPosition" in quarantine_reason(meta(cols), data({"id": 1, "v": "a"}))


def test_pk_change_update_splits() -> None:
    out = run(meta(BASIC), data({"id": 2, "v": "b"}, "UPDATE", seq=9, before={"id": 1, "v": "a"}))
    old, new = out[1:]
    assert (old.op, new.op) == (Op.DELETE, Op.INSERT)
    assert old.before == {"id": "1", "v": "a"} and old.after == {}
    assert new.after == {"id": "2", "v": "b"} and new.before is None
    assert old.position.endswith("|0") and new.position.endswith("|1") and old.position < new.position


def test_transaction_event_counter_breaks_ties_at_one_change_sequence() -> None:
    """Two different changes of one key at one changeSequence: the
    transactionEventCounter orders them, whatever the arrival order."""
    out = run(
        meta(BASIC),
        data({"id": 1, "v": "second"}, "UPDATE", seq=7, transactionEventCounter=10),
        data({"id": 1, "v": "first"}, "UPDATE", seq=7, transactionEventCounter=9),
    )
    later, earlier = out[1:]
    assert later.position.split("|")[0] == earlier.position.split("|")[0]
    assert later.position == "20260101000000000000000000000000007|00000000000000000010|1"
    assert [e.after["v"] for e in sorted([later, earlier], key=lambda e: e.position)] == ["first", "second"]


def test_a_transaction_event_counter_beyond_bigint_is_quarantined_naming_it() -> None:
    """The counter is the event's place in its transaction (a bigint in the
    canonical model): 2^63 is a damaged message, not a decode task that dies
    building its Arrow columns (found by the nemesis' hostile kind)."""
    out = run(
        meta(BASIC),
        data({"id": 1, "v": "a"}, "INSERT", seq=3, transactionEventCounter=2**63),
        data({"id": 2, "v": "b"}, "INSERT", seq=4, transactionEventCounter=2**63 - 1),
    )
    bad, good = out[1:]
    assert isinstance(bad, Quarantined) and "headers.transactionEventCounter 9223372036854775808 is out of range" in bad.reason
    assert isinstance(good, ChangeEvent) and good.tx_order == good.tx_total == 2**63 - 1


def test_change_id_pairs_the_halves_of_a_key_change_only() -> None:
    seq = "2026010100000000" + f"{9:019d}"
    out = run(
        meta(BASIC),
        data({"id": 2, "v": "b"}, "UPDATE", seq=9, before={"id": 1, "v": "a"}),
        data({"id": 2, "v": "c"}, "UPDATE", seq=10),
        data({"id": 3, "v": "d"}, "INSERT", seq=11),
        data({"id": 4, "v": "r"}, "REFRESH", changeSequence="", transactionEventCounter=0),
    )
    old, new, upd, ins, refresh = out[1:]
    assert old.change_id == new.change_id == seq
    assert upd.change_id == seq[:-2] + "10" and ins.change_id == seq[:-2] + "11"
    assert refresh.change_id is None  # a full-load row has no change sequence (and no pairing)


def test_pk_change_new_key_carries_only_present_columns() -> None:
    cols = {"id": ("INT4", 1), "a": ("STRING", 0), "b": ("STRING", 0)}
    # columnMask 05: ordinals 1 and 3 present, 'a' (ordinal 2) not present in either image
    out = run(meta(cols), data({"id": 2, "a": None, "b": "y"}, "UPDATE", seq=9, before={"id": 1, "a": None, "b": "x"}, columnMask="05"))
    old, new = out[1:]
    assert (old.op, new.op) == (Op.DELETE, Op.INSERT) and old.change_id == new.change_id
    assert new.after == {"id": "2", "b": "y"} and "a" not in new.after
    assert old.before == {"id": "1", "b": "x"}


def test_update_without_before_is_plain_update() -> None:
    ev = only_event(run(meta(BASIC), data({"id": 2, "v": "b"}, "UPDATE")))
    assert ev.op is Op.UPDATE and ev.before is None


def test_lowercase_operation_accepted() -> None:
    assert only_event(run(meta(BASIC), data({"id": 1, "v": "a"}, "insert"))).op is Op.INSERT


def test_missing_event_counter_noted() -> None:
    ev = only_event(run(meta(BASIC), data({"id": 1, "v": "a"}, transactionEventCounter=None)))
    assert ev.position.endswith("|" + "0" * 20 + "|1") and any("transactionEventCounter" in n for n in ev.notes)


# --------------------------------------------------------------------------
# Types


@pytest.mark.parametrize(
    "qtype,prec,expected",
    [
        ("INT1", None, "tinyint"),
        ("INT2", None, "smallint"),
        ("INT4", None, "int"),
        ("INT8", None, "bigint"),
        ("UINT1", None, "smallint"),
        ("UINT2", None, "int"),
        ("UINT4", None, "bigint"),
        ("UINT8", None, "decimal(20,0)"),
        ("NUMERIC", (10, 2), "decimal(10,2)"),
        ("NUMERIC(38,10)", None, "decimal(38,10)"),
        ("REAL4", None, "float"),
        ("REAL8", None, "double"),
        ("STRING", None, "string"),
        ("WSTRING", None, "string"),
        ("CLOB", None, "string"),
        ("NCLOB", None, "string"),
        ("BLOB", None, "binary"),
        ("BYTES", None, "binary"),
        ("BOOLEAN", None, "boolean"),
        ("DATE", None, "date"),
        ("TIME", None, "string"),
        ("DATETIME", None, "timestamp_ntz"),
    ],
)
def test_type_mapping(qtype: str, prec: tuple[int, int] | None, expected: str) -> None:
    p, s = prec or (None, None)
    assert qlik_type(qtype, p, s) == (expected, None)


def test_unknown_and_too_wide_types_become_string_with_note() -> None:
    assert qlik_type("GEOMETRY", None, None)[0] == "string" and "unknown Qlik type" in qlik_type("GEOMETRY", None, None)[1]
    assert qlik_type("NUMERIC", 50, 5)[0] == "string"
    cols = {"id": ("INT4", 1), "g": ("GEOMETRY", 0), "n": ("NUMERIC", 0)}
    ev = only_event(run(meta(cols, precision={"n": (50, 5)}), data({"id": 1, "g": "POINT(1 2)", "n": "1" * 45 + ".12345"})))
    assert ev.after["g"] == "POINT(1 2)" and ev.after["n"] == "1" * 45 + ".12345"
    assert len(ev.notes) == 2 and all("string" in n for n in ev.notes)


def test_values_exact_and_checked() -> None:
    cols = {"id": ("INT8", 1), "n": ("NUMERIC", 0), "f": ("REAL8", 0), "u": ("UINT8", 0), "b": ("BYTES", 0)}
    prec = {"n": (38, 10)}
    row = {"id": 9007199254740993, "n": "1234567890123456789012345678.0123456789", "f": 0.1, "u": "18446744073709551615", "b": "00ff"}
    ev = only_event(run(meta(cols, precision=prec), data(row)))
    assert ev.after == {
        "id": "9007199254740993",
        "n": "1234567890123456789012345678.0123456789",
        "f": "0.1",
        "u": "18446744073709551615",
        "b": "AP8=",
    }
    # a NUMERIC written as a JSON number keeps every digit
    text = data({**row, "n": 0}).replace('"n":0', '"n":12345678901234567890.1234567891')
    assert only_event(run(meta(cols, precision=prec), text)).after["n"] == "12345678901234567890.1234567891"
    assert "does not fit decimal(20,0)" in quarantine_reason(meta(cols, precision=prec), data({**row, "u": "18446744073709551616" + "0"}))
    assert "hexadecimal bytes" in quarantine_reason(meta(cols, precision=prec), data({**row, "b": "xyz"}))


# --------------------------------------------------------------------------
# Metadata versions, held messages, persisted state


V1 = {"id": ("INT4", 1), "v": ("STRING", 0)}
V2 = {"id": ("INT4", 1), "v": ("STRING", 0), "extra": ("NUMERIC", 0)}


def test_table_version_2_adds_a_column() -> None:
    out = run(
        meta(V1, 1),
        data({"id": 1, "v": "a"}, seq=1),
        meta(V2, 2, precision={"extra": (5, 1)}),
        data({"id": 2, "v": "b", "extra": "1.5"}, seq=2, columnMask="07"),
    )
    skipped = [o for o in out if isinstance(o, Skipped)]
    events = [o for o in out if isinstance(o, ChangeEvent)]
    assert [s.reason for s in skipped] == ["table-metadata"] * 2
    assert "version 2" in skipped[1].detail
    # the v1 message (absorbed metadata of both versions first) still decodes with v1
    assert [c.name for c in events[0].columns] == ["id", "v"] and any("version 1" in n for n in events[0].notes)
    assert [(c.name, c.type) for c in events[1].columns][-1] == ("extra", "decimal(5,1)")
    assert events[1].after == {"id": "2", "v": "b", "extra": "1.5"} and events[1].notes == []


def test_subset_of_latest_version_columns() -> None:
    """A message without a column of the latest version (and no exact version
    match) decodes with the latest version; the missing column is not present."""
    ev = only_event(run(meta(V2, 2, precision={"extra": (5, 1)}), data({"id": 1, "v": "a"})))
    assert ev.after == {"id": "1", "v": "a"} and len(ev.columns) == 3


def test_external_schema_id_selects_version() -> None:
    out = run(
        meta(V1, 1, schema_id="s1"),
        meta(V2, 2, schema_id="s2", precision={"extra": (5, 1)}),
        data({"id": 1, "v": "a"}, externalSchemaId="s2"),
    )
    ev = only_event(out)
    assert len(ev.columns) == 3 and "extra" not in ev.after
    assert "belongs to S.T" in quarantine_reason(meta(V1, 1, schema_id="s1"), data({"id": 1, "v": "a"}, table="U", externalSchemaId="s1"))


def test_missing_metadata_is_held() -> None:
    out = run(data({"id": 1, "v": "a"}))
    assert len(out) == 1 and isinstance(out[0], Held) and out[0].reason == "missing-table-metadata"
    assert (out[0].file, out[0].line) == ("f.jsonl", 1)
    # metadata of another table does not help
    out = run(meta(V1, table="OTHER"), data({"id": 1, "v": "a"}))
    assert isinstance(out[1], Held)
    # a column no known version has (metadata of the new version not seen yet)
    out = run(meta(V1), data({"id": 1, "v": "a", "new": 1}))
    assert isinstance(out[1], Held)
    # an unknown externalSchemaId on a message naming no table
    text = orjson.dumps(
        {"data": {"id": 1}, "beforeData": None, "headers": {"operation": "INSERT", "changeSequence": "1" * 35, "externalSchemaId": "later"}}
    ).decode()
    assert isinstance(run(text)[0], Held)


def test_state_persists_across_batches() -> None:
    first = QlikDecoder(DecodeContext(source="q"))
    out1 = list(decode_all(first, [RawMessage("a.jsonl", 1, meta(V1)), RawMessage("a.jsonl", 2, data({"id": 1, "v": "x"}))]))
    assert isinstance(out1[1], ChangeEvent)
    state = json.loads(json.dumps(first.export_state()))  # JSON-serialisable, as the ledger stores it
    second = QlikDecoder(DecodeContext(source="q", state=state))
    out2 = list(decode_all(second, [RawMessage("b.jsonl", 1, data({"id": 2, "v": "y"}, seq=2))]))
    assert isinstance(out2[0], ChangeEvent) and out2[0].after == {"id": "2", "v": "y"}
    # a fresh decoder without the state holds the message instead
    assert isinstance(next(iter(decode_all(QlikDecoder(), [RawMessage("b.jsonl", 1, data({"id": 2, "v": "y"}))]))), Held)


def test_decoder_does_not_mutate_callers_state() -> None:
    ctx = DecodeContext()
    dec = QlikDecoder(ctx)
    list(decode_all(dec, [RawMessage("a.jsonl", 1, meta(V1))]))
    assert ctx.state == {} and dec.export_state()["qlik"]["tables"]


def test_needs_driver_only_for_metadata() -> None:
    dec = QlikDecoder()
    assert dec.needs_driver(RawMessage("f", 1, meta(V1)))
    assert not dec.needs_driver(RawMessage("f", 2, data({"id": 1, "v": "a"})))
    assert not dec.needs_driver(RawMessage("f", 3, '{"tableStructure": '))  # malformed: decoded, then quarantined
    assert not dec.needs_driver(RawMessage("f", 4, data({"id": 1, "v": "tableStructure"})))


def test_same_version_replaced_is_reported() -> None:
    out = run(meta(V1), meta({"id": ("INT4", 1), "w": ("STRING", 0)}))
    assert "replaces" in out[1].detail


# --------------------------------------------------------------------------
# Quarantines and identifiers


@pytest.mark.parametrize(
    "text,reason",
    [
        ("not json", "malformed JSON"),
        ("[1,2]", "not an object"),
        ('{"foo": 1}', "neither a metadata message"),
        ('{"magic": "xxMSG", "type": "DT", "message": {}}', "envelope magic"),
        ('{"magic": "atMSG", "type": "XX", "message": {}}', "envelope type"),
        ('{"magic": "atMSG", "type": "MD", "message": {"headers": {}}}', "no tableStructure"),
    ],
)
def test_malformed_messages(text: str, reason: str) -> None:
    assert reason in quarantine_reason(text)


def test_bad_metadata_quarantined() -> None:
    good = json.loads(meta(V1))
    bad_ordinal = json.loads(meta(V1))
    bad_ordinal["tableStructure"]["tableColumns"]["v"]["ordinal"] = 1
    assert "used twice" in quarantine_reason(json.dumps(bad_ordinal))
    zero = json.loads(meta(V1))
    zero["tableStructure"]["tableColumns"]["id"]["ordinal"] = 0
    assert ">= 1" in quarantine_reason(json.dumps(zero))
    bad_name = dict(good, lineage={**good["lineage"], "table": "a\nb"})
    assert "control character" in quarantine_reason(json.dumps(bad_name))
    no_version = dict(good, lineage={**good["lineage"], "tableVersion": None})
    assert "tableVersion" in quarantine_reason(json.dumps(no_version))


def test_bad_data_messages_quarantined() -> None:
    m = meta(BASIC)
    assert "35-digit" in quarantine_reason(m, data({"id": 1, "v": "a"}, changeSequence="2026" + "0" * 32))
    assert "35-digit" in quarantine_reason(m, data({"id": 1, "v": "a"}, changeSequence=None))
    assert "35-digit" in quarantine_reason(m, data({"id": 1, "v": "a"}, changeSequence="٣" * 35))
    assert "unknown operation" in quarantine_reason(m, data({"id": 1, "v": "a"}, "TRUNCATE"))
    assert "not in the table metadata" in quarantine_reason(m, data({"id": 1, "v": "a", "zz": 1}, externalSchemaId="sid-S-T-1"))
    assert "without a value for key" in quarantine_reason(m, data({"id": None, "v": "a"}))
    assert "names no table" in quarantine_reason(m, data({"id": 1, "v": "a"}, table=None))
    assert "control character" in quarantine_reason(m, data({"id": 1, "v": "a"}, table="T\x00"))
    assert "timestamp" in quarantine_reason(m, data({"id": 1, "v": "a"}, timestamp="yesterday"))
    assert "transactionEventCounter" in quarantine_reason(m, data({"id": 1, "v": "a"}, transactionEventCounter=True))


# --------------------------------------------------------------------------
# Registry and sniffing


def test_registry_and_sniff() -> None:
    assert decoder_class(Format.QLIK) is QlikDecoder
    assert QlikDecoder.sniff(meta(V1)) and QlikDecoder.sniff(data({"id": 1, "v": "a"}))
    envelope = (CASES / "08_envelope_external_schema_id.jsonl").read_text().split("\n")[1]
    assert QlikDecoder.sniff(envelope)
    assert not QlikDecoder.sniff('{"payload": {"op": "c"}}') and not QlikDecoder.sniff("nope")
    # formats sniffed before Qlik must not claim Qlik messages (others may not exist yet in this tree)
    for fmt in (Format.DEBEZIUM_SQLSERVER, Format.DEBEZIUM_POSTGRES):
        assert not decoder_class(fmt).sniff(data({"id": 1, "v": "a"})) and not decoder_class(fmt).sniff(meta(V1))
