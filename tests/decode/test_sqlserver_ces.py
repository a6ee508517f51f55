"""SQL Server 2025 CES decoder: golden spec examples, type casts per SQL type,
positions, split reassembly, duplicate ids and quarantines.

Golden expected outputs are regenerated with ``SQLSERVER_CES_GOLDEN_REGEN=1``
(then reviewed by hand)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cdc_apply.decode import decoder_class, detect_format
from cdc_apply.decode.base import DecodeContext, decode_all
from cdc_apply.decode.sqlserver_ces import (
    SqlServerCesDecoder,
    decode_all_deduped,
    dedupe_ids,
    normalise_lsn,
    spark_type,
)
from cdc_apply.model import ChangeEvent, DecodeError, Format, Held, Op, Quarantined, RawMessage, Skipped
from tests.decode import outcome_dict as decoded_dict

CASES = Path(__file__).parent / "cases" / "sqlserver_ces"
REGEN = os.environ.get("SQLSERVER_CES_GOLDEN_REGEN") == "1"

COLS = [
    {"name": "id", "type": "int", "index": 0},
    {"name": "name", "type": "varchar(100)", "index": 1},
]
TX = {
    "commitlsn": "0000002C00000300017C",
    "beginlsn": "0000002C000003000001",
    "sequencenumber": 1,
    "committime": "2025-03-14T16:45:20.650Z",
}
UNSET = object()


def data_text(
    *,
    current: Any = UNSET,
    old: Any = "{}",
    cols: Any = UNSET,
    pkkey: Any = UNSET,
    tx: Any = UNSET,
    db: Any = "db1",
    schema: Any = "dbo",
    tbl: Any = "items",
) -> str:
    if current is UNSET:
        current = {"id": "1", "name": "a"}
    source: dict[str, Any] = {"db": db, "schema": schema, "tbl": tbl, "cols": COLS if cols is UNSET else cols}
    if pkkey is UNSET:
        pkkey = [{"columnname": "id", "value": "1"}]
    if pkkey is not None:
        source["pkkey"] = pkkey
    tx = TX if tx is UNSET else tx
    if tx is not None:
        source["transaction"] = tx

    def enc(v):
        return v if isinstance(v, str) else json.dumps(v)

    return json.dumps({"eventsource": source, "eventrow": {"old": enc(old), "current": enc(current)}})


def message(op: str = "INS", *, data: Any = UNSET, id: str = "e1", logicalid: str = "L1", **kw: Any) -> str:
    env: dict[str, Any] = {
        "specversion": "1.0",
        "type": "com.microsoft.SQL.CES.DML.V1",
        "source": "/",
        "id": id,
        "logicalid": logicalid,
        "time": "2025-03-14T16:45:20.650Z",
        "datacontenttype": "application/json",
        "operation": op,
        "splitindex": 0,
        "splittotalcnt": 0,
    }
    split_keys = {k: kw.pop(k) for k in list(kw) if k in ("splitindex", "splittotalcnt", "segmentindex", "finalsegment")}
    if "segmentindex" in split_keys or "finalsegment" in split_keys:
        env.pop("splitindex"), env.pop("splittotalcnt")
    env.update(split_keys)
    env["data"] = data_text(**kw) if data is UNSET else data
    return json.dumps(env)


def decode(text: str, ctx: DecodeContext | None = None) -> list[Any]:
    return SqlServerCesDecoder(ctx).decode(RawMessage("t.jsonl", 1, text))


def one_event(text: str, ctx: DecodeContext | None = None) -> ChangeEvent:
    out = decode(text, ctx)
    assert len(out) == 1 and isinstance(out[0], ChangeEvent), out
    return out[0]


def quarantined(text: str, ctx: DecodeContext | None = None) -> str:
    out = decode(text, ctx)
    assert len(out) == 1 and isinstance(out[0], Quarantined), out
    assert out[0].raw == text
    return out[0].reason


def run(lines: list[str], ctx: DecodeContext | None = None) -> list[Any]:
    msgs = [RawMessage("f.jsonl", i, t) for i, t in enumerate(lines, 1)]
    out = decode_all_deduped(SqlServerCesDecoder(ctx), msgs)
    assert {(o.file, o.line) for o in out} == {(m.file, m.line) for m in msgs}  # every message accounted for
    return out


# --------------------------------------------------------------------------
# Golden cases (every JSON message example of the spec, verbatim and repaired)


def outcome_dict(outcome: Any) -> dict[str, Any]:
    return decoded_dict(outcome, ("raw",))


GOLDEN = sorted(p.name for p in CASES.glob("*.jsonl"))


@pytest.mark.parametrize("name", GOLDEN)
def test_golden(name: str) -> None:
    path = CASES / name
    lines = [line for line in path.read_text().split("\n") if line.strip()]
    msgs = [RawMessage(name, i, t) for i, t in enumerate(lines, 1)]
    outcomes = decode_all_deduped(SqlServerCesDecoder(), msgs)
    assert sorted({(o.file, o.line) for o in outcomes}) == [(name, i) for i in range(1, len(lines) + 1)]
    for o in outcomes:
        if isinstance(o, Quarantined):
            assert o.raw == lines[o.line - 1]
    got = [outcome_dict(o) for o in outcomes]
    expected = CASES / name.replace(".jsonl", ".expected.json")
    if REGEN:
        expected.write_text(json.dumps({"outcomes": got}, indent=2, ensure_ascii=False) + "\n")
    assert got == json.loads(expected.read_text())["outcomes"]
    if ".verbatim." in name or ".repaired." in name:
        assert all(isinstance(o, ChangeEvent) for o in outcomes), "every spec example is a row change"


@pytest.mark.parametrize("example", ["01_insert", "02_update", "03_delete"])
def test_verbatim_spec_example_decodes_like_its_repaired_copy(example: str) -> None:
    """Without ``eventsource.transaction`` the logicalid's LSN and sequence are
    the position: the verbatim example is the same change as the one repaired
    with a transaction built from its logicalid (and its time as committime)."""
    [verbatim] = run([(CASES / f"{example}.verbatim.jsonl").read_text().strip()])
    [repaired] = run([(CASES / f"{example}.repaired.jsonl").read_text().strip()])
    assert isinstance(verbatim, ChangeEvent), verbatim
    assert outcome_dict(verbatim) == outcome_dict(repaired)


def test_golden_covers_every_spec_example() -> None:
    spec = Path("/work/shared/formats/sqlserver-ces-cloudevents.txt")
    if not spec.exists():
        pytest.skip("spec not available")
    lines = spec.read_text().split("\n")
    examples = []
    for i, line in enumerate(lines):
        if line.startswith("JSON message example"):
            k = i + 1
            while lines[k] != "}":
                k += 1
            examples.append(json.loads("\n".join(lines[i + 1 : k + 1])))
    verbatim = [json.loads((CASES / n).read_text()) for n in GOLDEN if ".verbatim." in n]
    assert len(examples) == 3 and examples == verbatim


def test_golden_repaired_insert_details() -> None:
    [ev] = run([(CASES / "01_insert.repaired.jsonl").read_text().strip()])
    assert (ev.database, ev.schema, ev.table, ev.op) == ("db1", "dbo", "Purchases", Op.INSERT)
    assert ev.position == "0000002c00000300017c|00000000000000000001"
    assert ev.tx_id == "0000002c00000300017c" and ev.message_id == "d43f09a6-d13b-4902-86d4-17bdb5edb872"
    assert ev.commit_ts_us == 1741970720650000
    assert ev.key_columns == ["purchase_id"]
    assert ev.after["purchase_date"] == "2025-03-14 16:45:01.000000"
    assert ev.after["price_per_item"] == "60" and ev.before is None


@pytest.mark.parametrize("kind", ["repaired", "verbatim"])
def test_golden_positions_follow_the_log(kind: str) -> None:
    evs = run([(CASES / f"{f}.{kind}.jsonl").read_text().strip() for f in ("03_delete", "01_insert", "02_update")])
    assert [e.op for e in sorted(evs, key=lambda e: e.position)] == [Op.INSERT, Op.UPDATE, Op.DELETE]
    assert [e.position for e in sorted(evs, key=lambda e: e.position)] == [
        "0000002c00000300017c|00000000000000000001",
        "0000002c000003500004|00000000000000000001",
        "0000002c000003600019|00000000000000000001",
    ]


# --------------------------------------------------------------------------
# Types


@pytest.mark.parametrize(
    "sql,expected",
    [
        ("int", "int"),
        ("bigint", "bigint"),
        ("smallint", "smallint"),
        ("tinyint", "smallint"),
        ("bit", "boolean"),
        ("decimal(10,2)", "decimal(10,2)"),
        ("NUMERIC(18, 4)", "decimal(18,4)"),
        ("decimal", "decimal(18,0)"),
        ("numeric(7)", "decimal(7,0)"),
        ("money", "decimal(19,4)"),
        ("smallmoney", "decimal(10,4)"),
        ("float", "double"),
        ("float(53)", "double"),
        ("float(24)", "float"),
        ("real", "float"),
        ("varchar(100)", "string"),
        ("nvarchar(max)", "string"),
        ("char(3)", "string"),
        ("nchar(2)", "string"),
        ("text", "string"),
        ("ntext", "string"),
        ("date", "date"),
        ("datetime", "timestamp_ntz"),
        ("datetime2(7)", "timestamp_ntz"),
        ("smalldatetime", "timestamp_ntz"),
        ("datetimeoffset(7)", "timestamp"),
        ("time(7)", "string"),
        ("uniqueidentifier", "string"),
        ("binary(4)", "binary"),
        ("varbinary(max)", "binary"),
        ("image", "binary"),
        ("rowversion", "binary"),
        ("xml", "string"),
        ("json", "string"),
    ],
)
def test_spark_type(sql: str, expected: str) -> None:
    assert spark_type(sql) == (expected, True)


def test_spark_type_unknown_and_too_wide() -> None:
    assert spark_type("geography") == ("string", False)
    with pytest.raises(DecodeError):
        spark_type("decimal(40,2)")


def typed_event(sql: str, value: Any) -> ChangeEvent:
    cols = [{"name": "id", "type": "int", "index": 0}, {"name": "v", "type": sql, "index": 1}]
    return one_event(message(cols=cols, current={"id": "1", "v": value}))


@pytest.mark.parametrize(
    "sql,value,expected",
    [
        ("int", "-2147483648", "-2147483648"),
        ("bigint", "9223372036854775807", "9223372036854775807"),
        ("smallint", "-32768", "-32768"),
        ("tinyint", "255", "255"),
        ("bit", "1", "true"),
        ("bit", "0", "false"),
        ("bit", "true", "true"),
        ("decimal(10,2)", "12.5", "12.50"),
        ("decimal(38,10)", "9999999999999999999999999999.9999999999", "9999999999999999999999999999.9999999999"),
        ("numeric(5,0)", "-12345", "-12345"),
        ("money", "922337203685477.5807", "922337203685477.5807"),
        ("smallmoney", "-214748.3648", "-214748.3648"),
        ("float", "1.5E+10", "15000000000.0"),
        ("real", "3.25", "3.25"),
        ("varchar(10)", "héllo", "héllo"),
        ("nvarchar(max)", "", ""),
        ("char(3)", "ab ", "ab "),
        ("date", "2025-03-14", "2025-03-14"),
        ("datetime", "2025-03-14 16:45:01.000", "2025-03-14 16:45:01.000000"),
        ("datetime2(7)", "2025-03-14 16:45:01.1234560", "2025-03-14 16:45:01.123456"),
        ("datetime2", "0001-01-01T00:00:00", "0001-01-01 00:00:00.000000"),
        ("smalldatetime", "2025-03-14 16:45", "2025-03-14 16:45:00.000000"),
        ("datetimeoffset(7)", "2025-03-14 16:45:01.1234567 +01:00", "2025-03-14 15:45:01.123456"),
        ("datetimeoffset", "2025-03-14T16:45:01Z", "2025-03-14 16:45:01.000000"),
        ("datetimeoffset", "2025-03-14T16:45:01-0530", "2025-03-14 22:15:01.000000"),
        ("time(7)", "16:45:01.1234567", "16:45:01.1234567"),
        ("uniqueidentifier", "6F9619FF-8B86-D011-B42D-00C04FC964FF", "6F9619FF-8B86-D011-B42D-00C04FC964FF"),
        ("varbinary(max)", "0x0001FF", "AAH/"),
        ("binary(2)", "AAE=", "AAE="),
        ("xml", "<a>1</a>", "<a>1</a>"),
        ("json", '{"a": 1}', '{"a": 1}'),
        ("int", None, None),
    ],
)
def test_cast(sql: str, value: Any, expected: str | None) -> None:
    ev = typed_event(sql, value)
    assert ev.after["v"] == expected
    assert ev.columns[1].type == spark_type(sql)[0]


@pytest.mark.parametrize(
    "sql,value",
    [
        ("int", "2147483648"),
        ("int", "1.5"),
        ("tinyint", "x"),
        ("smallint", "40000"),
        ("bit", "maybe"),
        ("decimal(10,2)", "1.234"),
        ("decimal(4,2)", "123.45"),
        ("money", "1.00001"),
        ("float", "abc"),
        ("date", "2025-02-30"),
        ("date", "2025-03-14 10:00"),
        ("datetime", "yesterday"),
        ("datetime2", "2025-03-14 16:45:01 +01:00"),
        ("datetimeoffset", "2025-03-14 16:45:01"),
        ("varbinary(10)", "not base64!"),
        ("binary(1)", "0xABC"),
    ],
)
def test_cast_rejects(sql: str, value: Any) -> None:
    cols = [{"name": "id", "type": "int", "index": 0}, {"name": "v", "type": sql, "index": 1}]
    reason = quarantined(message(cols=cols, current={"id": "1", "v": value}))
    assert "column v" in reason and sql in reason


def test_unquoted_json_numbers_stay_exact() -> None:
    cols = [{"name": "id", "type": "int", "index": 0}, {"name": "v", "type": "decimal(38,2)", "index": 1}]
    text = message(cols=cols, current='{"id": 1, "v": 123456789012345678901234567890.12}')
    assert one_event(text).after == {"id": "1", "v": "123456789012345678901234567890.12"}


def test_unknown_type_kept_as_string_with_note() -> None:
    ev = typed_event("geography", "POINT(1 2)")
    assert ev.after["v"] == "POINT(1 2)" and ev.columns[1].type == "string"
    assert any("unknown SQL type 'geography'" in n for n in ev.notes)


def test_sub_microsecond_digits_are_noted() -> None:
    ev = typed_event("datetime2(7)", "2025-03-14 16:45:01.1234567")
    assert ev.after["v"] == "2025-03-14 16:45:01.123456"
    assert any("sub-microsecond" in n for n in ev.notes)


def test_large_value_is_flagged() -> None:
    ev = typed_event("nvarchar(max)", "x" * (1 << 20))
    assert any("may be truncated" in n for n in ev.notes)


def test_absent_column_is_null_with_note() -> None:
    ev = one_event(message(current={"id": "1"}))
    assert ev.after == {"id": "1", "name": None}
    assert any("absent columns ['name']" in n for n in ev.notes)


def test_columns_follow_index_and_key_is_not_nullable() -> None:
    cols = [{"name": "name", "type": "varchar(5)", "index": 1}, {"name": "id", "type": "int", "index": 0}]
    ev = one_event(message(cols=cols))
    assert [(c.name, c.type, c.nullable) for c in ev.columns] == [("id", "int", False), ("name", "string", True)]


# --------------------------------------------------------------------------
# Positions


@pytest.mark.parametrize(
    "text,expected",
    [
        ("0000002C00000300017C", "0000002c00000300017c"),
        ("0x0000002C00000300017C", "0000002c00000300017c"),
        ("0000002C:00000300:017C", "0000002c00000300017c"),
        ("2C:300:17C", "0000002c00000300017c"),
    ],
)
def test_normalise_lsn(text: str, expected: str) -> None:
    assert normalise_lsn(text) == expected


@pytest.mark.parametrize("text", ["", "2C00000300017C", "0000002C00000300017G", "1:2", "123456789:0:0", 44])
def test_normalise_lsn_rejects(text: Any) -> None:
    with pytest.raises(DecodeError):
        normalise_lsn(text)


def test_position_layout_and_order() -> None:
    def pos(lsn: str, seq: Any) -> str:
        return one_event(message(tx={**TX, "commitlsn": lsn, "sequencenumber": seq})).position

    a = pos("0000002C:00000300:017C", 2)
    b = pos("0000002C00000300017c", "10")
    c = pos("0x0000002D000000000001", 1)
    assert a == "0000002c00000300017c|00000000000000000002"
    assert a < b < c


def test_commit_time_falls_back_to_cloudevent_time_and_naive_is_utc() -> None:
    assert one_event(message(tx={k: v for k, v in TX.items() if k != "committime"})).commit_ts_us == 1741970720650000
    assert one_event(message(tx={**TX, "committime": "2025-03-14 16:45:20.650"})).commit_ts_us == 1741970720650000


def test_logicalid_is_the_position_without_transaction() -> None:
    ev = one_event(message(tx=None, logicalid="9c8d4ad2-bf54-4f10-a96f-038af496997f:0000002C00000300017C:00000000000000000007"))
    assert ev.position == "0000002c00000300017c|00000000000000000007" and ev.tx_id == "0000002c00000300017c"
    assert ev.commit_ts_us == 1741970720650000 and ev.notes == []  # the CloudEvent time


def test_transaction_is_preferred_and_a_disagreeing_logicalid_is_noted() -> None:
    agree = one_event(message(logicalid="g:0000002C00000300017C:00000000000000000001"))
    assert agree.position == "0000002c00000300017c|00000000000000000001" and agree.notes == []
    other = one_event(message(logicalid="g:0000002C00000300017D:00000000000000000009"))
    assert other.position == "0000002c00000300017c|00000000000000000001"  # transaction wins
    assert any("disagrees" in n and "0000002c00000300017d" in n for n in other.notes), other.notes
    # a logicalid of another layout is only a group id: no note, the transaction orders
    assert one_event(message(logicalid="L1")).notes == []


@pytest.mark.parametrize(
    "logicalid",
    [
        "L1",
        "g:0000002C00000300017C",
        "g:0000002C0000030001:00000000000000000001",
        "g:0000002C00000300017C:1",
        "g:0000002C00000300017G:00000000000000000001",
    ],
)
def test_no_transaction_and_no_logicalid_position_quarantines(logicalid: str) -> None:
    reason = quarantined(message(tx=None, logicalid=logicalid))
    assert "eventsource.transaction missing" in reason and "logicalid" in reason


def test_sequencenumber_breaks_ties_within_one_commit() -> None:
    """Two changes of one key in one transaction share the commit LSN: the
    sequence number orders them (from transaction or from logicalid)."""

    def upd(seq: int, name: str, tx: bool) -> ChangeEvent:
        t = {**TX, "sequencenumber": seq} if tx else None
        return one_event(
            message("UPD", id=f"e{seq}", tx=t, current={"id": "1", "name": name}, logicalid=f"g:0000002C00000300017C:{seq:020d}")
        )

    for tx in (True, False):
        later, earlier = upd(10, "second", tx), upd(9, "first", tx)
        assert later.position.split("|")[0] == earlier.position.split("|")[0]
        assert [e.after["name"] for e in sorted([later, earlier], key=lambda e: e.position)] == ["first", "second"]


def test_change_id_pairs_the_halves_of_a_key_change_only() -> None:
    halves = decode(
        message("UPD", id="k1", current={"id": "2", "name": "a"}, old={"id": "1", "name": "a"}, pkkey=[{"columnname": "id", "value": "2"}])
    )
    assert [e.op for e in halves] == [Op.DELETE, Op.INSERT]
    assert halves[0].change_id == halves[1].change_id == "k1"
    plain = [one_event(message("UPD", id=f"u{i}", current={"id": "1", "name": str(i)})) for i in range(2)]
    assert [e.change_id for e in plain] == ["u0", "u1"]


@pytest.mark.parametrize(
    "tx,needle",
    [
        (None, "eventsource.transaction missing"),
        ({**TX, "commitlsn": "12"}, "20-hex-digit"),
        ({**TX, "sequencenumber": -1}, "negative"),
        ({**TX, "sequencenumber": True}, "sequencenumber"),
        ({**TX, "committime": "soon"}, "committime"),
    ],
)
def test_bad_transaction_quarantines(tx: Any, needle: str) -> None:
    assert needle in quarantined(message(tx=tx))


# --------------------------------------------------------------------------
# Operations and keys


def test_update_and_delete() -> None:
    ev = one_event(message("UPD", current={"id": "1", "name": "b"}))
    assert ev.op == Op.UPDATE and ev.before is None and ev.after == {"id": "1", "name": "b"}
    ev = one_event(message("UPD", current={"id": "1", "name": "b"}, old={"id": "1", "name": "a"}))
    assert ev.before == {"id": "1", "name": "a"}
    ev = one_event(message("DEL", current="{}", old={"id": "1", "name": "a"}))
    assert ev.op == Op.DELETE and ev.after == {} and ev.before == {"id": "1", "name": "a"}


def test_delete_without_old_image_takes_key_from_pkkey() -> None:
    ev = one_event(message("DEL", current="{}", old="{}"))
    assert ev.before == {"id": "1"} and ev.key_columns == ["id"]


def test_primary_key_update_with_old_image_is_delete_plus_insert() -> None:
    out = decode(message("UPD", current={"id": "2", "name": "a"}, old={"id": "1", "name": "a"}, pkkey=[{"columnname": "id", "value": "2"}]))
    assert [(e.op, e.before, e.after) for e in out] == [
        (Op.DELETE, {"id": "1", "name": "a"}, {}),
        (Op.INSERT, None, {"id": "2", "name": "a"}),
    ]
    assert out[0].position == out[1].position


def test_pkkey_disagreeing_with_row_quarantines() -> None:
    assert "pkkey says '2'" in quarantined(message(pkkey=[{"columnname": "id", "value": "2"}]))
    assert "without an old image" in quarantined(message("UPD", pkkey=[{"columnname": "id", "value": "2"}]))


def test_configured_key_when_pkkey_is_absent() -> None:
    ctx = DecodeContext(primary_keys={"dbo.items": ["id"]})
    assert one_event(message(pkkey=None), ctx).key_columns == ["id"]
    assert one_event(message(pkkey=[]), ctx).key_columns == ["id"]
    assert "no configured primary key" in quarantined(message(pkkey=None))
    assert "not columns of" in quarantined(message(pkkey=None), DecodeContext(primary_keys={"items": ["nope"]}))


def test_composite_key() -> None:
    cols = COLS + [{"name": "k2", "type": "date", "index": 2}]
    ev = one_event(
        message(
            cols=cols,
            current={"id": "1", "name": "a", "k2": "2025-01-02"},
            pkkey=[{"columnname": "id", "value": "1"}, {"columnname": "k2", "value": "2025-01-02"}],
        )
    )
    assert ev.key_columns == ["id", "k2"]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"current": "{}"}, "without a current row image"),
        ({"current": {"id": "1", "zzz": "x"}}, "not declared in cols"),
        ({"current": {"id": None, "name": "a"}}, "no value for key column"),
        ({"tbl": ""}, "eventsource.tbl name is empty"),
        ({"schema": "db\x00o"}, "control character"),
        ({"db": 5}, "eventsource.db name must be a string"),
        ({"cols": [{"name": "id\n", "type": "int", "index": 0}]}, "control character"),
        ({"cols": []}, "cols missing"),
        ({"cols": COLS + [{"name": "id", "type": "int", "index": 5}]}, "declared twice"),
        ({"pkkey": [{"columnname": "nope", "value": "1"}]}, "not declared in cols"),
        ({"pkkey": [{"columnname": "id", "value": None}]}, "has no value"),
        ({"current": "[1]"}, "not a JSON object"),
        ({"current": "{bad"}, "eventrow.current is not JSON"),
    ],
)
def test_bad_payload_quarantines(kwargs: dict[str, Any], needle: str) -> None:
    assert needle in quarantined(message(**kwargs))


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"specversion": "1.0", ', "malformed JSON envelope"),
        ("[1, 2]", "not a JSON object"),
        (message(data="{not json"), "data is not JSON"),
        (message(data={"eventsource": {}}), "data must be a string"),
        (message(data=None), "no data"),
        (message(data=json.dumps({"eventrow": {}})), "no eventsource"),
        (message(data=json.dumps({"eventsource": {"db": "x"}})), "no eventrow"),
        (message("MERGE"), "unknown operation 'MERGE'"),
        (message(None), "unknown operation None"),
        (message(id=""), "'id'"),
        (message(splitindex=3, splittotalcnt=0), "splitindex 3"),
        (message(segmentindex=0, finalsegment="yes"), "finalsegment"),
        (json.dumps({**json.loads(message()), "type": "com.example.Other"}), "unsupported CloudEvent type"),
        (json.dumps({**json.loads(message()), "specversion": "0.3"}), "specversion"),
    ],
)
def test_bad_envelope_quarantines(text: str, needle: str) -> None:
    assert needle in quarantined(text)


def test_lowercase_operation_and_eventdata_alias_are_accepted() -> None:
    assert one_event(message("ins")).op == Op.INSERT
    data = json.loads(data_text())
    data["eventdata"] = data.pop("eventrow")
    assert one_event(message(data=json.dumps(data))).op == Op.INSERT


def test_sniff_and_registry() -> None:
    assert decoder_class(Format.SQLSERVER_CES) is SqlServerCesDecoder
    assert SqlServerCesDecoder.sniff(message())
    assert not SqlServerCesDecoder.sniff('{"payload": {"op": "c"}}')
    assert detect_format([(CASES / "01_insert.verbatim.jsonl").read_text()]) == Format.SQLSERVER_CES


# --------------------------------------------------------------------------
# Split messages


def segments(text: str, n: int, *, style: str = "split", base: int = 0, id_prefix: str = "s") -> list[str]:
    env = json.loads(text)
    data = env.pop("data")
    env.pop("splitindex"), env.pop("splittotalcnt")
    size = -(-len(data) // n)
    out = []
    for i in range(n):
        seg = {**env, "id": f"{id_prefix}{i}"}
        if style == "split":
            seg.update(splitindex=i + base, splittotalcnt=n)
        else:
            seg.update(segmentindex=i, finalsegment=i == n - 1)
        seg["data"] = data[i * size : (i + 1) * size]
        out.append(json.dumps(seg))
    return out


BIG = message(current={"id": "1", "name": "x" * 300})


@pytest.mark.parametrize("style", ["split", "segment"])
@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2, 0]])
def test_split_reassembly(style: str, order: list[int]) -> None:
    segs = segments(BIG, 3, style=style)
    lines = [segs[i] for i in order]
    out = run(lines)
    events = [o for o in out if isinstance(o, ChangeEvent)]
    assert len(events) == 1 and events[0].after == {"id": "1", "name": "x" * 300}
    first_line = order.index(0) + 1
    assert (events[0].line, events[0].message_id) == (first_line, "s0")
    skipped = [o for o in out if isinstance(o, Skipped)]
    assert sorted(s.line for s in skipped) == sorted(set(range(1, 4)) - {first_line})
    assert all(s.reason == "split-segment" for s in skipped)
    assert all(SqlServerCesDecoder().needs_driver(RawMessage("f", 1, s)) for s in segs)


def test_split_one_based_numbering() -> None:
    out = run(segments(BIG, 3, base=1))
    assert [type(o).__name__ for o in out] == ["ChangeEvent", "Skipped", "Skipped"]


@pytest.mark.parametrize("style", ["split", "segment"])
def test_incomplete_split_is_held(style: str) -> None:
    segs = segments(BIG, 3, style=style)
    out = run([segs[0], segs[2], message(id="other")])
    assert [type(o).__name__ for o in out] == ["Held", "Held", "ChangeEvent"]
    assert all(o.reason == "incomplete-split" and o.group == "L1" for o in out[:2])


def test_split_segment_decoded_alone_is_held() -> None:
    [held] = decode(segments(BIG, 2)[1])
    assert isinstance(held, Held) and held.group == "L1"


def test_split_duplicates() -> None:
    segs = segments(BIG, 2)
    same_data_new_id = json.dumps({**json.loads(segs[1]), "id": "again"})
    out = run([segs[0], segs[1], segs[1], same_data_new_id])
    assert [(type(o).__name__, getattr(o, "reason", None)) for o in out] == [
        ("ChangeEvent", None),
        ("Skipped", "split-segment"),
        ("Skipped", "duplicate-id"),
        ("Skipped", "duplicate-segment"),
    ]


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda s: [s[0], s[1], json.dumps({**json.loads(s[1]), "id": "x", "data": "zz"})], "different data"),
        (lambda s: [s[0], json.dumps({**json.loads(s[1]), "operation": "DEL"})], "disagree on operation"),
        (lambda s: [s[0], json.dumps({**json.loads(s[1]), "splittotalcnt": 3})], "disagree on splittotalcnt"),
        (lambda s: [s[0], json.dumps({**json.loads(s[1]), "splitindex": 2})], "mix 0-based and 1-based"),
        (lambda s: [s[0], json.dumps({**json.loads(s[1]), "data": json.loads(s[1])["data"] + "}"})], "data is not JSON"),
    ],
)
def test_inconsistent_split_group_quarantines_every_segment(mutate: Any, needle: str) -> None:
    lines = mutate(segments(BIG, 2))
    out = run(lines)
    assert all(isinstance(o, Quarantined) and needle in o.reason for o in out), out
    assert [o.raw for o in out] == lines


def test_segment_style_final_inconsistencies_quarantine() -> None:
    segs = segments(BIG, 3, style="segment")
    two_finals = json.dumps({**json.loads(segs[1]), "finalsegment": True})
    out = run([segs[0], two_finals, segs[2]])
    assert all(isinstance(o, Quarantined) and "several final" in o.reason for o in out)


def test_groups_are_per_logicalid() -> None:
    a = segments(BIG, 2, id_prefix="a")
    b = segments(
        message(logicalid="L2", current={"id": "2", "name": "y" * 200}, pkkey=[{"columnname": "id", "value": "2"}]), 2, id_prefix="b"
    )
    out = run([a[1], b[0], b[1], a[0]])
    assert sorted(e.after["id"] for e in out if isinstance(e, ChangeEvent)) == ["1", "2"]


# --------------------------------------------------------------------------
# Duplicate CloudEvent ids


def test_decode_message_is_stateless_and_dedupe_ids_skips_repeats() -> None:
    text = message()
    dec = SqlServerCesDecoder()
    assert len(dec.decode(RawMessage("f", 1, text))) == len(dec.decode(RawMessage("f", 2, text))) == 1
    raw = list(decode_all(dec, [RawMessage("f", 1, text), RawMessage("f", 2, message(id="e2")), RawMessage("g", 1, text)]))
    out = dedupe_ids(raw)
    assert [(type(o).__name__, o.file, o.line) for o in out] == [("ChangeEvent", "f", 1), ("ChangeEvent", "f", 2), ("Skipped", "g", 1)]
    assert out[2].reason == "duplicate-id" and out[2].detail == "e1" and out[2].position == raw[0].position


def test_dedupe_keeps_both_events_of_one_message() -> None:
    pk_change = message("UPD", current={"id": "2", "name": "a"}, old={"id": "1", "name": "a"}, pkkey=[{"columnname": "id", "value": "2"}])
    out = run([pk_change, pk_change])
    assert [(type(o).__name__, o.line) for o in out] == [("ChangeEvent", 1), ("ChangeEvent", 1), ("Skipped", 2)]


def test_primary_key_update_pkkey_may_name_either_key_but_not_a_third() -> None:
    def pk_change(pk: str) -> str:
        return message("UPD", current={"id": "2", "name": "a"}, old={"id": "1", "name": "a"}, pkkey=[{"columnname": "id", "value": pk}])

    assert [e.op for e in decode(pk_change("1"))] == [Op.DELETE, Op.INSERT]
    assert "matches neither" in quarantined(pk_change("3"))


# --------------------------------------------------------------------------
# Split messages across batches (decoder state)


@pytest.mark.parametrize("style", ["split", "segment"])
def test_resent_segment_of_an_applied_split_message_is_a_duplicate(style: str) -> None:
    """The spec: split messages share a logicalid; source + id identify an
    event, a re-sent one may carry the same id.  A segment re-sent after its
    message was reassembled (and applied) in an earlier batch is a duplicate,
    not an incomplete group held for ever."""
    segs = segments(BIG, 2, style=style)
    first = SqlServerCesDecoder()
    out1 = list(decode_all(first, [RawMessage("a", i, s) for i, s in enumerate(segs, 1)]))
    assert [type(o).__name__ for o in out1] == ["ChangeEvent", "Skipped"]
    state = json.loads(json.dumps(first.export_state()))  # persisted as JSON in the ledger
    second = SqlServerCesDecoder(DecodeContext(state=state))
    out2 = list(decode_all(second, [RawMessage("b", 1, segs[1]), RawMessage("b", 2, message(id="new"))]))
    assert [(type(o).__name__, getattr(o, "reason", None)) for o in out2] == [("Skipped", "duplicate-segment"), ("ChangeEvent", None)]
    # the memory is carried on: a third batch still knows the message
    third = SqlServerCesDecoder(DecodeContext(state=json.loads(json.dumps(second.export_state()))))
    [again] = list(decode_all(third, [RawMessage("c", 1, segs[0])]))
    assert (type(again).__name__, again.reason) == ("Skipped", "duplicate-segment")
    # another source's message with the same logicalid is not confused with it
    other = json.dumps({**json.loads(segs[1]), "source": "/other"})
    [held] = list(decode_all(SqlServerCesDecoder(DecodeContext(state=state)), [RawMessage("d", 1, other)]))
    assert isinstance(held, Held)


def test_split_memory_is_bounded() -> None:
    from cdc_apply.decode import sqlserver_ces

    dec = SqlServerCesDecoder()
    for i in range(sqlserver_ces.APPLIED_SPLITS_MAX + 5):
        dec._remember_split("/", f"L{i}")
    kept = dec.export_state()[sqlserver_ces.STATE_KEY]["applied_splits"]
    assert len(kept) == sqlserver_ces.APPLIED_SPLITS_MAX and kept[-1] == ["/", f"L{sqlserver_ces.APPLIED_SPLITS_MAX + 4}"]
