"""Write one table's net changes onto its audit branch: the per-column
MERGE (each column takes the value of the latest event that set it) and the
truncate watermark.  Branches themselves: ``branches``."""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_apply.apply.branches import branch_ref
from cdc_apply.apply.compact import META_POS, NEVER_SET, quote
from cdc_apply.apply.tables import INT_TYPES, TableSpec


def apply_truncate(spark: SparkSession, spec: TableSpec, branch: str, truncated_at: str) -> None:
    """Rows older than the truncate disappear; the watermark (in the ledger)
    keeps older late events from bringing them back.  A newer row whose
    columns were partly set before the truncate (a late truncate after
    partial updates) has those columns set NULL at the truncate."""
    t = _sql_str(truncated_at)
    spark.sql(f"DELETE FROM {branch_ref(spec, branch)} WHERE _cdc_position < '{t}'")
    data_cols = [c for c in spec.columns if c not in spec.key_columns]
    if data_cols:
        older = {c: f"coalesce(_cdc_col_pos['{_sql_str(c)}'], _cdc_position) < '{t}'" for c in data_cols}
        sets = [f"{quote(c)} = CASE WHEN {cond} THEN NULL ELSE {quote(c)} END" for c, cond in older.items()]
        pos = (
            f"map_filter(transform_values(_cdc_col_pos, (k, v) -> CASE WHEN v < '{t}' THEN '{t}' ELSE v END), (k, v) -> v < _cdc_position)"
        )
        spark.sql(
            f"UPDATE {branch_ref(spec, branch)} SET {', '.join(sets)}, _cdc_col_pos = {pos} "
            f"WHERE NOT _cdc_deleted AND array_min(map_values(_cdc_col_pos)) < '{t}'"
        )


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


def _literal(value: Any, spark_type: str) -> str | None:
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
    spark: SparkSession,
    spec: TableSpec,
    branch: str,
    source: DataFrame,
    batch_id: str,
    key_ranges: dict[str, tuple] | None = None,
    *,
    new_keys: int | None = None,
    stored_keys: int | None = None,
) -> None:
    """Write the net changes ``source`` (compact.merge_source) onto the branch.

    With the counts of its keys the labelling found new to the branch
    (``new_keys``: no stored row, no tombstone) and stored in it
    (``stored_keys``), only the stored keys go through the MERGE — without an
    insert clause, so Spark joins the target with them by an inner join and
    ``key_ranges`` (theirs) prune the target's files — and the new keys are
    appended afterwards (``append_new_keys``): a commit that reads and
    rewrites no data file.  The MERGE goes first, so that it never reads the
    appended files.  Without the counts: one MERGE of every key."""
    if new_keys is None or stored_keys is None:
        _merge(spark, spec, branch, source, batch_id, key_ranges, matched_only=False)
        return
    stored = F.col("_cdc_stored_pos").isNotNull()
    if stored_keys:
        _merge(spark, spec, branch, source.where(stored), batch_id, key_ranges, matched_only=True)
    if new_keys:
        append_new_keys(spark, spec, branch, source.where(~stored), batch_id)


def _merge(
    spark: SparkSession,
    spec: TableSpec,
    branch: str,
    source: DataFrame,
    batch_id: str,
    key_ranges: dict[str, tuple] | None,
    *,
    matched_only: bool,
) -> None:
    view = f"_cdc_src_{abs(hash((spec.identifier, batch_id)))}"
    source.createOrReplaceTempView(view)
    try:
        spark.sql(merge_sql(spec, branch, view, batch_id, key_ranges, matched_only=matched_only))
    finally:
        spark.catalog.dropTempView(view)


def append_new_keys(spark: SparkSession, spec: TableSpec, branch: str, source: DataFrame, batch_id: str) -> None:
    """Append the net changes of keys the branch does not hold (no stored
    row, no tombstone: ``_cdc_stored_pos`` NULL in the labelling) as new rows,
    exactly as the MERGE's ``WHEN NOT MATCHED`` clause would insert them: an
    append commit that rewrites no data file.  A key whose last event is a
    delete goes in as a tombstone; a partial row leaves the columns no event
    set NULL, their ``_cdc_col_pos`` at ``NEVER_SET``."""
    data_cols = [c for c in spec.columns if c not in spec.key_columns]
    cols = [F.col(quote(c)) for c in spec.key_columns + data_cols]
    rows = source.select(
        *cols,
        F.col(META_POS).alias("_cdc_position"),
        F.col("_cdc_op"),
        (F.col("_cdc_action") == "delete").alias("_cdc_deleted"),
        F.col("_cdc_commit_ts"),
        F.col("_cdc_tx_id"),
        F.lit(batch_id).alias("_cdc_batch_id"),
        F.current_timestamp().alias("_cdc_applied_at"),
        F.expr(new_col_pos(data_cols, "")).alias("_cdc_col_pos"),
    )
    rows.writeTo(branch_ref(spec, branch)).append()


def _batch_pos(c: str, s: str) -> str:
    """The position that set column ``c`` in the batch (alias prefix ``s``)."""
    return f"(CASE WHEN array_contains({s}_cdc_present, '{_sql_str(c)}') THEN {s}_cdc_cpos['{_sql_str(c)}'] ELSE {s}_cdc_delpos END)"


def new_col_pos(data_cols: list[str], s: str) -> str:
    """``_cdc_col_pos`` of a new row (alias prefix ``s``, e.g. ``"s."``): the
    columns set below its position, ``NEVER_SET`` for the ones never set."""
    if not data_cols:
        return "cast(map() AS map<string,string>)"
    new_pos = ", ".join(f"'{_sql_str(c)}', coalesce({_batch_pos(c, s)}, '{NEVER_SET}')" for c in data_cols)
    return f"map_filter(map({new_pos}), (k, v) -> v < {s}{META_POS})"


def merge_sql(
    spec: TableSpec, branch: str, view: str, batch_id: str, key_ranges: dict[str, tuple] | None = None, *, matched_only: bool = False
) -> str:
    """The MERGE of the net changes in ``view`` (compact.merge_source) into the branch.

    Per data column, the stored value and the batch's compete by the position
    that set them: the stored one's is ``_cdc_col_pos[c]`` (absent: the row's
    position; a tombstone's columns were set NULL at its position), the
    batch's is the position of its last event carrying the column, else of
    its last delete of the key.  The higher one wins, so re-applying a batch
    changes nothing and a late event fills only what later events did not
    carry.  ``_cdc_col_pos`` keeps the columns set below the row's position."""
    on = " AND ".join([f"t.{quote(k)} = s.{quote(k)}" for k in spec.key_columns] + key_range_condition(spec, key_ranges))
    data_cols = [c for c in spec.columns if c not in spec.key_columns]
    batch = _sql_str(batch_id)
    newer = f"s.{META_POS} > t._cdc_position"

    def batch_pos(c: str) -> str:
        return _batch_pos(c, "s.")

    def stored_pos(c: str) -> str:
        return f"(CASE WHEN t._cdc_deleted THEN t._cdc_position ELSE coalesce(t._cdc_col_pos['{_sql_str(c)}'], t._cdc_position) END)"

    def wins(c: str) -> str:
        return f"coalesce({batch_pos(c)} > {stored_pos(c)}, false)"

    row_pos = f"greatest(s.{META_POS}, t._cdc_position)"
    matched_pos = ", ".join(f"'{_sql_str(c)}', CASE WHEN {wins(c)} THEN {batch_pos(c)} ELSE {stored_pos(c)} END" for c in data_cols)
    empty = "cast(map() AS map<string,string>)"
    col_pos_matched = f"map_filter(map({matched_pos}), (k, v) -> v < {row_pos})" if data_cols else empty
    sets = [f"{quote(c)} = CASE WHEN {wins(c)} THEN s.{quote(c)} ELSE t.{quote(c)} END" for c in data_cols]
    meta = [
        f"_cdc_col_pos = {col_pos_matched}",
        f"_cdc_op = CASE WHEN {newer} THEN s._cdc_op ELSE t._cdc_op END",
        f"_cdc_commit_ts = CASE WHEN {newer} THEN s._cdc_commit_ts ELSE t._cdc_commit_ts END",
        f"_cdc_tx_id = CASE WHEN {newer} THEN s._cdc_tx_id ELSE t._cdc_tx_id END",
        f"_cdc_deleted = CASE WHEN {newer} THEN s._cdc_action = 'delete' ELSE t._cdc_deleted END",
        f"_cdc_position = {row_pos}",
        f"_cdc_batch_id = '{batch}'",
        "_cdc_applied_at = current_timestamp()",
    ]
    insert_cols = [quote(c) for c in spec.key_columns + data_cols]
    insert_vals = [f"s.{quote(c)}" for c in spec.key_columns + data_cols]
    insert = f"""
    WHEN NOT MATCHED THEN INSERT
      ({", ".join(insert_cols)}, _cdc_position, _cdc_op, _cdc_deleted, _cdc_commit_ts, _cdc_tx_id, _cdc_batch_id, _cdc_applied_at, _cdc_col_pos)
      VALUES ({", ".join(insert_vals)}, s.{META_POS}, s._cdc_op, s._cdc_action = 'delete', s._cdc_commit_ts, s._cdc_tx_id,
              '{batch}', current_timestamp(), {new_col_pos(data_cols, "s.")})"""
    return f"""
    MERGE INTO {branch_ref(spec, branch)} t
    USING {view} s
    ON {on}
    WHEN MATCHED AND s.{META_POS} <> t._cdc_position THEN UPDATE SET
      {", ".join(sets + meta)}{"" if matched_only else insert}
    """


def _sql_str(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")
