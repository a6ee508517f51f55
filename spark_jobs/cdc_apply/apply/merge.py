"""Write one table's net changes onto its audit branch: the per-column
MERGE (each column takes the value of the latest event that set it) and the
truncate watermark.  Branches themselves: ``branches``."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_apply.apply.branches import branch_ref, read_branch
from cdc_apply.apply.compact import MAX_KEY_CHANGE_CHAIN, META_POS, NEVER_SET, batch_position, quote, sql_string
from cdc_apply.apply.tables import INT_TYPES, TableSpec

EMPTY_MAP = "cast(map() AS map<string,string>)"
"""SQL: an empty ``map<string,string>`` (``_cdc_col_pos``, ``_cdc_inherited``)."""


def apply_truncate(spark: SparkSession, spec: TableSpec, branch: str, truncated_at: str, batch_id: str) -> None:
    """Rows older than the truncate disappear; the watermark (in the ledger)
    keeps older late events from bringing them back.  A newer row whose
    columns were partly set before the truncate (a late truncate after
    partial updates) has those columns unset: NULL at ``NEVER_SET``, as no
    event after the truncate has set them, so the insert half of a key
    change after the truncate still takes them from its delete half in a
    later batch (``refresh_inherited``), and a late event fills them.  A
    newer tombstone too: it is the state a key change's new key inherits,
    and the rows it gave its pre-truncate values are given them again,
    unset, by the caller's ``refresh_inherited`` (the rows changed here
    carry ``batch_id``).  The caller marks the table as holding partial
    rows (``tables.mark_partial_rows``)."""
    t = sql_string(truncated_at)
    spark.sql(f"DELETE FROM {branch_ref(spec, branch)} WHERE _cdc_position < {t}")
    data_cols = [c for c in spec.columns if c not in spec.key_columns]
    if data_cols:
        never = sql_string(NEVER_SET)
        older = {c: f"coalesce(_cdc_col_pos[{sql_string(c)}], _cdc_position) < {t}" for c in data_cols}
        sets = [f"{quote(c)} = CASE WHEN {cond} THEN NULL ELSE {quote(c)} END" for c, cond in older.items()]
        set_before = f"v <> {never} AND v < {t}"
        pos = f"map_filter(transform_values(_cdc_col_pos, (k, v) -> CASE WHEN {set_before} THEN {never} ELSE v END), (k, v) -> v < _cdc_position)"
        spark.sql(
            f"UPDATE {branch_ref(spec, branch)} SET {', '.join(sets)}, _cdc_col_pos = {pos}, "
            f"_cdc_batch_id = {sql_string(batch_id)}, _cdc_applied_at = current_timestamp() "
            f"WHERE exists(map_values(_cdc_col_pos), v -> {set_before})"
        )


def key_range_condition(spec: TableSpec, key_ranges: dict[str, tuple] | None, alias: str | None = "t") -> list[str]:
    """``t.k BETWEEN lo AND hi`` per key column, from the batch's own keys
    (``alias`` None: ``k BETWEEN ...``, for a frame's ``where``).

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
            conds.append(f"{alias + '.' if alias else ''}{quote(k)} BETWEEN {lit_lo} AND {lit_hi}")
    return conds


def key_ranges_filter(spec: TableSpec, *ranges: dict[str, tuple]) -> str | None:
    """A condition every key in one of ``ranges`` meets (each as
    ``key_range_condition``'s), for a frame's ``where``: Iceberg then skips
    the data files whose key bounds miss all of them.  Separate ranges, not
    one around them all: a batch's new keys are often far above its stored
    ones (a sequence), and one range would span the table.  None when a
    range cannot be written (a key type without exact literals)."""
    parts = []
    for r in ranges:
        if r:
            conds = key_range_condition(spec, r, alias=None)
            if not conds:
                return None
            parts.append(f"({' AND '.join(conds)})")
    return " OR ".join(parts) or None


def key_spans(events: DataFrame, key: str, spark_type: str) -> list[tuple[Any, Any]]:
    """Spans ``(lo, hi)`` of ``events``' values of ``key`` (a typed key
    column, ``compact.prepare_events``), sorted, that hold every value: the least
    and greatest value of each group of values, in one small Spark job.

    Numbers are grouped by sign and order of magnitude, so the gaps a batch
    leaves stay out of its spans: an hourly batch of a large table touches
    a few recent keys and adds new ones from a sequence far above them, and
    one span around both would hold every stored key.  Any grouping is
    correct (a value lies in its own group's span); this one only decides
    what the spans leave out.  Other types get one span."""
    k = F.col(quote(key))
    numeric = spark_type in INT_TYPES or spark_type.startswith("decimal(")
    x = k.cast("double")  # abs of the least bigint overflows; the group needs no exact value
    group = F.signum(x) * F.floor(F.log2(F.abs(x) + 1)) if numeric else F.lit(0)
    rows = events.where(k.isNotNull()).groupBy(group.alias("_g")).agg(F.min(k).alias("lo"), F.max(k).alias("hi")).collect()
    return sorted((r["lo"], r["hi"]) for r in rows)


def _literal(value: Any, spark_type: str) -> str | None:
    if value is None:
        return None
    if spark_type in INT_TYPES:
        return f"CAST('{int(value)}' AS {spark_type})"
    if spark_type.startswith("decimal("):
        return f"CAST('{value:f}' AS {spark_type})"  # fixed-point text: exact, no exponent
    if spark_type == "string":
        return sql_string(value)
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
    whole_rows: bool = False,
) -> None:
    """Write the net changes ``source`` (compact.merge_source) onto the branch.

    With the counts of its keys the labelling found new to the branch
    (``new_keys``: no stored row, no tombstone) and stored in it
    (``stored_keys``), only the stored keys go through the MERGE — without an
    insert clause, so Spark joins the target with them by an inner join and
    ``key_ranges`` (theirs) prune the target's files — and the new keys are
    appended afterwards (``append_new_keys``): a commit that reads and
    rewrites no data file.  The MERGE goes first, so that it never reads the
    appended files.  Without the counts: one MERGE of every key.
    ``whole_rows``: every stored key's net change wins every column
    (``compact.Accounting.whole_rows``), so the MERGE takes the rows whole
    (``merge_sql``)."""
    if new_keys is None or stored_keys is None:
        _merge(spark, spec, branch, source, batch_id, key_ranges, matched_only=False)
        return
    stored = F.col("_cdc_stored_pos").isNotNull()
    if stored_keys:
        _merge(spark, spec, branch, source.where(stored), batch_id, key_ranges, matched_only=True, whole_rows=whole_rows)
    if new_keys:
        append_new_keys(spark, spec, branch, source.where(~stored), batch_id, rows=new_keys)


def _merge(
    spark: SparkSession,
    spec: TableSpec,
    branch: str,
    source: DataFrame,
    batch_id: str,
    key_ranges: dict[str, tuple] | None,
    *,
    matched_only: bool,
    whole_rows: bool = False,
) -> None:
    run_with_view(
        spark,
        source,
        f"_cdc_src_{abs(hash((spec.identifier, batch_id)))}",
        lambda view: merge_sql(spec, branch, view, batch_id, key_ranges, matched_only=matched_only, whole_rows=whole_rows),
    )


def run_with_view(spark: SparkSession, df: DataFrame, view: str, sql: Callable[[str], str]) -> None:
    """Run the statement ``sql(view)`` with ``df`` registered as ``view`` for its span."""
    df.createOrReplaceTempView(view)
    try:
        spark.sql(sql(view))
    finally:
        spark.catalog.dropTempView(view)


ROWS_PER_APPENDED_FILE = 100_000
"""New keys per data file of the append (at most one file per partition of
the net changes).  Without it, every shuffle partition writes a file: an
hourly batch's ~300 new keys went in as 8 files of ~40 rows, which every
later read opens until maintenance compacts them."""


def append_new_keys(spark: SparkSession, spec: TableSpec, branch: str, source: DataFrame, batch_id: str, rows: int) -> None:
    """Append the net changes of keys the branch does not hold (no stored
    row, no tombstone: ``_cdc_stored_pos`` NULL in the labelling) as new rows,
    exactly as the MERGE's ``WHEN NOT MATCHED`` clause would insert them: an
    append commit that rewrites no data file.  A key whose last event is a
    delete goes in as a tombstone; a partial row leaves the columns no event
    set NULL, their ``_cdc_col_pos`` at ``NEVER_SET``.  The ``rows`` new keys
    go in as one file per :data:`ROWS_PER_APPENDED_FILE`: ``source`` reads the
    batch's cached net changes, so fewer tasks recompute nothing."""
    data_cols = [c for c in spec.columns if c not in spec.key_columns]
    cols = [F.col(quote(c)) for c in spec.key_columns + data_cols]
    out = source.select(
        *cols,
        F.col(META_POS).alias("_cdc_position"),
        F.col("_cdc_op"),
        (F.col("_cdc_action") == "delete").alias("_cdc_deleted"),
        F.col("_cdc_commit_ts"),
        F.col("_cdc_tx_id"),
        F.lit(batch_id).alias("_cdc_batch_id"),
        F.current_timestamp().alias("_cdc_applied_at"),
        F.expr(new_col_pos(data_cols, "")).alias("_cdc_col_pos"),
        F.col("_cdc_cid").alias("_cdc_change_id"),
        F.col("_cdc_inh").alias("_cdc_inherited"),
        F.when(F.col("_cdc_action") == "delete", F.col("_cdc_endcid")).alias("_cdc_deleted_by"),
    )
    out.coalesce(max(1, math.ceil(rows / ROWS_PER_APPENDED_FILE))).writeTo(branch_ref(spec, branch)).append()


def new_col_pos(data_cols: list[str], s: str) -> str:
    """``_cdc_col_pos`` of a new row (alias prefix ``s``, e.g. ``"s."``): the
    columns set below its position, ``NEVER_SET`` for the ones never set.

    A change that carries every data column, each set by its own last event
    (``_cdc_cpos`` empty: most changes), sets none below its position: its
    map is empty, given without building and filtering one.  ``map_filter``
    and the map it filters are evaluated row by row without generated code,
    and were ~8 % of the JVM's time in a 1M-event batch (bench/README, issue
    20 step 26)."""
    if not data_cols:
        return EMPTY_MAP
    new_pos = ", ".join(f"{sql_string(c)}, coalesce({batch_position(c, s)}, '{NEVER_SET}')" for c in data_cols)
    filtered = f"map_filter(map({new_pos}), (k, v) -> v < {s}{META_POS})"
    return f"CASE WHEN {sets_every_column(data_cols, s)} THEN {EMPTY_MAP} ELSE {filtered} END"


def sets_every_column(data_cols: list[str], s: str) -> str:
    """SQL: the net change (alias prefix ``s``) carries every data column and
    each was set by its last event (no ``_cdc_cpos`` entry)."""
    carried = " AND ".join(f"array_contains({s}_cdc_present, {sql_string(c)})" for c in data_cols)
    return f"size({s}_cdc_cpos) = 0 AND {carried}"


def merge_sql(
    spec: TableSpec,
    branch: str,
    view: str,
    batch_id: str,
    key_ranges: dict[str, tuple] | None = None,
    *,
    matched_only: bool = False,
    whole_rows: bool = False,
) -> str:
    """The MERGE of the net changes in ``view`` (compact.merge_source) into the branch.

    Per data column, the stored value and the batch's compete by the position
    that set them: the stored one's is ``_cdc_col_pos[c]`` (absent: the row's
    position; a tombstone's columns were set NULL at its position), the
    batch's is the position of its last event carrying the column, else of
    its last delete of the key.  The higher one wins, so re-applying a batch
    changes nothing and a late event fills only what later events did not
    carry.  ``_cdc_col_pos`` keeps the columns set below the row's position.

    ``whole_rows`` (only with ``matched_only``): every net change in ``view``
    wins every column over the stored row its labelling saw
    (``_cdc_stored_pos``), so each column takes the batch's value and
    position, and the statement reads none of the stored data columns nor
    ``_cdc_col_pos``: merge-on-read then scans only the key and a few CDC
    columns of the table.  A matched row at any other position than the
    labelled one fails the statement (``raise_error``) instead of being
    overwritten.  Long because the per-column expressions and the CDC columns' rules
    (life, inheritance, tombstone) are one statement's clauses."""
    on = " AND ".join([f"t.{quote(k)} = s.{quote(k)}" for k in spec.key_columns] + key_range_condition(spec, key_ranges))
    data_cols = [c for c in spec.columns if c not in spec.key_columns]
    batch = sql_string(batch_id)
    newer = f"s.{META_POS} > t._cdc_position"

    def batch_pos(c: str) -> str:
        return batch_position(c, "s.")

    # a tombstone's columns hold the state just before its delete: what a
    # late (older) event competes with; a newer event finds them NULL at the delete
    dead = f"(t._cdc_deleted AND {newer})"

    def stored_pos(c: str) -> str:
        return f"(CASE WHEN {dead} THEN t._cdc_position ELSE coalesce(t._cdc_col_pos[{sql_string(c)}], t._cdc_position) END)"

    def stored_val(c: str) -> str:
        return f"(CASE WHEN {dead} THEN NULL ELSE t.{quote(c)} END)"

    def wins(c: str) -> str:
        return f"coalesce({batch_pos(c)} > {stored_pos(c)}, false)"

    row_pos = f"greatest(s.{META_POS}, t._cdc_position)"
    matched_pos = ", ".join(f"{sql_string(c)}, CASE WHEN {wins(c)} THEN {batch_pos(c)} ELSE {stored_pos(c)} END" for c in data_cols)
    col_pos_matched = EMPTY_MAP
    if data_cols:  # the map_filter's shortcut (new_col_pos): a newer change that sets every column by its last event wins them all
        filtered = f"map_filter(map({matched_pos}), (k, v) -> v < {row_pos})"
        col_pos_matched = f"CASE WHEN {newer} AND {sets_every_column(data_cols, 's.')} THEN {EMPTY_MAP} ELSE {filtered} END"
    sets = [f"{quote(c)} = CASE WHEN {wins(c)} THEN s.{quote(c)} ELSE {stored_val(c)} END" for c in data_cols]
    if whole_rows:  # wins(c) for every c, and newer: the same values without reading the stored ones
        if not matched_only:
            raise ValueError("whole_rows needs matched_only: only stored keys are labelled as replacing their row")
        stale = sql_string(f"{spec.identifier}: a stored row changed after its labelling (batch {batch_id}); retry the batch")
        row_pos = f"CASE WHEN t._cdc_position = s._cdc_stored_pos THEN s.{META_POS} ELSE raise_error({stale}) END"
        col_pos_matched = new_col_pos(data_cols, "s.")
        sets = [f"{quote(c)} = s.{quote(c)}" for c in data_cols]
    # the stored row's life goes on (no delete in between; for a delete: up to
    # it): the row keeps the change that began it and what it inherited
    goes_on = f"(NOT {newer} OR NOT t._cdc_deleted AND s._cdc_delpos IS NULL)"
    meta = [
        f"_cdc_col_pos = {col_pos_matched}",
        f"_cdc_op = CASE WHEN {newer} THEN s._cdc_op ELSE t._cdc_op END",
        f"_cdc_commit_ts = CASE WHEN {newer} THEN s._cdc_commit_ts ELSE t._cdc_commit_ts END",
        f"_cdc_tx_id = CASE WHEN {newer} THEN s._cdc_tx_id ELSE t._cdc_tx_id END",
        f"_cdc_deleted = CASE WHEN {newer} THEN s._cdc_action = 'delete' ELSE t._cdc_deleted END",
        f"_cdc_change_id = CASE WHEN {goes_on} THEN coalesce(t._cdc_change_id, s._cdc_cid) ELSE s._cdc_cid END",
        f"_cdc_inherited = CASE WHEN {goes_on} THEN map_concat(coalesce(t._cdc_inherited, {EMPTY_MAP}), s._cdc_inh) ELSE s._cdc_inh END",
        f"_cdc_deleted_by = CASE WHEN NOT {newer} THEN t._cdc_deleted_by WHEN s._cdc_action = 'delete' THEN s._cdc_endcid END",
        f"_cdc_position = {row_pos}",
        f"_cdc_batch_id = {batch}",
        "_cdc_applied_at = current_timestamp()",
    ]
    insert_cols = [quote(c) for c in spec.key_columns + data_cols]
    insert_vals = [f"s.{quote(c)}" for c in spec.key_columns + data_cols]
    insert = f"""
    WHEN NOT MATCHED THEN INSERT
      ({", ".join(insert_cols)}, _cdc_position, _cdc_op, _cdc_deleted, _cdc_commit_ts, _cdc_tx_id, _cdc_batch_id, _cdc_applied_at, _cdc_col_pos,
       _cdc_change_id, _cdc_inherited, _cdc_deleted_by)
      VALUES ({", ".join(insert_vals)}, s.{META_POS}, s._cdc_op, s._cdc_action = 'delete', s._cdc_commit_ts, s._cdc_tx_id,
              {batch}, current_timestamp(), {new_col_pos(data_cols, "s.")},
              s._cdc_cid, s._cdc_inh, CASE WHEN s._cdc_action = 'delete' THEN s._cdc_endcid END)"""
    return f"""
    MERGE INTO {branch_ref(spec, branch)} t
    USING {view} s
    ON {on}
    WHEN MATCHED AND s.{META_POS} <> t._cdc_position THEN UPDATE SET
      {", ".join(sets + meta)}{"" if matched_only else insert}
    """


def refresh_inherited(spark: SparkSession, spec: TableSpec, branch: str, batch_id: str) -> int:
    """The new key of a primary-key change takes the old key's values again
    where this batch changed the old key's tombstone (the state just before
    the change): the delete half arrived after the insert half, or a late
    event of the old key filled its tombstone.  Only the new key's columns
    that still hold what the change gave them are refreshed — inherited and
    set by no later event (``_cdc_col_pos`` still at the position
    ``_cdc_inherited`` records), or never set at all (the insert half applied
    before its delete half left them out).  A new key that is a tombstone
    itself (it moved on in a later key change) is refreshed too, and so on
    down the chain.  Returns the rows refreshed; each round commits on the
    audit branch like the MERGE before it."""
    data_cols = [c for c in spec.columns if c not in spec.key_columns]
    total = 0
    on = " AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in spec.key_columns)
    sets = ", ".join(f"{quote(c)} = s.{quote(c)}" for c in data_cols)
    for _ in range(MAX_KEY_CHANGE_CHAIN + 1) if data_cols else ():
        refreshed = _refreshed_rows(read_branch(spark, spec, branch), spec, data_cols, batch_id).persist()
        try:
            by_kind = {
                r["_cdc_deleted"]: r["n"] for r in refreshed.groupBy("_cdc_deleted").count().withColumnRenamed("count", "n").collect()
            }
            if not by_kind:
                break
            total += sum(by_kind.values())
            run_with_view(
                spark,
                refreshed.drop("_cdc_deleted"),
                f"_cdc_refresh_{abs(hash((spec.identifier, batch_id)))}",
                lambda view: (
                    f"MERGE INTO {branch_ref(spec, branch)} t USING {view} s ON {on} WHEN MATCHED THEN UPDATE SET {sets}, "
                    f"_cdc_batch_id = {sql_string(batch_id)}, _cdc_applied_at = current_timestamp()"
                ),
            )
        finally:
            refreshed.unpersist()
        if not by_kind.get(True):  # no tombstone refreshed: no new key further down a chain to refresh
            break
    return total


def _refreshed_rows(rows: DataFrame, spec: TableSpec, data_cols: list[str], batch_id: str) -> DataFrame:
    """The rows a key change made whose inherited columns differ from the
    state the old key's tombstone (written or filled by this batch) keeps,
    with their new values."""
    tombs = rows.where(F.col("_cdc_deleted") & F.col("_cdc_deleted_by").isNotNull() & (F.col("_cdc_batch_id") == batch_id)).select(
        F.col("_cdc_deleted_by").alias("_m_cid"),
        *[F.col(quote(k)).alias(f"_m_k{i}") for i, k in enumerate(spec.key_columns)],
        *[F.col(quote(c)).alias(f"_m_v{i}") for i, c in enumerate(data_cols)],
    )
    other_key = ~functools.reduce(operator.and_, [F.col(quote(k)).eqNullSafe(F.col(f"_m_k{i}")) for i, k in enumerate(spec.key_columns)])
    paired = rows.join(tombs, F.col("_cdc_change_id") == F.col("_m_cid")).where(other_key)
    empty = F.create_map().cast("map<string,string>")

    def still_inherited(c: str) -> Column:
        set_at = F.coalesce(F.col("_cdc_col_pos")[c], F.col("_cdc_position"))
        return set_at == F.coalesce(F.coalesce(F.col("_cdc_inherited"), empty)[c], F.lit(NEVER_SET))

    takes = {c: still_inherited(c) & ~F.col(quote(c)).eqNullSafe(F.col(f"_m_v{i}")) for i, c in enumerate(data_cols)}
    return paired.where(functools.reduce(operator.or_, takes.values())).select(
        *[F.col(quote(k)) for k in spec.key_columns],
        *[F.when(takes[c], F.col(f"_m_v{i}")).otherwise(F.col(quote(c))).alias(c) for i, c in enumerate(data_cols)],
        "_cdc_deleted",
    )
