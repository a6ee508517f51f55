"""Render synthetic changes as Debezium PostgreSQL JSON lines (Kafka-record
wrappers with key and value, both ``schemas.enable=true``).

Mapping: ``seq`` -> ``source.lsn = LSN_BASE + 8*seq`` (so position order ==
seq order), ``tx`` -> ``source.txId``, ``commit_ts`` -> ``source.ts_ms`` /
``ts_us`` / ``ts_ns``.  Columns: id int32 (key), name string optional,
amount ``org.apache.kafka.connect.data.Decimal`` scale 2 precision 10,
updated_at ``io.debezium.time.ZonedTimestamp``.  A delete is followed by its
Kafka tombstone (``tombstones.on.delete=true``, the connector default).  A
column missing from ``after`` is rendered as the unavailable-value placeholder
(Debezium only does that for TOASTable types: ``name`` here); columns missing
from ``before`` are rendered null (REPLICA IDENTITY DEFAULT style).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from decimal import Decimal
from typing import Any

from tests.formats.synthetic import DATABASE, SyntheticChange

PLACEHOLDER = "__debezium_unavailable_value"
LSN_BASE = 0x16B3_7000
SCHEMA = "public"
TABLE = "items"
PREFIX = "pg"

ROW_FIELDS = [
    {"type": "int32", "optional": False, "field": "id"},
    {"type": "string", "optional": True, "field": "name"},
    {
        "type": "bytes",
        "optional": True,
        "name": "org.apache.kafka.connect.data.Decimal",
        "version": 1,
        "parameters": {"scale": "2", "connect.decimal.precision": "10"},
        "field": "amount",
    },
    {"type": "string", "optional": True, "name": "io.debezium.time.ZonedTimestamp", "version": 1, "field": "updated_at"},
]
KEY_SCHEMA = {"type": "struct", "fields": [ROW_FIELDS[0]], "optional": False, "name": f"{PREFIX}.{SCHEMA}.{TABLE}.Key"}


def _source_schema(name: str, extra: list[dict[str, Any]]) -> dict[str, Any]:
    common = [
        {"type": "string", "optional": False, "field": "version"},
        {"type": "string", "optional": False, "field": "connector"},
        {"type": "string", "optional": False, "field": "name"},
        {"type": "int64", "optional": False, "field": "ts_ms"},
        {
            "type": "string",
            "optional": True,
            "name": "io.debezium.data.Enum",
            "version": 1,
            "parameters": {"allowed": "true,last,false,incremental"},
            "default": "false",
            "field": "snapshot",
        },
        {"type": "string", "optional": False, "field": "db"},
        {"type": "int64", "optional": True, "field": "ts_us"},
        {"type": "int64", "optional": True, "field": "ts_ns"},
        {"type": "string", "optional": False, "field": "schema"},
        {"type": "string", "optional": False, "field": "table"},
    ]
    return {"type": "struct", "fields": common + extra, "optional": False, "name": name, "field": "source"}


def envelope_schema(source: dict[str, Any], value_name: str, envelope_name: str) -> dict[str, Any]:
    row = {"type": "struct", "fields": ROW_FIELDS, "optional": True, "name": value_name}
    return {
        "type": "struct",
        "fields": [
            {**row, "field": "before"},
            {**row, "field": "after"},
            source,
            {"type": "string", "optional": False, "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
            {
                "type": "struct",
                "optional": True,
                "name": "event.block",
                "version": 1,
                "field": "transaction",
                "fields": [
                    {"type": "string", "optional": False, "field": "id"},
                    {"type": "int64", "optional": False, "field": "total_order"},
                    {"type": "int64", "optional": False, "field": "data_collection_order"},
                ],
            },
        ],
        "optional": False,
        "name": envelope_name,
        "version": 1,
    }


VALUE_SCHEMA = envelope_schema(
    _source_schema(
        "io.debezium.connector.postgresql.Source",
        [
            {"type": "string", "optional": True, "field": "sequence"},
            {"type": "int64", "optional": True, "field": "txId"},
            {"type": "int64", "optional": True, "field": "lsn"},
            {"type": "int64", "optional": True, "field": "xmin"},
        ],
    ),
    f"{PREFIX}.{SCHEMA}.{TABLE}.Value",
    f"{PREFIX}.{SCHEMA}.{TABLE}.Envelope",
)


# -- values -----------------------------------------------------------------


def decimal_b64(value: Decimal, scale: int = 2) -> str:
    unscaled = value.scaleb(scale)
    if unscaled != unscaled.to_integral_value():
        raise ValueError(f"{value} has more than {scale} decimal places")
    n = int(unscaled)
    return base64.b64encode(n.to_bytes(max(1, (n.bit_length() + 8) // 8), "big", signed=True)).decode()


def zoned(value: dt.datetime, utc_suffix: str = "Z") -> str:
    if value.tzinfo is None:
        raise ValueError("updated_at must be an aware datetime")
    return value.astimezone(dt.UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + utc_suffix


def render_row(row: dict[str, Any] | None, key: dict[str, Any], *, partial: str, utc_suffix: str = "Z") -> dict[str, Any] | None:
    """JSON row image; ``partial`` says how a missing column is rendered:
    'placeholder' (after images) or 'null' (before images)."""
    if row is None:
        return None
    out: dict[str, Any] = {}
    for f in ROW_FIELDS:
        col = f["field"]
        if col not in row:
            if col == "id" and "id" in key:
                out[col] = key["id"]
            elif partial == "null":
                out[col] = None
            elif col == "name":
                out[col] = PLACEHOLDER
            else:
                raise NotImplementedError(f"Debezium cannot leave the non-string column {col!r} out of a row")
            continue
        v = row[col]
        if v is None:
            out[col] = None
        elif col == "amount":
            out[col] = decimal_b64(Decimal(v))
        elif col == "updated_at":
            out[col] = zoned(v, utc_suffix)
        else:
            out[col] = v
    unknown = set(row) - {f["field"] for f in ROW_FIELDS}
    if unknown:
        raise ValueError(f"unknown columns {sorted(unknown)}")
    return out


def commit_times(ts: dt.datetime) -> dict[str, int]:
    delta = ts - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    us = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return {"ts_ms": us // 1000, "ts_us": us, "ts_ns": us * 1000}


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


# -- writer -----------------------------------------------------------------


def lsn_of(seq: int) -> int:
    if seq < 1:
        raise ValueError("seq must be >= 1")
    return LSN_BASE + 8 * seq


def write_messages(changes: list[SyntheticChange]) -> list[str]:
    lines: list[str] = []
    last_commit: int | None = None  # LSN of the last change of the previous transaction
    prev_tx: int | None = None
    prev_lsn: int | None = None
    for ch in changes:
        lsn = lsn_of(ch.seq)
        if prev_tx is not None and ch.tx != prev_tx:
            last_commit = prev_lsn
        source = {
            "version": "2.7.0.Final",
            "connector": "postgresql",
            "name": PREFIX,
            **commit_times(ch.commit_ts),
            "snapshot": "true" if ch.op == "r" else "false",
            "db": DATABASE,
            "sequence": dumps([None if last_commit is None else str(last_commit), str(lsn)]),
            "schema": SCHEMA,
            "table": TABLE,
            "txId": ch.tx,
            "lsn": lsn,
            "xmin": None,
        }
        payload: dict[str, Any] = {
            "before": None,
            "after": None,
            "source": source,
            "op": ch.op,
            "ts_ms": source["ts_ms"] + 5,
            "transaction": None,
        }
        key = None
        if ch.op in ("c", "u", "r"):
            payload["after"] = render_row(ch.after, ch.key, partial="placeholder")
            if ch.op == "u":
                payload["before"] = render_row(ch.before, ch.key, partial="null")
        elif ch.op == "d":
            payload["before"] = render_row(ch.before if ch.before is not None else dict(ch.key), ch.key, partial="null")
        elif ch.op != "t":
            raise ValueError(f"unknown synthetic op {ch.op!r}")
        if ch.op != "t":
            key = {"schema": KEY_SCHEMA, "payload": {"id": ch.key["id"]}}
        lines.append(dumps({"key": key, "value": {"schema": VALUE_SCHEMA, "payload": payload}}))
        if ch.op == "d":
            lines.append(dumps({"key": key, "value": None}))
        prev_tx, prev_lsn = ch.tx, lsn
    return lines
