"""Write one table's net changes onto its audit branch, and publish it.

Write-audit-publish: every write of a batch goes to branch ``audit_<batch>``;
``main`` moves only by ``fast_forward`` after the gate passed.  The batch's
ledger properties ride on every commit of the branch through Iceberg's
session snapshot properties (``spark.sql.iceberg.snapshot-property.*``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from pyspark.sql import DataFrame, SparkSession

from .compact import META_POS, quote
from .tables import INT_TYPES, TableSpec

_SNAPSHOT_PROPERTY = "spark.sql.iceberg.snapshot-property."
# Table maintenance holds this branch while it commits to main: a batch and
# maintenance each create their branch first and look for the other's second,
# so (catalog commits being serialised) at least one of them sees the other.
MAINTENANCE_BRANCH = "cdc_maintenance"


@contextlib.contextmanager
def snapshot_properties(spark: SparkSession, props: dict[str, str]) -> Iterator[None]:
    for k, v in props.items():
        spark.conf.set(_SNAPSHOT_PROPERTY + k, v)
    try:
        yield
    finally:
        for k in props:
            spark.conf.unset(_SNAPSHOT_PROPERTY + k)


def branch_ref(spec: TableSpec, branch: str) -> str:
    return f"{spec.identifier}.branch_{branch}"


def reset_branch(spark: SparkSession, spec: TableSpec, branch: str) -> None:
    """(Re)create the audit branch at main's current snapshot: a retry starts
    clean.  Refuses (transient: retried) while table maintenance runs."""
    from .errors import CdcError

    spark.sql(f"ALTER TABLE {spec.identifier} DROP BRANCH IF EXISTS {branch}")
    spark.sql(f"ALTER TABLE {spec.identifier} CREATE BRANCH {branch}")
    if branch_snapshot(spark, spec, MAINTENANCE_BRANCH) is not None:
        from .maintenance import recover_stale_lock

        if recover_stale_lock(spark, spec.identifier) is not None:  # a killed maintenance left it: logged, dropped
            return
        spark.sql(f"ALTER TABLE {spec.identifier} DROP BRANCH IF EXISTS {branch}")
        raise CdcError(f"{spec.identifier}: table maintenance is running (branch {MAINTENANCE_BRANCH!r}); the batch is retried after it")


def branch_snapshot(spark: SparkSession, spec: TableSpec, branch: str) -> int | None:
    rows = spark.sql(f"SELECT snapshot_id FROM {spec.identifier}.refs WHERE name = '{branch}'").collect()
    return rows[0][0] if rows else None


def read_branch(spark: SparkSession, spec: TableSpec, branch: str) -> DataFrame:
    return spark.sql(f"SELECT * FROM {spec.identifier} VERSION AS OF '{branch}'")


def apply_truncate(spark: SparkSession, spec: TableSpec, branch: str, truncated_at: str) -> None:
    """Rows older than the truncate disappear; the watermark (in the ledger)
    keeps older late events from bringing them back."""
    spark.sql(f"DELETE FROM {branch_ref(spec, branch)} WHERE _cdc_position < '{_sql_str(truncated_at)}'")


def key_range_condition(spec: TableSpec, key_ranges: dict[str, tuple] | None) -> list[str]:
    """``t.k BETWEEN lo AND hi`` per key column, from the batch's own keys.

    Redundant for the join (a matching target row has a batch key) but, being
    on the target alone, pushed into its scan: Iceberg skips the data files
    whose key bounds miss the batch.  Merge-on-read needs it (copy-on-write
    prunes by matched files at run time, merge-on-read reads every file);
    the MERGE has no ``NOT MATCHED BY SOURCE`` clause, whose meaning it would
    change.  Only types whose literals are exact get one."""
    conds = []
    for k, (lo, hi) in (key_ranges or {}).items():
        lit_lo, lit_hi = _literal(lo, spec.columns[k]), _literal(hi, spec.columns[k])
        if lit_lo is not None and lit_hi is not None:
            conds.append(f"t.{quote(k)} BETWEEN {lit_lo} AND {lit_hi}")
    return conds


def _literal(value, spark_type: str) -> str | None:
    if value is None:
        return None
    if spark_type in INT_TYPES:
        return f"CAST('{int(value)}' AS {spark_type})"
    if spark_type.startswith("decimal("):
        return f"CAST('{value:f}' AS {spark_type})"  # fixed-point text: exact, no exponent
    if spark_type == "string":
        return f"'{_sql_str(value)}'"
    if spark_type == "date":
        return f"DATE '{value.isoformat()}'"
    return None  # timestamps (time zones), floats, binary: no range, still correct


def merge_changes(
    spark: SparkSession, spec: TableSpec, branch: str, source: DataFrame, batch_id: str, key_ranges: dict[str, tuple] | None = None
) -> None:
    view = f"_cdc_src_{abs(hash((spec.identifier, batch_id)))}"
    source.createOrReplaceTempView(view)
    try:
        spark.sql(merge_sql(spec, branch, view, batch_id, key_ranges))
    finally:
        spark.catalog.dropTempView(view)


def merge_sql(spec: TableSpec, branch: str, view: str, batch_id: str, key_ranges: dict[str, tuple] | None = None) -> str:
    """The MERGE of the net changes in ``view`` (compact.merge_source) into the branch."""
    on = " AND ".join([f"t.{quote(k)} = s.{quote(k)}" for k in spec.key_columns] + key_range_condition(spec, key_ranges))
    data_cols = [c for c in spec.columns if c not in spec.key_columns]
    batch = _sql_str(batch_id)
    meta = (
        f"_cdc_position = s.{META_POS}, _cdc_op = s._cdc_op, _cdc_commit_ts = s._cdc_commit_ts, "
        f"_cdc_tx_id = s._cdc_tx_id, _cdc_batch_id = '{batch}', _cdc_applied_at = current_timestamp()"
    )
    keep = [
        f"{quote(c)} = CASE WHEN s._cdc_base = 'table' AND NOT t._cdc_deleted "
        f"AND NOT array_contains(s._cdc_present, '{_sql_str(c)}') THEN t.{quote(c)} ELSE s.{quote(c)} END"
        for c in data_cols
    ]
    tomb = [f"{quote(c)} = NULL" for c in data_cols]
    insert_cols = [quote(c) for c in spec.key_columns + data_cols]
    insert_vals = [f"s.{quote(c)}" for c in spec.key_columns + data_cols]
    return f"""
    MERGE INTO {branch_ref(spec, branch)} t
    USING {view} s
    ON {on}
    WHEN MATCHED AND s.{META_POS} > t._cdc_position AND s._cdc_action = 'delete' THEN UPDATE SET
      {', '.join(tomb + [meta, '_cdc_deleted = true'])}
    WHEN MATCHED AND s.{META_POS} > t._cdc_position THEN UPDATE SET
      {', '.join(keep + [meta, '_cdc_deleted = false'])}
    WHEN NOT MATCHED THEN INSERT
      ({', '.join(insert_cols)}, _cdc_position, _cdc_op, _cdc_deleted, _cdc_commit_ts, _cdc_tx_id, _cdc_batch_id, _cdc_applied_at)
      VALUES ({', '.join(insert_vals)}, s.{META_POS}, s._cdc_op, s._cdc_action = 'delete', s._cdc_commit_ts, s._cdc_tx_id,
              '{batch}', current_timestamp())
    """


def ledger_commit(spark: SparkSession, spec: TableSpec, branch: str) -> None:
    """An empty append carrying the ledger properties, for a batch whose events
    were all superseded or duplicates: its files still count as applied."""
    spark.table(spec.identifier).limit(0).writeTo(branch_ref(spec, branch)).append()


def publish(spark: SparkSession, spec: TableSpec, branch: str) -> int:
    """Fast-forward main to the audit branch, drop the branch; returns main's snapshot id."""
    ns_table = spec.identifier.split(".", 1)[1]
    catalog = spec.identifier.split(".", 1)[0]
    spark.sql(f"CALL {catalog}.system.fast_forward('{ns_table}', 'main', '{branch}')")
    snap = branch_snapshot(spark, spec, "main")
    spark.sql(f"ALTER TABLE {spec.identifier} DROP BRANCH IF EXISTS {branch}")
    return int(snap)


def _sql_str(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")
