"""Audit branches: every write of a batch goes to branch ``audit_<batch>``;
``main`` moves only by the ledger's fast-forward after the gate passed.  The
batch's ledger properties ride on every commit of the branch through
Iceberg's session snapshot properties (``spark.sql.iceberg.snapshot-property.*``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from pyspark.sql import DataFrame, SparkSession

from cdc_apply import ledger
from cdc_apply.apply import catalog_reads
from cdc_apply.apply.compact import sql_string
from cdc_apply.apply.maintenance_lock import MAINTENANCE_BRANCH, recover_stale_lock
from cdc_apply.apply.tables import TableSpec
from cdc_apply.errors import CdcError, ConcurrentApply

if TYPE_CHECKING:
    from cdc_apply.archive.files import ArchiveFile
    from cdc_apply.config import Settings

_SNAPSHOT_PROPERTY = "spark.sql.iceberg.snapshot-property."
ATTEMPT_PROPERTY = ledger.PREFIX + "attempt-id"
"""Snapshot-summary property naming the run that wrote a branch head (runs
of one batch share the branch): ``own_head`` checks it."""


@contextlib.contextmanager
def snapshot_properties(spark: SparkSession, props: dict[str, str]) -> Iterator[None]:
    for k, v in props.items():
        spark.conf.set(_SNAPSHOT_PROPERTY + k, v)
    try:
        yield
    finally:
        for k in props:
            spark.conf.unset(_SNAPSHOT_PROPERTY + k)


def snapshot_property_options(props: dict[str, str]) -> dict[str, str]:
    """The same properties as options of one DataFrame write: they ride on
    that write's commit alone, whatever the session's conf says meanwhile (a
    write on a thread of its own, ``runtime.background``)."""
    return {"snapshot-property." + k: v for k, v in props.items()}


def branch_ref(spec: TableSpec, branch: str) -> str:
    return f"{spec.identifier}.branch_{branch}"


def reset_branch(spark: SparkSession, spec: TableSpec, branch: str) -> int | None:
    """(Re)create the audit branch at main's current snapshot: a retry starts
    clean.  Refuses (transient: retried) while table maintenance runs.
    Returns the snapshot the branch was created at: main's head, read
    before the branch is made from it; on an empty table, the empty
    snapshot CREATE BRANCH makes, which no run wrote.  Not simply the
    branch's head read after: another run of the batch may have reset the
    branch and committed on it in between, and ``own_head`` would then take
    that run's commit for where this run began (both runs' rows published
    as one, the nemesis's two-applies race)."""
    spark.sql(f"ALTER TABLE {spec.identifier} DROP BRANCH IF EXISTS {branch}")
    start = _branch_heads(spark, spec, ("main",)).get("main")
    as_of = "" if start is None else f" AS OF VERSION {int(start)}"
    spark.sql(f"ALTER TABLE {spec.identifier} CREATE BRANCH {branch}{as_of}")
    if MAINTENANCE_BRANCH in _branch_heads(spark, spec, (MAINTENANCE_BRANCH,)) and recover_stale_lock(spark, spec.identifier) is None:
        spark.sql(f"ALTER TABLE {spec.identifier} DROP BRANCH IF EXISTS {branch}")
        raise CdcError(f"{spec.identifier}: table maintenance is running (branch {MAINTENANCE_BRANCH!r}); the batch is retried after it")
    # a killed maintenance left the lock: recover_stale_lock logged and dropped it
    if start is None:
        head, snaps = _head_and_attempts(spark, spec, branch)
        if head is not None and snaps.get(head, (None, None))[1] is not None:
            raise ConcurrentApply(
                f"another run of this batch is applying it to {spec.identifier} at the same time (it committed {head} on branch "
                f"{branch!r} as this run created it); retry: the retry applies what is left, exactly once"
            )
        start = head
    return start


def reset_branch_for(
    spark: SparkSession,
    spec: TableSpec,
    branch: str,
    files: Sequence[ArchiveFile],
    read: ledger.TableLedger | None,
    settings: Settings,
    batch_id: str,
) -> int | None:
    """``reset_branch`` for a write of ``files``, which main's ledger as
    ``read`` before says are not applied yet.  Refuses (transient
    ConcurrentApply: the retry applies what is left) when the snapshot the
    branch starts from holds any of them, or the batch (a file with held
    lines is in no ledger's files, held.py): another run of the batch
    published between the read and the branch, and writing the files again
    on top of its commit would apply them twice (an append, the change log,
    would log every change twice: the nemesis's two-applies race).  The
    fast-forward publishes only onto the snapshot the branch starts from,
    so the ledger there is the one the write must be new to."""
    start = reset_branch(spark, spec, branch)
    if start is None or start == (read.snapshot_id if read is not None else None):
        return start
    at_start = ledger.Ledger(settings).table_ledger(spec.short, start) or ledger.TableLedger()
    again = [f.path for f in files if f.path in at_start.files] or ([f"batch {batch_id}"] if batch_id in at_start.batches else [])
    if again:
        raise ConcurrentApply(
            f"another run applied {len(again)} file(s) of this batch to {spec.identifier} while this run prepared them "
            f"(main moved to {start} after this run read its ledger), e.g. {again[0]}; retry: the retry applies what is left, exactly once"
        )
    return start


def _branch_heads(spark: SparkSession, spec: TableSpec, names: tuple[str, ...]) -> dict[str, int | None]:
    """Head snapshot per named ref that exists (a branch of an empty table has none)."""
    table = catalog_reads.load_table(spark, spec.identifier)
    if table is not None:
        return {n: ref.snapshot_id for n, ref in table.metadata.refs.items() if n in names}
    wanted = ", ".join(sql_string(n) for n in names)
    rows = spark.sql(f"SELECT name, snapshot_id FROM {spec.identifier}.refs WHERE name IN ({wanted})").collect()
    return {r["name"]: r["snapshot_id"] for r in rows}


def branch_snapshot(spark: SparkSession, spec: TableSpec, branch: str) -> int | None:
    return _branch_heads(spark, spec, (branch,)).get(branch)


def read_branch(spark: SparkSession, spec: TableSpec, branch: str) -> DataFrame:
    return spark.sql(f"SELECT * FROM {spec.identifier} VERSION AS OF '{branch}'")


def ledger_commit(spark: SparkSession, spec: TableSpec, branch: str) -> None:
    """An empty append carrying the ledger properties, for a batch whose events
    were all superseded or duplicates: its files still count as applied."""
    spark.table(spec.identifier).limit(0).writeTo(branch_ref(spec, branch)).append()


def _head_and_attempts(
    spark: SparkSession, spec: TableSpec, branch: str
) -> tuple[int | None, dict[int | None, tuple[int | None, str | None]]]:
    """The branch's head, and per snapshot of the table its parent and the
    attempt id that wrote it: one read of the table's metadata."""
    table = catalog_reads.load_table(spark, spec.identifier)
    if table is not None:
        ref = table.metadata.refs.get(branch)
        summaries = catalog_reads.snapshot_summaries(table)
        return ref.snapshot_id if ref is not None else None, {k: (parent, s.get(ATTEMPT_PROPERTY)) for k, (parent, s) in summaries.items()}
    query = f"SELECT snapshot_id, parent_id, summary['{ATTEMPT_PROPERTY}'] AS a FROM {spec.identifier}.snapshots"
    return branch_snapshot(spark, spec, branch), {r["snapshot_id"]: (r["parent_id"], r["a"]) for r in spark.sql(query).collect()}


def own_head(spark: SparkSession, spec: TableSpec, branch: str, attempt: str, batch_id: str, start: int | None) -> int:
    """The branch head, checked to be this run's own commit and every commit
    between it and ``start`` (the branch as this run created it) too (their
    attempt id in the snapshot summary): another run of the batch may have
    reset the branch or committed in between.  The append of new keys
    (merge.append_new_keys) validates nothing at commit, so a run whose
    append landed on another run's commits fails here."""
    head, snaps = _head_and_attempts(spark, spec, branch)
    own, at = head is not None and head != start, head
    while own and at != start:
        parent, a = snaps.get(at, (None, None))
        own = a == attempt
        at = parent
        if at is None and start is not None:
            own = False
    if not own or head is None:
        raise ConcurrentApply(
            f"another run is applying batch {batch_id} to {spec.identifier} at the same time (the head {head} of branch {branch!r} "
            "is not this run's write); retry: the retry applies what is left, exactly once"
        )
    return int(head)


_CONCURRENT = ("ConcurrentApply", "ValidationException", "CommitFailedException", "CommitStateUnknownException", "Found conflicting files")


def concurrent_apply_message(exc: BaseException, table: str, batch_id: str | None, branch: str | None) -> str | None:
    """The clear, transient message of a failure that means another run is
    applying the same batch: Iceberg's optimistic concurrency let the other
    run's commit (or its reset of the shared audit branch) win.  None for
    any other failure."""
    text = f"{type(exc).__name__}: {exc}"
    if any(marker in text for marker in _CONCURRENT) or (branch and branch in text):
        return (
            f"{ConcurrentApply.__name__}: another run is applying batch {batch_id} to {table} at the same time "
            f"(its commit on branch {branch!r} won: {text.splitlines()[0][:300]}); retry: the retry applies what is left, exactly once"
        )
    return None
