"""The demo: write three hours of Debezium PostgreSQL change files for
``public.customers`` into the archive, apply them on the embedded default
(Spark local[*], Iceberg JDBC catalog on SQLite), and print the table.

Run: ``./dev demo``  (idempotent: a second run applies nothing new).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

from cdc_apply.archive.files import write_jsonl
from cdc_apply.config import Settings, get_source
from cdc_apply.status import Status

_FIELDS = [
    {"type": "int32", "optional": False, "field": "id"},
    {"type": "string", "optional": False, "field": "first_name"},
    {"type": "string", "optional": False, "field": "last_name"},
    {"type": "string", "optional": False, "field": "email"},
    {
        "type": "bytes",
        "optional": True,
        "name": "org.apache.kafka.connect.data.Decimal",
        "version": 1,
        "parameters": {"scale": "2", "connect.decimal.precision": "10"},
        "field": "balance",
    },
    {"type": "string", "optional": True, "name": "io.debezium.time.ZonedTimestamp", "version": 1, "field": "updated_at"},
]
_SOURCE_FIELDS = [
    {"type": "string", "optional": False, "field": "version"},
    {"type": "string", "optional": False, "field": "connector"},
    {"type": "string", "optional": False, "field": "name"},
    {"type": "int64", "optional": False, "field": "ts_ms"},
    {"type": "string", "optional": False, "field": "db"},
    {"type": "string", "optional": True, "field": "sequence"},
    {"type": "string", "optional": False, "field": "schema"},
    {"type": "string", "optional": False, "field": "table"},
    {"type": "int64", "optional": True, "field": "txId"},
    {"type": "int64", "optional": True, "field": "lsn"},
]
SCHEMA = {
    "type": "struct",
    "name": "demo.public.customers.Envelope",
    "optional": False,
    "fields": [
        {"type": "struct", "fields": _FIELDS, "optional": True, "name": "demo.public.customers.Value", "field": "before"},
        {"type": "struct", "fields": _FIELDS, "optional": True, "name": "demo.public.customers.Value", "field": "after"},
        {
            "type": "struct",
            "fields": _SOURCE_FIELDS,
            "optional": False,
            "name": "io.debezium.connector.postgresql.Source",
            "field": "source",
        },
        {"type": "string", "optional": False, "field": "op"},
        {"type": "int64", "optional": True, "field": "ts_ms"},
    ],
}


def encode_decimal(value: Decimal, scale: int) -> str:
    """Debezium's precise decimal: base64 of the big-endian two's-complement unscaled value."""
    unscaled = int(value.scaleb(scale))
    length = max(1, (unscaled.bit_length() + 8) // 8)
    return base64.b64encode(unscaled.to_bytes(length, "big", signed=True)).decode()


def pg_message(op: str, lsn: int, tx: int, ts: dt.datetime, before: dict | None, after: dict | None) -> str:
    def row(r: dict[str, Any] | None) -> dict[str, Any] | None:
        if r is None:
            return None
        out = dict(r)
        if out.get("balance") is not None:
            out["balance"] = encode_decimal(out["balance"], 2)
        if isinstance(out.get("updated_at"), dt.datetime):
            out["updated_at"] = out["updated_at"].isoformat().replace("+00:00", "Z")
        return out

    ts_ms = int(ts.timestamp() * 1000)
    payload = {
        "before": row(before),
        "after": row(after),
        "source": {
            "version": "2.7.0.Final",
            "connector": "postgresql",
            "name": "demo",
            "ts_ms": ts_ms,
            "snapshot": "false",
            "db": "inventory",
            "sequence": json.dumps([str(lsn - 8), str(lsn)]),
            "schema": "public",
            "table": "customers",
            "txId": tx,
            "lsn": lsn,
            "xmin": None,
        },
        "op": op,
        "ts_ms": ts_ms + 5,
    }
    return json.dumps({"schema": SCHEMA, "payload": payload}, separators=(",", ":"))


def demo_changes(start: dt.datetime) -> dict[dt.datetime, list[str]]:
    """Three hours of changes: inserts, updates, a delete, a late re-insert."""
    hours: dict[dt.datetime, list[str]] = {}
    lsn, tx = 24_000_000, 600

    def cust(i: int, first: str | None, bal: str | None, ts: dt.datetime) -> dict[str, Any]:
        return {
            "id": i,
            "first_name": first,
            "last_name": f"Doe{i}",
            "email": f"c{i}@example.com",
            "balance": Decimal(bal or "0"),
            "updated_at": ts,
        }

    plan: list[list[tuple[str, int, str | None, str | None]]] = [
        # hour 0: five customers arrive (snapshot read of 1-3, inserts of 4-5)
        [("r", 1, "Anne", "10.00"), ("r", 2, "Bob", "20.50"), ("r", 3, "Cid", "0.00"), ("c", 4, "Dee", "99.99"), ("c", 5, "Eve", "-5.25")],
        # hour 1: updates, a delete, an insert+update of the same key
        [
            ("u", 1, "Anne Marie", "11.00"),
            ("d", 3, None, None),
            ("c", 6, "Fay", "1.00"),
            ("u", 6, "Faye", "2.00"),
            ("u", 2, "Bob", "21.50"),
        ],
        # hour 2: delete then re-insert of 4, another update of 1
        [("d", 4, None, None), ("c", 4, "Dee", "100.00"), ("u", 1, "Anne-Marie", "12.34")],
    ]
    for h, changes in enumerate(plan):
        hour = start + dt.timedelta(hours=h)
        lines = []
        for n, (op, i, first, bal) in enumerate(changes):
            lsn += 64
            tx += 1
            ts = hour + dt.timedelta(minutes=5 + n)
            after = None if op == "d" else cust(i, first, bal, ts)
            before = {"id": i} if op in ("u", "d") else None
            lines.append(pg_message(op, lsn, tx, ts, before, after))
        hours[hour] = lines
    return hours


def write_demo_archive(settings: Settings, source_name: str = "pg_inventory", start: dt.datetime | None = None) -> list[Path]:
    source = get_source(settings, source_name)
    start = start or dt.datetime(2026, 1, 1, 0, tzinfo=dt.UTC)
    paths = []
    for hour, lines in demo_changes(start).items():
        path = Path(source.archive_path(settings)) / f"{hour:%Y/%m/%d/%H}" / "customers-0000.jsonl.gz"
        if not path.exists():
            write_jsonl(path, lines, compress=True)
        paths.append(path)
    return paths


def write_next_demo_hour(settings: Settings, source_name: str = "pg_inventory") -> Path:
    """One more hour of demo changes after the newest archived hour (updates of
    the demo's customers, one new customer), at log positions above every
    earlier one: fresh data for the DAG to apply after ``./dev demo``."""
    source = get_source(settings, source_name)
    root = Path(source.archive_path(settings))
    hours = sorted(
        dt.datetime.strptime("/".join(p.relative_to(root).parts[:4]), "%Y/%m/%d/%H").replace(tzinfo=dt.UTC)
        for p in root.glob("*/*/*/*")
        if p.is_dir()
    )
    hour = (hours[-1] if hours else dt.datetime(2026, 1, 1, tzinfo=dt.UTC)) + dt.timedelta(hours=1)
    lsn = int(hour.timestamp()) * 100  # above the demo's (24M) and every earlier hour's
    new_id = 100 + len(hours)
    lines = []
    for n, (op, i, first) in enumerate([("u", 1, "Anne-Marie"), ("u", 2, "Bob"), ("c", new_id, f"New{new_id}")]):
        ts = hour + dt.timedelta(minutes=5 + n)
        after = {
            "id": i,
            "first_name": first,
            "last_name": f"Doe{i}",
            "email": f"c{i}@example.com",
            "balance": Decimal(f"{len(hours) + n}.00"),
            "updated_at": ts,
        }
        lines.append(pg_message(op, lsn + 64 * n, 10_000 + len(hours) * 10 + n, ts, {"id": i} if op == "u" else None, after))
    path = root / f"{hour:%Y/%m/%d/%H}" / "customers-0000.jsonl.gz"
    write_jsonl(path, lines, compress=True)
    return path


def print_history(catalog: Any) -> None:
    """The SCD2 history of the demo table (``history: scd2`` in include/sources.yaml)."""
    from pyiceberg.exceptions import NoSuchTableError

    try:
        hist = catalog.load_table("pg_inventory.customers_history")
    except NoSuchTableError:  # history not configured for the table
        return
    rows = sorted(hist.scan().to_arrow().to_pylist(), key=lambda r: (r["id"], r["_cdc_valid_from"]))
    print("\nlake.pg_inventory.customers_history (one row per version; README, 'History: SCD type 2 per table'):")
    cols = ["id", "first_name", "balance", "_cdc_valid_from", "_cdc_valid_to", "_cdc_op", "_cdc_closed_by", "_cdc_current"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))


def main(argv: list[str] | None = None) -> int:
    import logging

    from cdc_apply.batch import run_batch
    from cdc_apply.ledger import Ledger

    p = argparse.ArgumentParser(description="CDC apply demo")
    p.add_argument("--source", default="pg_inventory")
    p.add_argument("--next-hour", action="store_true", help="only write one more hour of changes (fresh data for the DAG); apply nothing")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    settings = Settings.from_env()
    if args.next_hour:
        print(
            f"archive: wrote {write_next_demo_hour(settings, args.source)}; trigger cdc_apply (Airflow) or ./dev cdc apply --source {args.source} to apply it"
        )
        return 0
    paths = write_demo_archive(settings, args.source)
    print(f"archive: {len(paths)} file(s) under {get_source(settings, args.source).archive_path(settings)}")
    result = run_batch(settings, args.source)
    print(f"batch {result.batch_id}: {result.status} in {result.seconds}s; messages {result.messages}")
    for t in result.tables:
        print(f"  {t.table}: {t.status} {t.counts} snapshot={t.snapshot_id}")
        if t.message:
            print(f"    {t.message}")
    catalog = Ledger(settings).catalog
    table = catalog.load_table("pg_inventory.customers")
    rows = sorted(table.scan().to_arrow().to_pylist(), key=lambda r: r["id"])
    snapshot = table.current_snapshot()
    if snapshot is None:
        print("\nlake.pg_inventory.customers has no snapshot yet")
        return 1
    print(f"\nlake.pg_inventory.customers (snapshot {snapshot.snapshot_id}):")
    cols = ["id", "first_name", "last_name", "email", "balance", "updated_at", "_cdc_position", "_cdc_op", "_cdc_deleted"]
    print(" | ".join(cols))
    for r in rows:
        if not r["_cdc_deleted"]:
            print(" | ".join(str(r[c]) for c in cols))
    dead = [r for r in rows if r["_cdc_deleted"]]
    if dead:  # their data columns keep the row as it was just before the delete (docs/apply-semantics.md rule 3)
        print("tombstones (deleted keys, kept so that no older event brings them back; hidden by customers_live):")
        for r in dead:
            print(f"  id {r['id']}: {r['_cdc_op']} at {r['_cdc_position']}")
    print_history(catalog)
    summary = snapshot.summary.additional_properties if snapshot.summary else {}
    print(
        f"\nsnapshot summary: batch {summary.get('cdc.batch-id')}, files {len(json.loads(summary.get('cdc.files', '[]')))}, counts {summary.get('cdc.counts')}"
    )
    return 0 if result.status in (Status.COMPLETE, Status.NOTHING_TO_DO) else 1


if __name__ == "__main__":
    from cdc_apply.runtime.session import one_command_process

    one_command_process()
    raise SystemExit(main())
