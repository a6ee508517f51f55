"""One table's share of a batch: from its decoded events to a written audit
branch (status ``written``), or a ``TableResult`` that says why not.

In order: the target (name, key, columns); the batch's files not yet applied
to this table (exactly once); create or evolve the table; order, label and
fold the events (``compact``); MERGE them onto the audit branch (``merge``);
reconcile what was written with what was folded (judged later by the gate).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_apply import ledger
from cdc_apply.apply import branches, changelog, compact, gate, history, merge, quarantine, tables
from cdc_apply.archive.files import ArchiveFile
from cdc_apply.config import Settings, SourceConfig
from cdc_apply.errors import CdcError, ConfigError, TerminalError
from cdc_apply.results import TableResult
from cdc_apply.runtime import session, spark_conf
from cdc_apply.runtime.background import Background
from cdc_apply.runtime.session import described
from cdc_apply.status import Status

log = logging.getLogger("cdc_apply")

PRUNE_STATE_MIN_RATIO = 4
"""A batch of at most ``compact.BROADCAST_ROWS_MAX`` events of a table, into a
table of at least ``PRUNE_STATE_MIN_RATIO`` times as many live rows,
broadcasts its keys to keep only their stored rows before the labelling join
(``compact.label_against_target``): the join then shuffles the batch's share
of the table, not all of it (100k events against 10M rows: 2.6 -> 1.3 s).
A batch as large as the table gains nothing and pays the broadcast (1M
events into 1M rows: +2.6 s), and a large batch's keys would weigh on
the driver's heap: both join the whole stored state."""

KEY_SPANS_MIN_ROWS = 2_000_000
"""A pruned batch (``PRUNE_STATE_MIN_RATIO``) into a table of at least this
many live rows reads only the stored state of its keys' spans
(``within_key_spans``).  Finding the spans is one more small Spark job
(~0.4-0.9 s wall on two cores); reading a 1M-row table's state costs about
that, a 10M-row table's ~3 s (bench/README, issue 20 step 51)."""

TRUNCATES_KEY = "_cdc_truncates"
"""Source-state entry: ``{"<db>.<schema>.<table>": position}`` of truncates
of tables not in the lake yet, so that older events arriving later stay out."""


@dataclass
class TableWork:
    """What one table's apply takes from its batch."""

    spark: SparkSession
    settings: Settings
    source: SourceConfig
    batch_id: str
    files: list[ArchiveFile]
    source_state: dict[str, Any]
    """Carried to the next batch; the truncate watermarks are kept here."""
    held_files: frozenset[str] = field(default_factory=frozenset)
    """Files with held messages: not recorded as applied to any table yet."""
    dry_run: bool = False
    gate_ahead: gate.GateAhead | None = None
    """Set when the same job validates: each written table's GX suites start
    at once, beside its reconciliation."""

    @property
    def branch(self) -> str:
        return ledger.audit_branch(self.batch_id)


def source_identity(meta: Any) -> str:
    """The source table of a batch's table group (``tables.source_identity``)."""
    return tables.source_identity(meta["database"], meta["schema_name"], meta["table_name"])


def apply_table(work: TableWork, events: DataFrame, meta: Any, target: str | None = None) -> TableResult:
    """Write one source table's events (``meta``: its group of the batch) onto
    the audit branch.  Failures become the result's status: terminal for data
    and configuration (no retry helps), transient otherwise."""
    tr = TableResult(table=meta["table_name"], status=Status.FAILED)
    try:
        _apply(work, events, meta, target, tr)
    except TerminalError as exc:
        tr.message = f"{type(exc).__name__}: {exc}"
        tr.terminal = True
    except CdcError as exc:
        tr.message = str(exc)
        tr.terminal = False
    except Exception as exc:  # a Spark / catalog failure: may be transient
        log.exception("table %s failed", meta["table_name"])
        tr.message = (
            branches.concurrent_apply_message(exc, tr.table, work.batch_id, work.branch) or f"{type(exc).__name__}: {str(exc)[:2000]}"
        )
        tr.terminal = False
    return tr


def _apply(work: TableWork, events: DataFrame, meta: Any, target: str | None, tr: TableResult) -> None:
    spark, started = work.spark, time.perf_counter()
    if meta["untyped"]:
        refuse_untyped(spark, work.settings, work.source, meta, events)
    spec = table_spec(spark, work.settings, work.source, meta, target)
    if spec is None:
        _keep_truncate_watermark(work, meta, tr)
        return
    tr.table = spec.identifier
    ev = events.where(
        (F.col("table_name") == meta["table_name"])
        & F.col("schema_name").eqNullSafe(F.lit(meta["schema_name"]))
        & F.col("database").eqNullSafe(F.lit(meta["database"]))
    )
    exists = tables.table_exists(spark, spec.identifier)
    if exists:
        tables.check_source_table(spark, spec.identifier, source_identity(meta), claim=not work.dry_run)
    led = ledger.Ledger(work.settings).table_ledger(spec.short) if exists else None
    new_files = ledger.not_yet_applied(work.files, led.files if led else {}, spec.identifier)
    if not new_files:
        tr.status = Status.SKIPPED
        tr.message = "every file of the batch is already applied to this table"
        return
    partly = len(new_files) < len(work.files)
    if partly:
        ev = ev.where(F.col("file").isin([f.path for f in new_files]))
    if work.dry_run:
        tr.status = Status.DRY_RUN
        tr.counts = {"events": ev.count()}
        return
    tr.schema_changes += _create_or_evolve(work, spec, exists, meta)
    tr.seconds["setup"] = round(time.perf_counter() - started, 3)
    truncs = _truncates(ev, meta, partly)
    watermark = work.source_state.setdefault(TRUNCATES_KEY, {}).get(_table_key(meta))
    truncated_at = max([p for p in (truncs["p"], led.truncated_at if led else None, watermark) if p], default=None)
    properties = tables.table_properties(spark, spec.identifier)  # as created or evolved above
    tr.schema_changes += tables.keep_row_groups(spark, spec.identifier, properties)
    with spark_conf.table_conf(spark, work.settings, tables.recorded_live_rows(properties) if exists else 0):
        # the change log's append runs beside the labelling: it must commit before the table's MERGE
        log_write = (
            Background(spark, lambda: _write_changelog(work, spec, ev, new_files, tr), "changelog") if work.source.changelog else None
        )
        try:
            if work.source.lookup(work.source.history, meta["database"], meta["schema_name"], meta["table_name"]):
                if log_write:
                    log_write.result()
                with _phase(spark, tr, "history"):
                    tr.history, tr.history_snapshot = history.write(work, spec, new_files, tr.changelog_snapshot, watermark) or (None, None)
            _write(work, spec, ev.where("op <> 't'"), meta, properties, truncs, truncated_at, new_files, tr, led, log_write)
        finally:
            if log_write:
                log_write.wait()
    log.info("%s: written (%s)", spec.identifier, tr.describe_seconds())


def within_key_spans(state: DataFrame, events: DataFrame, spec: tables.TableSpec) -> DataFrame:
    """The stored ``state`` of the spans of the batch's leading key values
    (``merge.key_spans``): Iceberg then skips the data files whose key
    bounds miss them, and a small batch into a large table reads its keys'
    share of the stored state, not all of it (100k events into 10M rows:
    bench/README, issue 20 step 51).  Each of the batch's keys is in a span,
    so no stored row of theirs is left out; the labelling's join drops the
    others anyway."""
    k = spec.key_columns[0]
    condition = merge.key_ranges_filter(spec, *[{k: span} for span in merge.key_spans(events, k, spec.columns[k])])
    return state.where(condition) if condition else state


def _truncates(ev: DataFrame, meta: Any, partly: bool) -> Any:
    """The table's truncates in the batch: highest position ``p``, count ``n``
    and latest commit ``us`` (µs), from the decode's census (``meta``), or
    counted again when some files were applied to this table already."""
    if not partly:
        return {"p": meta["max_truncate"], "n": meta["truncates"], "us": meta["max_commit_us"]}
    return ev.agg(
        F.max(F.when(F.col("op") == "t", F.col("position"))).alias("p"),
        F.count(F.when(F.col("op") == "t", 1)).alias("n"),
        F.unix_micros(F.max("commit_ts")).alias("us"),
    ).collect()[0]


def _write_changelog(work: TableWork, spec: tables.TableSpec, events: DataFrame, files: list[ArchiveFile], tr: TableResult) -> None:
    with _phase(work.spark, tr, "changelog"):
        tr.changelog, tr.changelog_snapshot = changelog.write(work, spec, events, files) or (None, None)


@contextmanager
def _phase(spark: SparkSession, tr: TableResult, phase: str) -> Iterator[None]:
    """A phase of the table's apply: timed into ``tr.seconds`` and its Spark
    jobs named ``<table>: <phase>`` in the Spark UI."""
    with tr.timed(phase), described(spark, f"{tr.table}: {phase}"):
        yield


def _table_key(meta: Any) -> str:
    return f"{meta['database']}.{meta['schema_name']}.{meta['table_name']}"


def _keep_truncate_watermark(work: TableWork, meta: Any, tr: TableResult) -> None:
    """A truncate of a table we have never seen: nothing to remove, but
    remember its position so older events arriving later stay out."""
    pos, key = meta["max_truncate"], _table_key(meta)
    truncates = work.source_state.setdefault(TRUNCATES_KEY, {})
    if not work.dry_run and (truncates.get(key) is None or pos > truncates[key]):
        truncates[key] = pos
    tr.status = Status.SKIPPED
    tr.counts = {"truncates": int(meta["n"])}
    tr.message = f"truncate at {pos} of a table not in the lake yet: watermark kept in the source state"


def _create_or_evolve(work: TableWork, spec: tables.TableSpec, exists: bool, meta: Any) -> list[str]:
    """Create the table, or evolve it to the batch's columns (and finish one a
    killed run left half-made); returns the schema changes made."""
    spark, source = work.spark, work.source
    if not exists:
        fixed = None if source.merge_mode == "auto" else source.merge_mode
        tables.create_table(spark, spec, source.name, fixed, source_identity(meta))
        return ["created table"]
    changes = tables.evolve(spark, spec)
    if source.merge_mode != "auto":
        changes += tables.keep_merge_mode(spark, spec.identifier, source.merge_mode)
    if not tables.is_complete(spark, spec.identifier):  # a killed run left it half-made
        tables.finish_table(spark, spec)
        changes.append("finished a half-made table")
    return changes


def _write(
    work: TableWork,
    spec: tables.TableSpec,
    rows: DataFrame,
    meta: Any,
    properties: dict[str, str],
    truncs: Any,
    truncated_at: str | None,
    new_files: list[ArchiveFile],
    tr: TableResult,
    prior: ledger.TableLedger | None = None,
    log_write: Background[None] | None = None,
) -> None:
    """Order, label and fold the row events; MERGE them onto a fresh audit
    branch with the ledger properties; reconcile.  ``properties``: the
    table's, as ``_apply`` read them.  ``log_write``: the change
    log's append, waited for before the MERGE (a failed one fails the table
    before it is written).  Long because the net changes are persisted for
    exactly this span."""
    spark, branch = work.spark, work.branch
    prepared = compact.prepare_events(rows, {k: spec.columns[k] for k in spec.key_columns})
    start_snapshot = branches.reset_branch_for(spark, spec, branch, new_files, prior, work.settings, work.batch_id)
    # main as this branch was cut from it: another run may publish meanwhile (its
    # newer positions are no regression of this batch; the fast-forward refuses it)
    main_df = read_snapshot(spark, spec, start_snapshot) if start_snapshot is not None else branches.read_branch(spark, spec, "main")
    attempt = uuid.uuid4().hex  # on every commit of this run's write: branches.own_head checks the branch holds only them
    if truncs["n"]:
        # the rows it leaves may have columns unset (merge.apply_truncate), which a key change's old key fills
        tr.schema_changes += tables.mark_partial_rows(spark, spec.identifier, properties)
        properties = {**properties, tables.PARTIAL_ROWS_PROPERTY: "true"}  # as the table has it now
        merge.apply_truncate(spark, spec, branch, truncs["p"], work.batch_id)
        # a delete of whole files commits without the session's snapshot properties: the write starts after it
        start_snapshot = branches.branch_snapshot(spark, spec, branch)
    # a primary-key change is a delete and an insert sharing a change_id; its
    # delete half may be in this batch or, as a tombstone, in the table
    with _phase(spark, tr, "key_changes"):
        moved = compact.inherit_moved_columns(
            prepared,
            branches.read_branch(spark, spec, branch),
            spec.key_columns,
            spec.columns,
            batch_deletes=bool(meta["keyed_deletes"]),
            truncated_at=truncated_at,
            partial_inserts=meta["min_keyed_after"] is not None and meta["min_keyed_after"] < len(spec.columns),
        )
    prepared = moved.events
    state = branches.read_branch(spark, spec, branch).select(
        *[compact.quote(k) for k in spec.key_columns], "_cdc_position", "_cdc_deleted", "_cdc_col_pos"
    )
    # the live rows as the last batch's reconciliation counted them, when this batch starts from its snapshot
    base_live = None if truncs["n"] else tables.counted_live_rows(properties, start_snapshot)
    if base_live is None:
        with _phase(spark, tr, "live_rows"):
            base_live = tables.live_rows(branches.read_branch(spark, spec, branch))
    n_events = int(meta["n"])
    prune = n_events <= compact.BROADCAST_ROWS_MAX and n_events * PRUNE_STATE_MIN_RATIO <= base_live
    if prune and base_live >= KEY_SPANS_MIN_ROWS:
        with _phase(spark, tr, "key_spans"):
            state = within_key_spans(state, prepared, spec)

    def net_changes(events: DataFrame) -> tuple[DataFrame, compact.Accounting, Callable[[], object]]:
        """The batch's net changes, cached and counted (``compact.cache_counted``),
        and how to let them go; a small batch's cut off from their plan
        (``session.cut_off``), which its later queries would read again."""
        with _phase(spark, tr, "label"), spark_conf.scoped_conf(spark, work.settings, spark_conf.NET_CHANGES_CACHE_CONF):
            net = compact.net_changes(events, state, spec.key_columns, truncated_at, width=len(spec.columns), prune=prune)
            cached, acc = compact.cache_counted(net, spec.key_columns, list(spec.columns))
            if n_events > spark_conf.SMALL_BATCH_MESSAGES:
                return cached, acc, cached.unpersist
            try:
                kept, release = session.cut_off(cached)
            finally:
                cached.unpersist()
            return kept, acc, release

    net, acc, release = net_changes(prepared)
    try:
        counts, tr.position_min, tr.position_max = acc.counts, acc.position_min, acc.position_max
        if acc.null_keys:  # rare: quarantine them, apply the rest (a missing key never blocks the source)
            keyless = _quarantine_keyless(work, spec, rows)
            release()
            prepared = prepared.where(~compact.null_key_filter(spec.key_columns))
            net, acc, release = net_changes(prepared)
            counts, tr.position_min, tr.position_max = acc.counts, acc.position_min, acc.position_max
            counts["quarantined"] = keyless
            if keyless > work.source.quarantine_max_share * n_events:
                tr.failed_expectations.append(
                    f"null_key_share(max={work.source.quarantine_max_share}, got={keyless / n_events:.4f}, events={keyless})"
                )
        folded = compact.applied(net)
        counts["truncates"] = int(truncs["n"])
        counts["key_changes_inherited"] = moved.pairs
        if counts.get("partial_inserts"):
            log.warning(
                "%s: %d insert(s) leave columns out and the delete half of their primary-key change has not arrived: "
                "those columns stay unset until it does (its batch fills them) or a later event carries them",
                spec.identifier,
                counts["partial_inserts"],
            )
        if counts["conflicts"]:
            tr.failed_expectations.append(
                _conflict_check(compact.label_duplicates(prepared, spec.key_columns), spec.key_columns, counts["conflicts"])
            )
        tr.counts = counts
        if truncs["p"] and (tr.position_max is None or truncs["p"] > tr.position_max):
            tr.position_max = truncs["p"]
        # a file with held messages is not applied to the table until they are (held.py)
        applied = [f.as_dict() for f in new_files if f.path not in work.held_files]
        props = ledger.summary_properties(work.batch_id, applied, position_max=tr.position_max, truncated_at=truncated_at, counts=counts)
        props.update(ledger.watermark_properties(prior, tr.position_max, truncs["us"]))  # what as-of reads (asof.py)
        props[branches.ATTEMPT_PROPERTY] = attempt
        stored_keys = counts["keys"] - acc.new_keys
        if work.source.merge_mode == "auto" and stored_keys:
            _choose_merge_mode(spark, spec, stored_keys, base_live, properties)
        if acc.partial_rows:
            for change in tables.mark_partial_rows(spark, spec.identifier, properties):
                log.info("%s: %s (%d net change(s) write a row with inherited or unset columns)", spec.identifier, change, acc.partial_rows)
        # only a row with inherited or never-set columns can take an old key's values (merge.refresh_inherited)
        refresh = tables.may_hold_partial_rows(properties) or acc.partial_rows > 0
        if log_write:
            log_write.result()
        with branches.snapshot_properties(spark, props):
            source_df = compact.merge_source(folded, spec.key_columns, spec.columns)
            with _phase(spark, tr, "merge"), spark_conf.merge_conf(spark, work.settings):
                merge.merge_changes(
                    spark,
                    spec,
                    branch,
                    source_df,
                    work.batch_id,
                    acc.key_ranges,
                    new_keys=acc.new_keys,
                    stored_keys=stored_keys,
                    whole_rows=acc.whole_rows == stored_keys,
                )
            if refresh and (counts["deleted"] + counts["noop_deletes"] + counts["filled"] or truncs["n"]):  # tombstones changed
                with _phase(spark, tr, "key_change_refresh"):
                    counts["key_changes_refreshed"] = merge.refresh_inherited(spark, spec, branch, work.batch_id)
            # a net change always commits (a stored key's has another position than the
            # stored row: it matches; a new key's is appended); none: the ledger alone
            if not counts["keys"] or truncs["n"]:
                branches.ledger_commit(spark, spec, branch)
        tr.branch = branch
        tr.branch_snapshot = branches.own_head(spark, spec, branch, attempt, work.batch_id, start_snapshot)
        tr.key_columns = spec.key_columns
        if work.gate_ahead is not None:
            work.gate_ahead.start(tr, read_snapshot(spark, spec, tr.branch_snapshot))
        # reconciliation needs the folded batch: computed now, judged by the gate
        with _phase(spark, tr, "reconcile"):
            written = read_snapshot(spark, spec, tr.branch_snapshot)
            # the count's small jobs beside the key checks' (each leaves a core idle)
            counting = Background(spark, lambda: tables.live_rows(written), "live-rows")
            try:
                keys = merge.key_ranges_filter(spec, acc.key_ranges, acc.new_key_ranges)
                tr.failed_expectations += gate.reconcile(
                    written, base_live, counting.result, folded, spec.key_columns, counts, main_df, keys
                )
            finally:
                counting.wait()
            _keep_live_rows(spark, spec, tr.branch_snapshot, counting.result())
        tr.status = Status.WRITTEN
    finally:
        release()
        moved.release()


def _keep_live_rows(spark: SparkSession, spec: tables.TableSpec, snapshot_id: int, n: int) -> None:
    """Keep the counted live rows for the next batch; a failure costs that
    batch a scan of the table, never this batch."""
    try:
        tables.record_live_rows(spark, spec.identifier, snapshot_id, n)
    except Exception as exc:  # an optimisation only
        log.warning("%s: live-row count not kept (the next batch counts them): %s", spec.identifier, str(exc).splitlines()[0])


def _choose_merge_mode(spark: SparkSession, spec: tables.TableSpec, stored_keys: int, table_rows: int, properties: dict[str, str]) -> None:
    """``merge_mode: auto``: set the table's ``write.merge.mode`` for this
    batch's MERGE (Iceberg reads it from the table properties only; a
    metadata-only commit, made only when the mode changes)."""
    mode = tables.auto_merge_mode(stored_keys, table_rows)
    for change in tables.keep_merge_mode(spark, spec.identifier, mode, properties):
        log.info("%s: %s (auto: %d stored key(s) of %d live rows)", spec.identifier, change, stored_keys, table_rows)


def _quarantine_keyless(work: TableWork, spec: tables.TableSpec, rows: DataFrame) -> int:
    """Quarantine the events of a table whose key has no value (absent or
    NULL): the row they change cannot be known. Each with its file, line,
    the event as JSON and a reason naming the table and key; the table
    applies the rest. Returns how many."""
    key_types = {k: spec.columns[k] for k in spec.key_columns}
    missing = functools.reduce(lambda a, b: a | b, [compact.typed_value(compact.key_text(k), t).isNull() for k, t in key_types.items()])
    types = ", ".join(f"{k} {t}" for k, t in key_types.items())
    reason = f"{quarantine.NULL_KEY_PREFIX}{spec.short}: the event has no value for key column(s) ({types}) (absent or NULL)"
    raw = F.to_json(F.struct("database", "schema_name", "table_name", "op", "key_columns", "position", "after", "before"))
    bad = (
        rows.where(missing)
        .select(
            F.lit(work.batch_id).alias("batch_id"),
            F.lit(work.source.name).alias("source"),
            "file",
            "line",
            F.lit(reason).alias("reason"),
            raw.alias("raw"),
            F.current_timestamp().alias("recorded_at"),
        )
        .persist()
    )
    try:
        n = bad.count()
        ledger.Ledger(work.settings).ensure_audit_tables()
        target = f"{work.settings.catalog_name}.{work.settings.audit_namespace}.{ledger.QUARANTINE_TABLE}"
        quarantine.write(work.spark, target, bad, work.batch_id, quarantine.null_key(reason))  # a retry replaces
    finally:
        bad.unpersist()
    log.warning("batch %s: %d event(s) of %s quarantined: %s", work.batch_id, n, spec.identifier, reason)
    return n


def table_spec(
    spark: SparkSession, settings: Settings, source: SourceConfig, meta: Any, target: str | None = None
) -> tables.TableSpec | None:
    """The target's name, key and columns; None for a table that is not in the
    lake yet and whose batch holds nothing but truncates (nothing to create)."""
    name = meta["table_name"]
    ident = f"{settings.catalog_name}.{source.namespace}.{target or tables.target_name(name)}"
    declared = [[(c["name"], c["type"]) for c in cols] for cols in meta["decl"] if cols]
    columns, _ = tables.resolve_columns(declared, name)
    keysets = {tuple(k) for k in meta["keys"] if k}
    existing_cols: dict[str, str] = {}
    existing_key: list[str] = []
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
    return tables.TableSpec(identifier=ident, key_columns=key, columns=columns)


def refuse_untyped(spark: SparkSession, settings: Settings, source: SourceConfig, meta: Any, events: DataFrame) -> None:
    """A table not in the lake yet whose messages carry no schema and have no
    declared column types cannot be created: refuse it, saying what to add."""
    name = meta["table_name"]
    if tables.table_exists(spark, f"{settings.catalog_name}.{source.namespace}.{tables.target_name(name)}"):
        return
    ev = events.where((F.col("table_name") == name) & F.col("schema_name").eqNullSafe(F.lit(meta["schema_name"])))
    cols = [
        r[0]
        for r in ev.select(F.explode(F.map_keys(F.map_concat("after", F.coalesce("before", F.create_map().cast("map<string,string>"))))))
        .distinct()
        .orderBy(1)
        .collect()
    ]
    qualified = f"{meta['schema_name']}.{name}" if meta["schema_name"] else name
    key = next((k for k in meta["keys"] if k), None) or next(
        (source.primary_keys[n] for n in (f"{meta['database']}.{qualified}", qualified, name) if n in source.primary_keys), None
    )
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


def read_snapshot(spark: SparkSession, spec: tables.TableSpec, snapshot_id: int) -> DataFrame:
    return spark.sql(f"SELECT * FROM {spec.identifier} VERSION AS OF {int(snapshot_id)}")
