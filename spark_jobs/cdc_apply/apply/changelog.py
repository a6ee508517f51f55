"""The change log (bronze): every decoded change of a table, appended to
``<namespace>.<table>_changes`` in the batch that applies it and behind the
same gate.

Exactly once, by file, like the table: the change log keeps its own ledger
(``cdc.files`` in its snapshot summaries, ``ledger.TableLedger``) and writes
only the events of the batch's files it does not hold yet, onto the batch's
audit branch; the publish fast-forwards it *before* the table.  So the change
log's applied files always include the table's: a run killed between the two
fast-forwards re-applies the table, and the change log skips the files it
already holds (a batch formed again with other files included).
"""

from __future__ import annotations

import uuid
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_apply import ledger
from cdc_apply.apply import branches, tables
from cdc_apply.archive.files import ArchiveFile
from cdc_apply.errors import ConfigError

SUFFIX = "_changes"
COLUMNS = (
    "batch_id string NOT NULL, source_table string, op string NOT NULL, key_columns array<string>, key map<string,string>, "
    "after map<string,string>, before map<string,string>, present array<string>, position string, tx_id string, "
    "commit_ts timestamp, change_id string, message_id string, file string NOT NULL, line bigint NOT NULL"
)
"""``present``: the columns the after image carries (sorted): a column absent
from it was not present in the message (partial rows), one present with NULL
was set to NULL."""
SHUFFLE_BYTES_PER_WRITE_TASK = 64 << 20
"""The change log's write shuffles its rows by day (the table's partitions),
and Iceberg asks Spark for write tasks of a size it derives from its 512 MB
target file, so a backfill's rows of one day (1M events: ~260 MB shuffled)
were written by one task on one core while the batch waited for it
(bench/README, issue 20 step 22).  Asked for this size instead, adaptive
execution splits the day among tasks; a small batch (one shuffle partition,
``spark_conf.small_batch_conf``) writes one file as before."""


def identifier(table_identifier: str) -> str:
    """``catalog.ns.table`` -> ``catalog.ns.table_changes``."""
    return table_identifier + SUFFIX


def table_spec(ident: str) -> tables.TableSpec:
    """The change log ``ident`` as the branch and ledger helpers take a table (it has no key)."""
    return tables.TableSpec(identifier=ident, key_columns=[], columns={})


def change_rows(events: DataFrame, batch_id: str, key_columns: list[str]) -> DataFrame:
    """Decoded events (``decode.stage.OUTCOME_DDL``) -> change-log rows.  The
    key is read as the apply reads it (``compact.key_text``: a delete's from
    its before image); a truncate has no key; an event without a key value
    (quarantined by the apply) is left out."""
    image = F.when(F.col("op") == "d", F.coalesce("before", "after")).otherwise(F.coalesce("after", "before"))
    other = F.when(F.col("op") == "d", F.col("after")).otherwise(F.col("before"))
    keys = F.array(*[F.lit(k) for k in key_columns])
    key = F.when(F.col("op") != "t", F.map_from_arrays(keys, F.array(*[F.coalesce(image[k], other[k]) for k in key_columns]))).cast(
        "map<string,string>"
    )
    table = F.concat_ws(".", "database", "schema_name", "table_name")
    keyless = F.lit(False)
    for k in key_columns:  # quarantined as null-key by the apply (its quarantine row keeps them), not changes of the table
        keyless = keyless | F.coalesce(image[k], other[k]).isNull()
    return events.where((F.col("op") == "t") | ~keyless).select(
        F.lit(batch_id).alias("batch_id"),
        table.alias("source_table"),
        "op",
        F.when(F.col("op") != "t", keys).alias("key_columns"),
        key.alias("key"),
        "after",
        "before",
        F.sort_array(F.map_keys("after")).alias("present"),  # generated code; array_sort's comparator is a lambda
        "position",
        "tx_id",
        "commit_ts",
        "change_id",
        "message_id",
        "file",
        "line",
    )


def ensure_table(spark: SparkSession, ident: str, source: str) -> None:
    """Partitioned by day of commit time (a time range reads its days); a
    batch's rows are written by one commit, so its files hold only its
    ``batch_id`` and their column bounds prune a read of one batch.  A table
    of that name that is not a change log (a source table ``<t>_changes``)
    is refused, terminally: its target must be mapped elsewhere.  A change
    log made before ``tables.ROW_GROUP_BYTES`` is given them."""
    if tables.table_exists(spark, ident):
        properties = tables.table_properties(spark, ident)
        if "cdc.changelog-of" not in properties:
            raise ConfigError(
                f"{ident} is a table, not the change log of {ident.removesuffix(SUFFIX)}: map one of them to another target "
                "(`tables: {<table>: {target: <name>}}`) or set `changelog: false` on the source"
            )
        tables.keep_row_groups(spark, ident, properties)
        return
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {ident} ({COLUMNS}) USING iceberg PARTITIONED BY (days(commit_ts)) "
        f"TBLPROPERTIES ({tables.created_properties(source, **{'cdc.changelog-of': ident.removesuffix(SUFFIX)})})"
    )


def write(work: Any, spec: tables.TableSpec, events: DataFrame, files: list[ArchiveFile]) -> tuple[str, int] | None:
    """Write the change-log rows of ``files`` (``work``: the ``table.TableWork``)
    not yet in the change log onto the batch's audit branch of
    ``<table>_changes``; returns (identifier, branch head) for the publish,
    None when the change log holds every file already."""
    spark, batch_id = work.spark, work.batch_id
    ident = identifier(spec.identifier)
    ensure_table(spark, ident, work.source.name)
    cl = table_spec(ident)
    led = ledger.Ledger(work.settings).table_ledger(cl.short)
    new = ledger.not_yet_applied(files, led.files if led else {}, ident)
    if not new or (led is not None and batch_id in led.batches):
        # a run of this batch logged it (a file with held lines is in no
        # ledger's files until released, held.py), then died before the table's publish
        return None
    rows = change_rows(events.where(F.col("file").isin([f.path for f in new])), batch_id, spec.key_columns)
    branch = ledger.audit_branch(batch_id)
    start = branches.reset_branch_for(spark, cl, branch, new, led, work.settings, batch_id)
    applied = [f.as_dict() for f in new if f.path not in work.held_files]
    props = ledger.summary_properties(batch_id, applied, position_max=None, truncated_at=None, counts={})
    attempt = props[branches.ATTEMPT_PROPERTY] = uuid.uuid4().hex
    # as write options, not session conf: the table's labelling runs beside this write (table._apply)
    options = {**branches.snapshot_property_options(props), "advisory-partition-size": str(SHUFFLE_BYTES_PER_WRITE_TASK)}
    rows.writeTo(branches.branch_ref(cl, branch)).options(**options).append()
    return ident, branches.own_head(spark, cl, branch, attempt, batch_id, start)


def publish(led: ledger.Ledger, tr: Any) -> None:
    """Fast-forward the change log of a validated table (``results.TableResult``)
    before the table itself (see the module docstring)."""
    if tr.changelog:
        led.fast_forward(tr.changelog.split(".", 1)[1], tr.audit_branch, expected_head=tr.changelog_snapshot)
