"""Rebuild from zero: replay every archive file the source's complete batches
applied into fresh tables beside the live ones (namespace ``<ns>_rebuild``,
source ``<source>_rebuild`` in the ledger), then compare them with the live
tables row for row — every row, tombstones and CDC columns included, except
the run-dependent ones (batch ids, apply times).

The one documented exception: a tombstone that table maintenance purged from
the live table (older than the tombstone retention) is still in the rebuilt
one; it is counted, not a difference, when the live table's history has a
maintenance delete and the key has no row at all in the live table.

Transactions an operator's *force* let through incomplete on the live source
(held past ``transaction_max_hold_hours``) are let through by the replay too
(``rebuild_source``).  Not so events a CockroachDB source's force let past
its resolved watermark: the replay holds those again, and they show as rows
only the live table has.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_apply import ledger
from cdc_apply.apply import held, transactions
from cdc_apply.apply.compact import quote
from cdc_apply.apply.tables import existing_schema, sql_string, table_properties
from cdc_apply.archive.files import ArchiveFile
from cdc_apply.archive.listing import list_files
from cdc_apply.batch import run_batch
from cdc_apply.config import Settings, SourceConfig
from cdc_apply.errors import CdcError, TerminalError
from cdc_apply.results import Override
from cdc_apply.status import Status

log = logging.getLogger("cdc_apply")

SUFFIX = "_rebuild"
RUN_DEPENDENT = frozenset({"_cdc_batch_id", "_cdc_applied_at", "batch_id"})
"""Columns that name the run, not the data: a change log's ``batch_id`` too
(the rebuild's batches are other batches)."""


def rebuild_source(source: SourceConfig, forced: list[str] | None = None) -> SourceConfig:
    """The source the replay applies as: its own name (ledger rows, decoder
    state) and namespace, the same format, keys and options; ``forced``: the
    transactions an operator's force let through on the live source
    (``transactions.FORCED_KEY``), which the replay lets through too: its
    clock, minutes long, would hold them."""
    return dataclasses.replace(
        source, name=source.name + SUFFIX, namespace=source.namespace + SUFFIX, forced_transactions=frozenset(forced or ())
    )


def replay_files(settings: Settings, source: SourceConfig, rows: list[dict[str, Any]] | None = None) -> list[ArchiveFile]:
    """The files of the source's complete batches (not those an operator
    skipped: they were never applied), and the files it holds lines of
    (applied but for those: ``held.py``), found in the archive; a recorded
    file missing from it refuses the rebuild (it cannot be replayed).
    ``rows``: the source's ``Ledger.batch_rows``, when the caller has read them."""
    led = ledger.Ledger(settings)
    rows = led.batch_rows(source.name) if rows is None else rows
    complete = [r for r in rows if r["table_name"] == "*" and r["status"] == Status.COMPLETE]
    recorded = {f["path"]: (f["size"], f["sha256"]) for r in complete for f in r["files"] or []}
    holding = led.latest_decoder_state(source.name, rows).get(held.HELD_KEY) or {}
    # a held record keeps no size: such a file is read and hashed, then checked as the others
    recorded |= {path: (-1, rec["sha256"]) for path, rec in holding.items() if path not in recorded}
    found = [f for f in list_files(source.archive_path(settings), known=recorded) if f.path in recorded]
    missing = sorted(set(recorded) - {f.path for f in found})
    if missing:
        raise TerminalError(f"source {source.name}: {len(missing)} applied file(s) are not in the archive any more: {missing[:5]}")
    changed = [f.path for f in found if f.sha256 != recorded[f.path][1]]
    if changed:
        raise TerminalError(f"source {source.name}: applied file(s) changed since: {changed[:5]}")
    return found


def by_hour(files: list[ArchiveFile]) -> list[list[ArchiveFile]]:
    """One batch per archive hour, oldest first (as the hourly DAG forms them)."""
    groups: dict[Any, list[ArchiveFile]] = {}
    for f in sorted(files):
        groups.setdefault(f.hour, []).append(f)
    return [groups[h] for h in sorted(groups)]


def reset(spark: SparkSession, settings: Settings, rb: SourceConfig) -> None:
    """Start from zero: drop the rebuild namespace's tables and views and the
    rebuild source's batch rows (its decoder state and applied files)."""
    ns = f"{settings.catalog_name}.{quote(rb.namespace)}"
    if spark.sql(f"SHOW NAMESPACES IN {settings.catalog_name} LIKE {sql_string(rb.namespace)}").collect():
        for r in spark.sql(f"SHOW VIEWS IN {ns}").collect():
            spark.sql(f"DROP VIEW IF EXISTS {ns}.{quote(r['viewName'])}")
        for r in spark.sql(f"SHOW TABLES IN {ns}").collect():
            if not r["isTemporary"]:
                spark.sql(f"DROP TABLE IF EXISTS {ns}.{quote(r['tableName'])} PURGE")
    batches = f"{settings.catalog_name}.{quote(settings.audit_namespace)}.{ledger.BATCHES_TABLE}"
    if spark.catalog.tableExists(batches):
        spark.sql(f"DELETE FROM {batches} WHERE source = {sql_string(rb.name)}")


def table_filter(source: SourceConfig, table: str) -> str:
    """``--table`` as the apply's ``table_name`` filter: the source table's name,
    bare or qualified (``public.customers``), or the target a table is mapped to."""
    names = {table.split(".")[-1]} | {name.split(".")[-1] for name, target in source.targets.items() if target == table.lower()}
    return "^(" + "|".join(re.escape(n) for n in sorted(names)) + ")$"


def replay(spark: SparkSession, settings: Settings, source: SourceConfig, table: str | None = None) -> SourceConfig:
    """Replay the source's applied files into the rebuild namespace, one batch
    per hour; forced past the gate (the comparison is the check); a batch
    that fails stops the rebuild."""
    led = ledger.Ledger(settings)
    rows = led.batch_rows(source.name)
    rb = rebuild_source(source, led.latest_decoder_state(source.name, rows).get(transactions.FORCED_KEY))
    applied = replay_files(settings, source, rows)
    reset(spark, settings, rb)
    force = Override.parse("force", "rebuild from zero: compared with the live tables afterwards", "cdc rebuild")
    holding: list[ArchiveFile] = []
    for files in by_hour(applied):
        # as discovery offers them: a file with held lines again, until they are released
        batch = sorted(set(files) | set(holding))
        result = run_batch(settings, rb, batch, spark=spark, table_filter=table_filter(source, table) if table else None, override=force)
        if result.status != Status.COMPLETE:
            raise CdcError(f"rebuild of {source.name}: batch {result.batch_id} {result.status}: {result.message}")
        held_paths = set(result.held_files)
        holding = [f for f in batch if f.path in held_paths]
    return rb


def row_text(df: DataFrame, exclude: frozenset[str] = RUN_DEPENDENT) -> DataFrame:
    """Each row as one JSON text of its columns by name (maps as sorted entry
    lists): comparable across tables whose columns were added in another
    order, and usable in set operations (maps are not)."""
    cols: list[Column] = []
    for name in sorted(c for c in df.columns if c not in exclude):
        col = F.col(quote(name))
        if isinstance(df.schema[name].dataType, T.MapType):
            col = F.array_sort(F.map_entries(col))
        cols.append(col.alias(name))
    return df.select(F.to_json(F.struct(*cols)).alias("row"))


def fingerprint(rows: DataFrame) -> str:
    """Order-free fingerprint of ``row_text`` rows: count and sum of hashes."""
    r = rows.agg(F.count(F.lit(1)).alias("n"), F.sum(F.xxhash64("row").cast("decimal(38,0)")).alias("h")).collect()[0]
    return f"{r['n']}:{r['h'] or 0}"


def purged_tombstones(live: DataFrame, rebuilt: DataFrame, key_columns: list[str]) -> DataFrame:
    """Rebuilt tombstones whose key has no row at all in the live table."""
    keys = [quote(k) for k in key_columns]
    return rebuilt.where("_cdc_deleted").join(live.select(*keys), key_columns, "left_anti")


def compare(live: DataFrame, rebuilt: DataFrame, key_columns: list[str] | None, purge_ran: bool, sample: int = 5) -> dict[str, Any]:
    """The comparison of one table: fingerprints, rows only on one side (a
    few), and the purged tombstones set aside when maintenance purged some."""
    purged = 0
    if key_columns and purge_ran:
        gone = purged_tombstones(live, rebuilt, key_columns)
        purged = gone.count()
        rebuilt = rebuilt.join(gone.select(*[quote(k) for k in key_columns]), key_columns, "left_anti")
    a, b = row_text(live), row_text(rebuilt)
    only_live, only_rebuilt = a.exceptAll(b), b.exceptAll(a)
    out = {
        "fingerprint_live": fingerprint(a),
        "fingerprint_rebuilt": fingerprint(b),
        "only_live": [r["row"] for r in only_live.limit(sample).collect()],
        "only_rebuilt": [r["row"] for r in only_rebuilt.limit(sample).collect()],
        "purged_tombstones": purged,
        "columns_differ": sorted(set(live.columns) ^ set(rebuilt.columns)),
    }
    out["equal"] = out["fingerprint_live"] == out["fingerprint_rebuilt"] and not (
        out["only_live"] or out["only_rebuilt"] or out["columns_differ"]
    )
    return out


def maintenance_purged(spark: SparkSession, ident: str) -> bool:
    """Whether a commit not made by a batch (table maintenance) deleted rows of
    the live table: the only way a tombstone leaves it."""
    rows = spark.sql(
        f"SELECT count(*) AS n FROM {ident}.snapshots WHERE operation IN ('delete', 'overwrite') "
        f"AND summary['{ledger.PREFIX}batch-id'] IS NULL AND "
        + " + ".join(
            f"coalesce(CAST(summary['{k}'] AS bigint), 0)" for k in ("deleted-records", "added-position-deletes", "added-equality-deletes")
        )
        + " > 0"
    ).collect()
    return bool(rows[0]["n"])


def rebuild(spark: SparkSession, settings: Settings, source: SourceConfig, table: str | None = None) -> list[dict[str, Any]]:
    """Replay, then compare every rebuilt table (and change log) with its live
    table; one report per table, ``equal`` true when they match."""
    rb = replay(spark, settings, source, table)
    live_ns, rb_ns = f"{settings.catalog_name}.{quote(source.namespace)}", f"{settings.catalog_name}.{quote(rb.namespace)}"
    views = {r["viewName"] for r in spark.sql(f"SHOW VIEWS IN {rb_ns}").collect()}
    names = sorted(
        r["tableName"] for r in spark.sql(f"SHOW TABLES IN {rb_ns}").collect() if not r["isTemporary"] and r["tableName"] not in views
    )
    reports = []
    for name in names:
        live_ident, rb_ident = f"{live_ns}.{quote(name)}", f"{rb_ns}.{quote(name)}"
        if not spark.catalog.tableExists(live_ident):
            reports.append({"table": name, "equal": False, "message": "rebuilt, but no live table of that name"})
            continue
        live, rebuilt = spark.table(live_ident), spark.table(rb_ident)
        is_log = bool(ledger.DERIVED_PROPERTIES & table_properties(spark, live_ident).keys())  # change log, history: no tombstones
        keys = None if is_log else existing_schema(spark, live_ident)[1]
        report = {"table": name, **compare(live, rebuilt, keys, not is_log and maintenance_purged(spark, live_ident))}
        log.info("rebuild %s: %s", name, report)
        reports.append(report)
    return reports
