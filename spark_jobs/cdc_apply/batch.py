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

import contextlib
import datetime as dt
import hashlib
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_apply import ledger
from cdc_apply.apply import branches, changelog, gate, held, history, quarantine, tables, transactions
from cdc_apply.apply.table import (
    TableWork,
    apply_table,
    read_snapshot,
    source_identity,
)
from cdc_apply.archive.files import ArchiveFile
from cdc_apply.archive.listing import archive_file_exists, list_files
from cdc_apply.config import Settings, SourceConfig, get_source
from cdc_apply.decode import DecodeContext, census
from cdc_apply.decode.stage import decode_batch
from cdc_apply.errors import CdcError, ConcurrentApply, ConfigError, TerminalError
from cdc_apply.model import CONFIG_REFUSED_PREFIX
from cdc_apply.results import BatchResult, Override, TableResult, reason_class
from cdc_apply.runtime import spark_conf
from cdc_apply.runtime.session import described
from cdc_apply.status import Status

log = logging.getLogger("cdc_apply")


STAGES = ("write", "validate", "publish")
TYPED_BY_STORED_TABLES = ("debezium_postgres", "debezium_sqlserver")
"""Formats whose schemaless messages take the stored tables' column types (``_decode_context``)."""
Known = tuple[dict[tuple[str, str | None], int] | None, list | None]
"""What the decode counted (``stage.Decoded.counts``, ``tables``): None where a Spark job counts."""


def batch_id_for(source: str, files: list[ArchiveFile]) -> str:
    return _batch_id(source, ((f.path, f.sha256) for f in sorted(files)))  # by hour, then path


def _batch_id(source: str, files: Iterable[tuple[str, str]]) -> str:
    """A batch's id: its source and a digest of its files' (path, SHA-256),
    in the order given (an id never changes: the ledger and the audit
    branches know a batch by it)."""
    digest = hashlib.sha256("\n".join(f"{path}:{sha}" for path, sha in files).encode()).hexdigest()[:16]
    return f"{source}_{digest}"


def pending_files(
    settings: Settings,
    source: SourceConfig,
    *,
    root: str | Path | None = None,
    until: dt.datetime | None = None,
    since: dt.datetime | None = None,
    records: dict[str, tuple[int, str]] | None = None,
) -> list[ArchiveFile]:
    """Files of the source not yet applied (oldest first), under ``root``
    (default: the source's archive folder); refuses applied files that changed
    — by size (their recorded SHA-256 is reused while the size is unchanged),
    or by SHA-256 with ``CDC_VERIFY_APPLIED=sha256``.  ``records``: the
    ledger's applied files, when the caller has read them."""
    if records is None:
        records = ledger.Ledger(settings).applied_file_records(source.name)
    known = records if settings.verify_applied == "size" else None
    files = list_files(source.archive_path(settings) if root is None else root, until=until, since=since, known=known)
    return ledger.not_yet_applied(files, ledger.sha256_by_path(records), f"source {source.name}")


def run_batch(
    settings: Settings,
    source_name: str | SourceConfig,
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
    source = source_name if isinstance(source_name, SourceConfig) else get_source(settings, source_name)  # a SourceConfig: rebuild.py
    if files is None:
        files = pending_files(settings, source)
    files = sorted(files)
    if max_files:
        files = files[:max_files]
    if not files:
        return _nothing_pending(settings, source, override, dry_run=dry_run, stages=stages)
    batch_id = batch_id_for(source.name, files)
    result = BatchResult(
        batch_id=batch_id,
        source=source.name,
        status=Status.DRY_RUN if dry_run else Status.COMPLETE,
        files=[f.as_dict() for f in files],
        override=asdict(override) if override else None,
    )
    log.info("batch %s: %d file(s) of source %s", batch_id, len(files), source.name)
    if override is not None:
        log.warning("batch %s: operator override %s", batch_id, override.describe())
    if override is not None and override.action == "skip":
        return skip_batch(settings, source, result, dry_run=dry_run)
    from cdc_apply.runtime.session import get_spark

    decoder_state = ledger.DecoderStateAhead(settings, source.name, source.namespace if source.format in TYPED_BY_STORED_TABLES else None)
    spark = spark or get_spark(settings, pool=source.name)
    if "validate" in stages and not dry_run:
        gate.preload_great_expectations()
    ctx = _decode_context(spark, settings, source, batch_id, decoder_state)
    out = decode_batch(spark, [(f.path, f.size) for f in files], source.format, ctx)
    decoded, new_state, known = out.frame, {**ctx.state, **out.state}, (out.counts, out.tables)
    if dry_run or "validate" not in stages:
        apply_decoded(spark, settings, source, result, files, decoded, new_state, dry_run=dry_run, table_filter=table_filter, known=known)
    else:
        write_and_validate(
            spark, settings, source, result, files, decoded, new_state, table_filter, in_write_job="publish" not in stages, known=known
        )
    if not dry_run and "publish" in stages:
        publish_batch(settings, result)
        finish_batch(settings, result)
    result.seconds = round(time.time() - started, 3)
    return result


def write_and_validate(
    spark: SparkSession,
    settings: Settings,
    source: SourceConfig,
    result: BatchResult,
    files: list[ArchiveFile],
    decoded: DataFrame,
    state: dict[str, Any] | None,
    table_filter: str | None,
    *,
    in_write_job: bool,
    known: Known = (None, None),
) -> None:
    """``apply_decoded`` then ``validate_batch`` in one session, each table's
    GX suites started as soon as its branch is written (``gate.GateAhead``)."""
    ahead = gate.GateAhead(settings, result.id)
    with contextlib.ExitStack() as scope:  # the batch's small-batch conf, given back once its GX runs have ended
        try:
            apply_decoded(
                spark,
                settings,
                source,
                result,
                files,
                decoded,
                state,
                table_filter=table_filter,
                gate_ahead=ahead,
                scope=scope,
                known=known,
            )
            if result.pending(Status.WRITTEN):
                validate_batch(settings, result, spark, in_write_job=in_write_job, ahead=ahead)
        finally:
            ahead.close()


def held_files_gone_while_quiet(settings: Settings, source: SourceConfig) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """For a source with no pending file: its state, and the files it holds
    messages of that are gone from the archive (path -> held record).  No
    batch reads such a file again, and with nothing pending no batch runs to
    find it gone (``_held_files_gone``): without this a quiet source's runs
    would end *nothing to do* while its held messages wait unseen."""
    led = ledger.Ledger(settings)
    rows = led.batch_rows(source.name)
    state = dict(led.latest_decoder_state(source.name, rows))
    if not state.get(held.HELD_KEY):
        return state, {}
    held.forget(state, ledger.applied_file_records_of(rows))  # an operator's skip marked them applied
    return state, held.gone(state, [], archive_file_exists)


def held_gone_batch_id(source: str, lost: dict[str, dict[str, Any]]) -> str:
    """The id of the batch that fails on (or gives up) held files gone while
    nothing else is pending: named by those files, as a batch by its own."""
    return _batch_id(source, ((path, rec["sha256"]) for path, rec in sorted(lost.items())))


def _nothing_pending(
    settings: Settings, source: SourceConfig, override: Override | None, *, dry_run: bool, stages: tuple[str, ...]
) -> BatchResult:
    """No pending file: nothing to do, unless the source holds messages of
    files gone from the archive (``held_files_gone_while_quiet``).  Then this
    run is a batch of no file that fails naming them, as a batch with files
    would; forced, it gives their messages up and records the source state
    without them."""
    state, lost = held_files_gone_while_quiet(settings, source)
    if not lost:
        return BatchResult(batch_id=None, source=source.name, status=Status.NOTHING_TO_DO, message="no pending files")
    result = BatchResult(
        batch_id=held_gone_batch_id(source.name, lost),
        source=source.name,
        status=Status.DRY_RUN if dry_run else Status.COMPLETE,
        override=asdict(override) if override else None,
    )
    result.started_at = dt.datetime.now(dt.UTC).isoformat()
    given_up = _judge_held_files_gone(result, state, lost)
    if given_up:
        result.messages[GIVEN_UP] = given_up
        result.source_state = state
        result.message = f"no pending files; {given_up} held message(s) of {len(lost)} file(s) gone from the archive given up"
    if not dry_run and "publish" in stages:
        finish_batch(settings, result)
    return result


def skip_batch(settings: Settings, source: SourceConfig, result: BatchResult, *, dry_run: bool = False) -> BatchResult:
    """The operator's *skip*: the batch's files are marked applied without
    being applied (recorded with the reason), and the audit branches a failed
    attempt of the same batch left behind are dropped."""
    result.status = Status.DRY_RUN if dry_run else Status.SKIPPED
    result.message = f"{result.describe_override()}; {len(result.files)} file(s) marked applied without applying them"
    result.started_at = dt.datetime.now(dt.UTC).isoformat()
    if not dry_run:
        led = ledger.Ledger(settings)  # one catalog for the whole skip
        published = led.published_tables(source.namespace, result.id)
        if published:  # a run applied it meanwhile (or before its finish recorded it): its files are applied
            raise TerminalError(f"batch {result.batch_id} is already published to {published} by a run: it cannot be skipped; nothing done")
        dropped = led.drop_branches(source.namespace, ledger.audit_branch(result.id))
        if dropped:
            result.message += f"; dropped audit branch of {dropped}"
        led.record_batch(result)
    log.warning("batch %s: %s", result.batch_id, result.message)
    return result


def _decode_context(
    spark: SparkSession, settings: Settings, source: SourceConfig, batch_id: str, decoder_state: ledger.DecoderStateAhead
) -> DecodeContext:
    """What the decoders know before the batch: the source's decoder state
    from the ledger (being read ahead: ``ledger.DecoderStateAhead``), its
    options and declared types, and (Debezium) the stored tables' column
    types that schemaless messages are typed by."""
    stored_types: dict[str, dict[str, str]] = {}
    decoder_state.catalog_opened()
    if source.format in TYPED_BY_STORED_TABLES:
        t0 = time.time()
        ahead = decoder_state.stored_types()
        stored_types = tables.stored_column_types(spark, settings.catalog_name, source.namespace) if ahead is None else ahead
        log.info(
            "batch %s: column types of %d stored table(s) read in %.2f s%s",
            batch_id,
            len(stored_types),
            time.time() - t0,
            "" if ahead is None else " (read ahead)",
        )
    return DecodeContext(
        source=source.name,
        primary_keys=source.primary_keys,
        state=decoder_state.state(),
        options=source.decode_options(),
        declared_types=source.columns,
        stored_types=stored_types,
    )


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
    gate_ahead: gate.GateAhead | None = None,
    scope: contextlib.ExitStack | None = None,
    known: Known = (None, None),
) -> BatchResult:
    """Everything after decode: accounting, quarantine, per-table apply, ledger.

    ``decoder_state`` is the source state carried to the next batch (decoder
    state plus truncate watermarks of tables not in the lake yet); None reads
    the latest from the ledger.  ``gate_ahead``: the caller validates next,
    with it (``validate_batch``).  ``scope``: where the batch's small-batch
    conf (``spark_conf.small_batch_conf``) is given back; by default when
    this returns, as the cached decode is released.  ``known``: the decoded
    rows per (status, reason) and the batch's tables, when the decode counted
    them (``stage.Decoded.counts`` and ``tables``)."""
    state = dict(ledger.Ledger(settings).latest_decoder_state(source.name) if decoder_state is None else decoder_state)
    result.started_at = dt.datetime.now(dt.UTC).isoformat()
    result.stage = "write"
    given_up = _held_files_gone(settings, result, state, files)
    if given_up is None:
        return result
    with contextlib.ExitStack() as own:
        raw = decoded.persist()
        own.callback(raw.unpersist)
        with described(spark, f"{source.name}: decode"):
            # lines of partly applied files that an earlier batch accounted for are not read again
            decoded = held.only_held_lines(spark, raw, held.prior_in_batch(state, files))
            kept, linked = _hold_transactions(spark, source, result, state, decoded)
            if kept is None:
                return result
            # the decode's own census holds while no line was set apart above
            status_counts, table_meta = _count_messages(kept, result, known if kept is raw else (None, None), whole=kept is raw)
            decoded = kept
        (own if scope is None else scope).enter_context(spark_conf.small_batch_conf(spark, settings, result.messages["read"]))
        _refuse_config(source, status_counts, decoded)
        _carry_held(decoded, result, state, files, given_up)
        if not dry_run and result.messages.get("quarantined", 0):
            _record_quarantine(spark, settings, source, result.id, decoded)
        if _quarantine_over_limit(settings, source, result):
            return result
        events = decoded.where("status = 'event'")
        if table_filter:
            events, table_meta = events.where(F.col("table_name").rlike(table_filter)), None
        # a table's column declaration rides on one event per decode batch, which may
        # be a line held (an incomplete transaction) or applied before (census.table_meta)
        declared = raw.where("status = 'event' AND columns IS NOT NULL")
        _apply_tables(spark, settings, source, result, files, events, state, dry_run, linked, declared, gate_ahead, table_meta)
        result.source_state = state
        result.fail_if_any()
    return result


GIVEN_UP = "given-up:held-file-gone"
"""``BatchResult.messages`` key: messages an earlier batch held whose file is
gone from the archive, given up by an operator's *force* (``_held_files_gone``)."""


def _held_files_gone(settings: Settings, result: BatchResult, state: dict[str, Any], files: list[ArchiveFile]) -> int | None:
    """Files an earlier batch held messages of, gone from the archive since
    (``held.gone``): the batch fails, naming them, since their messages would
    otherwise wait unseen for ever; an operator's *force* gives them up
    (their records leave the source state, their count is the result's
    ``GIVEN_UP``).  A held file an operator's skip marked applied is held no
    longer (``held.forget``).  Returns the messages given up, None
    when the batch fails."""
    if held.unread(state, files):  # rare: only then is the ledger asked
        for path in held.forget(state, ledger.Ledger(settings).applied_file_records(result.source)):
            log.info("batch %s: %s is applied (an operator's skip): its held lines are held no longer", result.batch_id, path)
    return _judge_held_files_gone(result, state, held.gone(state, files, archive_file_exists))


def _judge_held_files_gone(result: BatchResult, state: dict[str, Any], lost: dict[str, dict[str, Any]]) -> int | None:
    """``_held_files_gone`` once the gone files are known: 0 when none is; the
    messages given up under *force*; None when the batch fails (``result``
    says which files and the ways on)."""
    if not lost:
        return 0
    n = sum(held.messages(rec) for rec in lost.values())
    shown = "; ".join(
        f"{path} ({held.messages(rec)} message(s), lines {', '.join(f'{lo}-{hi}' for lo, hi in rec['lines'])}, "
        f"held since {rec.get(held.HELD_SINCE, 'unknown')})"
        for path, rec in sorted(lost.items())[:5]
    ) + (f"; and {len(lost) - 5} more" if len(lost) > 5 else "")
    what = f"{len(lost)} archive file(s) of {result.source} with {n} held message(s) not applied yet are gone from the archive: {shown}"
    override = result.get_override()
    result.failed_checks.append(f"held_file_gone(files={len(lost)}, messages={n})")  # forced: recorded as let through
    if override is not None and override.action == "force":
        log.warning("batch %s: giving up %d held message(s): %s -- %s", result.batch_id, n, what, override.describe())
        held.forget(state, lost)
        return n
    result.status = Status.FAILED
    result.message = (
        f"{what}. Ways on: restore the file(s) as they were and re-run; or give their held messages up with "
        "--override force --override-reason '...' (the count is recorded in the batch's messages as "
        f"{GIVEN_UP!r})"
    )
    return None


def _hold_transactions(
    spark: SparkSession, source: SourceConfig, result: BatchResult, state: dict[str, Any], decoded: DataFrame
) -> tuple[DataFrame | None, bool]:
    """Under ``publish: transactions``: ``decoded`` less what waits for the
    rest of its source transaction (CockroachDB: for the resolved watermark),
    and whether events are linked by transaction.  None: the batch stops here
    (``result`` says why)."""
    if source.publish != "transactions":
        return decoded, False
    if source.format == "cockroachdb":  # up to the resolved watermark
        return _hold_after_watermark(source, result, state, decoded), False
    census = transactions.census(decoded)  # readers never see part of a source transaction
    hold = _transactions_to_hold(source, result, state, census.incomplete)
    return (None if hold is None else transactions.hold(spark, decoded, hold)), census.transactions > 0


def _hold_after_watermark(source: SourceConfig, result: BatchResult, state: dict[str, Any], decoded: DataFrame) -> DataFrame | None:
    """CockroachDB under ``publish: transactions``: hold the events after the
    feed's resolved watermark (``transactions.watermark``); None when the
    batch fails because events have waited longer than the source's maximum
    for it (an operator's *force* applies them)."""
    mark, marks = transactions.watermark(decoded, state.get(transactions.RESOLVED_KEY) or {})
    state[transactions.RESOLVED_KEY] = marks
    held_out = transactions.hold_after(decoded, mark)
    limit = dt.datetime.now(dt.UTC) - dt.timedelta(hours=source.max_hold_hours)
    old = {p: r[held.HELD_SINCE] for p, r in (state.get(held.HELD_KEY) or {}).items() if held.HELD_SINCE in r}
    old = {p: since for p, since in old.items() if dt.datetime.fromisoformat(since) < limit}
    if old:
        still = {r["file"] for r in held_out.where("status = 'held'").select("file").distinct().collect()} & set(old)
        what = (
            f"events of {source.name} held for the resolved watermark longer than {source.max_hold_hours} h (publish: transactions; "
            f"watermark {mark or 'none: no resolved timestamp read yet'}; since {min((old[f] for f in still), default='')} in "
            f"{', '.join(sorted(still)[:5])})"
        )
        check = f"resolved_watermark_age(max_hours={source.max_hold_hours}, files={len(still)})"
        remedy = "create the changefeed WITH resolved and archive every partition's resolved messages"
        if still:
            return decoded if _held_too_long(result, check, what, remedy) else None
    return held_out


def _transactions_to_hold(
    source: SourceConfig, result: BatchResult, state: dict[str, Any], incomplete: list[transactions.Incomplete]
) -> list[transactions.Incomplete] | None:
    """The incomplete transactions to hold; None when the batch fails because
    some were held longer than the source's maximum (an operator's *force*
    applies those as they are, and records them).  Events of a transaction
    forced earlier (or, in a rebuild's replay, on the live source) apply as
    they come: readers have seen it in part already, holding the rest would
    only delay it, and a replay, whose batches are not the live ones, agrees."""
    forced = set(state.get(transactions.FORCED_KEY) or ()) | source.forced_transactions
    through = sorted(i.group for i in incomplete if i.group in forced)
    if through:
        log.warning("batch %s: applying events of %d transaction(s) forced through earlier: %s", result.batch_id, len(through), through[:5])
        state[transactions.FORCED_KEY] = sorted(set(state.get(transactions.FORCED_KEY) or ()) | set(through))
        incomplete = [i for i in incomplete if i.group not in forced]
    late = transactions.overdue(incomplete, state.get(held.HELD_KEY) or {}, source.max_hold_hours)
    if not late:
        return incomplete
    shown = "; ".join(list(late.values())[:5]) + (f"; and {len(late) - 5} more" if len(late) > 5 else "")
    what = f"{len(late)} source transaction(s) of {source.name} held longer than {source.max_hold_hours} h (publish: transactions): {shown}"
    check = f"transaction_hold_age(max_hours={source.max_hold_hours}, transactions={len(late)})"
    if _held_too_long(result, check, what, "archive the missing messages (or release them from quarantine) and re-run"):
        state[transactions.FORCED_KEY] = sorted(set(state.get(transactions.FORCED_KEY) or ()) | set(late))
        return [i for i in incomplete if i.group not in late]
    return None


def _held_too_long(result: BatchResult, check: str, what: str, remedy: str) -> bool:
    """Events held longer than their source allows: an operator's *force*
    lets them through as they are (True, logged); otherwise the batch fails
    with ``what`` and the ways on (False)."""
    override = result.get_override()
    if override is not None and override.action == "force":
        log.warning("batch %s: applying as they are: %s -- %s", result.batch_id, what, override.describe())
        return True
    result.status = Status.FAILED
    result.failed_checks.append(check)
    result.message = (
        f"{what}. Ways on: {remedy}; apply them as they are with --override force --override-reason '...'; "
        "or set publish: events for the source"
    )
    return False


def _count_messages(
    decoded: DataFrame, result: BatchResult, known: Known, *, whole: bool
) -> tuple[dict[tuple[str, str | None], int], list | None]:
    """Every message read, by status and reason class (the detail is in the
    quarantine row), into ``result.messages``; returns the exact counts and,
    when ``decoded`` is the whole decode (``whole``), its tables
    (``census``).  The first pass over the decoded batch: its time is the
    decode's.  ``known``: the counts and tables as the decode took them (no
    Spark job)."""
    t0 = time.perf_counter()
    status_counts, table_meta = known
    if status_counts is None:
        if whole:
            status_counts, table_meta = census.counted(decoded)
        else:
            status_counts = {
                (r["status"], r["reason"]): r["n"] for r in decoded.groupBy("status", "reason").agg(F.count(F.lit(1)).alias("n")).collect()
            }
    messages = {"read": sum(status_counts.values())}
    for (status, reason), n in status_counts.items():
        messages[status] = messages.get(status, 0) + n
        if status != "event":
            key = f"{status}:{reason_class(reason)}"
            messages[key] = messages.get(key, 0) + n
    result.messages = messages
    log.info("batch %s: %d message(s) decoded and counted in %.1f s", result.batch_id, messages["read"], time.perf_counter() - t0)
    return status_counts, table_meta


def _carry_held(decoded: DataFrame, result: BatchResult, state: dict[str, Any], files: list[ArchiveFile], given_up: int = 0) -> None:
    """Record the held lines of each file in the source state (``held.py``):
    the file stays unapplied until they are; and count the held messages
    given up (``_held_files_gone``)."""
    if given_up:
        result.messages[GIVEN_UP] = given_up
    held_lines: dict[str, list[int]] = {}
    if result.messages.get("held"):  # a Spark job only when something is held
        for r in decoded.where("status = 'held'").select("file", "line").collect():
            held_lines.setdefault(r["file"], []).append(r["line"])
        result.held_files = sorted(held_lines)
    state[held.HELD_KEY] = held.carry(state, files, held_lines)
    if not state[held.HELD_KEY]:
        del state[held.HELD_KEY]


def _quarantine_over_limit(settings: Settings, source: SourceConfig, result: BatchResult) -> bool:
    """The quarantine share check: True (the batch failed) when over the
    source's limit and not forced by an operator."""
    messages = result.messages
    quarantined = messages.get("quarantined", 0)
    share = quarantined / messages["read"] if messages["read"] else 0.0
    if share <= source.quarantine_max_share:
        return False
    msg = (
        f"{quarantined} of {messages['read']} messages quarantined ({share:.1%}) exceeds the limit "
        f"{source.quarantine_max_share:.1%} of source {source.name}; inspect "
        f"{settings.catalog_name}.{settings.audit_namespace}.quarantine WHERE batch_id = '{result.batch_id}'"
    )
    result.failed_checks.append(f"quarantine_share(max={source.quarantine_max_share}, got={share:.4f})")
    override = result.get_override()
    if override is not None and override.action == "force":
        log.warning("batch %s: %s -- %s", result.batch_id, msg, override.describe())
        return False
    result.status = Status.FAILED
    result.message = msg
    return True


def _apply_tables(
    spark: SparkSession,
    settings: Settings,
    source: SourceConfig,
    result: BatchResult,
    files: list[ArchiveFile],
    events: DataFrame,
    state: dict[str, Any],
    dry_run: bool,
    linked: bool = False,
    declared: DataFrame | None = None,
    gate_ahead: gate.GateAhead | None = None,
    table_meta: list | None = None,
) -> None:
    """One ``apply_table`` per source table of the batch, after refusing the
    tables without a valid target and those colliding on one.  ``linked``:
    the batch has source transactions, whose tables publish together
    (``result.publish_groups``).  ``table_meta``: the tables of ``events``
    as the decode's census found them (None: a Spark job finds them)."""
    if table_meta is None:
        with described(spark, f"{source.name}: tables of the batch"):
            table_meta = census.table_meta(events, declared)
    aliases, ambiguous = _fuller_names(table_meta)
    if aliases:  # one table under two names (rare): read as its fuller name, grouped again
        events = _rename_tables(events, aliases)
        table_meta = census.table_meta(events, None if declared is None else _rename_tables(declared, aliases))
    targets, refused, collisions = _targets(source, table_meta)
    collisions.update(ambiguous)
    if refused:
        _refuse_tables(spark, settings, source, result, events, refused, dry_run)
    work = TableWork(spark, settings, source, result.id, files, state, frozenset(result.held_files), dry_run, gate_ahead)
    written: dict[str, str] = {}  # source identity -> its table's result name
    for meta in sorted(table_meta, key=lambda r: (r["table_name"], r["schema_name"] or "")):
        ident = source_identity(meta)
        if ident in refused:
            continue
        if ident in collisions:
            result.tables.append(
                TableResult(table=meta["table_name"], status=Status.FAILED, message=f"ConfigError: {collisions[ident]}", terminal=True)
            )
            continue
        tr = apply_table(work, events, meta, targets[ident])
        _count_keyless(result, tr)
        result.tables.append(tr)
        written[ident] = tr.table
    if linked:
        groups = [[written[i] for i in (tables.source_identity(*t) for t in g) if i in written] for g in transactions.linked_tables(events)]
        result.publish_groups = [g for g in groups if len(g) > 1]


def _fuller_names(table_meta: list) -> tuple[dict[str, str], dict[str, str]]:
    """Source tables named with less in some messages than in others (a
    CockroachDB topic without ``full_table_name`` gives neither database nor
    schema, an enriched ``source`` gives both): one table under two names.
    Returns the identities to read as their fuller name (the one fuller
    name of the batch they can be), and those that can be several tables
    (identity -> why, naming them), which are refused."""
    idents = {source_identity(m) for m in table_meta}
    aliases: dict[str, str] = {}
    ambiguous: dict[str, str] = {}
    for ident in sorted(idents):
        fuller = [i for i in idents if i != ident and tables.same_table(ident, i) and tables.qualification(i) > tables.qualification(ident)]
        if not fuller:
            continue
        best = max(fuller, key=tables.qualification)
        if (
            all(tables.same_table(best, i) for i in fuller)
            and sum(tables.qualification(i) == tables.qualification(best) for i in fuller) == 1
        ):
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
        match = (
            F.col("database").eqNullSafe(F.lit(p_db)) & F.col("schema_name").eqNullSafe(F.lit(p_schema)) & (F.col("table_name") == table)
        )
        db = F.when(match, F.lit(f_db)).otherwise(db)
        schema = F.when(match, F.lit(f_schema)).otherwise(schema)
    return events.withColumns({"database": db, "schema_name": schema})


def _count_keyless(result: BatchResult, tr: TableResult) -> None:
    """A table's events quarantined for a missing key move from ``event`` to
    ``quarantined`` in the batch's message accounting."""
    n = (tr.counts or {}).get("quarantined", 0) if tr.status == Status.WRITTEN else 0
    if n:
        m = result.messages
        m["event"] = m.get("event", 0) - n
        m["quarantined"] = m.get("quarantined", 0) + n
        m["quarantined:null-key"] = m.get("quarantined:null-key", 0) + n


def _refuse_config(source: SourceConfig, status_counts: dict[tuple[str, str | None], int], decoded: DataFrame) -> None:
    """Fail the batch once, terminally, when decoders refused messages for a
    configuration reason (``ConfigRefused``): one line per distinct reason
    (with its first file and line), nothing quarantined or applied, the files
    stay pending for after the fix."""
    refused = sorted((r, n) for (s, r), n in status_counts.items() if s == "quarantined" and r and r.startswith(CONFIG_REFUSED_PREFIX))
    if refused:

        def first(reason: str) -> str:
            row = decoded.where(F.col("reason") == reason).select("file", "line").orderBy("file", "line").first()
            return f"{row['file']}:{row['line']}" if row else "?"

        lines = "; ".join(f"{n} message(s), first at {first(r)}: {r[len(CONFIG_REFUSED_PREFIX) :]}" for r, n in refused[:5])
        more = f" (and {len(refused) - 5} more reasons)" if len(refused) > 5 else ""
        raise ConfigError(f"source {source.name}: the configuration does not fit its messages: {lines}{more}")


def _targets(source: SourceConfig, table_meta: list) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Per source table (``tables.source_identity``): its target name (a
    configured ``target``, else the table's own name), the tables refused
    (no valid Iceberg name: identity -> why) and those colliding with another
    source table of the batch on one target (identity -> why, naming both)."""
    targets: dict[str, str] = {}
    refused: dict[str, str] = {}
    for meta in table_meta:
        ident = source_identity(meta)
        mapped = source.lookup(source.targets, meta["database"], meta["schema_name"], meta["table_name"])
        try:
            targets[ident] = mapped or tables.target_name(meta["table_name"])
        except ConfigError as exc:
            refused[ident] = f"{quarantine.REFUSED_TABLE_PREFIX}{tables.describe_identity(ident)}: {exc}"
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
    spark: SparkSession,
    settings: Settings,
    source: SourceConfig,
    result: BatchResult,
    events: DataFrame,
    refused: dict[str, str],
    dry_run: bool,
) -> None:
    """Quarantine the events of refused tables (file, line, the event as JSON,
    the reason naming the table) so that the batch completes for the others;
    counted in the result and logged as a warning."""
    identity = F.lit(None).cast("string")
    for ident in refused:
        db, schema, table = json.loads(ident)
        match = F.col("database").eqNullSafe(F.lit(db)) & F.col("schema_name").eqNullSafe(F.lit(schema)) & (F.col("table_name") == table)
        identity = F.when(match, F.lit(ident)).otherwise(identity)
    reasons = F.create_map(*[x for ident, why in refused.items() for x in (F.lit(ident), F.lit(why))])
    rows = events.withColumn("_ident", identity).where(F.col("_ident").isNotNull())
    counts = {r["_ident"]: r["n"] for r in rows.groupBy("_ident").agg(F.count(F.lit(1)).alias("n")).collect()}
    total = sum(counts.values())
    m = result.messages
    m["event"] = m.get("event", 0) - total
    m["quarantined"] = m.get("quarantined", 0) + total
    m["quarantined:refused-table"] = m.get("quarantined:refused-table", 0) + total
    for ident, why in sorted(refused.items()):
        result.tables.append(
            TableResult(
                table=tables.describe_identity(ident), status=Status.REFUSED, counts={"quarantined": counts.get(ident, 0)}, message=why
            )
        )
        log.warning("batch %s: %d message(s) quarantined: %s", result.batch_id, counts.get(ident, 0), why)
    result.message = f"{len(refused)} table(s) refused, their {total} message(s) quarantined: {sorted(refused.values())}"
    if dry_run:
        return
    ledger.Ledger(settings).ensure_audit_tables()
    target = f"{settings.catalog_name}.{settings.audit_namespace}.{ledger.QUARANTINE_TABLE}"
    raw = F.to_json(F.struct("database", "schema_name", "table_name", "op", "key_columns", "position", "after", "before"))
    rows = rows.select(
        F.lit(result.batch_id).alias("batch_id"),
        F.lit(source.name).alias("source"),
        "file",
        "line",
        reasons[F.col("_ident")].alias("reason"),
        raw.alias("raw"),
        F.current_timestamp().alias("recorded_at"),
    )
    quarantine.write(spark, target, rows, result.id, quarantine.REFUSED_TABLES)


def _record_quarantine(spark: SparkSession, settings: Settings, source: SourceConfig, batch_id: str, decoded: DataFrame) -> None:
    ledger.Ledger(settings).ensure_audit_tables()
    target = f"{settings.catalog_name}.{settings.audit_namespace}.{ledger.QUARANTINE_TABLE}"
    rows = decoded.where("status = 'quarantined'").select(
        F.lit(batch_id).alias("batch_id"),
        F.lit(source.name).alias("source"),
        "file",
        "line",
        "reason",
        "raw",
        F.current_timestamp().alias("recorded_at"),
    )
    quarantine.write(spark, target, rows, batch_id, quarantine.DECODED)


def validate_batch(
    settings: Settings,
    result: BatchResult,
    spark: SparkSession | None = None,
    table: str | None = None,
    *,
    in_write_job: bool = False,
    ahead: gate.GateAhead | None = None,
) -> BatchResult:
    """The gate: GX suites (generated + user) and the write stage's
    reconciliation, on each written table's audit branch (or only ``table``'s).
    An operator's *force* override lets failed checks through, logged.
    ``in_write_job``: run by the write job in its warm session; a gate that
    cannot run leaves its table written, for the validate stage to retry.
    ``ahead``: the suites the write started (``gate.GateAhead``)."""
    from cdc_apply.runtime.session import get_spark

    result.stage = "validate"
    override = result.get_override()
    for tr in result.tables:
        if tr.status != Status.WRITTEN or (table is not None and tr.table != table):
            continue
        spark = spark or get_spark(settings, pool=result.source)
        spec = tables.TableSpec(identifier=tr.table, key_columns=tr.key_columns, columns={})
        try:
            gx_result = _run_suites(settings, spark, spec, tr, result.id, ahead)
        except Exception as exc:  # GX or Spark broke, or another run took the branch: not a data verdict, may be retried
            log.exception("validation of %s failed to run", tr.table)
            if in_write_job:  # the validate stage runs it again, in its own job
                continue
            tr.status, tr.terminal = Status.FAILED, False
            tr.message = (
                branches.concurrent_apply_message(exc, tr.table, result.batch_id, tr.branch or "")
                or f"validation could not run: {type(exc).__name__}: {str(exc)[:2000]}"
            )
            continue
        tr.data_docs = gx_result.data_docs
        log.info("%s: data docs %s (gate %.1f s)", tr.table, gx_result.data_docs, tr.seconds["gate"])
        failed = tr.failed_expectations + gx_result.failed
        tr.failed_expectations = failed
        if failed and override is not None and override.action == "force":
            tr.status, tr.gate = Status.VALIDATED, "forced"
            tr.override = f"{override.describe()}; failed checks let through: {failed}"
            log.warning("%s: %s", tr.table, tr.override)
        elif failed:
            tr.status, tr.terminal, tr.gate = Status.FAILED, True, "failed"
            tr.message = (
                f"GateFailed: batch {result.batch_id} failed {len(failed)} check(s): {failed}; main is untouched, "
                f"inspect branch '{tr.branch}' (SELECT * FROM {tr.table} VERSION AS OF '{tr.branch}'), data docs {tr.data_docs}"
            )
            log.error("%s: %s", tr.table, tr.message)
        else:
            tr.status, tr.gate = Status.VALIDATED, "passed"
    result.fail_if_any()
    return result


def _run_suites(
    settings: Settings, spark: SparkSession, spec: tables.TableSpec, tr: TableResult, batch_id: str, ahead: gate.GateAhead | None
) -> gate.GateResult:
    """The GX suites' result on the branch head the write left (``tr``),
    taken from ``ahead`` when the write started them for that head."""
    if tr.branch_snapshot is not None and branches.branch_snapshot(spark, spec, tr.audit_branch) != tr.branch_snapshot:
        raise ConcurrentApply(f"branch {tr.branch!r} moved from snapshot {tr.branch_snapshot} (this run's write)")
    got = ahead.result(tr.table, tr.branch_snapshot) if ahead is not None else None
    if got is not None:
        return got
    branch_df = (
        branches.read_branch(spark, spec, tr.audit_branch) if tr.branch_snapshot is None else read_snapshot(spark, spec, tr.branch_snapshot)
    )
    with tr.timed("gate"):
        return gate.run_gx(settings, branch_df, tr.table, tr.key_columns, batch_id)


def publish_batch(settings: Settings, result: BatchResult, table: str | None = None) -> BatchResult:
    """Fast-forward main to each validated branch (or only ``table``'s) with
    pyiceberg: no Spark needed."""
    result.stage = "publish"
    led = ledger.Ledger(settings)
    for tr in result.tables:
        if tr.status != Status.VALIDATED or (table is not None and tr.table != table):
            continue
        transactions.check_group(result, tr)  # tables that shared source transactions publish together
        if tr.status != Status.VALIDATED:
            continue
        if Status.SKIPPED in led.recorded_statuses(result.batch_id):  # an operator skipped it meanwhile
            led.drop_branches(tr.table.split(".")[1], tr.audit_branch)
            tr.status, tr.terminal = Status.FAILED, False
            tr.message = f"batch {result.batch_id} was recorded skipped by an operator while this run applied it: nothing published"
            log.warning("%s: %s", tr.table, tr.message)
            continue
        try:
            changelog.publish(led, tr)
            history.publish(led, tr)
            tr.snapshot_id = led.fast_forward(tr.table.split(".", 1)[1], tr.audit_branch, expected_head=tr.branch_snapshot)
            tr.status = Status.PUBLISHED
            log.info("%s: published batch %s as snapshot %s", tr.table, result.batch_id, tr.snapshot_id)
        except CdcError as exc:
            tr.status, tr.terminal, tr.message = Status.FAILED, False, str(exc)
        except Exception as exc:  # a lost commit race (pyiceberg's CommitFailedException): transient
            msg = branches.concurrent_apply_message(exc, tr.table, result.batch_id, tr.branch)
            if msg is None:
                raise
            tr.status, tr.terminal, tr.message = Status.FAILED, False, msg
    result.fail_if_any()
    return result


def finish_batch(settings: Settings, result: BatchResult) -> BatchResult:
    """Close the attempt: the batch is *complete* (its files applied for
    discovery) only when every table published or skipped; record the ledger
    rows of every table and of the batch."""
    if result.status in (Status.NOTHING_TO_DO, Status.DRY_RUN, Status.SKIPPED):
        return result
    result.stage = "finish"
    led = ledger.Ledger(settings)
    for t in result.tables:
        if t.status == Status.VALIDATED and t.branch:  # its publish may have committed, then died before saving its result
            snap = led.published_snapshot(t.table.split(".", 1)[1], result.id)
            if snap is not None:
                t.status, t.snapshot_id = Status.PUBLISHED, snap
                log.warning(
                    "%s: found batch %s on main (snapshot %s): published by an attempt that did not save its result",
                    t.table,
                    result.batch_id,
                    snap,
                )
    unfinished = [t for t in result.tables if t.status in (Status.WRITTEN, Status.VALIDATED)]
    for t in unfinished:
        t.message = f"stopped after the {t.status} stage: its next stage did not run or did not finish"
        t.status, t.terminal = Status.FAILED, False
    result.fail_if_any()
    if result.status != Status.FAILED:
        result.status = Status.COMPLETE
        forced = [t.table for t in result.tables if t.override]
        if result.failed_checks or forced:
            result.message = f"{result.describe_override()}; let through: {result.failed_checks + forced}"
    led.record_batch(result)
    return result
