"""A seeded Debezium PostgreSQL workload: a few hourly files over two tables
(inserts, updates, partial updates with the TOAST placeholder, deletes with
their Kafka tombstones, primary-key changes), a few malformed lines that are
quarantined, some files gzip.  Written with ``tests/formats``' writer.

With ``transactions`` (the default) the changes carry Debezium's transaction
metadata (``provide.transaction.metadata``: a ``transaction`` block on each
event, BEGIN and END markers), so ``publish: transactions`` holds what is
torn: the END of hour 0's last ``items`` transaction is archived in hour 1's
file (batch A holds it, batch B releases it), and the END of the last hour's
last ``orders`` transaction is never archived (every run ends holding it).
Kills and races then reach the held files' paths (a rerun of a batch whose
change log published a held file's lines)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import random
from decimal import Decimal
from pathlib import Path

from cdc_apply.archive.files import write_jsonl
from tests.formats import write_debezium_postgres as pg
from tests.formats.synthetic import SyntheticChange

UTC = dt.UTC
T0 = dt.datetime(2026, 1, 1, tzinfo=UTC)
TABLES = ("items", "orders")
SOURCE = "nem"


def sources_yaml(name: str = SOURCE, namespace: str = SOURCE) -> str:
    """The sources file of the workload (a tolerant quarantine limit: the
    workload's malformed lines are part of the expected state); ``items``
    keeps an SCD2 history, so kills between its publish and the table's are tried."""
    tables = "".join(f"      public.{t}: {{primary_key: [id]{', history: scd2' if t == 'items' else ''}}}\n" for t in TABLES)
    return f"sources:\n  {name}:\n    format: debezium_postgres\n    namespace: {namespace}\n    quarantine_max_share: 0.5\n    tables:\n{tables}"


def _changes(rnd: random.Random, n: int, seq0: int, hour: int) -> list[SyntheticChange]:
    """``n`` changes of one table at sequence numbers after ``seq0``."""
    out: list[SyntheticChange] = []
    seq = seq0
    for i in range(n):
        seq += 1
        ts = T0 + dt.timedelta(hours=hour, seconds=i)
        key = rnd.randint(1, 12)
        row = {
            "id": key,
            "name": rnd.choice(["a", "b", None, "ü x", "q'uote"]),
            "amount": Decimal(rnd.randint(-9999, 9999)).scaleb(-2),
            "updated_at": ts,
        }
        kind = rnd.choice("cuuudkp")
        if kind == "d":
            out.append(SyntheticChange("d", {"id": key}, None, {"id": key}, seq, seq, ts))
        elif kind == "k":  # a primary-key change: delete + insert in one transaction
            new = key + 100
            out.append(SyntheticChange("d", {"id": key}, None, {"id": key}, seq, seq, ts))
            seq += 1
            out.append(SyntheticChange("c", {"id": new}, {**row, "id": new}, None, seq, seq - 1, ts))
        else:
            if kind == "p":  # a partial update: name unchanged (TOAST placeholder)
                row.pop("name")
            op = "c" if kind == "c" else "u"
            out.append(SyntheticChange(op, {"id": key}, row, {"id": key} if op == "u" else None, seq, seq, ts))
    return out


def _group(rnd: random.Random, changes: list[SyntheticChange]) -> list[SyntheticChange]:
    """Consecutive changes grouped into source transactions of up to three;
    a primary-key change's two halves (one ``tx``) stay in one."""
    out: list[SyntheticChange] = []
    tx, size, prev = 0, 0, None
    for ch in changes:
        if ch.tx != prev and (size == 0 or size >= 3 or rnd.random() < 0.5):
            tx, size = ch.tx, 0
        prev, size = ch.tx, size + 1
        out.append(dataclasses.replace(ch, tx=tx))
    return out


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _marker(status: str, tx_id: str, table: str, count: int | None, ts_ms: int) -> str:
    collections = None if count is None else [{"data_collection": f"public.{table}", "event_count": count}]
    return _dumps(
        {"schema": None, "payload": {"status": status, "id": tx_id, "event_count": count, "data_collections": collections, "ts_ms": ts_ms}}
    )


def _archived(lines: list[str], table: str, tx_base: int, transactions: bool) -> tuple[list[str], str | None]:
    """The writer's lines of one table retargeted to ``table``; with
    ``transactions``, each event in its transaction block between BEGIN and
    END markers.  Returns the lines without the last transaction's END, and that END."""
    out: list[str] = []
    end: str | None = None
    group: tuple[int, str] | None = None
    order = 0
    for line in lines:
        obj = json.loads(line)
        payload = (obj.get("value") or {}).get("payload")
        if payload is None:  # a delete's Kafka tombstone
            out.append(line)
            continue
        payload["source"]["table"] = table
        if transactions:
            tx, ts_ms = tx_base + payload["source"]["txId"], payload["source"]["ts_ms"]
            if group is None or group[0] != tx:
                if end is not None:
                    out.append(end)
                group, order = (tx, f"{tx}:{payload['source']['lsn']}"), 0
                out.append(_marker("BEGIN", group[1], table, None, ts_ms))
            order += 1
            payload["source"]["txId"] = tx
            payload["transaction"] = {"id": group[1], "total_order": order, "data_collection_order": order}
            end = _marker("END", group[1], table, order, ts_ms)
        out.append(_dumps(obj))
    return out, end


def write_workload(root: Path, seed: int, hours: int = 3, per_hour: int = 25, *, transactions: bool = True) -> list[Path]:
    """The archive under ``root`` (``YYYY/MM/DD/HH/``), one or two files per
    hour; returns the files.  Same seed, same bytes."""
    rnd = random.Random(seed)
    files: list[Path] = []
    seqs = {table: 0 for table in TABLES}  # each table's own log, increasing across hours
    carried: list[str] = []  # END markers archived an hour late
    for hour in range(hours):
        lines: list[str] = carried
        carried = []
        for n, table in enumerate(TABLES):
            changes = _changes(rnd, per_hour, seqs[table], hour)
            seqs[table] = changes[-1].seq
            table_lines, end = _archived(pg.write_messages(_group(rnd, changes)), table, (n + 1) * 1_000_000, transactions)
            lines += table_lines
            if end is not None and (hour, table) == (0, "items") and hours > 1:
                carried.append(end)  # torn across the hour: held by the batch of hour 0
            elif end is not None and not (hour == hours - 1 and table == "orders"):
                lines.append(end)  # the last hour's last orders transaction never ends: always held
        bad = ['{"payload": {"op": "c", broken', "not json at all", '{"schema": null, "payload": {"op": "zz", "source": {}}}']
        for b in rnd.sample(bad, 2):
            lines.insert(rnd.randint(0, len(lines)), b)
        cut = rnd.randint(1, len(lines) - 1)
        folder = root / f"{T0:%Y/%m/%d}/{hour:02d}"
        files.append(write_jsonl(folder / "part-0.jsonl", lines[:cut]))
        files.append(write_jsonl(folder / "part-1.jsonl.gz", lines[cut:], compress=True))
    return files
