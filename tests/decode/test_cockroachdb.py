"""CockroachDB changefeed decoder: golden spec examples, HLC positions,
envelope detection, resolved / key_only / webhook batches, keys, types and
quarantines."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cdc_apply.decode import decoder_class, detect_format
from cdc_apply.decode.base import DecodeContext, decode_all
from cdc_apply.decode.cockroachdb import (
    CockroachDbDecoder,
    arrival_position,
    cloud_storage_table,
    hlc_position,
    hlc_text,
    is_key_only,
    parse_hlc,
)
from cdc_apply.model import CONFIG_REFUSED_PREFIX, ChangeEvent, Column, DecodeError, Format, Op, Quarantined, RawMessage, Skipped
from tests.decode import outcome_dict

CASES = Path(__file__).parent / "cases" / "cockroachdb"
REGEN = os.environ.get("COCKROACHDB_GOLDEN_REGEN") == "1"

# --------------------------------------------------------------------------
# Golden cases


def golden_inputs() -> list[Path]:
    return sorted(p for p in CASES.iterdir() if p.suffix in (".json", ".jsonl", ".txt") and not p.name.endswith(".expected.json"))


def expected_path(path: Path) -> Path:
    return path.with_name(path.name.rsplit(".", 1)[0] + ".expected.json")


def messages_of(path: Path, spec: dict[str, Any] | None = None) -> list[RawMessage]:
    """The case's messages as archived: under ``spec["file"]`` (e.g. the name a
    cloud-storage sink gives its file) and, with ``spec["kafka"]`` (``topic``,
    optional ``key``), inside the archive wrapper a Kafka archiver writes."""
    spec = spec or {}
    name = spec.get("file", path.name)
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [RawMessage(name, i, line) for i, line in enumerate(text.split("\n"), 1) if line.strip()]
    if path.suffix == ".json":
        text = text.rstrip("\n")  # one archived line
    if "kafka" in spec:
        text = json.dumps({"topic": spec["kafka"]["topic"], "key": spec["kafka"].get("key"), "value": text})
    return [RawMessage(name, 1, text)]


@pytest.mark.parametrize("path", golden_inputs(), ids=lambda p: p.name)
def test_golden(path: Path) -> None:
    exp_file = expected_path(path)
    spec = json.loads(exp_file.read_text()) if exp_file.exists() else {}
    ctx = DecodeContext(**spec.get("context", {}))
    msgs = messages_of(path, spec)
    outcomes = list(decode_all(CockroachDbDecoder(ctx), msgs))
    assert len(outcomes) >= len(msgs)  # every message accounted for
    assert {o.line for o in outcomes} == {m.line for m in msgs}
    for o in outcomes:
        assert o.file == spec.get("file", path.name)
        if isinstance(o, Quarantined):
            assert o.raw == msgs[o.line - 1].text if path.suffix != ".jsonl" else o.raw == next(m.text for m in msgs if m.line == o.line)
    got = [outcome_dict(o) for o in outcomes]
    if REGEN:
        data = {k: spec[k] for k in ("context", "file", "kafka") if k in spec}
        data["outcomes"] = got
        exp_file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        spec = data
    assert exp_file.exists(), f"no expected output for {path.name}"
    assert got == spec["outcomes"]
    if ".verbatim." in path.name:
        assert all(isinstance(o, Quarantined) for o in outcomes), "verbatim spec text that is not JSON must quarantine"
        assert all("malformed JSON" in o.reason for o in outcomes)
    if ".repaired." in path.name:
        assert not any("malformed JSON" in getattr(o, "reason", "") for o in outcomes)


def test_every_spec_example_has_a_case() -> None:
    """Every JSON example of the spec is a case (README table lists them)."""
    readme = (CASES / "README.md").read_text()
    for path in golden_inputs():
        assert path.name.split(".")[0] in readme, f"{path.name} missing from README"
    spec = Path("/work/shared/formats/cockroachdb-changefeed-envelopes.txt")
    if spec.exists():
        stored = {" ".join(p.read_text().split()) for p in golden_inputs()}
        stored_compact = {s.replace(" ", "") for s in stored}
        for line in spec.read_text().split("\n"):
            t = line.strip()
            if (t.startswith('{"') or t.startswith('["')) and t.endswith(("}", "]")):
                assert t.replace(" ", "") in stored_compact, f"spec example not stored: {t[:60]}"


# --------------------------------------------------------------------------
# HLC timestamps and positions


def test_hlc_parse_exact_integers() -> None:
    assert parse_hlc("1745506768962755000.0000000000") == (1745506768962755000, 0)
    assert parse_hlc("1745506768962755000.0000000007") == (1745506768962755000, 7)
    assert parse_hlc("1745506768962755000.2147483647?") == (1745506768962755000, 2147483647)
    assert parse_hlc("1745506768962755000") == (1745506768962755000, 0)
    # nanosecond digits a float would lose
    assert parse_hlc("1745506768962755001.0000000000")[0] - parse_hlc("1745506768962755000.0000000000")[0] == 1


def test_hlc_position_order_is_numeric_order() -> None:
    stamps = [
        "999999999.0000000005",  # fewer wall digits
        "1000000000.0000000000",
        "1000000000.0000000001",
        "1000000000.0000000010",  # logical 10 > logical 9 (string order of raw text would agree only by luck)
        "1000000000.0000000009?",
        "1745506768962755000.0000000000",
        "10000000000000000000.0000000000",
    ]
    numeric = sorted(stamps, key=lambda s: parse_hlc(s))
    assert sorted(stamps, key=hlc_text) == numeric
    assert hlc_text("1000000000.0000000009?") < hlc_text("1000000000.0000000010")
    assert hlc_text("999999999.0000000005") < hlc_text("1000000000.0000000000")
    assert hlc_text("1745506768962755000.0000000003?") == hlc_position(1745506768962755000, 3)
    assert hlc_text("1745506768962755000.0000000003?") == "01745506768962755000.0000000003"
    # a float would make these equal
    assert hlc_text("1745506768962755000.0000000001") > hlc_text("1745506768962755000.0000000000")


@pytest.mark.parametrize(
    "bad", ["", "abc", "1.5", "1.00000000001", "-1.0000000000", "0.0000000000", "1e18", None, True, 1.5, "1745506768962755000.0000000000??"]
)
def test_hlc_rejects(bad: Any) -> None:
    with pytest.raises(DecodeError):
        parse_hlc(bad)


# --------------------------------------------------------------------------
# Builders

UPD = "1700000000000000000.0000000000"


def decode(obj: Any, ctx: DecodeContext | None = None) -> list[Any]:
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return CockroachDbDecoder(ctx).decode(RawMessage("t.jsonl", 3, text))


def one_event(obj: Any, ctx: DecodeContext | None = None) -> ChangeEvent:
    out = decode(obj, ctx)
    assert len(out) == 1 and isinstance(out[0], ChangeEvent), out
    return out[0]


def quarantined(obj: Any, ctx: DecodeContext | None = None) -> str:
    out = decode(obj, ctx)
    assert len(out) == 1 and isinstance(out[0], Quarantined), out
    assert out[0].line == 3
    return out[0].reason


KEYED = DecodeContext(primary_keys={"items": ["id"]})


def wrapped(**kw: Any) -> dict[str, Any]:
    msg = {"after": {"id": 1, "name": "a"}, "key": [1], "topic": "items", "updated": UPD}
    msg.update(kw)
    return {k: v for k, v in msg.items() if v is not ...}


# --------------------------------------------------------------------------
# Envelope detection


def test_wrapped_upsert_without_diff_is_update() -> None:
    ev = one_event(wrapped(), KEYED)
    assert (ev.op, ev.table, ev.key_columns, ev.after) == (Op.UPDATE, "items", ["id"], {"id": "1", "name": "a"})
    assert ev.before is None and ev.position == "01700000000000000000.0000000000"
    assert ev.commit_ts_us == 1700000000000000
    assert ev.format == "cockroachdb" and ev.database is None and ev.schema is None
    assert ev.columns == [Column("id", "bigint", False), Column("name", "string")]


def test_wrapped_diff_ops() -> None:
    assert one_event(wrapped(before=None), KEYED).op is Op.INSERT
    ev = one_event(wrapped(before={"id": 1, "name": "old"}), KEYED)
    assert ev.op is Op.UPDATE and ev.before == {"id": "1", "name": "old"}
    ev = one_event(wrapped(after=None, before={"id": 1, "name": "old"}), KEYED)
    assert (ev.op, ev.after, ev.before) == (Op.DELETE, {}, {"id": "1", "name": "old"})
    ev = one_event(wrapped(after=None), KEYED)  # no diff: the key alone names the row
    assert (ev.op, ev.after, ev.before) == (Op.DELETE, {}, {"id": "1"})
    assert ev.columns == [Column("id", "bigint", False)]


def test_wrapped_key_from_configured_names_and_row() -> None:
    ev = one_event(wrapped(key=...), KEYED)  # Kafka sink without key_in_value
    assert ev.key_columns == ["id"] and ev.after["id"] == "1"
    ctx = DecodeContext(primary_keys={"shop.public.items": ["id"]})
    ev = one_event(wrapped(key=..., topic="shop.public.items"), ctx)
    assert (ev.database, ev.schema, ev.table) == ("shop", "public", "items")


def test_wrapped_without_key_names_or_values_leaves_key_to_the_job() -> None:
    ev = one_event(wrapped(key=...))
    assert ev.key_columns == []


def test_scan_emission_is_read() -> None:
    ev = one_event(wrapped(updated="1700000000500000000.0000000000", mvcc_timestamp="1690000000000000000.0000000001"), KEYED)
    assert ev.op is Op.READ and ev.position == hlc_text("1690000000000000000.0000000001")
    assert ev.commit_ts_us == 1690000000000000
    assert any("initial scan" in n for n in ev.notes)


def test_position_preference_mvcc_then_hlc_then_updated() -> None:
    ev = one_event(wrapped(mvcc_timestamp="1700000000000000000.0000000004"), KEYED)
    assert ev.position.endswith(".0000000004")
    payload = {
        "after": {"id": 1},
        "op": "u",
        "ts_ns": 1800000000000000000,
        "source": {"table_name": "items", "primary_keys": ["id"], "ts_hlc": "1700000000000000000.0000000002", "ts_ns": 1700000000000000000},
    }
    ev = one_event(payload)
    assert ev.position == hlc_text("1700000000000000000.0000000002")
    payload["source"]["mvcc_timestamp"] = "1600000000000000000.0000000001"
    assert one_event(payload).position == hlc_text("1600000000000000000.0000000001")


def test_enriched_never_uses_top_level_ts_ns() -> None:
    payload = {"after": {"id": 1}, "op": "c", "ts_ns": 1745523745569419000, "source": {"table_name": "items", "primary_keys": ["id"]}}
    reason = quarantined(payload)
    assert "no position" in reason and "mvcc_timestamp" in reason
    payload["source"]["ts_ns"] = 1700000000000000123
    ev = one_event(payload)
    assert ev.position == "01700000000000000123.0000000000" and ev.commit_ts_us == 1700000000000000


def test_enriched_ops_and_source() -> None:
    src = {
        "database_name": "shop",
        "schema_name": "public",
        "table_name": "items",
        "primary_keys": ["id"],
        "mvcc_timestamp": UPD,
        "origin": "cockroachdb",
    }
    for op, expect in (("c", Op.INSERT), ("u", Op.UPDATE), ("r", Op.READ)):
        ev = one_event({"after": {"id": 2, "x": "y"}, "before": None, "op": op, "source": src, "ts_ns": 1})
        assert (ev.op, ev.database, ev.schema, ev.table, ev.key_columns) == (expect, "shop", "public", "items", ["id"])
    ev = one_event({"after": None, "before": {"id": 2, "x": "y"}, "op": "d", "source": src, "ts_ns": 1})
    assert (ev.op, ev.after, ev.before) == (Op.DELETE, {}, {"id": "2", "x": "y"})
    assert "unknown op" in quarantined({"after": {"id": 2}, "op": "x", "source": src})
    assert "non-null after" in quarantined({"after": {"id": 2}, "op": "d", "source": src})
    assert "without an after" in quarantined({"after": None, "op": "u", "source": src})
    assert "without a key" in quarantined({"after": None, "before": None, "op": "d", "source": {**src, "primary_keys": None}})


def test_enriched_delete_key_from_archive_wrapper_key_object() -> None:
    value = {"after": None, "op": "d", "source": {"table_name": "items", "mvcc_timestamp": UPD}}
    ev = one_event({"key": json.dumps({"id": 5}), "table": "items", "value": json.dumps(value)})
    assert (ev.op, ev.key_columns, ev.before) == (Op.DELETE, ["id"], {"id": "5"})


SCHEMA_FIELDS = [
    {"field": "id", "optional": False, "type": "int64"},
    {"field": "price", "name": "decimal", "optional": False, "parameters": {"precision": "10", "scale": "2"}, "type": "float64"},
    {"field": "big", "name": "decimal", "optional": True, "parameters": {"precision": "38", "scale": "10"}, "type": "float64"},
    {"field": "free", "name": "decimal", "optional": True, "parameters": {"precision": "0", "scale": "0"}, "type": "float64"},
    {"field": "f", "optional": True, "type": "float64"},
    {"field": "ok", "optional": True, "type": "boolean"},
    {"field": "ts", "name": "timestamp", "optional": True, "type": "string"},
    {"field": "d", "name": "date", "optional": True, "type": "string"},
    {"field": "t", "name": "time", "optional": True, "type": "string"},
    {"field": "b", "optional": True, "type": "bytes"},
    {"field": "j", "optional": True, "type": "json"},
    {"field": "arr", "optional": True, "type": "array", "items": {"type": "int64", "optional": True}},
    {"field": "odd", "optional": True, "type": "map"},
]


def enriched_with_schema(after: str) -> str:
    """Raw JSON text, so decimals stay as the doc renders them."""
    schema = {
        "type": "struct",
        "name": "cockroachdb.envelope",
        "optional": False,
        "fields": [
            {"field": "after", "type": "struct", "optional": False, "name": "items.after.value", "fields": SCHEMA_FIELDS},
            {"field": "ts_ns", "type": "int64", "optional": False},
            {"field": "op", "type": "string", "optional": False},
        ],
    }
    src = json.dumps({"table_name": "items", "primary_keys": ["id"], "mvcc_timestamp": UPD})
    return f'{{"payload": {{"after": {after}, "op": "c", "source": {src}, "ts_ns": 1}}, "schema": {json.dumps(schema)}}}'


def test_enriched_schema_types_are_exact() -> None:
    after = (
        '{"id": 9223372036854775807, "price": 12345678.90, "big": 1234567890123456789012345678.0123456789, '
        '"free": 3.14159265358979323846264338327950288419716939937510, "f": 0.1, "ok": true, '
        '"ts": "2025-04-24T14:59:28.96273", "d": "2025-04-24", "t": "14:59:28.5", "b": "AAEC", '
        '"j": {"z": 1, "a": [1.5, null]}, "arr": [1, 2], "odd": {"k": "v"}}'
    )
    ev = one_event(enriched_with_schema(after))
    assert ev.after == {
        "id": "9223372036854775807",
        "price": "12345678.90",
        "big": "1234567890123456789012345678.0123456789",
        "free": "3.14159265358979323846264338327950288419716939937510",
        "f": "0.1",
        "ok": "true",
        "ts": "2025-04-24 14:59:28.962730",
        "d": "2025-04-24",
        "t": "14:59:28.5",
        "b": "AAEC",
        "j": '{"a":[1.5,null],"z":1}',
        "arr": "[1,2]",
        "odd": '{"k":"v"}',
    }
    types = {c.name: c.type for c in ev.columns}
    assert types == {
        "id": "bigint",
        "price": "decimal(10,2)",
        "big": "decimal(38,10)",
        "free": "string",
        "f": "double",
        "ok": "boolean",
        "ts": "timestamp",
        "d": "date",
        "t": "string",
        "b": "binary",
        "j": "string",
        "arr": "string",
        "odd": "string",
    }
    assert [c.nullable for c in ev.columns][:2] == [False, False]
    assert INFERRED not in ev.notes
    assert any("unconstrained DECIMAL" in n for n in ev.notes)
    assert any("odd" in n and "unsupported" in n for n in ev.notes)


INFERRED = "no schema: column types inferred from JSON values"


@pytest.mark.parametrize(
    "after, reason",
    [
        ('{"id": 1, "price": 1.005}', "more than 2 decimal places"),
        ('{"id": 1, "price": 123456789.00}', "does not fit decimal(10,2)"),
        ('{"id": 1, "price": "NaN"}', "finite"),
        ('{"id": 1, "price": 1.00, "ts": "yesterday"}', "ts"),
        ('{"id": 1, "price": 1.00, "b": "not base64!"}', "b"),
        ('{"id": 1, "price": 1.00, "extra": 1}', "not in the message schema"),
        ('{"id": "x", "price": 1.00}', "id"),
        ('{"id": 9223372036854775808, "price": 1.00}', "does not fit bigint"),
    ],
)
def test_value_not_fitting_type_quarantines(after: str, reason: str) -> None:
    assert reason in quarantined(enriched_with_schema(after))


def test_schemaless_inference_is_exact() -> None:
    text = (
        '{"after": {"id": 1, "dec": 45.00, "big": 123456789012345678901234567890, "tiny": 1E-3, "e": 1E+2, '
        f'"s": "x", "b": false, "j": {{"a": 1.10}}, "n": null}}, "key": [1], "topic": "items", "updated": "{UPD}"}}'
    )
    ev = one_event(text, KEYED)
    assert ev.after == {
        "id": "1",
        "dec": "45.00",
        "big": "123456789012345678901234567890",
        "tiny": "0.001",
        "e": "100",
        "s": "x",
        "b": "false",
        "j": '{"a":1.10}',
        "n": None,
    }
    assert {c.name: c.type for c in ev.columns} == {
        "id": "bigint",
        "dec": "decimal(38,2)",
        "big": "decimal(38,0)",
        "tiny": "decimal(38,3)",
        "e": "decimal(38,0)",
        "s": "string",
        "b": "boolean",
        "j": "string",
    }  # a JSON null declares no column
    assert ev.notes[0] == INFERRED


def test_bare_and_row() -> None:
    meta = {"key": [1], "topic": "items", "updated": UPD}
    ev = one_event({"__crdb__": meta, "id": 1, "name": "a"}, KEYED)
    assert (ev.op, ev.after, ev.key_columns) == (Op.UPDATE, {"id": "1", "name": "a"}, ["id"])
    assert any("bare envelope" in n for n in ev.notes)
    assert "without row columns" in quarantined({"__crdb__": meta}, KEYED)
    assert "unknown fields" in quarantined({"__crdb__": {**meta, "zzz": 1}, "id": 1}, KEYED)
    reason = quarantined({"id": 1, "name": "a"}, KEYED)
    assert "envelope=row" in reason and "no position" in reason and "no table name" in reason


def test_resolved_forms() -> None:
    pos = hlc_text("1745506768962755000.0000000001")
    for obj in (
        {"resolved": "1745506768962755000.0000000001"},
        {"__crdb__": {"resolved": "1745506768962755000.0000000001"}},
        {"key": "", "table": "", "value": '{"resolved":"1745506768962755000.0000000001"}'},
        {"payload": {"resolved": "1745506768962755000.0000000001"}},
    ):
        out = decode(obj)
        assert len(out) == 1 and isinstance(out[0], Skipped), (obj, out)
        assert (out[0].reason, out[0].position, out[0].line) == ("resolved-watermark", pos, 3)
    assert "not an HLC" in quarantined({"resolved": "soon"})


def test_key_only() -> None:
    assert "key_only" in quarantined(["boston", "22222222-2222-4200-8000-000000000002"])
    assert "key_only" in quarantined({"key": '["seattle", "x"]', "table": "users", "value": ""})
    assert "key_only" in quarantined({"key": '["seattle", "x"]', "topic": "users", "value": None})
    assert is_key_only('["boston", "x"]')
    assert is_key_only('{"key":"[\\"seattle\\"]","table":"users","value":""}')
    assert not is_key_only('{"key":"[\\"seattle\\"]","table":"users","value":"{\\"after\\": null}"}')
    assert not is_key_only(json.dumps(wrapped()))
    assert not is_key_only("not json")


def test_webhook_batch_yields_one_outcome_per_element() -> None:
    batch = {"payload": [wrapped(), {"resolved": UPD}, wrapped(after="oops"), wrapped(key=[2], after={"id": 2})], "length": 4}
    out = decode(batch, KEYED)
    assert [type(o).__name__ for o in out] == ["ChangeEvent", "Skipped", "Quarantined", "ChangeEvent"]
    assert all(o.line == 3 and o.file == "t.jsonl" for o in out)
    assert out[2].reason.startswith("payload[2]: DecodeError: after is neither") and out[2].raw == json.dumps(batch)
    assert "length 3 but carries 4" in quarantined({**batch, "length": 3}, KEYED)
    empty = decode({"payload": [], "length": 0})
    assert [(type(o).__name__, o.reason) for o in empty] == [("Skipped", "empty-webhook-batch")]


def test_key_quarantines() -> None:
    reason = quarantined(wrapped(topic="vehicles", key=["seattle", 1]))
    assert "configure primary key columns for table vehicles" in reason
    assert "2 values" in quarantined(wrapped(key=[1, 2]), KEYED)
    assert "disagrees" in quarantined(wrapped(key=[2]), KEYED)
    assert "null value" in quarantined(wrapped(key=[None], after={"id": None}), KEYED)
    assert "no value for key column" in quarantined(wrapped(key=..., after={"name": "a"}), KEYED)
    assert "no value for key column" in quarantined(wrapped(key=..., after=None), KEYED)
    # archive wrapper key vs key_in_value
    text = json.dumps({"key": "[2]", "topic": "items", "value": json.dumps(wrapped())})
    assert "disagrees" in quarantined(text, KEYED)
    # source.primary_keys vs key object names
    value = {"after": {"id": 1, "k": 2}, "op": "c", "source": {"table_name": "items", "primary_keys": ["id"], "mvcc_timestamp": UPD}}
    assert "disagree" in quarantined({"key": '{"k": 2}', "table": "items", "value": json.dumps(value)})


def test_table_name_sources_and_validation() -> None:
    assert "no table name" in quarantined(wrapped(topic=...), KEYED)
    assert "column-family" in quarantined(wrapped(topic="items.fam"), KEYED)
    assert "control character" in quarantined(wrapped(topic="it\u0001ems"), KEYED)
    assert "control character" in quarantined(wrapped(after={"id": 1, "na\nme": 1}), KEYED)
    text = json.dumps({"key": "[1]", "table": "other", "value": json.dumps(wrapped())})
    assert "names table" in quarantined(text, KEYED)
    ev = one_event({"key": "[1]", "table": "items", "value": json.dumps(wrapped(topic=..., key=...))}, KEYED)
    assert ev.table == "items" and ev.key_columns == ["id"]


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"after": {"id": 1}', "malformed JSON"),
        ("", "malformed JSON"),
        ('"just a string"', "not a JSON object"),
        ("{}", "empty JSON object"),
        ('{"after": {"id": 1}, "key": [1], "topic": "items", "updated": NaN}', "malformed JSON"),
        ('{"after": {"id": 1}, "key": [1], "topic": "items", "updated": "1.5"}', "not an HLC"),
        ('{"after": {"id": 1}, "key": [1], "topic": "items", "mvcc_timestamp": 17}', "not an HLC timestamp string"),
        ('{"key": "[1", "table": "items", "value": "{}"}', "malformed JSON in archive wrapper key"),
        ('{"key": "[1]", "table": "items", "value": "{\\"after\\""}', "malformed JSON in archive wrapper value"),
        ('{"key": "[1]", "table": "items", "value": "[1]"}', "JSON array"),
        ('{"payload": {"after": {"id": 1}, "op": "c", "bogus": 1}}', "unknown fields"),
        ('{"payload": "x", "schema": {}}', "payload is not an object"),
        ('{"schema": {"fields": []}}', "schema without a payload"),
    ],
)
def test_malformed_and_unknown_shapes_quarantine(text: str, reason: str) -> None:
    assert reason in quarantined(text, KEYED)


def test_mvcc_wall_digits_differ_positions_still_order() -> None:
    a = one_event(wrapped(updated="999999999999999999.0000000000"), KEYED).position
    b = one_event(wrapped(updated="1000000000000000000.0000000000"), KEYED).position
    assert a < b


def test_sniff_and_detect() -> None:
    yes = [
        json.dumps(wrapped()),
        '{"resolved":"1.0000000000"}',
        '{"__crdb__": {"topic": "vehicles"}, "city": "la"}',
        (CASES / "03_full_fidelity.json").read_text(),
        (CASES / "07_sinkless_enriched_source.json").read_text(),
        (CASES / "21_webhook_batch.json").read_text(),
        (CASES / "19_key_only_sinkless.json").read_text(),
    ]
    for text in yes:
        assert CockroachDbDecoder.sniff(text), text[:80]
    assert not CockroachDbDecoder.sniff(
        '{"schema": null, "payload": {"before": null, "after": {"id": 1}, "op": "c", "source": {"connector": "postgresql"}}}'
    )
    assert not CockroachDbDecoder.sniff("nope")
    assert decoder_class(Format.COCKROACHDB) is CockroachDbDecoder
    assert detect_format([(CASES / "03_full_fidelity.json").read_text()]) == Format.COCKROACHDB


# --------------------------------------------------------------------------
# Configuration refusals, ordering: arrival, envelope: row, cloud-storage names

ARRIVAL = DecodeContext(primary_keys={"items": ["id"], "vehicles": ["city", "id"]}, options={"ordering": "arrival"})
SINK_NAME = "202504241459289627550000000000000-56087568dba1e6b8-1-72-00000000-{topic}-1.ndjson"


def decode_in(file: str, obj: Any, ctx: DecodeContext | None = None, line: int = 3) -> list[Any]:
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return CockroachDbDecoder(ctx).decode(RawMessage(file, line, text))


def refused(obj: Any, ctx: DecodeContext | None = None, file: str = "t.jsonl") -> str:
    out = decode_in(file, obj, ctx)
    assert len(out) == 1 and isinstance(out[0], Quarantined), out
    assert out[0].reason.startswith(CONFIG_REFUSED_PREFIX), out[0].reason
    return out[0].reason


def test_missing_timestamps_are_a_configuration_refusal_naming_the_options() -> None:
    reason = refused(wrapped(updated=...), KEYED)
    assert "mvcc_timestamp" in reason and "updated" in reason and "ordering: arrival" in reason
    # the reason carries nothing of the message: one line per batch in the job's error
    assert refused(wrapped(updated=..., key=[7], after={"id": 7, "name": "zz"}), KEYED) == reason


def test_missing_key_names_and_key_only_are_configuration_refusals() -> None:
    assert "configure primary key columns for table vehicles" in refused(wrapped(topic="vehicles", key=["seattle", 1]))
    assert "delete of items without a key" in refused(wrapped(after=None, key=...))
    assert "key_only" in refused(["boston", "22222222-2222-4200-8000-000000000002"])
    reason = refused({"key": '["seattle", "x"]', "table": "users", "value": ""})
    assert "key_only" in reason and "`envelope: row`" in reason


def test_webhook_element_refusal_keeps_the_groupable_reason() -> None:
    out = decode({"payload": [wrapped(updated=...)], "length": 1}, KEYED)
    assert len(out) == 1 and out[0].reason.startswith(CONFIG_REFUSED_PREFIX + "no position")


def test_arrival_ordering_is_file_then_line_then_batch_index() -> None:
    msg = wrapped(updated=...)
    pos = [
        one_event_in(f, msg, line)
        for f, line in (
            ("a/2025-04-24/x.ndjson", 2),
            ("a/2025-04-24/x.ndjson", 10),
            ("a/2025-04-24/x.ndjson.gz", 1),
            ("a/2025-04-25/w.ndjson", 1),
        )
    ]
    assert pos == sorted(pos) and len(set(pos)) == 4
    assert pos[0] == "a/2025-04-24/x.ndjson\0" + "000000000002.000000"
    batch = {"payload": [wrapped(updated=..., after={"id": 1, "name": n}) for n in "abc"], "length": 3}
    evs = decode_in("b.jsonl", batch, ARRIVAL)
    assert [e.position for e in evs] == sorted(e.position for e in evs) and [e.after["name"] for e in evs] == ["a", "b", "c"]
    # an HLC, when the message has one, gives the commit time only: every message of the source is ordered alike
    ev = decode_in("c.jsonl", wrapped(updated="1700000000000000000.0000000000"), ARRIVAL)[0]
    assert ev.position == arrival_position("c.jsonl", 3) and ev.commit_ts_us == 1700000000000000
    assert decode_in("c.jsonl", wrapped(updated=...), ARRIVAL)[0].commit_ts_us is None


def one_event_in(file: str, obj: Any, line: int) -> str:
    out = decode_in(file, obj, ARRIVAL, line)
    assert len(out) == 1 and isinstance(out[0], ChangeEvent), out
    return out[0].position


def test_envelope_row_option_reads_a_key_without_value_as_delete() -> None:
    ctx = DecodeContext(primary_keys={"vehicles": ["city", "id"]}, options={"ordering": "arrival", "envelope": "row"})
    out = decode_in("k.jsonl", {"key": '["seattle", "x1"]', "topic": "vehicles", "value": None}, ctx)
    ev = out[0]
    assert (ev.op, ev.table, ev.after, ev.before, ev.key_columns) == (
        Op.DELETE,
        "vehicles",
        {},
        {"city": "seattle", "id": "x1"},
        ["city", "id"],
    )
    row = decode_in("k.jsonl", {"key": '["seattle", "x1"]', "topic": "vehicles", "value": '{"city": "seattle", "id": "x1", "s": 1}'}, ctx)[
        0
    ]
    assert (row.op, row.after) == (Op.UPDATE, {"city": "seattle", "id": "x1", "s": "1"})
    assert "key_only" in refused(["seattle", "x1"], ctx)  # a key printed alone is still no row image


@pytest.mark.parametrize(
    "path, table",
    [
        (f"/arch/crdb/2025-04-24/{SINK_NAME.format(topic='vehicles')}", ("vehicles", None, None)),  # daily (default)
        (f"/arch/crdb/2025-04-24/14/{SINK_NAME.format(topic='vehicles')}", ("vehicles", None, None)),  # hourly
        (SINK_NAME.format(topic="vehicles"), ("vehicles", None, None)),  # flat
        (f"s3://b/p/2025-04-24/{SINK_NAME.format(topic='vehicles')}.gz", ("vehicles", None, None)),  # compression=gzip
        (f"/a/2025-04-24/{SINK_NAME.format(topic='movr.public.vehicles')}", ("vehicles", "public", "movr")),  # full_table_name
        (
            "/2020-04-02/202004022058072107140000000000000-56087568dba1e6b8-1-72-00000000-test_table-1.ndjson",
            ("test_table", None, None),
        ),  # the docs' example
    ],
)
def test_cloud_storage_file_name_names_the_table(path: str, table: tuple) -> None:
    ref = cloud_storage_table(path)
    assert (ref.table, ref.schema, ref.database) == table
    ev = decode_in(
        path, wrapped(topic=..., updated=..., key=...), DecodeContext(primary_keys={table[0]: ["id"]}, options={"ordering": "arrival"})
    )[0]
    assert (ev.table, ev.schema, ev.database) == table


def test_cloud_storage_names_that_do_not_name_a_table() -> None:
    for path in ("/a/2025-04-24/202504241459289627550000000000000.RESOLVED", "/a/items.jsonl", "/a/2025-04-24/x-vehicles-1.ndjson"):
        assert cloud_storage_table(path) is None
    reason = refused(wrapped(topic=..., updated=...), ARRIVAL, file="/a/items.jsonl")
    assert "no table name" in reason and "'items.jsonl'" in reason
    # a column-family topic cannot be told from a table: refused for the file, not guessed
    assert "column-family" in refused(wrapped(topic=...), ARRIVAL, file=f"/a/{SINK_NAME.format(topic='vehicles.fam')}")


def test_file_name_and_message_table_must_agree() -> None:
    path = f"/a/2025-04-24/{SINK_NAME.format(topic='items')}"
    assert decode_in(path, wrapped(updated=...), ARRIVAL)[0].table == "items"  # topic_in_value agrees
    assert "names table" in decode_in(path, wrapped(topic="other", updated=...), ARRIVAL)[0].reason


def test_hlc_orders_two_events_of_one_key_by_wall_then_logical() -> None:
    """Issue 17 item 5: the position is the HLC; logical breaks a wall-time tie,
    and a later wall wins over any logical (string order of the positions)."""
    stamps = [
        "1700000000000000001.0000000000",
        "1700000000000000000.0000000009",
        "1700000000000000000.0000000010",
        "1700000000000000000.0000000002",
    ]
    evs = [one_event(wrapped(updated=s, after={"id": 1, "name": s}), KEYED) for s in stamps]
    ordered = sorted(evs, key=lambda e: e.position)
    assert [e.after["name"] for e in ordered] == [stamps[3], stamps[1], stamps[2], stamps[0]]
    assert len({e.position for e in evs}) == 4 and {tuple(e.key_columns) for e in evs} == {("id",)}


# --------------------------------------------------------------------------
# A damaged message among good ones (issue 18's known gap): quarantined, not a refusal


def file_outcomes(name: str, objs: list[Any], ctx: DecodeContext | None = KEYED) -> list[Any]:
    """Decode ``objs`` as the lines 1.. of one archive file, as the job does (``decode_all``)."""
    msgs = [RawMessage(name, i, o if isinstance(o, str) else json.dumps(o)) for i, o in enumerate(objs, 1)]
    return list(decode_all(CockroachDbDecoder(ctx), msgs))


def by_line(outcomes: list[Any]) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for o in outcomes:
        assert o.line not in out, f"line {o.line} has two outcomes"
        out[o.line] = o
    return out


def test_a_message_that_lost_its_table_or_hlc_among_good_ones_is_quarantined_naming_what_it_lost() -> None:
    """A Kafka archive file whose messages carry topic and updated: a line that
    lost them is damaged, not a changefeed without them; it is quarantined
    (file, line, a reason saying what is missing and that the rest of the file
    has it), the others decode, wherever the damaged line sits (first too)."""
    objs = [
        wrapped(updated=...),  # line 1: no HLC, before any good line
        wrapped(),
        wrapped(topic=...),  # no table
        wrapped(key=[2], after={"id": 2, "name": "b"}),
        {"id": 3, "name": "c"},  # lost every field but the row: read as envelope=row, nothing to place it with
        wrapped(topic=..., updated=...),  # neither
    ]
    out = by_line(file_outcomes("kafka/2026/01/01/00/part-0.jsonl", objs))
    assert {n for n, o in out.items() if isinstance(o, ChangeEvent)} == {2, 4}
    for n, missing in ((1, "HLC"), (3, "table"), (5, "table"), (5, "HLC"), (6, "table"), (6, "HLC")):
        q = out[n]
        assert isinstance(q, Quarantined), (n, q)
        assert not q.reason.startswith(CONFIG_REFUSED_PREFIX), q.reason
        assert q.reason.startswith("DecodeError: damaged message"), q.reason
        assert missing in q.reason and "other messages of this file carry" in q.reason, q.reason
        assert (q.file, q.line, q.raw) == ("kafka/2026/01/01/00/part-0.jsonl", n, json.dumps(objs[n - 1]))
    assert "no table name" not in out[1].reason and "no position" not in out[3].reason


def test_a_file_without_hlcs_is_still_a_configuration_refusal_even_next_to_a_file_with_them() -> None:
    """The decision is per file: a changefeed created without mvcc_timestamp /
    updated writes no HLC on any message, so each of its messages is refused
    (the batch fails once, naming the options), whatever other files carry."""
    good = file_outcomes("a.jsonl", [wrapped(), wrapped(key=[2], after={"id": 2})])
    assert all(isinstance(o, ChangeEvent) for o in good)
    out = file_outcomes("b.jsonl", [wrapped(updated=...), wrapped(updated=..., key=[2], after={"id": 2})])
    assert len(out) == 2 and all(o.reason.startswith(CONFIG_REFUSED_PREFIX + "no position") for o in out), out
    # a file with no table anywhere (no topic_in_value, not the sink's file name) is refused too
    out = file_outcomes("c.jsonl", [wrapped(topic=...), wrapped(topic=..., key=[2], after={"id": 2})])
    assert len(out) == 2 and all(o.reason.startswith(CONFIG_REFUSED_PREFIX + "no table name") for o in out), out


def test_hlc_evidence_is_per_table_of_the_file() -> None:
    """One Kafka archive file can hold two changefeeds' topics: a table none of
    whose messages in the file has an HLC is refused, even though the other
    table's messages have one."""
    ctx = DecodeContext(primary_keys={"items": ["id"], "orders": ["id"]})
    objs = [wrapped(), wrapped(topic="orders", updated=...), wrapped(topic="orders", updated=..., key=[2], after={"id": 2})]
    out = by_line(file_outcomes("k.jsonl", objs, ctx))
    assert isinstance(out[1], ChangeEvent)
    assert out[2].reason.startswith(CONFIG_REFUSED_PREFIX + "no position") and out[3].reason == out[2].reason


def test_damaged_webhook_element_among_good_ones_is_quarantined() -> None:
    batch = {"payload": [wrapped(), wrapped(updated=..., key=[2], after={"id": 2})], "length": 2}
    out = file_outcomes("w.jsonl", [batch])
    assert isinstance(out[0], ChangeEvent) and isinstance(out[1], Quarantined)
    assert out[1].reason.startswith("DecodeError: damaged message") and "payload[1]" in out[1].reason, out[1].reason


def test_a_file_of_only_refusals_longer_than_the_buffer_is_refused_without_holding_it_all(monkeypatch) -> None:
    """Refusals wait for the file's evidence in a bounded buffer: past it, the
    file is judged to lack the fields (a refusal), memory does not grow."""
    import cdc_apply.decode.cockroachdb as crdb

    monkeypatch.setattr(crdb, "PENDING_LIMIT", 3)
    objs = [wrapped(updated=..., key=[i], after={"id": i}) for i in range(1, 6)] + [wrapped()]
    out = by_line(file_outcomes("long.jsonl", objs))
    assert all(out[n].reason.startswith(CONFIG_REFUSED_PREFIX + "no position") for n in range(1, 6))
    assert isinstance(out[6], ChangeEvent)


def test_a_bare_key_array_among_messages_with_row_images_is_a_damaged_message() -> None:
    """A key_only changefeed writes bare key arrays on every line: one array
    line in a file of wrapped messages (found by the nemesis: a message
    wrapped in brackets) is damaged, quarantined; a file of arrays only is
    still refused.  So is a Kafka-archived key with an empty value among
    wrapped or enriched messages of its table (their deletes are never an
    empty value); among row-envelope messages, or alone, it stays a refusal:
    it can be an envelope=row delete (the source option decides)."""
    objs = [wrapped(), [wrapped(key=[2], after={"id": 2})], ["boston", 7]]
    out = by_line(file_outcomes("k.jsonl", objs))
    assert isinstance(out[1], ChangeEvent)
    for n in (2, 3):
        assert out[n].reason.startswith("DecodeError: damaged message") and "row image" in out[n].reason, out[n].reason
    out = file_outcomes("keys.jsonl", [["boston", 7], ["boston", 8]])
    assert len(out) == 2 and all(o.reason.startswith(CONFIG_REFUSED_PREFIX) and "key_only" in o.reason for o in out)
    key_only = {"topic": "items", "key": "[2]", "value": ""}
    out = by_line(file_outcomes("w.jsonl", [{"topic": "items", "key": "[1]", "value": wrapped()}, key_only]))
    assert isinstance(out[1], ChangeEvent) and out[2].reason.startswith("DecodeError: damaged message") and "empty value" in out[2].reason
    arrival = DecodeContext(primary_keys={"items": ["id"]}, options={"ordering": "arrival"})
    row = {"topic": "items", "key": "[1]", "value": json.dumps({"id": 1, "name": "a"})}
    for objs in ([row, key_only], [key_only], [{"topic": "orders", "key": "[1]", "value": wrapped(topic="orders")}, key_only]):
        out = file_outcomes("r.jsonl", objs, arrival)
        assert "`envelope: row`" in out[-1].reason and out[-1].reason.startswith(CONFIG_REFUSED_PREFIX), (objs, out[-1])


def test_a_resolved_timestamp_names_the_stream_it_covers() -> None:
    """Kafka gives every partition its own resolved timestamps (the archive
    wrapper names the partition); webhook and cloud-storage sinks one for
    the whole feed ("*"): apply/transactions.py takes the lowest."""
    dec = CockroachDbDecoder(DecodeContext())
    inner = json.dumps({"resolved": "1745506768962755000.0000000000"})
    [kafka] = dec.decode_message(
        RawMessage("f", 1, json.dumps({"topic": "movr.public.rides", "partition": 3, "key": None, "value": inner}))
    )
    [webhook] = dec.decode_message(RawMessage("f", 2, inner))
    assert isinstance(kafka, Skipped) and (kafka.reason, kafka.tx_group) == ("resolved-watermark", "movr.public.rides/3")
    assert isinstance(webhook, Skipped) and webhook.tx_group == "*" and webhook.position == kafka.position
