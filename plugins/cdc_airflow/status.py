"""Per-table status for the UI (ui.py): what ``cdc status`` prints, plus the
pending files (the lag an operator acts on) and the last failed attempt.
Read with pyiceberg from the ledger (the tables' snapshot summaries and
``cdc_audit.batches``): no Spark."""

from __future__ import annotations

import datetime as dt
from typing import Any


def table_status(settings) -> list[dict[str, Any]]:
    """One dict per table of every configured source, ids as strings."""
    from cdc_apply.apply import held
    from cdc_apply.archive.listing import archive_file_exists
    from cdc_apply.batch import pending_files
    from cdc_apply.config import load_sources
    from cdc_apply.ledger import DERIVED_PROPERTIES, Ledger, applied_file_records_of

    ledger = Ledger(settings)
    catalog = ledger.catalog
    now = dt.datetime.now(dt.UTC)
    out = []
    for src in load_sources(settings).values():
        try:
            idents = sorted(f"{src.namespace}.{name}" for _, name in catalog.list_tables(src.namespace))
        except Exception:  # the namespace does not exist yet: nothing applied
            idents = []
        rows = ledger.batch_rows(src.name)  # read once: the applied files and the held ones come from them
        state, applied = ledger.latest_decoder_state(src.name, rows), applied_file_records_of(rows)
        try:
            pending = pending_files(settings, src, records=applied)
        except Exception as exc:  # an unreadable archive: say so on the page
            pending, pending_error = [], f"{type(exc).__name__}: {exc}"
        else:
            pending_error = None
        try:
            holding = held.summary(state, applied, archive_file_exists)
        except Exception as exc:  # an archive that cannot be asked: the page says so
            holding = {**held.summary(state, applied, lambda _: True), "held_files_gone": None}
            pending_error = pending_error or f"{type(exc).__name__}: {exc}"
        for ident in idents:
            full = f"{settings.catalog_name}.{ident}"
            led = ledger.table_ledger(ident)
            if DERIVED_PROPERTIES & catalog.load_table(ident).properties.keys():  # a change log or history: no live rows
                continue
            deleted = catalog.load_table(ident).scan(selected_fields=("_cdc_deleted",)).to_arrow().column("_cdc_deleted").to_pylist()
            mine = [r for r in rows if r["table_name"] == full]
            failures = [r for r in mine if r["status"] == "failed"]
            last = mine[-1] if mine else None
            applied_at = dt.datetime.fromisoformat(led.last_applied_at) if led and led.last_applied_at else None
            out.append(
                {
                    "source": src.name,
                    "table": full,
                    "live_rows": sum(1 for d in deleted if not d),
                    "tombstones": sum(1 for d in deleted if d),
                    "last_batch": led.last_batch if led else None,
                    "last_status": last["status"] if last else None,
                    "last_position": led.last_position if led else None,
                    "last_applied_at": applied_at.isoformat() if applied_at else None,
                    "lag_minutes": round((now - applied_at).total_seconds() / 60, 1) if applied_at else None,
                    "pending_files": len(pending),
                    "oldest_pending_hour": min((f.hour for f in pending), default=None) and min(f.hour for f in pending).isoformat(),
                    "pending_error": pending_error,
                    "snapshot_id": str(led.snapshot_id) if led and led.snapshot_id is not None else None,
                    "last_failure": _failure(failures[-1]) if failures else None,
                    "data_docs": next((r["data_docs"] for r in reversed(mine) if r["data_docs"]), None),
                    **holding,
                }
            )
    return out


def _failure(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "batch_id": row["batch_id"],
        "at": row["ended_at"].isoformat() if row["ended_at"] else None,
        "failed_expectations": list(row["failed_expectations"] or []),
        "message": (row["message"] or "")[:1000],
    }
