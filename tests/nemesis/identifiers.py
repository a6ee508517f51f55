"""Hostile identifiers: quotes, backticks, semicolons, dots, spaces, unicode,
300 characters, ``x; DROP TABLE ...`` as schema, table and column names of
Debezium PostgreSQL messages, in one batch with a good table.  Nothing is
executed (every table of the catalog is still there with its rows), a
table whose name cannot be an Iceberg name is refused with a reason naming
it, a column name is refused or stored exactly, the good table is published.

The quoting of every identifier that reaches SQL is property-tested in
``tests/test_nemesis.py`` (compact.quote, tables.sql_string,
tables.validate_column, config.validate_identifier)."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from tests.formats import write_debezium_postgres as pg
from tests.formats.synthetic import SyntheticChange, example_row
from tests.nemesis.trial import Trial

HOSTILE = [
    "a'b",
    'a"b',
    "a`b",
    "x;y",
    "a.b",
    "a b",
    "ключ",
    "表",
    "x" * 300,
    "x; DROP TABLE {victim}",
    "items` ; DROP TABLE {victim}; --",
    "'); DROP TABLE {victim}; --",
    "a\\b",
    "a\nb",
    "a\x00b",
    "",
    " ",
    "${jndi:x}",
    "a--b",
    "a/*b*/",
    "CON",
    "a\u202eb",
    "a,b",
    "a=b",
]
ROLES = ("schema", "table", "column")


def _lines(schema: str, table: str, column: str, keys: range) -> list[str]:
    """Debezium PostgreSQL lines (Kafka wrapper with key) with the names replaced."""
    import datetime as dt

    t0 = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    changes = [SyntheticChange("c", {"id": k}, example_row(k), None, k, k, t0) for k in keys]
    out = []
    for line in pg.write_messages(changes):
        obj = json.loads(line)
        value = obj["value"]
        value["payload"]["source"].update(schema=schema, table=table)
        for f in value["schema"]["fields"]:
            for g in f.get("fields", []) if f.get("field") in ("before", "after") else []:
                if g["field"] == "name":
                    g["field"] = column
        after = value["payload"]["after"]
        if after is not None and "name" in after:
            after[column] = after.pop("name")
        out.append(json.dumps(obj))
    return out


class _RowCounts:
    """Every table of the catalog with its row count: what an injection would
    change.  A table is counted (a Spark job) only when its current snapshot
    is one not counted before; the tests' catalog holds every table of the
    worker's earlier tests, and a batch here changes only a few of them."""

    def __init__(self, spark, settings) -> None:
        from cdc_apply.ledger import Ledger

        self.spark, self.name, self.catalog = spark, settings.catalog_name, Ledger(settings).catalog
        self.counted: dict[tuple[str, int | None], int] = {}

    def __call__(self) -> dict[str, int]:
        from cdc_apply.apply.compact import quote

        out = {}
        for ns in self.catalog.list_namespaces():
            for ident in self.catalog.list_tables(ns):
                name = ".".join(ident)
                snapshot = self.catalog.load_table(ident).current_snapshot()
                seen = (name, snapshot.snapshot_id if snapshot else None)
                if seen not in self.counted:
                    quoted = ".".join(quote(p) for p in ident)
                    self.counted[seen] = self.spark.sql(f"SELECT count(*) FROM {self.name}.{quoted}").collect()[0][0]
                out[name] = self.counted[seen]
        return out


def identifier_trial(spark, settings, work: Path, seed: int, names: list[str] | None = None) -> Trial:
    """Each hostile name in each role, one batch per name and role, beside the good table ``victim``."""
    from cdc_apply.archive.listing import list_files
    from cdc_apply.batch import run_batch
    from cdc_apply.config import Settings

    rnd = random.Random(seed)
    trial = Trial("identifiers", f"seed {seed}")
    t0 = time.time()
    source = f"ident{seed % 10**6}"
    victim = f"{settings.catalog_name}.{source}.victim"
    sources = work / "sources.yaml"
    work.mkdir(parents=True, exist_ok=True)
    sources.write_text(json.dumps({"sources": {source: {"format": "debezium_postgres", "namespace": source, "quarantine_max_share": 1.0}}}))
    os.environ["CDC_SOURCES_FILE"] = str(sources)
    settings = Settings.from_env()
    tried = refused = 0
    tables = _RowCounts(spark, settings)
    picks = names if names is not None else HOSTILE
    for i, (name, role) in enumerate((n, r) for n in picks for r in ROLES):
        name = name.format(victim=victim) if "{victim}" in name else name
        hour = work / "archive" / f"{i:04d}" / "2026/03/01/00"
        hour.mkdir(parents=True, exist_ok=True)
        schema, table, column = {
            "schema": (name, "hostile", "name"),
            "table": ("public", name, "name"),
            "column": ("public", "hostile", name),
        }[role]
        lines = _lines(schema, table, column, range(1, 4)) + _lines("public", "victim", "name", range(10 * i + 1, 10 * i + 3))
        rnd.shuffle(lines)
        (hour / "f.jsonl").write_text("\n".join(lines) + "\n")
        before = tables()
        tried += 1
        try:
            result = run_batch(settings, source, list_files(hour.parents[3]), spark=spark)
        except Exception as exc:
            trial.problems.append(f"{role} {name[:60]!r}: the batch died: {type(exc).__name__}: {str(exc)[:800]}")
            continue
        after = tables()
        lost = {t: n for t, n in before.items() if after.get(t, -1) < n and not t.endswith(f"{source}.victim")}
        if lost:
            trial.problems.append(f"{role} {name[:60]!r}: tables lost or emptied: {lost}")
        if after.get(f"{source}.victim") != 2 * (i + 1):
            trial.problems.append(f"{role} {name[:60]!r}: the good table has {after.get(f'{source}.victim')} rows, {2 * (i + 1)} expected")
        hostile = [t for t in result.tables if not t.table.endswith(".victim")]
        if any(t.status in ("refused", "failed") for t in hostile) or result.messages.get("event", 0) < 5:
            refused += 1
            why = " ".join((t.message or "") for t in hostile) + json.dumps(result.messages)
            if not why.strip():
                trial.problems.append(f"{role} {name[:60]!r}: refused without a reason")
        else:  # accepted: then stored exactly, under its own name
            got = hostile[0].table.split(".", 2)[-1] if hostile else None
            cols = [f.name for f in spark.table(hostile[0].table).schema.fields] if hostile else []
            if role == "table" and got != name.lower():
                trial.problems.append(f"table {name[:60]!r} accepted as {got!r}")
            if role == "column" and name not in cols:
                trial.problems.append(f"column {name[:60]!r} accepted, but the table has {cols}")
    trial.figures.update(identifiers=tried, refused=refused)
    trial.seconds = time.time() - t0
    return trial
