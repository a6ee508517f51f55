"""Render synthetic changes as CockroachDB changefeed JSON lines.

Envelopes:

* ``wrapped`` (default): ``CREATE CHANGEFEED ... WITH diff, key_in_value,
  topic_in_value, updated, mvcc_timestamp`` — ``{"after", "before", "key",
  "topic", "updated", "mvcc_timestamp"}``.  The key names are not in the
  message: decode with ``DecodeContext(primary_keys={'items': ['id']})``.
  ``amount`` is rendered as CockroachDB renders a DECIMAL(10,2): a JSON
  number with exactly two places (the decoder reads it exactly; it is typed
  ``decimal(38,2)`` by inference), ``updated_at`` as RFC 3339 text (inferred
  ``string``).
* ``enriched``: ``envelope=enriched, enriched_properties='source,schema',
  diff, updated, mvcc_timestamp`` — payload + schema, so every type is exact
  (``amount`` as a JSON string under a ``decimal`` schema with precision 10,
  scale 2); the key names come from ``source.primary_keys``.  Each line is
  an archived Kafka record ``{"key": "{\"id\": 1}", "topic": "items",
  "value": "<enriched JSON>"}``: without ``diff`` an enriched delete names
  its row only in the Kafka key.

Positions: the HLC of a change is ``(commit_ts in ns, seq)`` — wall from the
commit time, logical from ``seq`` — so position order == seq order as long
as commit times do not decrease with seq (checked).  An ``'r'`` (initial scan)
change is emitted with ``updated`` one second *after* its MVCC time (a scan
reads older versions) in ``wrapped``, and with ``op: "r"`` in ``enriched``.
The enriched top-level ``ts_ns`` is a processing time that decreases with
seq on purpose: the decoder must never order by it.

CockroachDB has no partial rows and no truncate events: a change with a
missing column or op ``'t'`` raises ``NotImplementedError``.
"""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from typing import Any

from cdc_apply.model import epoch_micros
from tests.formats.synthetic import COLUMNS, DATABASE, KEY, TABLE, SyntheticChange

SCHEMA = "public"
ENVELOPES = ("wrapped", "enriched")
PROCESSING_BASE_NS = 1_900_000_000_000_000_000

_ROW_FIELDS = [
    {"field": "id", "optional": False, "type": "int64"},
    {"field": "name", "optional": True, "type": "string"},
    {"field": "amount", "name": "decimal", "optional": True, "parameters": {"precision": "10", "scale": "2"}, "type": "float64"},
    {"field": "updated_at", "name": "timestamp", "optional": True, "type": "string"},
]
_SOURCE_FIELDS = [
    {"field": "mvcc_timestamp", "optional": True, "type": "string"},
    {"field": "ts_ns", "optional": True, "type": "int64"},
    {"field": "ts_hlc", "optional": True, "type": "string"},
    {"field": "table_name", "optional": False, "type": "string"},
    {"field": "origin", "optional": False, "type": "string"},
    {"field": "schema_name", "optional": False, "type": "string"},
    {"field": "database_name", "optional": False, "type": "string"},
    {"field": "primary_keys", "items": {"optional": False, "type": "string"}, "optional": False, "type": "array"},
]
ENRICHED_SCHEMA = {
    "fields": [
        {"field": "before", "fields": _ROW_FIELDS, "name": f"{TABLE}.before.value", "optional": True, "type": "struct"},
        {"field": "after", "fields": _ROW_FIELDS, "name": f"{TABLE}.after.value", "optional": False, "type": "struct"},
        {"field": "source", "fields": _SOURCE_FIELDS, "name": "cockroachdb.source", "optional": True, "type": "struct"},
        {"field": "ts_ns", "optional": False, "type": "int64"},
        {"field": "op", "optional": False, "type": "string"},
    ],
    "name": "cockroachdb.envelope",
    "optional": False,
    "type": "struct",
}


class _Raw(str):
    """JSON number text to splice verbatim (exact decimals)."""


def hlc(wall_ns: int, logical: int) -> str:
    return f"{wall_ns}.{logical:010d}"


def _wall_ns(ts: dt.datetime) -> int:
    return epoch_micros(ts) * 1000


def _ts_text(value: dt.datetime) -> str:
    """RFC 3339 as CockroachDB renders a TIMESTAMPTZ: UTC, trailing zeros trimmed."""
    d = value.astimezone(dt.UTC)
    frac = f"{d.microsecond:06d}".rstrip("0")
    return f"{d.year:04d}-{d.month:02d}-{d.day:02d}T{d.hour:02d}:{d.minute:02d}:{d.second:02d}" + (f".{frac}" if frac else "") + "Z"


def _row(row: dict[str, Any] | None, envelope: str, *, partial_ok: bool = False) -> dict[str, Any] | None:
    """A row image; a partial ``after`` cannot be expressed (a partial
    ``before`` is rendered as given: only the key is needed for a delete)."""
    if row is None:
        return None
    missing = [c for c in COLUMNS if c not in row]
    if missing and not partial_ok:
        raise NotImplementedError(f"CockroachDB changefeeds always carry whole rows (missing {missing})")
    out: dict[str, Any] = {}
    for col in (c for c in COLUMNS if c in row):
        v = row[col]
        if v is None:
            out[col] = None
        elif col == "amount":
            text = format(Decimal(v).quantize(Decimal("0.01")), "f")
            out[col] = _Raw(text) if envelope == "wrapped" else text
        elif col == "updated_at":
            out[col] = _ts_text(v)
        else:
            out[col] = v
    return out


def _dumps(obj: Any) -> str:
    """json.dumps with ``_Raw`` values spliced in as bare number text."""
    marks: dict[str, str] = {}

    def walk(o: Any) -> Any:
        if isinstance(o, _Raw):
            token = f"@@raw{len(marks)}@@"
            marks[token] = str(o)
            return token
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        return o

    text = json.dumps(walk(obj), ensure_ascii=False)
    for token, raw in marks.items():
        text = text.replace(f'"{token}"', raw)
    return text


def write_messages(changes: list[SyntheticChange], envelope: str = "wrapped") -> list[str]:
    if envelope not in ENVELOPES:
        raise ValueError(f"unknown envelope {envelope!r}; one of {ENVELOPES}")
    lines: list[str] = []
    last_wall = None
    for i, ch in enumerate(changes):
        if ch.op == "t":
            raise NotImplementedError("CockroachDB changefeeds emit no truncate events")
        if ch.op not in "curd":
            raise ValueError(f"unknown synthetic op {ch.op!r}")
        wall = _wall_ns(ch.commit_ts)
        if last_wall is not None and wall < last_wall:
            raise ValueError("commit times must not decrease with seq (the HLC wall is the commit time)")
        last_wall = wall
        mvcc = hlc(wall, ch.seq)
        after = _row(ch.after, envelope) if ch.op != "d" else None
        before = None if ch.op in "cr" else _row(ch.before, envelope, partial_ok=True)
        key = [ch.key[k] for k in KEY]
        if envelope == "wrapped":
            updated = hlc(wall + 1_000_000_000, ch.seq) if ch.op == "r" else mvcc
            msg = {"after": after, "before": before, "key": key, "topic": TABLE, "updated": updated, "mvcc_timestamp": mvcc}
        else:
            source = {
                "mvcc_timestamp": mvcc,
                "ts_ns": wall,
                "ts_hlc": mvcc,
                "table_name": TABLE,
                "origin": "cockroachdb",
                "schema_name": SCHEMA,
                "database_name": DATABASE,
                "primary_keys": list(KEY),
            }
            payload = {"after": after, "before": before, "op": ch.op, "source": source, "ts_ns": PROCESSING_BASE_NS - i}
            value = _dumps({"payload": payload, "schema": ENRICHED_SCHEMA})
            # archived Kafka record: the key {"id": ...} travels as the message key
            lines.append(json.dumps({"key": json.dumps(dict(zip(KEY, key))), "topic": TABLE, "value": value}))
            continue
        lines.append(_dumps(msg))
    return lines
