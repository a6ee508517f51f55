"""Format-neutral synthetic changes, rendered into each format by
``tests/formats/write_<format>.py``. Used by round-trip property tests of the
decoders and by the apply-semantics property tests (reference model)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

# The one table every writer knows.  ``id`` is the primary key.
TABLE = "items"
SCHEMA = "dbo"  # writers may use their format's natural default instead ('public' for Postgres)
DATABASE = "shop"
COLUMNS = {  # name -> canonical Spark type
    "id": "int",
    "name": "string",
    "amount": "decimal(10,2)",
    "updated_at": "timestamp",
}
KEY = ["id"]


@dataclass
class SyntheticChange:
    op: str
    """'c' insert, 'u' update, 'd' delete, 'r' snapshot read, 't' truncate."""
    key: dict[str, Any]
    """{'id': int} (empty for a truncate)."""
    after: dict[str, Any] | None
    """Row image after the change for c/u/r. Python values: int, str | None,
    Decimal (2 places) | None, aware UTC datetime | None.  A column missing from
    the dict is *not present* (partial row); writers of formats that cannot
    express that raise NotImplementedError."""
    before: dict[str, Any] | None
    """Row image before (u/d); a primary-key change is a 'd' of the old key
    followed by a 'c' of the new key with the same ``seq``-group (see below)."""
    seq: int
    """Unique, increasing log sequence number (>= 1): the writer maps it onto
    the format's native position (LSN, changeSequence, HLC, ...) so that
    position order == seq order."""
    tx: int
    commit_ts: dt.datetime
    """Aware UTC datetime of the commit."""


def example_row(i: int, *, name: str | None = "n", amount: str | None = "1.50") -> dict[str, Any]:
    return {
        "id": i,
        "name": None if name is None else f"{name}{i}",
        "amount": None if amount is None else Decimal(amount),
        "updated_at": dt.datetime(2026, 1, 1, 12, 0, i % 60, 123456, tzinfo=dt.UTC),
    }
