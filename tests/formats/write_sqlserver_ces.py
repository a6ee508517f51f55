"""Render synthetic changes as SQL Server 2025 CES CloudEvents (JSON lines).

Table ``shop.dbo.items``: ``id int`` (primary key), ``name varchar(100)``,
``amount decimal(10,2)``, ``updated_at datetimeoffset(7)``.  Position mapping:
changes are walked in ``seq`` order; every run of consecutive changes with the
same ``tx`` is one transaction whose commit LSN is the run's first ``seq`` as
20 hex digits, and ``sequencenumber`` is the change's ``seq``.  So (commit LSN,
sequencenumber) order == ``seq`` order, and one run <-> one tx_id.

CES cannot express partial rows, truncates or snapshot reads: those raise
``NotImplementedError``.  ``split_every`` cuts a ``data`` text longer than that
many characters into segments (``style`` picks the attribute spelling).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from decimal import Decimal
from typing import Any

from tests.formats.synthetic import COLUMNS, DATABASE, SCHEMA, TABLE, SyntheticChange

OPERATION = {"c": "INS", "u": "UPD", "d": "DEL"}
COLS = [
    {"name": "id", "type": "int", "index": 0},
    {"name": "name", "type": "varchar(100)", "index": 1},
    {"name": "amount", "type": "decimal(10,2)", "index": 2},
    {"name": "updated_at", "type": "datetimeoffset(7)", "index": 3},
]
GUID = "9c8d4ad2-bf54-4f10-a96f-038af496997f"


def lsn_hex(n: int) -> str:
    """An LSN as SQL Server prints it in CES ids: 20 uppercase hex digits."""
    return f"{n:020X}"


def sql_text(column: str, value: Any) -> str | None:
    """A Python value as CES writes it: text (or JSON null)."""
    if value is None:
        return None
    if column == "amount":
        return f"{Decimal(value):f}"
    if column == "updated_at":
        utc = value.astimezone(dt.UTC)
        # datetimeoffset(7) text; isoformat keeps 4-digit years (strftime may not)
        return utc.replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds") + "0 +00:00"
    return str(value)


def _image(row: dict[str, Any] | None) -> str:
    if not row:
        return "{}"
    return json.dumps({c: sql_text(c, v) for c, v in row.items()})


def _commit_lsns(changes: list[SyntheticChange]) -> dict[int, str]:
    """seq -> commit LSN: one per run of consecutive same-tx changes."""
    out: dict[int, str] = {}
    prev_tx, lsn = None, ""
    for ch in sorted(changes, key=lambda c: c.seq):
        if ch.tx != prev_tx:
            prev_tx, lsn = ch.tx, lsn_hex(ch.seq)
        out[ch.seq] = lsn
    return out


def _render_one(ch: SyntheticChange, commit_lsn: str) -> tuple[dict[str, Any], str]:
    if ch.op not in OPERATION:
        raise NotImplementedError(f"CES has no {ch.op!r} operation (no snapshot reads, no truncate)")
    if ch.op in "cu" and (ch.after is None or set(ch.after) != set(COLUMNS)):
        raise NotImplementedError("CES row images are full rows: no partial rows")
    key = ch.key["id"]
    old = _image(ch.before) if ch.op in "ud" else "{}"
    current = _image(ch.after) if ch.op in "cu" else "{}"
    data = {
        "eventsource": {
            "db": DATABASE,
            "schema": SCHEMA,
            "tbl": TABLE,
            "cols": COLS,
            "pkkey": [{"columnname": "id", "value": str(key)}],
            "transaction": {
                "commitlsn": commit_lsn,
                "beginlsn": commit_lsn,
                "sequencenumber": ch.seq,
                "committime": ch.commit_ts.astimezone(dt.UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z",
            },
        },
        "eventrow": {"old": old, "current": current},
    }
    env = {
        "specversion": "1.0",
        "type": "com.microsoft.SQL.CES.DML.V1",
        "source": "/",
        "id": str(uuid.uuid5(uuid.NAMESPACE_OID, f"ces-{ch.seq}")),
        "logicalid": f"{GUID}:{commit_lsn}:{ch.seq:020d}",
        "time": data["eventsource"]["transaction"]["committime"],
        "datacontenttype": "application/json",
        "operation": OPERATION[ch.op],
    }
    return env, json.dumps(data, indent=2)


def write_messages(changes: list[SyntheticChange], split_every: int | None = None, style: str = "splitindex") -> list[str]:
    """One JSON line per CloudEvent (a split change yields several, in index order)."""
    if style not in ("splitindex", "segmentindex"):
        raise ValueError(f"unknown split style {style!r}")
    lsns = _commit_lsns(changes)
    lines: list[str] = []
    for ch in changes:
        env, data = _render_one(ch, lsns[ch.seq])
        if split_every is None or len(data) <= split_every:
            parts = [data]
        else:
            parts = [data[i : i + split_every] for i in range(0, len(data), split_every)]
        for i, part in enumerate(parts):
            seg = dict(env)
            if len(parts) > 1:
                seg["id"] = str(uuid.uuid5(uuid.NAMESPACE_OID, f"ces-{ch.seq}-{i}"))
            if style == "splitindex":
                seg["splitindex"], seg["splittotalcnt"] = (i, len(parts)) if len(parts) > 1 else (0, 0)
            else:
                seg["segmentindex"], seg["finalsegment"] = i, i == len(parts) - 1
            seg["data"] = part
            lines.append(json.dumps(seg, separators=(",", ":")))
    return lines
