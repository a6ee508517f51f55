"""Render synthetic changes as Debezium SQL Server JSON lines (Kafka-record
wrappers with key and value, both ``schemas.enable=true``).

Mapping: ``seq`` -> ``change_lsn = 0000002a:<seq as 8 hex>:0003``; the
``commit_lsn`` of a change is the change LSN of the last change of its
transaction run (a maximal run of consecutive changes with the same ``tx``),
so (commit LSN, change LSN) order == seq order, as on a real server where a
transaction's changes share the commit LSN.  ``event_serial_no`` is 2 for
updates and 1 otherwise (the connector's numbering; a primary-key change
arrives as a 'd' and a 'c' with consecutive seqs, i.e. distinct change LSNs —
kept simple).  Snapshot reads keep their change LSN too (order must follow
seq).  Columns as in ``write_debezium_postgres``; ``updated_at`` is a
``datetimeoffset`` -> ``io.debezium.time.ZonedTimestamp``.  A delete is
followed by its Kafka tombstone.  SQL Server's connector has no truncate:
``op='t'`` raises NotImplementedError.
"""

from __future__ import annotations

import itertools
from typing import Any

from tests.formats.synthetic import DATABASE, SyntheticChange
from tests.formats.write_debezium_postgres import ROW_FIELDS, _source_schema, commit_times, dumps, envelope_schema, render_row

SCHEMA = "dbo"
TABLE = "items"
PREFIX = "server1"
KEY_SCHEMA = {"type": "struct", "fields": [ROW_FIELDS[0]], "optional": False, "name": f"{PREFIX}.{DATABASE}.{SCHEMA}.{TABLE}.Key"}
VALUE_SCHEMA = envelope_schema(
    _source_schema(
        "io.debezium.connector.sqlserver.Source",
        [
            {"type": "string", "optional": True, "field": "change_lsn"},
            {"type": "string", "optional": True, "field": "commit_lsn"},
            {"type": "int64", "optional": True, "field": "event_serial_no"},
        ],
    ),
    f"{PREFIX}.{DATABASE}.{SCHEMA}.{TABLE}.Value",
    f"{PREFIX}.{DATABASE}.{SCHEMA}.{TABLE}.Envelope",
)


def lsn_of(seq: int) -> str:
    if not 1 <= seq <= 0xFFFFFFFF:
        raise ValueError(f"seq {seq} does not fit the LSN block field")
    return f"0000002a:{seq:08x}:0003"


def _commit_seqs(changes: list[SyntheticChange]) -> list[int]:
    """For each change, the seq of the last change of its transaction run."""
    if any(b.seq <= a.seq for a, b in itertools.pairwise(changes)):
        raise ValueError("changes must be in increasing seq order")
    out = [0] * len(changes)
    i = 0
    while i < len(changes):
        j = i
        while j + 1 < len(changes) and changes[j + 1].tx == changes[i].tx:
            j += 1
        for k in range(i, j + 1):
            out[k] = changes[j].seq
        i = j + 1
    return out


def write_messages(changes: list[SyntheticChange]) -> list[str]:
    lines: list[str] = []
    for ch, commit_seq in zip(changes, _commit_seqs(changes)):
        if ch.op == "t":
            raise NotImplementedError("the Debezium SQL Server connector emits no truncate events")
        source = {
            "version": "2.7.0.Final",
            "connector": "sqlserver",
            "name": PREFIX,
            **commit_times(ch.commit_ts),
            "snapshot": "true" if ch.op == "r" else "false",
            "db": DATABASE,
            "schema": SCHEMA,
            "table": TABLE,
            "change_lsn": lsn_of(ch.seq),
            "commit_lsn": lsn_of(commit_seq),
            "event_serial_no": 2 if ch.op == "u" else 1,
        }
        payload: dict[str, Any] = {
            "before": None,
            "after": None,
            "source": source,
            "op": ch.op,
            "ts_ms": source["ts_ms"] + 5,
            "transaction": None,
        }
        if ch.op in ("c", "u", "r"):
            payload["after"] = render_row(ch.after, ch.key, partial="placeholder", utc_suffix="+00:00")
            if ch.op == "u":
                payload["before"] = render_row(ch.before, ch.key, partial="null", utc_suffix="+00:00")
        elif ch.op == "d":
            payload["before"] = render_row(
                ch.before if ch.before is not None else dict(ch.key), ch.key, partial="null", utc_suffix="+00:00"
            )
        else:
            raise ValueError(f"unknown synthetic op {ch.op!r}")
        key = {"schema": KEY_SCHEMA, "payload": {"id": ch.key["id"]}}
        lines.append(dumps({"key": key, "value": {"schema": VALUE_SCHEMA, "payload": payload}}))
        if ch.op == "d":
            lines.append(dumps({"key": key, "value": None}))
    return lines
