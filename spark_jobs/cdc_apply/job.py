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
import hashlib
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from . import compact, gate, ledger, merge, tables
from .archive import ArchiveFile, list_files
from .config import Settings, SourceConfig, get_source
from .decode import DecodeContext
from .decode.debezium_common import UNTYPED_NOTE
from .decode_stage import decode_batch
from .errors import AlreadyAppliedFileChanged, CdcError, ConfigError, TerminalError
from .results import BatchResult, Override, TableResult

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
    ctx = DecodeContext(source=source.name, primary_keys=source.primary_keys, state=state, declared_types=source.columns)
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
    decoded = decoded.persist()
    try:
        status_counts = {(r["status"], r["reason"]): r["n"] for r in decoded.groupBy("status", "reason").agg(F.count(F.lit(1)).alias("n")).collect()}
        messages = {"read": sum(status_counts.values())}
        for (status, reason), n in status_counts.items():
            messages[status] = messages.get(status, 0) + n
            if status != "event":
                messages[f"{status}:{reason}"] = n
        result.messages = messages
        if messages.get("held"):  # a Spark job only when something is held
            result.held_files = sorted(r["file"] for r in decoded.where("status = 'held'").select("file").distinct().collect())
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
        table_meta = (
            events.groupBy("database", "schema_name", "table_name")
            .agg(
                F.collect_set("columns").alias("decl"),
                F.collect_set("key_columns").alias("keys"),
                F.count(F.lit(1)).alias("n"),
                F.bool_and(F.col("op") == "t").alias("only_truncates"),
                F.max(F.when(F.col("op") == "t", F.col("position"))).alias("max_truncate"),
                F.count(F.when(F.col("op") == "t", 1)).alias("truncates"),
                F.count(F.when(F.array_contains("notes", UNTYPED_NOTE), 1)).alias("untyped"),
            )
            .collect()
        )
        for meta in sorted(table_meta, key=lambda r: (r["table_name"], r["schema_name"] or "")):
            tr = _apply_table(spark, settings, source, batch_id, branch, files, events, meta, dry_run, state)
            result.tables.append(tr)
        result.source_state = state
        result.fail_if_any()
    finally:
        decoded.unpersist()
    return result


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


def _table_spec(spark: SparkSession, settings: Settings, source: SourceConfig, meta: Any) -> tables.TableSpec | None:
    """The target's name, key and columns; None for a table that is not in the
    lake yet and whose batch holds nothing but truncates (nothing to create)."""
    name = meta["table_name"]
    ident = f"{settings.catalog_name}.{source.namespace}.{tables.target_name(name)}"
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
) -> TableResult:
    name = meta["table_name"]
    tr = TableResult(table=name, status="failed")
    table_key = f"{meta['database']}.{meta['schema_name']}.{name}"
    truncates = source_state.setdefault("_cdc_truncates", {})
    try:
        if meta["untyped"]:
            _refuse_untyped(spark, settings, source, meta, events)
        spec = _table_spec(spark, settings, source, meta)
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
            tables.create_table(spark, spec, source.name, source.merge_mode)
            tr.schema_changes.append("created table")
        else:
            tr.schema_changes += tables.evolve(spark, spec)
            if source.merge_mode:
                tr.schema_changes += tables.keep_merge_mode(spark, spec.identifier, source.merge_mode)

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
        labelled = compact.label_duplicates(prepared, spec.key_columns)
        if truncs["n"]:
            merge.apply_truncate(spark, spec, branch, truncs["p"])
        state = merge.read_branch(spark, spec, branch).select(*[compact.quote(k) for k in spec.key_columns], "_cdc_position", "_cdc_deleted")
        base_live = merge.read_branch(spark, spec, branch).where("NOT _cdc_deleted").count()
        n_events = int(meta["n"])
        prune = n_events <= PRUNE_STATE_MAX_EVENTS and n_events * PRUNE_STATE_MIN_RATIO <= base_live
        labelled = compact.label_against_target(labelled, state, spec.key_columns, truncated_at, prune_state=prune).persist()
        folded = compact.fold_per_key(labelled, spec.key_columns).persist()
        try:
            counts, tr.position_min, tr.position_max, null_keys, key_ranges = compact.accounting(labelled, folded, spec.key_columns)
            if null_keys:  # before anything is merged: the branch is reset by the next attempt
                raise ConfigError(f"{spec.identifier}: {null_keys} event(s) carry no value for key column(s) {spec.key_columns}")
            counts["truncates"] = int(truncs["n"])
            tr.counts = counts
            if truncs["p"] and (tr.position_max is None or truncs["p"] > tr.position_max):
                tr.position_max = truncs["p"]
            props = ledger.summary_properties(batch_id, [f.as_dict() for f in new_files], position_max=tr.position_max, truncated_at=truncated_at, counts=counts)
            with merge.snapshot_properties(spark, props):
                source_df = compact.merge_source(folded, spec.key_columns, spec.columns)
                merge.merge_changes(spark, spec, branch, source_df, batch_id, key_ranges)
                if merge.branch_snapshot(spark, spec, branch) == start_snapshot or truncs["n"]:
                    merge.ledger_commit(spark, spec, branch)
            tr.branch = branch
            tr.key_columns = spec.key_columns
            # reconciliation needs the folded batch: computed now, judged by the gate
            tr.failed_expectations = gate.reconcile(merge.read_branch(spark, spec, branch), base_live, folded, spec.key_columns, counts, main_df)
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
        tr.message = f"{type(exc).__name__}: {str(exc)[:2000]}"
        tr.terminal = False
    return tr


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
            gx_result = gate.run_gx(settings, merge.read_branch(spark, spec, tr.branch), tr.table, tr.key_columns, result.batch_id)
        except Exception as exc:  # GX or Spark broke: not a data verdict, may be retried
            log.exception("validation of %s failed to run", tr.table)
            tr.status, tr.terminal = "failed", False
            tr.message = f"validation could not run: {type(exc).__name__}: {str(exc)[:2000]}"
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
            tr.snapshot_id = ledger.fast_forward(catalog, tr.table.split(".", 1)[1], tr.branch)
            tr.status = "published"
            log.info("%s: published batch %s as snapshot %s", tr.table, result.batch_id, tr.snapshot_id)
        except CdcError as exc:
            tr.status, tr.terminal, tr.message = "failed", False, str(exc)
    result.fail_if_any()
    return result


def finish_batch(settings: Settings, result: BatchResult) -> BatchResult:
    """Close the attempt: the batch is *complete* (its files applied for
    discovery) only when every table published or skipped; record the ledger
    rows of every table and of the batch."""
    if result.status in ("nothing-to-do", "dry-run", "skipped"):
        return result
    result.stage = "finish"
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
