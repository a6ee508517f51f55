"""Time travel by source position: which published snapshot of a table
reflects the source up to a position (or a source commit time), and the SQL
that reads it.

Every batch's commits carry the source watermark the table reflects once they
are published (``cdc.watermark``: the highest position of main before it and
of the batch; ``cdc.commit-ts-max`` likewise for source commit times,
``ledger.watermark_properties``), and every publish tags its snapshot
``cdc_<batch>`` (``ledger.fast_forward``) so that it outlives snapshot expiry.
The snapshot *as of* position P is the last publish whose watermark is at or
below P: it holds every change at or below its watermark, and none above.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from cdc_apply import ledger
from cdc_apply.apply.compact import quote
from cdc_apply.config import Settings, get_source
from cdc_apply.errors import ConfigError


@dataclass(frozen=True)
class Publish:
    """One published batch of a table: its last snapshot and watermarks."""

    snapshot_id: int
    batch_id: str
    watermark: str
    commit_ts_max: str | None
    published_ms: int


@dataclass(frozen=True)
class AsOf:
    table: str
    snapshot_id: int
    batch_id: str
    watermark: str
    commit_ts_max: str | None
    next_watermark: str | None
    """The watermark of the next publish: the table holds no state between."""

    @property
    def sql(self) -> str:
        return f"SELECT * FROM {self.table} VERSION AS OF {self.snapshot_id} WHERE NOT _cdc_deleted"


def publishes(table: Any) -> list[Publish]:
    """The published batches of a pyiceberg table, oldest first: the last
    snapshot of each batch on main's ancestry, and the snapshots of the
    publish tags (older than the ancestry expiry left).  An audit branch's
    snapshots that were never published are neither."""
    from pyiceberg.table.snapshots import ancestors_of

    current = table.current_snapshot()
    chain = list(ancestors_of(current, table.metadata)) if current else []  # newest first
    tagged = [
        table.snapshot_by_id(ref.snapshot_id)
        for name, ref in table.metadata.refs.items()
        if name.startswith(ledger.PUBLISH_TAG_PREFIX) and ref.snapshot_ref_type == "tag"
    ]
    out: dict[str, Publish] = {}
    for snap in chain + [s for s in tagged if s is not None]:
        props = dict(snap.summary.additional_properties) if snap.summary else {}
        batch, mark = props.get(ledger.PREFIX + "batch-id"), props.get(ledger.PREFIX + "watermark")
        if batch and mark and batch not in out:  # newest first: a batch's last commit
            out[batch] = Publish(snap.snapshot_id, batch, mark, props.get(ledger.PREFIX + "commit-ts-max"), snap.timestamp_ms)
    return sorted(out.values(), key=lambda p: p.published_ms)


def pick(published: list[Publish], *, position: str | None = None, commit_ts: str | None = None) -> tuple[Publish, str | None] | None:
    """The last publish (in publish order) whose watermark is at or below
    ``position`` (or whose source commit time is at or below ``commit_ts``),
    with the next publish's watermark; None before the first."""
    if (position is None) == (commit_ts is None):
        raise ConfigError("give a source position or a source commit time, not both")
    best: int | None = None
    for i, p in enumerate(published):
        if (position is not None and p.watermark <= position) or (
            commit_ts is not None and p.commit_ts_max is not None and p.commit_ts_max <= commit_ts
        ):
            best = i
    if best is None:
        return None
    nxt = published[best + 1].watermark if best + 1 < len(published) else None
    return published[best], nxt


def iso_utc(text: str) -> str:
    """An ISO time (``Z`` or an offset; naive is UTC) as the fixed-width text
    ``cdc.commit-ts-max`` is written in."""
    t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return ledger.iso_utc_text(t if t.tzinfo else t.replace(tzinfo=dt.UTC))


def as_of(settings: Settings, source: str, table: str, *, position: str | None = None, time: str | None = None) -> AsOf | None:
    """The snapshot of ``<source namespace>.<table>`` as of a source position
    or source commit time (``time``, ISO); None before its first publish."""
    return table_as_of(settings, get_source(settings, source).namespace, table, position=position, time=time)


def table_as_of(settings: Settings, namespace: str, table: str, *, position: str | None = None, time: str | None = None) -> AsOf | None:
    """``as_of`` of a table named by its namespace."""
    tbl = ledger.Ledger(settings).catalog.load_table(f"{namespace}.{table}")
    found = pick(publishes(tbl), position=position, commit_ts=iso_utc(time) if time else None)
    if found is None:
        return None
    p, nxt = found
    ident = f"{settings.catalog_name}.{quote(namespace)}.{quote(table)}"
    return AsOf(ident, p.snapshot_id, p.batch_id, p.watermark, p.commit_ts_max, nxt)
