"""A seeded Debezium PostgreSQL workload: a few hourly files over two tables
(inserts, updates, partial updates with the TOAST placeholder, deletes with
their Kafka tombstones, primary-key changes), a few malformed lines that are
quarantined, some files gzip.  Written with ``tests/formats``' writer."""

from __future__ import annotations

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


def _retable(line: str, table: str) -> str:
    obj = json.loads(line)
    if obj.get("value") and obj["value"].get("payload"):
        obj["value"]["payload"]["source"]["table"] = table
    return json.dumps(obj, separators=(",", ":"))


def write_workload(root: Path, seed: int, hours: int = 3, per_hour: int = 25) -> list[Path]:
    """The archive under ``root`` (``YYYY/MM/DD/HH/``), one or two files per
    hour; returns the files.  Same seed, same bytes."""
    rnd = random.Random(seed)
    files: list[Path] = []
    seqs = {table: 0 for table in TABLES}  # each table's own log, increasing across hours
    for hour in range(hours):
        lines: list[str] = []
        for table in TABLES:
            changes = _changes(rnd, per_hour, seqs[table], hour)
            seqs[table] = changes[-1].seq
            lines += [_retable(x, table) for x in pg.write_messages(changes)]
        bad = ['{"payload": {"op": "c", broken', "not json at all", '{"schema": null, "payload": {"op": "zz", "source": {}}}']
        for b in rnd.sample(bad, 2):
            lines.insert(rnd.randint(0, len(lines)), b)
        cut = rnd.randint(1, len(lines) - 1)
        folder = root / f"{T0:%Y/%m/%d}/{hour:02d}"
        files.append(write_jsonl(folder / "part-0.jsonl", lines[:cut]))
        files.append(write_jsonl(folder / "part-1.jsonl.gz", lines[cut:], compress=True))
    return files
