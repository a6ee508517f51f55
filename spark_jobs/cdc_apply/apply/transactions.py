"""Transaction-consistent publish (source option ``publish: transactions``):
readers never see part of a source transaction.

* **Hold what is incomplete.**  A decoded message that belongs to a source
  transaction carries ``tx_group`` (the transaction as the format reports it)
  and ``tx_order`` (its place in it); the message that says how many events
  the transaction has carries ``tx_total`` (Debezium's END marker
  ``event_count``, Qlik's ``transactionLastEvent`` event's counter).  A
  transaction is complete among the lines read when its total is known and
  that many distinct places were read.  Every event and marker of an
  incomplete one is *held* (``held.py``): its file stays pending, the next
  batch reads those lines again, with whatever arrived since.  Messages
  without transaction metadata apply as they come.
* **Never forever.**  A file's held lines remember since when it has been
  held (``HELD_SINCE``); once a transaction has waited
  ``transaction_max_hold_hours`` the batch fails, naming it and what is
  missing (an END marker that was never archived, an event that was
  quarantined).  An operator's *force* applies it as it is.
* **Publish together.**  Tables that shared a transaction in the batch form
  a publish group: all of them publish, or none (a table whose group-mate
  failed is held back; one whose group-mate is still being validated waits).
  Each table's publish is its own catalog commit: during the few seconds of
  the step a reader of two tables can see one published and not yet the
  other (Iceberg catalogs here commit one table at a time).
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_apply.apply.held import HELD_SINCE
from cdc_apply.status import Status

log = logging.getLogger(__name__)

HELD_REASON = "transaction incomplete"


@dataclass(frozen=True)
class Incomplete:
    group: str
    seen: int
    total: int | None
    files: tuple[str, ...]

    def reason(self) -> str:
        total = "?" if self.total is None else str(self.total)
        missing = "its END marker / last event not read" if self.total is None else f"{self.total - self.seen} event(s) not read"
        return f"{HELD_REASON}: transaction {self.group}: {self.seen} of {total} event(s) read ({missing})"


@dataclass(frozen=True)
class Census:
    transactions: int
    """Source transactions among the lines read."""
    incomplete: list[Incomplete]


def census(decoded: DataFrame) -> Census:
    """The transactions among the decoded lines and which are incomplete (one
    Spark job; the incomplete ones come to the driver: the batch's tail)."""
    tx = decoded.where(
        F.col("tx_group").isNotNull() & F.col("status").isin("event", "skipped") & ~F.coalesce(F.col("reason") == RESOLVED, F.lit(False))
    )
    groups = tx.groupBy("tx_group").agg(
        F.max("tx_total").alias("total"),
        F.count_distinct("tx_order").alias("seen"),  # markers have no place: not counted
        F.array_sort(F.collect_set("file")).alias("files"),
    )
    short = F.col("total").isNull() | (F.col("seen") < F.col("total"))
    row = groups.agg(
        F.count(F.lit(1)).alias("n"), F.collect_list(F.when(short, F.struct("tx_group", "seen", "total", "files"))).alias("inc")
    ).collect()[0]
    incomplete = [Incomplete(r["tx_group"], int(r["seen"]), r["total"], tuple(r["files"])) for r in row["inc"] or []]
    return Census(int(row["n"]), sorted(incomplete, key=lambda i: i.group))


def hold(spark: SparkSession, decoded: DataFrame, incomplete: list[Incomplete]) -> DataFrame:
    """``decoded`` with the events and markers of ``incomplete`` transactions
    as held lines, each with its transaction's reason."""
    if not incomplete:
        return decoded
    reasons = spark.createDataFrame([(i.group, i.reason()) for i in incomplete], "_txh_group string, _txh_reason string")
    joined = decoded.join(F.broadcast(reasons), decoded["tx_group"] == reasons["_txh_group"], "left")
    held = F.col("_txh_group").isNotNull() & F.col("status").isin("event", "skipped")
    out = {
        "status": F.when(held, F.lit("held")).otherwise(F.col("status")),
        "reason": F.when(held, F.col("_txh_reason")).otherwise(F.col("reason")),
    }
    return joined.select(*[out[c].alias(c) if c in out else F.col(c) for c in decoded.columns])


def overdue(
    incomplete: list[Incomplete], held_files: dict[str, dict[str, Any]], max_hours: float, now: dt.datetime | None = None
) -> dict[str, str]:
    """The incomplete transactions held longer than ``max_hours`` (from their
    oldest file's ``HELD_SINCE``): transaction -> a line for the failure message."""
    now = now or dt.datetime.now(dt.UTC)
    out = {}
    for i in incomplete:
        since = [dt.datetime.fromisoformat(held_files[f][HELD_SINCE]) for f in i.files if HELD_SINCE in held_files.get(f, {})]
        if since and now - min(since) > dt.timedelta(hours=max_hours):
            out[i.group] = f"{i.reason()}, held since {min(since).isoformat(timespec='seconds')} in {', '.join(i.files)}"
    return out


def linked_tables(events: DataFrame) -> list[list[tuple[Any, ...]]]:
    """The source tables that shared a transaction among ``events``, as
    groups (connected components; one Spark job): each publishes whole."""
    rows = (
        events.where(F.col("tx_group").isNotNull())
        .groupBy("tx_group")
        .agg(F.array_sort(F.collect_set(F.struct("database", "schema_name", "table_name"))).alias("t"))
        .where(F.size("t") > 1)
        .select("t")
        .distinct()
        .collect()
    )
    parent: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def root(x: tuple[Any, ...]) -> tuple[Any, ...]:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for r in rows:
        ids = [tuple(t) for t in r["t"]]
        for other in ids[1:]:
            parent[root(other)] = root(ids[0])
    groups: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    for x in list(parent):
        groups.setdefault(root(x), []).append(x)
    return sorted(sorted(g) for g in groups.values())


def mates(groups: list[list[str]], table: str) -> list[str]:
    """The other tables of ``table``'s publish group (none: it publishes alone)."""
    return next((sorted(set(g) - {table}) for g in groups if table in g), [])


RESOLVED = "resolved-watermark"
FORCED_KEY = "_cdc_forced_transactions"
"""Source-state key: the source transactions an operator's *force* let
through incomplete (sorted); a rebuild's replay lets the same through
(``config.SourceConfig.forced_transactions``)."""
RESOLVED_KEY = "_cdc_resolved"
"""Source-state key (CockroachDB): stream -> the highest resolved timestamp it emitted."""
WATERMARK_REASON = "after the resolved timestamp"


def watermark(decoded: DataFrame, prior: dict[str, str]) -> tuple[str | None, dict[str, str]]:
    """CockroachDB: the feed's resolved watermark -- the lowest, over its
    streams (Kafka partitions; one stream for webhook and cloud-storage
    sinks), of the highest resolved timestamp each emitted, this batch's and
    earlier ones' (``prior``) -- and the streams' marks to carry.  None: no
    resolved timestamp yet.  A changefeed emits every row of a transaction at
    the transaction's timestamp, so the rows at or below the watermark are
    whole transactions, and no row below it can arrive later."""
    marks = dict(prior)
    rows = (
        decoded.where((F.col("status") == "skipped") & (F.col("reason") == RESOLVED))
        .groupBy(F.coalesce(F.col("tx_group"), F.lit("*")).alias("s"))
        .agg(F.max("position").alias("p"))
        .collect()
    )
    for r in rows:
        marks[r["s"]] = max(marks.get(r["s"], r["p"]), r["p"])
    return (min(marks.values()) if marks else None), marks


def hold_after(decoded: DataFrame, mark: str | None) -> DataFrame:
    """``decoded`` with its events after the watermark ``mark`` (all, without one) held."""
    late = (F.col("status") == "event") & (F.lit(mark).isNull() | (F.col("position") > F.lit(mark)))
    reason = F.concat(F.lit(f"{WATERMARK_REASON}: position "), F.col("position"), F.lit(f" is after the feed's resolved watermark {mark}"))
    out = {"status": F.when(late, F.lit("held")).otherwise(F.col("status")), "reason": F.when(late, reason).otherwise(F.col("reason"))}
    return decoded.select(*[out[c].alias(c) if c in out else F.col(c) for c in decoded.columns])


class GatePending(Exception):
    """A table's publish waits for the gate of a table it shares transactions with."""


def check_group(result: Any, tr: Any) -> None:
    """Before ``tr`` (validated) publishes: hold it back (status failed) when a
    table of its publish group failed; raise GatePending while one is still
    before its gate.  No-op for a table that publishes alone."""
    names = mates(result.publish_groups, tr.table)
    if not names:
        return
    others = [result.table(n) for n in names]
    failed = [o for o in others if o.status == Status.FAILED]
    if failed:
        tr.status, tr.terminal = Status.FAILED, all(o.terminal for o in failed)
        tr.message = (
            f"held back: {tr.table} shares source transactions with {', '.join(o.table for o in failed)} in batch "
            f"{result.batch_id}, which failed; publish: transactions publishes them together or not at all "
            "(a forced re-run publishes both, publish: events each on its own)"
        )
        log.warning("%s: %s", tr.table, tr.message)
        return
    pending = [o.table for o in others if o.status == Status.WRITTEN]
    if pending:
        raise GatePending(f"{tr.table} publishes with {', '.join(pending)} (shared source transactions): waiting for their gate")
