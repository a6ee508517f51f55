"""Render synthetic changes as Qlik Replicate Event Hubs JSON lines.

Table ``dbo.items``: id INT4 (primaryKeyPosition 1), name STRING, amount
NUMERIC(10,2), updated_at DATETIME.  Output: one metadata message (tableVersion
1), then one data message per change, shaped like the spec's field tables
(``schema``, ``table``, ``data``, ``beforeData``, ``headers``), values as Qlik's
JSON mapping writes them (INT4 a number, NUMERIC a string, DATETIME a zone-less
string: the UTC wall clock).

Mapping: ``seq`` -> ``changeSequence = <16-digit YYYYMMDDHHmmSShh of commit_ts,
never decreasing> + <seq, 19 digits>`` so position order == seq order; ``tx`` ->
``transactionId`` (32 hex digits) and ``transactionEventCounter`` counts the
changes of one transaction run from 1; ``commit_ts`` -> ``timestamp``.  A column
missing from ``after`` gets columnMask bit 0 (and null in ``data``).  'r' ->
REFRESH without change sequence / transaction / timestamp (full load), counter =
running row number.  A primary-key change ('d' + 'c') is simply a DELETE and an
INSERT.  Truncate has no Qlik data message: NotImplementedError.
"""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from typing import Any

from tests.formats.synthetic import SyntheticChange

SCHEMA = "dbo"
TABLE = "items"
SCHEMA_ID = "7e1b3a52-2b55-4f0e-9c8d-5a1e6b0c4d21"
COLUMNS = [  # name, Qlik type, length, precision, scale, primaryKeyPosition (ordinal = index + 1)
    ("id", "INT4", 4, 0, 0, 1),
    ("name", "STRING", 200, 0, 0, 0),
    ("amount", "NUMERIC", 0, 10, 2, 0),
    ("updated_at", "DATETIME", 0, 26, 6, 0),
]
NAMES = [c[0] for c in COLUMNS]
OPERATIONS = {"c": "INSERT", "u": "UPDATE", "d": "DELETE", "r": "REFRESH"}


def data_schema() -> str:
    """The dataSchema field: an Avro record schema text for the data messages."""
    fields = [
        {"name": "id", "type": ["null", "int"]},
        {"name": "name", "type": ["null", "string"]},
        {"name": "amount", "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}]},
        {"name": "updated_at", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
    ]
    return json.dumps({"type": "record", "name": f"{SCHEMA}.{TABLE}", "fields": fields}, separators=(",", ":"))


def metadata_message(version: int = 1, timestamp: str = "2026-01-01T00:00:00.000") -> str:
    cols = {
        name: {"ordinal": i, "type": qtype, "length": length, "precision": precision, "scale": scale, "primaryKeyPosition": pk}
        for i, (name, qtype, length, precision, scale, pk) in enumerate(COLUMNS, 1)
    }
    msg = {
        "schemaId": SCHEMA_ID,
        "lineage": {
            "server": "qlik-srv-01",
            "task": "shop-to-eventhubs",
            "schema": SCHEMA,
            "table": TABLE,
            "tableVersion": version,
            "timestamp": timestamp,
        },
        "tableStructure": {"tableColumns": cols},
        "dataSchema": data_schema(),
    }
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False)


def mask(names: set[str]) -> str:
    """Hex mask, little-endian byte order, bit ordinal-1 set for each name."""
    n = 0
    for i, name in enumerate(NAMES):
        if name in names:
            n |= 1 << i
    width = (len(NAMES) + 7) // 8
    return n.to_bytes(width, "little").hex().upper()


def value(col: str, v: Any) -> Any:
    if v is None:
        return None
    if col == "amount":
        return format(Decimal(v), "f")
    if col == "updated_at":
        if v.tzinfo is None:
            raise ValueError("updated_at must be an aware datetime")
        return v.astimezone(dt.UTC).replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")
    return v


def render_row(row: dict[str, Any] | None, key: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Full Qlik row image (every column, missing ones null) and the present names."""
    row = dict(row or {})
    unknown = set(row) - set(NAMES)
    if unknown:
        raise ValueError(f"unknown columns {sorted(unknown)}")
    row.setdefault("id", key.get("id"))
    present = set(row)
    return {c: value(c, row.get(c)) for c in NAMES}, present


def sequence_prefix(ts: dt.datetime) -> str:
    u = ts.astimezone(dt.UTC)
    return u.strftime("%Y%m%d%H%M%S") + f"{u.microsecond // 10000:02d}"


def write_messages(changes: list[SyntheticChange]) -> list[str]:
    lines = [metadata_message()]
    prefix = "0" * 16
    last_seq = 0
    refresh_rows = 0
    tx_counter: dict[int, int] = {}
    for i, ch in enumerate(changes):
        if ch.op == "t":
            raise NotImplementedError("Qlik Replicate has no truncate data message")
        if ch.op not in OPERATIONS:
            raise ValueError(f"unknown op {ch.op!r}")
        if ch.seq <= last_seq:
            raise ValueError("seq must increase")
        last_seq = ch.seq
        if ch.op == "r":
            refresh_rows += 1
            data, present = render_row(ch.after, ch.key)
            headers = {
                "operation": "REFRESH",
                "changeSequence": "",
                "timestamp": "",
                "streamPosition": "",
                "transactionId": "",
                "changeMask": mask(present),
                "columnMask": mask(present),
                "transactionEventCounter": refresh_rows,
                "transactionLastEvent": False,
            }
            lines.append(_data_message(data, None, headers))
            continue
        prefix = max(prefix, sequence_prefix(ch.commit_ts))
        counter = tx_counter[ch.tx] = tx_counter.get(ch.tx, 0) + 1
        last_in_tx = i + 1 == len(changes) or changes[i + 1].tx != ch.tx
        before_data = None
        if ch.op == "d":
            data, present = render_row(ch.before, ch.key)
            change_mask = mask({"id"})
        else:
            data, present = render_row(ch.after, ch.key)
            change_mask = mask(present)
            if ch.op == "u" and ch.before is not None:
                before_data, _ = render_row(ch.before, ch.key)
                change_mask = mask({c for c in present if before_data[c] != data[c]})
        headers = {
            "operation": OPERATIONS[ch.op],
            "changeSequence": prefix + f"{ch.seq:019d}",
            "timestamp": ch.commit_ts.astimezone(dt.UTC).replace(tzinfo=None).isoformat(timespec="microseconds"),
            "streamPosition": f"{ch.seq:016X}.{counter:08X}",
            "transactionId": f"{ch.tx:032x}",
            "changeMask": change_mask,
            "columnMask": mask(present),
            "transactionEventCounter": counter,
            "transactionLastEvent": last_in_tx,
        }
        lines.append(_data_message(data, before_data, headers))
    return lines


def _data_message(data: dict[str, Any], before: dict[str, Any] | None, headers: dict[str, Any]) -> str:
    msg = {"schema": SCHEMA, "table": TABLE, "data": data, "beforeData": before, "headers": headers}
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False)
