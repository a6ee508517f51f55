"""One batch, end to end: decode -> order/compact -> MERGE on the audit branch
-> gate -> publish -> ledger.  Used by ``spark_jobs/apply_batch.py`` (spark-submit),
the CLI and the tests.

A batch is a set of archive files of one source.  Its id is derived from the
files' fingerprints, so the same files always form the same batch (and the
same audit branch).  Tables are independent: one table failing its gate or
its schema check does not stop the others; the batch is *complete* (its files
marked applied for discovery) only when every table published.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import logging
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from . import compact, gate, held, ledger, merge, tables
from .archive import ArchiveFile, list_files
from .config import Settings, SourceConfig, get_source
from .decode import DecodeContext
from .decode.debezium_common import UNTYPED_NOTE
from .decode_stage import decode_batch
from .errors import AlreadyAppliedFileChanged, CdcError, ConcurrentApply, ConfigError, TerminalError
from .model import CONFIG_REFUSED_PREFIX
from .results import BatchResult, Override, TableResult, reason_class

log = logging.getLogger("cdc_apply")
PRUNE_STATE_MAX_EVENTS = 2_000_000
PRUNE_STATE_MIN_RATIO = 4
"""A batch of at most ``PRUNE_STATE_MAX_EVENTS`` events of a table, into a
table of at least ``PRUNE_STATE_MIN_RATIO`` times as many live rows,
broadcasts its keys to keep only their stored rows before the labelling join
(``compact.label_against_target``): the join then shuffles the batch's share
of the table, not all of it (100k events against 10M rows: 2.6 -> 1.3 s).
A batch as large as the table gains nothing and pays the broadcast (1M
events into 1M rows: +2.6 s), and a very large batch's keys would weigh on
the driver: both join the whole stored state."""


STAGES = ("write", "validate", "publish")


def batch_id_for(source: str, files: list[ArchiveFile]) -> str:
    digest = hashlib.sha256("\n".join(f"{f.path}:{f.sha256}" for f in sorted(files)).encode()).hexdigest()[:16]
    return f"{source}_{digest}"


def pending_files(
    settings: Settings,
    source: SourceConfig,
    *,
    root: str | Path | None = None,
    until: dt.datetime | None = None,
    since: dt.datetime | None = None,
) -> list[ArchiveFile]:
    """Files of the source not yet applied (oldest first), under ``root``
    (default: the source's archive folder); refuses applied files that changed
    — by size (their recorded SHA-256 is reused while the size is unchanged),
    or by SHA-256 with ``CDC_VERIFY_APPLIED=sha256``."""
    records = ledger.applied_file_records(settings, source.name)
    known = records if settings.verify_applied == "size" else None
    files = list_files(source.archive_path(settings) if root is None else root, until=until, since=since, known=known)
    applied = ledger.sha256_by_path(records)
    changed = [f.path for f in files if f.path in applied and applied[f.path] != f.sha256]
    if changed:
        raise AlreadyAppliedFileChanged(
            f"{len(changed)} already-applied file(s) changed on disk since they were applied: {changed[:5]}. "
            "Archives are immutable: restore the original file, or move the new content to a new file name."
        )
    return [f for f in files if f.path not in applied]


def run_batch(
    settings: Settings,
    source_name: str,
    files: list[ArchiveFile] | None = None,
    *,
    spark: SparkSession | None = None,
    dry_run: bool = False,
    table_filter: str | None = None,
    max_files: int | None = None,
    stages: tuple[str, ...] = STAGES,
    override: Override | None = None,
) -> BatchResult:
    """Decode and write a batch onto audit branches, then (by default) validate,
    publish and record it.  ``stages=("write",)`` stops after the write: the
    DAG runs validate and publish per table as their own tasks on the saved
    result, then :func:`finish_batch`."""
    started = time.time()
    source = get_source(settings, source_name)
    if files is None:
        files = pending_files(settings, source)
    files = sorted(files)
    if max_files:
        files = files[:max_files]
    if not files:
        return BatchResult(batch_id=None, source=source.name, status="nothing-to-do", message="no pending files")
    batch_id = batch_id_for(source.name, files)
    result = BatchResult(
        batch_id=batch_id,
        source=source.name,
        status="dry-run" if dry_run else "complete",
        files=[f.as_dict() for f in files],
        override=asdict(override) if override else None,
    )
    log.info("batch %s: %d file(s) of source %s", batch_id, len(files), source.name)
    if override is not None:
        log.warning("batch %s: operator override %s", batch_id, override.describe())
    if override is not None and override.action == "skip":
        return skip_batch(settings, source, result, dry_run=dry_run)
    from .spark_session import get_spark

    spark = spark or get_spark(settings)
    state = ledger.latest_decoder_state(settings, source.name)
    ctx = DecodeContext(source=source.name, primary_keys=source.primary_keys, state=state, options=source.decode_options(), declared_types=source.columns)
    if source.format in ("debezium_postgres", "debezium_sqlserver"):  # they type schemaless messages by the stored tables
        t0 = time.time()
        ctx.stored_types = tables.stored_column_types(spark, settings.catalog_name, source.namespace)
        log.info("batch %s: column types of %d stored table(s) read in %.2f s", batch_id, len(ctx.stored_types), time.time() - t0)
    decoded, new_state = decode_batch(spark, [(f.path, f.size) for f in files], source.format, ctx)
    new_state = {**state, **new_state}
    apply_decoded(spark, settings, source, result, files, decoded, new_state, dry_run=dry_run, table_filter=table_filter)
    if not dry_run:
        if "validate" in stages and result.pending("written"):
            validate_batch(settings, result, spark)
        if "publish" in stages:
            publish_batch(settings, result)
            finish_batch(settings, result)
    result.seconds = round(time.time() - started, 3)
    return result


def skip_batch(settings: Settings, source: SourceConfig, result: BatchResult, *, dry_run: bool = False) -> BatchResult:
    """The operator's *skip*: the batch's files are marked applied without
    being applied (recorded with the reason), and the audit branches a failed
    attempt of the same batch left behind are dropped."""
    override = result.get_override()
    result.status = "dry-run" if dry_run else "skipped"
    result.message = f"{override.describe()}; {len(result.files)} file(s) marked applied without applying them"
    result.started_at = dt.datetime.now(dt.timezone.utc).isoformat()
    if not dry_run:
        dropped = ledger.drop_branches(settings, source.namespace, ledger.audit_branch(result.batch_id))
        if dropped:
            result.message += f"; dropped audit branch of {dropped}"
        ledger.record_batch(settings, result)
    log.warning("batch %s: %s", result.batch_id, result.message)
    return result


def apply_decoded(
    spark: SparkSession,
    settings: Settings,
    source: SourceConfig,
    result: BatchResult,
    files: list[ArchiveFile],
    decoded: DataFrame,
    decoder_state: dict | None = None,
    *,
    dry_run: bool = False,
    table_filter: str | None = None,
) -> BatchResult:
    """Everything after decode: accounting, quarantine, per-table apply, ledger.

    ``decoder_state`` is the source state carried to the next batch (decoder
    state plus truncate watermarks of tables not in the lake yet); None reads
    the latest from the ledger.
    """
    state = dict(ledger.latest_decoder_state(settings, source.name) if decoder_state is None else decoder_state)
    result.started_at = dt.datetime.now(dt.timezone.utc).isoformat()
    result.stage = "write"
    batch_id = result.batch_id
    branch = ledger.audit_branch(batch_id)
    # lines of partly applied files that an earlier batch accounted for are not read again
    decoded = held.only_held_lines(spark, decoded, held.prior_in_batch(state, files))
    decoded = decoded.persist()
    try:
        status_counts = {(r["status"], r["reason"]): r["n"] for r in decoded.groupBy("status", "reason").agg(F.count(F.lit(1)).alias("n")).collect()}
        messages = {"read": sum(status_counts.values())}
        for (status, reason), n in status_counts.items():
            messages[status] = messages.get(status, 0) + n
            if status != "event":
                key = f"{status}:{reason_class(reason)}"  # a short class; the detail is in the quarantine row
                messages[key] = messages.get(key, 0) + n
        result.messages = messages
        _refuse_config(source, status_counts, decoded)
        held_lines: dict[str, list[int]] = {}
        if messages.get("held"):  # a Spark job only when something is held
            for r in decoded.where("status = 'held'").select("file", "line").collect():
                held_lines.setdefault(r["file"], []).append(r["line"])
            result.held_files = sorted(held_lines)
        state[held.HELD_KEY] = held.carry(state, files, held_lines)
        if not state[held.HELD_KEY]:
            del state[held.HELD_KEY]
        quarantined = messages.get("quarantined", 0)
        if not dry_run and quarantined:
            _record_quarantine(spark, settings, source, batch_id, decoded)
        share = quarantined / messages["read"] if messages["read"] else 0.0
        if share > source.quarantine_max_share:
            check = f"quarantine_share(max={source.quarantine_max_share}, got={share:.4f})"
            msg = (
                f"{quarantined} of {messages['read']} messages quarantined ({share:.1%}) exceeds the limit "
                f"{source.quarantine_max_share:.1%} of source {source.name}; inspect "
                f"{settings.catalog_name}.{settings.audit_namespace}.quarantine WHERE batch_id = '{batch_id}'"
            )
            result.failed_checks.append(check)
            override = result.get_override()
            if override is not None and override.action == "force":
                log.warning("batch %s: %s -- %s", batch_id, msg, override.describe())
            else:
                result.status = "failed"
                result.message = msg
                return result

        events = decoded.where("status = 'event'")
        if table_filter:
            events = events.where(F.col("table_name").rlike(table_filter))
        table_meta = _table_meta(events)
        aliases, ambiguous = _fuller_names(table_meta)
        if aliases:  # one table under two names (rare): read as its fuller name, grouped again
            events = _rename_tables(events, aliases)
            table_meta = _table_meta(events)
        targets, refused, collisions = _targets(source, table_meta)
        collisions.update(ambiguous)
        if refused:
            _refuse_tables(spark, settings, source, result, events, refused, dry_run)
        for meta in sorted(table_meta, key=lambda r: (r["table_name"], r["schema_name"] or "")):
            ident = _identity(meta)
            if ident in refused:
                continue
            if ident in collisions:
                result.tables.append(TableResult(table=meta["table_name"], status="failed", message=f"ConfigError: {collisions[ident]}", terminal=True))
                continue
            tr = _apply_table(spark, settings, source, batch_id, branch, files, events, meta, dry_run, state, held_files=set(result.held_files), target=targets[ident])
            _count_keyless(result, tr)
            result.tables.append(tr)
        result.source_state = state
        result.fail_if_any()
    finally:
        decoded.unpersist()
    return result


def _refuse_config(source: SourceConfig, status_counts: dict[tuple[str, str], int], decoded: DataFrame) -> None:
    """Fail the batch once, terminally, when decoders refused messages for a
    configuration reason (``ConfigRefused``): one line per distinct reason
    (with its first file and line), nothing quarantined or applied, the files
    stay pending for after the fix."""
    refused = sorted((r, n) for (s, r), n in status_counts.items() if s == "quarantined" and (r or "").startswith(CONFIG_REFUSED_PREFIX))
    if refused:
        def first(reason: str) -> str:
            row = decoded.where(F.col("reason") == reason).select("file", "line").orderBy("file", "line").first()
            return f"{row['file']}:{row['line']}"

        lines = "; ".join(f"{n} message(s), first at {first(r)}: {r[len(CONFIG_REFUSED_PREFIX):]}" for r, n in refused[:5])
        more = f" (and {len(refused) - 5} more reasons)" if len(refused) > 5 else ""
        raise ConfigError(f"source {source.name}: the configuration does not fit its messages: {lines}{more}")
def _identity(meta: Any) -> str:
    return tables.source_identity(meta["database"], meta["schema_name"], meta["table_name"])


def _table_meta(events: DataFrame) -> list:
    """Per source table of the batch: declarations, keys and counts (one Spark job)."""
    return (
        events.groupBy("database", "schema_name", "table_name")
        .agg(
            F.collect_set("columns").alias("decl"),
            F.collect_set("key_columns").alias("keys"),
            F.count(F.lit(1)).alias("n"),
            F.bool_and(F.col("op") == "t").alias("only_truncates"),
            F.max(F.when(F.col("op") == "t", F.col("position"))).alias("max_truncate"),
            F.count(F.when(F.col("op") == "t", 1)).alias("truncates"),
            F.count(F.when((F.col("op") == "d") & F.col("change_id").isNotNull(), 1)).alias("keyed_deletes"),
            F.count(F.when(F.array_contains("notes", UNTYPED_NOTE), 1)).alias("untyped"),
        )
        .collect()
    )


def _fuller_names(table_meta: list) -> tuple[dict[str, str], dict[str, str]]:
    """Source tables named with less in some messages than in others (a
    CockroachDB topic without ``full_table_name`` gives neither database nor
    schema, an enriched ``source`` gives both): one table under two names.
    Returns the identities to read as their fuller name (the one fuller
    name of the batch they can be), and those that can be several tables
    (identity -> why, naming them), which are refused."""
    idents = {_identity(m) for m in table_meta}
    aliases: dict[str, str] = {}
    ambiguous: dict[str, str] = {}
    for ident in sorted(idents):
        fuller = [i for i in idents if i != ident and tables.same_table(ident, i) and tables.qualification(i) > tables.qualification(ident)]
        if not fuller:
            continue
        best = max(fuller, key=tables.qualification)
        if all(tables.same_table(best, i) for i in fuller) and sum(tables.qualification(i) == tables.qualification(best) for i in fuller) == 1:
            aliases[ident] = best
        else:
            names = sorted(tables.describe_identity(i) for i in fuller)
            ambiguous[ident] = (
                f"source table {tables.describe_identity(ident)} is named without its database or schema in some messages and "
                f"can be any of {names} of this batch: which one cannot be known; name tables fully in every message "
                "(CockroachDB: WITH full_table_name, or enriched_properties=source)"
            )
    return aliases, ambiguous


def _rename_tables(events: DataFrame, aliases: dict[str, str]) -> DataFrame:
    """Events of a less qualified name carry the fuller name (``_fuller_names``)."""
    db, schema = F.col("database"), F.col("schema_name")
    for partial, full in aliases.items():
        p_db, p_schema, table = json.loads(partial)
        f_db, f_schema, _ = json.loads(full)
        match = F.col("database").eqNullSafe(F.lit(p_db)) & F.col("schema_name").eqNullSafe(F.lit(p_schema)) & (F.col("table_name") == table)
        db = F.when(match, F.lit(f_db)).otherwise(db)
        schema = F.when(match, F.lit(f_schema)).otherwise(schema)
    return events.withColumns({"database": db, "schema_name": schema})


def _targets(source: SourceConfig, table_meta: list) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Per source table (``tables.source_identity``): its target name (a
    configured ``target``, else the table's own name), the tables refused
    (no valid Iceberg name: identity -> why) and those colliding with another
    source table of the batch on one target (identity -> why, naming both)."""
    targets: dict[str, str] = {}
    refused: dict[str, str] = {}
    for meta in table_meta:
        ident = _identity(meta)
        mapped = source.lookup(source.targets, meta["database"], meta["schema_name"], meta["table_name"])
        try:
            targets[ident] = mapped or tables.target_name(meta["table_name"])
        except ConfigError as exc:
            refused[ident] = f"refused table {tables.describe_identity(ident)}: {exc}"
    by_target: dict[str, list[str]] = {}
    for ident, target in targets.items():
        by_target.setdefault(target, []).append(ident)
    collisions = {}
    for target, idents in by_target.items():
        if len(idents) > 1:
            names = sorted(tables.describe_identity(i) for i in idents)
            for ident in idents:
                collisions[ident] = (
                    f"source tables {names} would all be written to {source.namespace}.{target}: two source tables never share a "
                    f"target; map each to its own with `tables: {{<schema>.<table>: {{target: <name>}}}}` in the sources file"
                )
    return targets, refused, collisions


def _refuse_tables(
    spark: SparkSession, settings: Settings, source: SourceConfig, result: BatchResult, events: DataFrame, refused: dict[str, str], dry_run: bool
) -> None:
    """Quarantine the events of refused tables (file, line, the event as JSON,
    the reason naming the table) so that the batch completes for the others;
    counted in the result and logged as a warning."""
    identity = None
    for ident in refused:
        db, schema, table = json.loads(ident)
        match = F.col("database").eqNullSafe(F.lit(db)) & F.col("schema_name").eqNullSafe(F.lit(schema)) & (F.col("table_name") == table)
        identity = (F.when if identity is None else identity.when)(match, F.lit(ident))
    reasons = F.create_map(*[x for ident, why in refused.items() for x in (F.lit(ident), F.lit(why))])
    rows = events.withColumn("_ident", identity).where(F.col("_ident").isNotNull())
    counts = {r["_ident"]: r["n"] for r in rows.groupBy("_ident").agg(F.count(F.lit(1)).alias("n")).collect()}
    total = sum(counts.values())
    m = result.messages
    m["event"] = m.get("event", 0) - total
    m["quarantined"] = m.get("quarantined", 0) + total
    m["quarantined:refused-table"] = m.get("quarantined:refused-table", 0) + total
    for ident, why in sorted(refused.items()):
        result.tables.append(TableResult(table=tables.describe_identity(ident), status="refused", counts={"quarantined": counts.get(ident, 0)}, message=why))
        log.warning("batch %s: %d message(s) quarantined: %s", result.batch_id, counts.get(ident, 0), why)
    result.message = f"{len(refused)} table(s) refused, their {total} message(s) quarantined: {sorted(refused.values())}"
    if dry_run:
        return
    ledger.ensure_audit_tables(settings)
    target = f"{settings.catalog_name}.{settings.audit_namespace}.{ledger.QUARANTINE_TABLE}"
    spark.sql(f"DELETE FROM {target} WHERE batch_id = {tables.sql_string(result.batch_id)} AND reason LIKE 'refused table %'")
    raw = F.to_json(F.struct("database", "schema_name", "table_name", "op", "key_columns", "position", "after", "before"))
    (
        rows.select(
            F.lit(result.batch_id).alias("batch_id"), F.lit(source.name).alias("source"), "file", "line",
            reasons[F.col("_ident")].alias("reason"), raw.alias("raw"), F.current_timestamp().alias("recorded_at"),
        )
        .writeTo(target)
        .append()
    )


def _record_quarantine(spark: SparkSession, settings: Settings, source: SourceConfig, batch_id: str, decoded: DataFrame) -> None:
    ledger.ensure_audit_tables(settings)
    target = f"{settings.catalog_name}.{settings.audit_namespace}.{ledger.QUARANTINE_TABLE}"
    spark.sql(f"DELETE FROM {target} WHERE batch_id = '{batch_id}'")  # a retry replaces, never doubles
    (
        decoded.where("status = 'quarantined'")
        .select(
            F.lit(batch_id).alias("batch_id"),
            F.lit(source.name).alias("source"),
            "file",
            "line",
            "reason",
            "raw",
            F.current_timestamp().alias("recorded_at"),
        )
        .writeTo(target)
        .append()
    )


def _table_spec(spark: SparkSession, settings: Settings, source: SourceConfig, meta: Any, target: str | None = None) -> tables.TableSpec | None:
    """The target's name, key and columns; None for a table that is not in the
    lake yet and whose batch holds nothing but truncates (nothing to create)."""
    name = meta["table_name"]
    ident = f"{settings.catalog_name}.{source.namespace}.{target or tables.target_name(name)}"
    declared = [[(c["name"], c["type"]) for c in cols] for cols in meta["decl"] if cols]
    columns, _ = tables.resolve_columns(declared, name)
    keysets = {tuple(k) for k in meta["keys"] if k}
    existing_cols, existing_key = ({}, [])
    if tables.table_exists(spark, ident):
        existing_cols, existing_key = tables.existing_schema(spark, ident)
        columns = {**existing_cols, **columns}
    configured = None
    for cand in (f"{meta['database']}.{meta['schema_name']}.{name}", f"{meta['schema_name']}.{name}", name):
        if cand in source.primary_keys:
            configured = source.primary_keys[cand]
            break
    if configured:
        key = list(configured)
    elif len(keysets) == 1:
        key = list(next(iter(keysets)))
    elif len(keysets) > 1:
        raise ConfigError(f"table {name}: messages disagree on the primary key {sorted(keysets)}; configure it in the sources file")
    elif existing_key:
        key = existing_key
    elif meta["only_truncates"]:
        return None
    else:
        raise ConfigError(
            f"table {name} of source {source.name} has no primary key in its messages: add "
            f"`tables: {{{name}: {{primary_key: [col, ...]}}}}` to source {source.name} in {settings.sources_file}"
        )
    missing = [k for k in key if k not in columns]
    if missing:
        raise ConfigError(f"table {name}: key column(s) {missing} are not among the message columns {list(columns)}")
    return tables.TableSpec(identifier=ident, short=ident.split(".", 1)[1], key_columns=key, columns=columns)


def _refuse_untyped(spark: SparkSession, settings: Settings, source: SourceConfig, meta: Any, events: DataFrame) -> None:
    """A table not in the lake yet whose messages carry no schema and have no
    declared column types cannot be created: refuse it, saying what to add."""
    name = meta["table_name"]
    if tables.table_exists(spark, f"{settings.catalog_name}.{source.namespace}.{tables.target_name(name)}"):
        return
    ev = events.where((F.col("table_name") == name) & F.col("schema_name").eqNullSafe(F.lit(meta["schema_name"])))
    cols = [r[0] for r in ev.select(F.explode(F.map_keys(F.map_concat("after", F.coalesce("before", F.create_map().cast("map<string,string>")))))).distinct().orderBy(1).collect()]
    qualified = f"{meta['schema_name']}.{name}" if meta["schema_name"] else name
    key = next((k for k in meta["keys"] if k), None) or next((source.primary_keys[n] for n in (f"{meta['database']}.{qualified}", qualified, name) if n in source.primary_keys), None)
    missing = "columns" if key else "primary_key and columns"
    declared = ", ".join(f"{c}: <type>" for c in cols) or "<column>: <type>, ..."
    raise ConfigError(
        f"table {qualified} of source {source.name}: {meta['untyped']} message(s) carry no schema (JsonConverter schemas.enable=false) "
        f"and the table is not in the lake yet, so its column types are unknown; missing in {settings.sources_file}: {missing}. Add to source {source.name}:\n"
        f"    tables:\n      {qualified}:\n        primary_key: [{', '.join(key) if key else '<key column>, ...'}]\n"
        f"        columns: {{{declared}}}\n"
        "with Spark types (int, decimal(12,2), date, timestamp_ntz, ...) or Debezium semantic types (io.debezium.time.MicroTimestamp, ...); "
        "or archive with a converter that writes the schema (value.converter.schemas.enable=true)."
    )


def _apply_table(
    spark: SparkSession,
    settings: Settings,
    source: SourceConfig,
    batch_id: str,
    branch: str,
    files: list[ArchiveFile],
    events: DataFrame,
    meta: Any,
    dry_run: bool,
    source_state: dict,
    held_files: set[str] | None = None,
    target: str | None = None,
) -> TableResult:
    name = meta["table_name"]
    tr = TableResult(table=name, status="failed")
    table_key = f"{meta['database']}.{meta['schema_name']}.{name}"
    truncates = source_state.setdefault("_cdc_truncates", {})
    try:
        if meta["untyped"]:
            _refuse_untyped(spark, settings, source, meta, events)
        spec = _table_spec(spark, settings, source, meta, target)
        if spec is None:
            # A truncate of a table we have never seen: nothing to remove, but
            # remember its position so older events arriving later stay out.
            pos = meta["max_truncate"]
            if not dry_run and (truncates.get(table_key) is None or pos > truncates[table_key]):
                truncates[table_key] = pos
            tr.status = "skipped"
            tr.counts = {"truncates": int(meta["n"])}
            tr.message = f"truncate at {pos} of a table not in the lake yet: watermark kept in the source state"
            return tr
        tr.table = spec.identifier
        ev = events.where(
            (F.col("table_name") == name)
            & F.col("schema_name").eqNullSafe(F.lit(meta["schema_name"]))
            & F.col("database").eqNullSafe(F.lit(meta["database"]))
        )
        exists = tables.table_exists(spark, spec.identifier)
        if exists:
            tables.check_source_table(spark, spec.identifier, _identity(meta), claim=not dry_run)
        led = ledger.read_table_ledger(settings, spec.short) if exists else None
        done = {p for p, sha in (led.files if led else {}).items()}
        for f in files:
            if f.path in done and led.files[f.path] != f.sha256:
                raise AlreadyAppliedFileChanged(f"{spec.identifier}: file {f.path} changed since it was applied (sha256 {led.files[f.path][:12]} -> {f.sha256[:12]})")
        new_files = [f for f in files if f.path not in done]
        if not new_files:
            tr.status = "skipped"
            tr.message = "every file of the batch is already applied to this table"
            return tr
        if len(new_files) < len(files):
            ev = ev.where(F.col("file").isin([f.path for f in new_files]))
        if dry_run:
            tr.status = "dry-run"
            tr.counts = {"events": ev.count()}
            return tr
        if not exists:
            tables.create_table(spark, spec, source.name, source.merge_mode, _identity(meta))
            tr.schema_changes.append("created table")
        else:
            tr.schema_changes += tables.evolve(spark, spec)
            if source.merge_mode:
                tr.schema_changes += tables.keep_merge_mode(spark, spec.identifier, source.merge_mode)
            if not tables.is_complete(spark, spec.identifier):  # a killed run left it half-made
                tables.finish_table(spark, spec)
                tr.schema_changes.append("finished a half-made table")

        if len(new_files) < len(files):  # some files were applied to this table already: count the rest
            truncs = ev.where("op = 't'").agg(F.max("position").alias("p"), F.count(F.lit(1)).alias("n")).collect()[0]
        else:
            truncs = {"p": meta["max_truncate"], "n": meta["truncates"]}
        truncated_at = max([p for p in (truncs["p"], led.truncated_at if led else None, truncates.get(table_key)) if p], default=None)
        rows = ev.where("op <> 't'")
        key_types = {k: spec.columns[k] for k in spec.key_columns}
        prepared = compact.prepare_events(rows, key_types)
        merge.reset_branch(spark, spec, branch)
        start_snapshot = merge.branch_snapshot(spark, spec, branch)
        main_df = merge.read_branch(spark, spec, "main")
        if truncs["n"]:
            merge.apply_truncate(spark, spec, branch, truncs["p"])
        moved = None
        if meta["keyed_deletes"]:  # a primary-key change is a delete and an insert sharing a change_id
            prepared, moved = compact.inherit_moved_columns(prepared, merge.read_branch(spark, spec, branch), spec.key_columns, spec.columns)
        labelled = compact.label_duplicates(prepared, spec.key_columns)
        state = merge.read_branch(spark, spec, branch).select(
            *[compact.quote(k) for k in spec.key_columns], "_cdc_position", "_cdc_deleted", "_cdc_col_pos"
        )
        base_live = merge.read_branch(spark, spec, branch).where("NOT _cdc_deleted").count()
        n_events = int(meta["n"])
        prune = n_events <= PRUNE_STATE_MAX_EVENTS and n_events * PRUNE_STATE_MIN_RATIO <= base_live
        labelled = compact.label_against_target(labelled, state, spec.key_columns, truncated_at, prune_state=prune).persist()
        folded = compact.fold_per_key(labelled, spec.key_columns).persist()
        try:
            counts, tr.position_min, tr.position_max, null_keys, key_ranges = compact.accounting(labelled, folded, spec.key_columns, len(spec.columns))
            keyless = 0
            if null_keys:  # rare: quarantine them, apply the rest (a missing key never blocks the source)
                keyless = _quarantine_keyless(spark, settings, source, batch_id, spec, rows, key_types)
                labelled.unpersist()
                folded.unpersist()
                prepared = prepared.where(~compact.null_key_filter(spec.key_columns))
                labelled = compact.label_against_target(
                    compact.label_duplicates(prepared, spec.key_columns), state, spec.key_columns, truncated_at, prune_state=prune
                ).persist()
                folded = compact.fold_per_key(labelled, spec.key_columns).persist()
                counts, tr.position_min, tr.position_max, _, key_ranges = compact.accounting(labelled, folded, spec.key_columns, len(spec.columns))
                counts["quarantined"] = keyless
                if keyless > source.quarantine_max_share * n_events:
                    tr.failed_expectations.append(f"null_key_share(max={source.quarantine_max_share}, got={keyless / n_events:.4f}, events={keyless})")
            counts["truncates"] = int(truncs["n"])
            if moved is not None:
                counts["key_changes_inherited"] = moved.count()
                moved.unpersist()
            if counts.get("partial_inserts"):
                log.warning(
                    "%s: %d insert(s) leave columns out and the delete half of their primary-key change is not in this batch: "
                    "those columns are NULL until a later event carries them", spec.identifier, counts["partial_inserts"])
            if counts["conflicts"]:
                tr.failed_expectations.append(_conflict_check(labelled, spec.key_columns, counts["conflicts"]))
            tr.counts = counts
            if truncs["p"] and (tr.position_max is None or truncs["p"] > tr.position_max):
                tr.position_max = truncs["p"]
            # a file with held messages is not applied to the table until they are (held.py)
            applied = [f.as_dict() for f in new_files if f.path not in (held_files or ())]
            props = ledger.summary_properties(batch_id, applied, position_max=tr.position_max, truncated_at=truncated_at, counts=counts)
            attempt = props[ATTEMPT_PROPERTY] = uuid.uuid4().hex  # which run wrote the branch head (runs of one batch share the branch)
            with merge.snapshot_properties(spark, props):
                source_df = compact.merge_source(folded, spec.key_columns, spec.columns)
                merge.merge_changes(spark, spec, branch, source_df, batch_id, key_ranges)
                if merge.branch_snapshot(spark, spec, branch) == start_snapshot or truncs["n"]:
                    merge.ledger_commit(spark, spec, branch)
            tr.branch = branch
            tr.branch_snapshot = _own_head(spark, spec, branch, attempt, batch_id)
            tr.key_columns = spec.key_columns
            # reconciliation needs the folded batch: computed now, judged by the gate
            tr.failed_expectations += gate.reconcile(_read_snapshot(spark, spec, tr.branch_snapshot), base_live, folded, spec.key_columns, counts, main_df)
            tr.status = "written"
        finally:
            labelled.unpersist()
            folded.unpersist()
    except TerminalError as exc:
        tr.message = f"{type(exc).__name__}: {exc}"
        tr.terminal = True
    except CdcError as exc:
        tr.message = str(exc)
        tr.terminal = False
    except Exception as exc:  # a Spark / catalog failure: may be transient
        log.exception("table %s failed", name)
        tr.message = concurrent_apply_message(exc, tr.table, batch_id, branch) or f"{type(exc).__name__}: {str(exc)[:2000]}"
        tr.terminal = False
    return tr


def _quarantine_keyless(
    spark: SparkSession, settings: Settings, source: SourceConfig, batch_id: str, spec: tables.TableSpec, rows: DataFrame, key_types: dict[str, str]
) -> int:
    """Quarantine the events of a table whose key has no value (absent or
    NULL): the row they change cannot be known. Each with its file, line, the event as JSON and a reason
    naming the table and key; the table applies the rest. Returns how many."""
    missing = functools.reduce(lambda a, b: a | b, [compact.typed_value(compact.key_text(k), t).isNull() for k, t in key_types.items()])
    types = ", ".join(f"{k} {t}" for k, t in key_types.items())
    reason = f"null key: {spec.short}: the event has no value for key column(s) ({types}) (absent or NULL)"
    raw = F.to_json(F.struct("database", "schema_name", "table_name", "op", "key_columns", "position", "after", "before"))
    bad = rows.where(missing).select(
        F.lit(batch_id).alias("batch_id"), F.lit(source.name).alias("source"), "file", "line", F.lit(reason).alias("reason"), raw.alias("raw"),
        F.current_timestamp().alias("recorded_at"),
    ).persist()
    try:
        n = bad.count()
        ledger.ensure_audit_tables(settings)
        target = f"{settings.catalog_name}.{settings.audit_namespace}.{ledger.QUARANTINE_TABLE}"
        spark.sql(f"DELETE FROM {target} WHERE batch_id = {tables.sql_string(batch_id)} AND reason = {tables.sql_string(reason)}")  # a retry replaces
        bad.writeTo(target).append()
    finally:
        bad.unpersist()
    log.warning("batch %s: %d event(s) of %s quarantined: %s", batch_id, n, spec.identifier, reason)
    return n


def _count_keyless(result: BatchResult, tr: TableResult) -> None:
    """A table's events quarantined for a missing key move from ``event`` to
    ``quarantined`` in the batch's message accounting."""
    n = (tr.counts or {}).get("quarantined", 0) if tr.status == "written" else 0
    if n:
        m = result.messages
        m["event"] = m.get("event", 0) - n
        m["quarantined"] = m.get("quarantined", 0) + n
        m["quarantined:null-key"] = m.get("quarantined:null-key", 0) + n


def _conflict_check(labelled: DataFrame, key_columns: list[str], n: int) -> str:
    """The failed check for events of one key at one position whose contents
    differ: the gate refuses the table (nothing of the key at that position
    is applied) until the source is fixed, or an operator forces or skips."""
    rows = (
        labelled.where(F.col("_cdc_label") == compact.CONFLICT)
        .select(*[compact.quote(k) for k in key_columns], compact.META_POS, "_cdc_file", "_cdc_line")
        .limit(5)
        .collect()
    )
    where = "; ".join(
        f"key {tuple(r[k] for k in key_columns)} position {r[compact.META_POS]} at {r['_cdc_file']}:{r['_cdc_line']}" for r in rows
    )
    return f"equal_position_conflict(events={n}: different events of one key at one source position, not applied; e.g. {where})"


ATTEMPT_PROPERTY = ledger.PREFIX + "attempt-id"


def _own_head(spark: SparkSession, spec: tables.TableSpec, branch: str, attempt: str, batch_id: str) -> int:
    """The branch head, checked to be this run's own commit (its attempt id in
    the snapshot summary): another run of the batch may have reset the branch."""
    head = merge.branch_snapshot(spark, spec, branch)
    rows = [] if head is None else spark.sql(f"SELECT summary['{ATTEMPT_PROPERTY}'] AS a FROM {spec.identifier}.snapshots WHERE snapshot_id = {int(head)}").collect()
    if not rows or rows[0]["a"] != attempt:
        raise ConcurrentApply(
            f"another run is applying batch {batch_id} to {spec.identifier} at the same time (the head {head} of branch {branch!r} "
            "is not this run's write); retry: the retry applies what is left, exactly once"
        )
    return int(head)


def _read_snapshot(spark: SparkSession, spec: tables.TableSpec, snapshot_id: int) -> DataFrame:
    return spark.sql(f"SELECT * FROM {spec.identifier} VERSION AS OF {int(snapshot_id)}")


_CONCURRENT = ("ConcurrentApply", "ValidationException", "CommitFailedException", "CommitStateUnknownException", "Found conflicting files")


def concurrent_apply_message(exc: BaseException, table: str, batch_id: str, branch: str) -> str | None:
    """The clear, transient message of a failure that means another run is
    applying the same batch: Iceberg's optimistic concurrency let the other
    run's commit (or its reset of the shared audit branch) win.  None for
    any other failure."""
    text = f"{type(exc).__name__}: {exc}"
    if any(marker in text for marker in _CONCURRENT) or branch in text:
        return (
            f"{ConcurrentApply.__name__}: another run is applying batch {batch_id} to {table} at the same time "
            f"(its commit on branch {branch!r} won: {text.splitlines()[0][:300]}); retry: the retry applies what is left, exactly once"
        )
    return None


def validate_batch(settings: Settings, result: BatchResult, spark: SparkSession | None = None, table: str | None = None) -> BatchResult:
    """The gate: GX suites (generated + user) and the write stage's
    reconciliation, on each written table's audit branch (or only ``table``'s).
    An operator's *force* override lets failed checks through, logged."""
    from .spark_session import get_spark

    result.stage = "validate"
    override = result.get_override()
    for tr in result.tables:
        if tr.status != "written" or (table is not None and tr.table != table):
            continue
        spark = spark or get_spark(settings)
        spec = tables.TableSpec(identifier=tr.table, short=tr.table.split(".", 1)[1], key_columns=tr.key_columns, columns={})
        try:
            if tr.branch_snapshot is not None and merge.branch_snapshot(spark, spec, tr.branch) != tr.branch_snapshot:
                raise ConcurrentApply(f"branch {tr.branch!r} moved from snapshot {tr.branch_snapshot} (this run's write)")
            branch_df = merge.read_branch(spark, spec, tr.branch) if tr.branch_snapshot is None else _read_snapshot(spark, spec, tr.branch_snapshot)
            gx_result = gate.run_gx(settings, branch_df, tr.table, tr.key_columns, result.batch_id)
        except Exception as exc:  # GX or Spark broke, or another run took the branch: not a data verdict, may be retried
            log.exception("validation of %s failed to run", tr.table)
            tr.status, tr.terminal = "failed", False
            tr.message = concurrent_apply_message(exc, tr.table, result.batch_id, tr.branch or "") or f"validation could not run: {type(exc).__name__}: {str(exc)[:2000]}"
            continue
        tr.data_docs = gx_result.data_docs
        log.info("%s: data docs %s", tr.table, gx_result.data_docs)
        failed = tr.failed_expectations + gx_result.failed
        tr.failed_expectations = failed
        if failed and override is not None and override.action == "force":
            tr.status = "validated"
            tr.override = f"{override.describe()}; failed checks let through: {failed}"
            log.warning("%s: %s", tr.table, tr.override)
        elif failed:
            tr.status, tr.terminal = "failed", True
            tr.message = (
                f"GateFailed: batch {result.batch_id} failed {len(failed)} check(s): {failed}; main is untouched, "
                f"inspect branch '{tr.branch}' (SELECT * FROM {tr.table} VERSION AS OF '{tr.branch}'), data docs {tr.data_docs}"
            )
            log.error("%s: %s", tr.table, tr.message)
        else:
            tr.status = "validated"
    result.fail_if_any()
    return result


def publish_batch(settings: Settings, result: BatchResult, table: str | None = None) -> BatchResult:
    """Fast-forward main to each validated branch (or only ``table``'s) with
    pyiceberg: no Spark needed."""
    result.stage = "publish"
    catalog = None
    for tr in result.tables:
        if tr.status != "validated" or (table is not None and tr.table != table):
            continue
        catalog = catalog or ledger.load_catalog(settings)
        try:
            tr.snapshot_id = ledger.fast_forward(catalog, tr.table.split(".", 1)[1], tr.branch, expected_head=tr.branch_snapshot)
            tr.status = "published"
            log.info("%s: published batch %s as snapshot %s", tr.table, result.batch_id, tr.snapshot_id)
        except CdcError as exc:
            tr.status, tr.terminal, tr.message = "failed", False, str(exc)
        except Exception as exc:  # a lost commit race (pyiceberg's CommitFailedException): transient
            msg = concurrent_apply_message(exc, tr.table, result.batch_id, tr.branch)
            if msg is None:
                raise
            tr.status, tr.terminal, tr.message = "failed", False, msg
    result.fail_if_any()
    return result


def finish_batch(settings: Settings, result: BatchResult) -> BatchResult:
    """Close the attempt: the batch is *complete* (its files applied for
    discovery) only when every table published or skipped; record the ledger
    rows of every table and of the batch."""
    if result.status in ("nothing-to-do", "dry-run", "skipped"):
        return result
    result.stage = "finish"
    catalog = None
    for t in result.tables:
        if t.status == "validated" and t.branch:  # its publish may have committed, then died before saving its result
            catalog = catalog or ledger.load_catalog(settings)
            snap = ledger.published_snapshot(catalog, t.table.split(".", 1)[1], result.batch_id)
            if snap is not None:
                t.status, t.snapshot_id = "published", snap
                log.warning("%s: found batch %s on main (snapshot %s): published by an attempt that did not save its result", t.table, result.batch_id, snap)
    unfinished = [t for t in result.tables if t.status in ("written", "validated")]
    for t in unfinished:
        t.message = f"stopped after the {t.status} stage: its next stage did not run or did not finish"
        t.status, t.terminal = "failed", False
    result.fail_if_any()
    if result.status != "failed":
        result.status = "complete"
        forced = [t.table for t in result.tables if t.override]
        if result.failed_checks or forced:
            result.message = f"{result.get_override().describe()}; let through: {result.failed_checks + forced}"
    ledger.record_batch(settings, result)
    return result
