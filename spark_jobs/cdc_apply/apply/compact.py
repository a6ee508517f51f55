"""Order and compact one table's canonical events into one net change per key.

Pure DataFrame -> DataFrame functions; the rules are documented in
``docs/apply-semantics.md`` and mirrored by the reference model in
``tests/reference_model.py``:

1. exact duplicates (same key, same position, same content) count once;
   different events of one key at one position are a *conflict*, refused;
2. events at or before the table's truncate watermark are superseded;
3. an event at the position already stored for the key is a duplicate; an
   older one is superseded unless the stored row has a column last set at a
   lower position still (a partial row: the event may fill it) — no row, and
   no column, ever regresses;
4. the remaining events of a key are folded in (position, file, line) order:
   c/u/r overlay their *present* columns on the row as it stands, d removes
   it; the fold remembers the position that set each column (``cpos``) and
   the last delete (``delpos``), and the MERGE keeps, per column, whichever
   of the stored and the batch's value was set at the higher position;
5. the insert half of a primary-key change inherits the columns it does not
   carry from the old key's state just before the change
   (``inherit_moved_columns``).

Every input row ends in exactly one bucket of ``Accounting``.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from cdc_apply.runtime import session

META_POS = "_cdc_pos"

# Labels label_duplicates gives each event (superseded is told per key, against the table: label_against_target).
APPLY, DUPLICATE, CONFLICT = "apply", "duplicate", "conflict"
MAX_KEY_CHANGE_CHAIN = 32
"""Key changes of one key chained within a batch (1 -> 2 -> 3 ...) that the
inheritance follows; an insert further down a longer chain keeps what it
does not carry NULL and is counted as ``partial_inserts``."""
BROADCAST_ROWS_MAX = 250_000
"""The most rows of a batch's keys a join broadcasts (the labelling's pruning
of the stored state, the reconciliation); past it the join shuffles.  A
broadcast is built in the driver's heap beside what the driver caches: on
``local[*]`` and on a Spark Connect server (shared by every batch running)
that is all of the cached batch too.  A 1M-event backfill broadcasting its
~900k keys ran a 3 GB Connect server out of heap, twice in two runs
(bench/README, issue 20 step 16); at this size a shuffle costs the batch
little."""
NEVER_SET = ""
"""The per-column position of a column no event has set (NULL since the row
began): lower than every real position, so any late event may fill it."""


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def sql_string(text: str) -> str:
    """``text`` as a Spark SQL string literal (quotes and backslashes escaped):
    every value written into SQL text goes through here."""
    return "'" + str(text).replace("\\", "\\\\").replace("'", "\\'") + "'"


def batch_position(c: str, s: str = "", present: str | None = None) -> str:
    """SQL: the position that set data column ``c`` in a net change (alias
    prefix ``s``, e.g. ``"s."``): its last event carrying the column, else
    the key's last delete.  ``_cdc_cpos`` names only the columns set at
    another position than the change's own (``_cdc_pos``, see
    ``_folded_columns``).  ``present``: the SQL list of the columns the
    change carries (default ``{s}_cdc_present``, as ``merge_source`` names
    it).  The MERGE's contest per column and ``_replaces_stored_row`` both
    read it here."""
    col = sql_string(c)
    return (
        f"(CASE WHEN array_contains({present or s + '_cdc_present'}, {col}) "
        f"THEN coalesce({s}_cdc_cpos[{col}], {s}{META_POS}) ELSE {s}_cdc_delpos END)"
    )


def typed_value(text: Column, spark_type: str) -> Column:
    """Canonical text -> typed value (exact; see model.canonical_value)."""
    if spark_type == "binary":
        return F.unbase64(text)
    return text.cast(spark_type)


def key_text(k: str) -> Column:
    """Deletes name their key in ``before``; every other op in ``after``."""
    return F.when(F.col("op") == "d", F.coalesce(F.col("before")[k], F.col("after")[k])).otherwise(
        F.coalesce(F.col("after")[k], F.col("before")[k])
    )


def prepare_events(events: DataFrame, key_types: dict[str, str]) -> DataFrame:
    """Typed key columns plus the metadata the fold needs."""
    keys = [typed_value(key_text(k), t).alias(k) for k, t in key_types.items()]
    return events.select(
        *keys,
        F.col("position").alias(META_POS),
        F.col("op").alias("_cdc_op"),
        F.col("after").alias("_cdc_after"),
        F.col("commit_ts").alias("_cdc_commit_ts"),
        F.col("tx_id").alias("_cdc_tx_id"),
        F.col("file").alias("_cdc_file"),
        F.col("line").alias("_cdc_line"),
        (F.col("change_id") if "change_id" in events.columns else F.lit(None).cast("string")).alias("_cdc_change_id"),
        F.lit(None).cast("map<string,string>").alias("_cdc_inh"),
    )


def null_key_filter(key_cols: list[str]) -> Column:
    return F.greatest(*[F.col(quote(k)).isNull() for k in key_cols]) if len(key_cols) > 1 else F.col(quote(key_cols[0])).isNull()


def label_duplicates(events: DataFrame, key_cols: list[str]) -> DataFrame:
    """Same key and same position: the first delivery (by file, line) applies
    when every delivery has the same content (a re-delivery); when their
    contents differ, all of them are labelled ``conflict`` (the format's own
    tie-breaker is in the position, so two different events at one position
    cannot be ordered: the caller refuses them, never keeps one arbitrarily).

    The window is partitioned by the key alone (the previous event of the key
    in position order has the same position): the join with the target and
    the fold then find the events already partitioned by key, and the batch
    is shuffled once instead of twice."""
    keys = [quote(k) for k in key_cols]
    w = Window.partitionBy(*keys).orderBy(META_POS, "_cdc_file", "_cdc_line")
    repeated = F.lag(META_POS).over(w) == F.col(META_POS)
    shares_position = repeated | (F.lead(META_POS).over(w) == F.col(META_POS))
    # The key's events in the batch, counted by the same window (no extra pass):
    # fold_per_key folds a key with one event without grouping.
    whole_key = w.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    content = F.xxhash64(
        F.col("_cdc_op"), F.to_json(F.array_sort(F.map_entries(F.coalesce(F.col("_cdc_after"), F.create_map().cast("map<string,string>")))))
    )
    labelled = (
        events.withColumn("_cdc_label", F.when(repeated, F.lit(DUPLICATE)).otherwise(F.lit(APPLY)))
        .withColumn("_cdc_key_events", F.count(F.lit(1)).over(whole_key))
        .withColumn("_cdc_content", F.when(shares_position, content))
    )
    # only deliveries that share a position have a content hash (rare): the
    # (key, position) window needs no new shuffle, the data is partitioned by key
    same_pos = Window.partitionBy(*keys, META_POS)
    differs = F.min("_cdc_content").over(same_pos) != F.max("_cdc_content").over(same_pos)
    return labelled.withColumn(
        "_cdc_label", F.when(F.col("_cdc_content").isNotNull() & differs, F.lit(CONFLICT)).otherwise(F.col("_cdc_label"))
    ).drop("_cdc_content")


def net_changes(
    events: DataFrame, target_state: DataFrame, key_cols: list[str], truncated_at: str | None, *, width: int, prune: bool = False
) -> DataFrame:
    """A batch's events (``prepare_events``) as one row per key: labelled
    (``label_duplicates``, ``label_against_target``), folded and counted
    (``fold_per_key``): what ``accounting`` sums and ``applied`` writes.
    One shuffle of the events (by key); the join with the target joins keys.
    ``prune``: ``label_against_target``'s ``prune_to`` is the batch."""
    per_key = collapse_per_key(label_duplicates(events, key_cols), key_cols)
    labelled = label_against_target(per_key, target_state, key_cols, truncated_at, prune_to=events if prune else None)
    return fold_per_key(labelled, key_cols, width)


def collapse_per_key(labelled: DataFrame, key_cols: list[str]) -> DataFrame:
    """One row per key of the batch, out of ``label_duplicates``' window (the
    same partitioning and order: no new shuffle, no new sort), so that the
    join with the target joins keys, not events.

    ``_cdc_evs``: the key's events labelled ``apply``, in the order they
    apply (position, file, line: the window's own order); ``_cdc_key_events``
    counts all of its events, ``_k_dups``/``_k_conflicts`` those the batch
    itself labelled so, ``_k_lo``/``_k_hi`` their lowest and highest position."""
    keys = [quote(k) for k in key_cols]
    w = Window.partitionBy(*keys).orderBy(META_POS, "_cdc_file", "_cdc_line")
    whole_key = w.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    label = F.col("_cdc_label")
    return (
        labelled.select(
            *keys,
            "_cdc_key_events",
            F.collect_list(F.when(label == APPLY, _event())).over(whole_key).alias("_cdc_evs"),
            F.count(F.when(label == DUPLICATE, 1)).over(whole_key).alias("_k_dups"),
            F.count(F.when(label == CONFLICT, 1)).over(whole_key).alias("_k_conflicts"),
            F.min(META_POS).over(whole_key).alias("_k_lo"),
            F.max(META_POS).over(whole_key).alias("_k_hi"),
            F.row_number().over(w).alias("_k_row"),
        )
        .where(F.col("_k_row") == F.col("_cdc_key_events"))
        .drop("_k_row")
    )


def label_against_target(
    per_key: DataFrame, target_state: DataFrame, key_cols: list[str], truncated_at: str | None, *, prune_to: DataFrame | None = None
) -> DataFrame:
    """Compare each key's events (``collapse_per_key``) with its stored
    position and the truncate watermark: ``_cdc_evs`` keeps those that
    apply; ``_k_dups`` adds those at the stored position, ``_k_superseded``
    counts the rest.

    ``target_state`` has the key columns, ``_cdc_position``, ``_cdc_deleted``
    and ``_cdc_col_pos`` (tombstones included: a deleted key remembers its
    position).  An event older than the stored row still applies when one of
    its columns was last set at a lower position than the event's (a
    tombstone's columns hold the state just before its delete) (``_cdc_stored_min_pos``): a late event fills what the later
    partial events did not carry, whatever the delivery order.

    ``prune_to``: the batch's events; first keep only the stored rows of
    their keys (broadcast, a semi join while scanning), so the join
    shuffles rows in proportion to the batch instead of the whole table.  The
    caller gives it for a batch small next to its table (table.PRUNE_STATE_*).
    """
    live = ~F.coalesce(F.col("_cdc_deleted"), F.lit(False))
    state = target_state.select(
        *[quote(k) for k in key_cols],
        F.col("_cdc_position").alias("_cdc_stored_pos"),
        live.alias("_cdc_stored_live"),
        # a tombstone keeps the state just before its delete: a late event may fill it too
        F.coalesce(F.array_min(F.map_values(F.col("_cdc_col_pos"))), F.col("_cdc_position")).alias("_cdc_stored_min_pos"),
    )
    if prune_to is not None:
        state = state.join(F.broadcast(prune_to.select(*[quote(k) for k in key_cols])), on=key_cols, how="left_semi")
    kept = "NOT ({e}.pos < " + sql_string(truncated_at) + ")" if truncated_at is not None else "true"
    at_stored = kept + " AND {e}.pos = _cdc_stored_pos"
    applies = (
        kept + " AND (_cdc_stored_pos IS NULL OR {e}.pos > _cdc_stored_pos"
        " OR ({e}.pos <> _cdc_stored_pos AND {e}.pos > _cdc_stored_min_pos))"
    )
    return (
        per_key.join(state, on=key_cols, how="left")
        .withColumn("_k_batch_apply", F.size("_cdc_evs"))
        .withColumn("_k_at_stored", F.size(F.expr(_keep_where("_cdc_evs", at_stored))))
        .withColumn("_cdc_evs", F.expr(_keep_where("_cdc_evs", applies)))
        .withColumn("_k_dups", F.col("_k_dups") + F.col("_k_at_stored"))
        .withColumn("_k_superseded", F.col("_k_batch_apply") - F.size("_cdc_evs") - F.col("_k_at_stored"))
        .withColumn("_cdc_stored_live", F.coalesce(F.col("_cdc_stored_live"), F.lit(False)))
        .drop("_k_batch_apply", "_k_at_stored", "_cdc_stored_min_pos")
    )


def _keep_where(events: str, condition: str) -> str:
    """SQL: the ``events`` array's elements that meet ``condition`` (over
    ``{e}``).  A one-event array, most keys' of a batch, is tested by a
    plain expression: a lambda is evaluated row by row, without generated code."""
    one = condition.format(e=f"{events}[0]")
    return f"CASE WHEN size({events}) = 1 THEN IF({one}, {events}, slice({events}, 1, 0)) ELSE filter({events}, e -> {condition.format(e='e')}) END"


def text_of(column: Column, spark_type: str) -> Column:
    """A stored typed value as canonical text (the inverse of ``typed_value``)."""
    if spark_type == "binary":
        return F.base64(column)
    if spark_type.startswith("timestamp"):
        return F.date_format(column, "yyyy-MM-dd HH:mm:ss.SSSSSS")
    return column.cast("string")


_IN_LOG_ORDER = """array_sort({events}, (l, r) -> CASE
      WHEN l.pos < r.pos THEN -1 WHEN l.pos > r.pos THEN 1
      WHEN l.file < r.file THEN -1 WHEN l.file > r.file THEN 1
      WHEN l.line < r.line THEN -1 WHEN l.line > r.line THEN 1 ELSE 0 END)"""
"""A key's events sorted as they apply: position, then lineage (file, line)."""

_STATE_BEFORE = (
    """
aggregate(
  """
    + _IN_LOG_ORDER.format(events="hist")
    + """,
  cast(map() AS map<string,string>),
  (acc, e) -> CASE WHEN e.op = 'd' THEN cast(map() AS map<string,string>) ELSE map_concat(acc, e.after) END)
"""
)


class Inherited(NamedTuple):
    events: DataFrame
    """the prepared events, paired inserts completed (``_cdc_inh`` names what they took)"""
    pairs: int
    """how many inserts inherited (counted where they were found: the caller's count needs no job)"""
    cached: list[DataFrame]
    """frames persisted for ``events``: the caller unpersists them when done"""

    def release(self) -> None:
        for df in self.cached:
            df.unpersist()


def inherit_moved_columns(
    prepared: DataFrame,
    stored: DataFrame,
    key_cols: list[str],
    columns: dict[str, str],
    *,
    batch_deletes: bool = True,
    truncated_at: str | None = None,
    partial_inserts: bool = True,
) -> Inherited:
    """The insert half of a primary-key change inherits what it does not carry.

    A source emits a key change as a delete of the old key and an insert of
    the new key with one ``change_id`` (Debezium PostgreSQL: one lsn;
    SQL Server: one commit/change LSN, serials 1 and 2; Qlik: the split
    UPDATE).  The insert may leave columns out (an unchanged TOASTed value
    arrives as Debezium's unavailable-value placeholder, a Qlik mask bit 0):
    their value is the old key's as of just before the delete, taken from the
    old key's earlier events in this batch over its stored live row — or,
    when the delete half came in an earlier batch, from the old key's
    tombstone, which keeps the state just before its delete (``_cdc_deleted_by``
    names the delete's change).

    An event older than the truncate watermark ``truncated_at`` is no state
    to inherit: the truncate emptied the old key after it (the labelling
    supersedes such events; the stored rows are already gone).

    Returns ``prepared`` with the inserts' ``_cdc_after`` completed and
    ``_cdc_inh`` naming the inherited columns (-> the insert's position, so
    that a later refresh from the old key's tombstone, ``merge.refresh_inherited``,
    knows which values came from it), and the pairs found for the caller's
    counts.  An insert whose delete half
    has not arrived yet keeps those columns unset (``partial_inserts``); the
    delete half's batch fills them (``merge.refresh_inherited``).

    ``partial_inserts=False``: the caller knows that no such insert is in the
    batch (``decode.census``'s ``min_keyed_after``), so no Spark job
    looks for one.

    Long because the pairing, the state before the change and the fill are
    one Spark plan whose steps share their column lists."""
    keys = [quote(k) for k in key_cols]
    cid = F.col("_cdc_change_id")
    if not partial_inserts:
        return Inherited(prepared.withColumn("_cdc_inh", F.lit(None).cast("map<string,string>")), 0, [])
    old = [f"_m_old{i}" for i in range(len(key_cols))]
    partial = (
        prepared.where((F.col("_cdc_op") != "d") & cid.isNotNull() & (F.size("_cdc_after") < len(columns)))
        .select(cid.alias("_m_cid"), *keys, "_cdc_file", "_cdc_line", F.col(META_POS).alias("_m_ipos"))
        .persist()
    )
    same_key = functools.reduce(operator.and_, [F.col(quote(k)).eqNullSafe(F.col(o)) for k, o in zip(key_cols, old)])
    try:
        unchanged = prepared.withColumn("_cdc_inh", F.lit(None).cast("map<string,string>"))
        if partial.isEmpty():
            return Inherited(unchanged, 0, [])
        deletes = prepared.where((F.col("_cdc_op") == "d") & cid.isNotNull()).select(
            cid.alias("_m_cid"), *[F.col(k).alias(o) for k, o in zip(keys, old)], F.col(META_POS).alias("_m_pos")
        )
        # no delete in the batch (the caller knows): no pair to look for in it
        pairs = partial.join(deletes if batch_deletes else deletes.limit(0), "_m_cid").where(~same_key).drop(*key_cols, "_m_ipos").persist()
        # the delete half in an earlier batch: its tombstone keeps the state before the change
        deleted_by = F.col("_cdc_deleted_by")
        tomb_state = stored.where(F.coalesce(F.col("_cdc_deleted"), F.lit(False)) & deleted_by.isNotNull()).select(
            deleted_by.alias("_m_cid"),
            *[F.col(k).alias(o) for k, o in zip(keys, old)],
            F.col("_cdc_position").alias("_m_pos"),
            _row_data(columns).alias("_m_data"),
        )
        by_tomb = (
            partial.join(pairs.select("_m_cid"), "_m_cid", "left_anti")
            .join(tomb_state, "_m_cid")
            .where(~same_key & (F.col("_m_pos") <= F.col("_m_ipos")))
            .select("_m_cid", F.col("_cdc_file").alias("_m_file"), F.col("_cdc_line").alias("_m_line"), "_m_data")
            .persist()
        )
        if pairs.isEmpty() and by_tomb.isEmpty():
            pairs.unpersist()
            by_tomb.unpersist()
            return Inherited(unchanged, 0, [])
        found = pairs.select("_m_cid").unionByName(by_tomb.select("_m_cid")).count()
        completed, cached = _inherit(prepared, stored, pairs, by_tomb, key_cols, columns, truncated_at)
        pairs.unpersist()
        by_tomb.unpersist()
        return Inherited(completed, found, [cached])
    finally:
        partial.unpersist()


def _row_data(columns: dict[str, str]) -> Column:
    """A stored row's columns as canonical text (NULLs included: a NULL is a value to inherit)."""
    return F.create_map(*[x for c, t in columns.items() for x in (F.lit(c), text_of(F.col(quote(c)), t))])


def _inherit(
    prepared: DataFrame,
    stored: DataFrame,
    pairs: DataFrame,
    by_tomb: DataFrame,
    key_cols: list[str],
    columns: dict[str, str],
    truncated_at: str | None,
) -> tuple[DataFrame, DataFrame]:
    """Complete the paired inserts' ``_cdc_after`` (see inherit_moved_columns);
    also returns the frame checkpointed under the result.  Long because the
    three sources of the state before a change (the batch, the stored row, the
    tombstone) and the rounds along a chain share one plan's column names."""
    old = [f"_m_old{i}" for i in range(len(key_cols))]
    on = functools.reduce(operator.and_, [F.col(quote(k)) == F.col(o) for k, o in zip(key_cols, old)])
    event = F.struct(
        F.col(META_POS).alias("pos"),
        F.col("_cdc_file").alias("file"),
        F.col("_cdc_line").alias("line"),
        F.col("_cdc_op").alias("op"),
        F.coalesce(F.col("_cdc_after"), F.create_map().cast("map<string,string>")).alias("after"),
    )
    # the pair's own lineage names the insert; rename so both sides agree
    pb = F.broadcast(pairs.withColumnRenamed("_cdc_file", "_m_file").withColumnRenamed("_cdc_line", "_m_line"))

    def table_event(pos: Column, data: Column) -> Column:
        return F.struct(
            pos.alias("pos"), F.lit("").alias("file"), F.lit(0).cast("bigint").alias("line"), F.lit("u").alias("op"), data.alias("after")
        )

    from_table = (
        stored.join(pb, on)
        .where(
            # its live row before the change, or (the delete half applied before) its tombstone of this change
            ~F.coalesce(F.col("_cdc_deleted"), F.lit(False)) & (F.col("_cdc_position") < F.col("_m_pos"))
            | F.coalesce(F.col("_cdc_deleted"), F.lit(False)) & (F.col("_cdc_deleted_by") == F.col("_m_cid"))
        )
        .select(
            "_m_file",
            "_m_line",
            table_event(F.when(F.col("_cdc_deleted"), F.lit("")).otherwise(F.col("_cdc_position")), _row_data(columns)).alias("e"),
        )
    )
    from_tomb = by_tomb.select("_m_file", "_m_line", table_event(F.lit(""), F.col("_m_data")).alias("e"))
    original = prepared.withColumn("_m_carried", F.map_keys(F.coalesce(F.col("_cdc_after"), F.create_map().cast("map<string,string>"))))
    # A chain of key changes (1 -> 2 -> 3 in one transaction) makes an insert
    # inherit from an insert that inherits in turn: repeat over the completed
    # events until no insert gains a column (one round more than the chain).
    completed: DataFrame = original
    cached: DataFrame | None = None
    for _ in range(MAX_KEY_CHANGE_CHAIN + 1):
        earlier = F.col(META_POS) < F.col("_m_pos")
        if truncated_at is not None:  # the truncate emptied the old key after those
            earlier = earlier & (F.col(META_POS) >= F.lit(truncated_at))
        from_batch = completed.join(pb, on).where(earlier).select("_m_file", "_m_line", event.alias("e"))
        inherited = (
            from_batch.unionByName(from_table)
            .unionByName(from_tomb)
            .groupBy("_m_file", "_m_line")
            .agg(F.collect_list("e").alias("hist"))
            .select(F.col("_m_file").alias("_cdc_file"), F.col("_m_line").alias("_cdc_line"), F.expr(_STATE_BEFORE).alias("_m_inherited"))
        )
        richer = (
            completed.join(F.broadcast(inherited), ["_cdc_file", "_cdc_line"], "left")
            .withColumn(
                "_m_gain", F.coalesce(F.size(F.map_concat(F.col("_m_inherited"), F.col("_cdc_after"))) - F.size("_cdc_after"), F.lit(0))
            )
            .withColumn(
                "_cdc_after",
                F.when(F.col("_m_inherited").isNotNull(), F.map_concat(F.col("_m_inherited"), F.col("_cdc_after"))).otherwise(
                    F.col("_cdc_after")
                ),
            )
            .drop("_m_inherited")
            # a checkpoint, not a cache: each round reads the last one twice, and a
            # cached frame's plan text holds the plan under it (2^rounds copies)
            .localCheckpoint(eager=True)
        )
        gained = richer.where(F.col("_m_gain") > 0).limit(1).count()
        cached, completed = richer, richer.drop("_m_gain")
        if not gained:
            break
    assert cached is not None  # the loop ran at least once
    inh = F.array_except(F.map_keys("_cdc_after"), F.col("_m_carried"))
    done = completed.withColumn(
        "_cdc_inh",
        F.when(F.size(inh) > 0, F.map_from_arrays(inh, F.array_repeat(F.col(META_POS), F.size(inh)))),
    ).drop("_m_carried")
    return done, cached


_FOLD = """
aggregate(
  _cdc_evs,
  named_struct('deleted', false, 'vals', cast(map() AS map<string,string>),
               'cpos', cast(map() AS map<string,string>), 'delpos', cast(NULL AS string),
               'pos', cast(NULL AS string), 'op', cast(NULL AS string),
               'commit_ts', cast(NULL AS timestamp), 'tx_id', cast(NULL AS string),
               'cid', cast(NULL AS string), 'inh', cast(map() AS map<string,string>),
               'bvals', cast(map() AS map<string,string>), 'bcpos', cast(map() AS map<string,string>),
               'bdelpos', cast(NULL AS string), 'endcid', cast(NULL AS string),
               'bcid', cast(NULL AS string), 'binh', cast(map() AS map<string,string>)),
  (acc, e) -> CASE WHEN e.op = 'd'
    THEN named_struct('deleted', true, 'vals', cast(map() AS map<string,string>),
                      'cpos', cast(map() AS map<string,string>), 'delpos', e.pos,
                      'pos', e.pos, 'op', e.op, 'commit_ts', e.commit_ts, 'tx_id', e.tx_id,
                      'cid', cast(NULL AS string), 'inh', cast(map() AS map<string,string>),
                      'bvals', acc.vals, 'bcpos', acc.cpos, 'bdelpos', acc.delpos, 'endcid', e.cid,
                      'bcid', acc.cid, 'binh', acc.inh)
    ELSE named_struct('deleted', false, 'vals', map_concat(acc.vals, e.after),
                      'cpos', map_concat(acc.cpos, map_from_arrays(map_keys(e.after), array_repeat(e.pos, size(e.after)))),
                      'delpos', acc.delpos,
                      'pos', e.pos, 'op', e.op, 'commit_ts', e.commit_ts, 'tx_id', e.tx_id,
                      'cid', CASE WHEN acc.deleted OR acc.cid IS NULL THEN e.cid ELSE acc.cid END,
                      'inh', CASE WHEN acc.deleted THEN e.inh ELSE map_concat(acc.inh, e.inh) END,
                      'bvals', acc.bvals, 'bcpos', acc.bcpos, 'bdelpos', acc.bdelpos, 'endcid', acc.endcid,
                      'bcid', acc.bcid, 'binh', acc.binh)
  END)
"""
"""The fold of a key's events.  ``vals``/``cpos``/``delpos``: the row as the
batch leaves it (columns set since its last delete, and that delete);
``bvals``/``bcpos``/``bdelpos``: the same just before its last delete — what
a tombstone keeps, so that the insert half of a primary-key change arriving
later, or a late event of the deleted key, still finds the state before the
delete; ``cid``: the change id of the event that began the row's life
(``bcid`` of the life the last delete ended), ``endcid`` the delete's;
``inh``/``binh``: the columns inherited from a key change's old key."""
# The fold of a key's only event, written out over one event ``{e}`` (a struct
# of fold_per_key's ``ev``, whose ``after`` is never null): most keys of a
# batch have one, and the fold's lambdas (array_sort's comparator,
# aggregate's merge) are evaluated row by row, without generated code.
_ONE_EVENT = """
CASE WHEN {e}.op = 'd'
  THEN named_struct('deleted', true, 'vals', cast(map() AS map<string,string>),
                    'cpos', cast(map() AS map<string,string>), 'delpos', {e}.pos,
                    'pos', {e}.pos, 'op', {e}.op, 'commit_ts', {e}.commit_ts, 'tx_id', {e}.tx_id,
                    'cid', cast(NULL AS string), 'inh', cast(map() AS map<string,string>),
                    'bvals', cast(map() AS map<string,string>), 'bcpos', cast(map() AS map<string,string>),
                    'bdelpos', cast(NULL AS string), 'endcid', {e}.cid,
                    'bcid', cast(NULL AS string), 'binh', cast(map() AS map<string,string>))
  ELSE named_struct('deleted', false, 'vals', {e}.after,
                    'cpos', cast(map() AS map<string,string>),
                    'delpos', cast(NULL AS string),
                    'pos', {e}.pos, 'op', {e}.op, 'commit_ts', {e}.commit_ts, 'tx_id', {e}.tx_id,
                    'cid', {e}.cid, 'inh', {e}.inh,
                    'bvals', cast(map() AS map<string,string>), 'bcpos', cast(map() AS map<string,string>),
                    'bdelpos', cast(NULL AS string), 'endcid', cast(NULL AS string),
                    'bcid', cast(NULL AS string), 'binh', cast(map() AS map<string,string>))
END
"""
_ONE_OR_FOLD = "CASE WHEN size(_cdc_evs) = 1 THEN " + _ONE_EVENT.format(e="_cdc_evs[0]") + " ELSE " + _FOLD + " END"


def _event() -> Column:
    """An event as the fold takes it (``_cdc_evs``' elements)."""
    return F.struct(
        F.col(META_POS).alias("pos"),
        F.col("_cdc_file").alias("file"),
        F.col("_cdc_line").alias("line"),
        F.col("_cdc_op").alias("op"),
        F.coalesce(F.col("_cdc_after"), F.create_map().cast("map<string,string>")).alias("after"),
        F.col("_cdc_commit_ts").alias("commit_ts"),
        F.col("_cdc_tx_id").alias("tx_id"),
        F.col("_cdc_change_id").alias("cid"),
        F.coalesce(F.col("_cdc_inh"), F.create_map().cast("map<string,string>")).alias("inh"),
    )


def fold_per_key(per_key: DataFrame, key_cols: list[str], width: int = 0) -> DataFrame:
    """Net effect per key of its events that apply (``label_against_target``'s
    ``_cdc_evs``, in log order); the counts of its events carried along.

    Output: key columns, ``_cdc_action`` ('upsert' | 'delete' when the
    batch's last event is newer than the stored row; 'fill' when every event
    is older, so only columns last set lower still change; NULL when none of
    the key's events applies), ``_cdc_vals``
    (present columns as canonical text), ``_cdc_cpos`` (the position that set
    each of them, where it is not ``_cdc_pos``), ``_cdc_delpos`` (the batch's last delete of the key: the
    columns not present were set NULL there; null when the batch has none,
    so they keep the stored value), ``_cdc_pos``/``_cdc_op``/
    ``_cdc_commit_ts``/``_cdc_tx_id`` of the last event, ``_cdc_events``
    folded, ``_cdc_stored_live``, ``_cdc_stored_pos``; and the key's
    events counted for ``accounting``: ``_cdc_key_events``, ``_k_dups``,
    ``_k_conflicts``, ``_k_superseded``, ``_k_lo``/``_k_hi``, and
    ``_k_partial_inserts``, inserts that apply carrying fewer than ``width`` columns.
    """
    keys = [quote(k) for k in key_cols]
    partial_insert = "{e}.op = 'c' AND size({e}.after) < " + str(int(width))
    folded = (
        per_key.withColumn("_f", F.expr(_ONE_OR_FOLD))
        .withColumn("_cdc_events", F.size("_cdc_evs").cast("bigint"))
        .withColumn("_k_partial_inserts", F.size(F.expr(_keep_where("_cdc_evs", partial_insert))))
    )
    return _folded_columns(folded, keys)


_COUNTS = ("_cdc_key_events", "_k_dups", "_k_conflicts", "_k_superseded", "_k_lo", "_k_hi", "_k_partial_inserts")
"""A key's events counted by ``collapse_per_key`` and ``label_against_target``, for ``accounting``."""


def applied(net: DataFrame) -> DataFrame:
    """The net changes to write: ``fold_per_key``'s keys with an event that applies."""
    return net.where(F.col("_cdc_events") > 0)


def _folded_columns(df: DataFrame, keys: list[str]) -> DataFrame:
    """The net change's columns out of the fold ``_f``.  ``_cdc_cpos`` keeps
    only the columns set at another position than ``_cdc_pos`` (the others
    were set by the change's own last event, ``batch_position``): a key with
    one event has none to keep, and the batch's cached net changes do not
    carry each row's position once per column."""
    newer = F.col("_cdc_stored_pos").isNull() | (F.col("_f.pos") > F.col("_cdc_stored_pos"))
    tombstone = newer & F.col("_f.deleted")  # keeps the state just before its delete
    cpos = F.when(tombstone, F.col("_f.bcpos")).otherwise(F.col("_f.cpos"))
    return df.select(
        *keys,
        F.when(F.col("_cdc_events") == 0, F.lit(None).cast("string"))
        .when(~newer, F.lit("fill"))
        .when(F.col("_f.deleted"), F.lit("delete"))
        .otherwise(F.lit("upsert"))
        .alias("_cdc_action"),
        F.when(tombstone, F.col("_f.bvals")).otherwise(F.col("_f.vals")).alias("_cdc_vals"),
        # (the one-event fold's cpos is empty: no lambda for most keys)
        F.when(F.size(cpos) > 0, F.map_filter(cpos, lambda _, v: v != F.col("_f.pos"))).otherwise(cpos).alias("_cdc_cpos"),
        F.when(tombstone, F.col("_f.bdelpos")).otherwise(F.col("_f.delpos")).alias("_cdc_delpos"),
        F.when(tombstone, F.col("_f.bcid")).otherwise(F.col("_f.cid")).alias("_cdc_cid"),
        F.when(tombstone, F.col("_f.binh")).otherwise(F.col("_f.inh")).alias("_cdc_inh"),
        F.col("_f.endcid").alias("_cdc_endcid"),
        F.col("_f.pos").alias(META_POS),
        F.col("_f.op").alias("_cdc_op"),
        F.col("_f.commit_ts").alias("_cdc_commit_ts"),
        F.col("_f.tx_id").alias("_cdc_tx_id"),
        "_cdc_events",
        "_cdc_stored_live",
        "_cdc_stored_pos",
        *_COUNTS,
    )


def merge_source(folded: DataFrame, key_cols: list[str], columns: dict[str, str]) -> DataFrame:
    """Typed data columns for the MERGE; ``_cdc_present`` lists present columns;
    ``_cdc_stored_pos`` is NULL for a key the branch does not hold."""
    data = [typed_value(F.col("_cdc_vals")[c], t).alias(c) for c, t in columns.items() if c not in key_cols]
    return folded.select(
        *[quote(k) for k in key_cols],
        *data,
        F.map_keys("_cdc_vals").alias("_cdc_present"),
        "_cdc_action",
        "_cdc_cpos",
        "_cdc_delpos",
        "_cdc_cid",
        "_cdc_inh",
        "_cdc_endcid",
        META_POS,
        "_cdc_op",
        "_cdc_commit_ts",
        "_cdc_tx_id",
        "_cdc_stored_pos",
    )


class Accounting(NamedTuple):
    counts: dict[str, int]
    position_min: str | None
    position_max: str | None
    null_keys: int
    """events without a value for a key column: the caller refuses the table"""
    key_ranges: dict[str, tuple]
    """(lowest, highest) value of each key column among the batch's net changes
    of keys the branch holds (the MERGE's share: new keys are appended), for
    the MERGE to prune the target's files (merge.key_range_condition)"""
    new_keys: int
    """net changes of keys the branch holds neither as a row nor as a tombstone"""
    new_key_ranges: dict[str, tuple]
    """the same of the net changes of new keys (with ``key_ranges``, every key the reconciliation reads)"""
    partial_rows: int = 0
    """net changes that write a row with inherited or never-set columns (``_writes_partial_row``)"""
    whole_rows: int = 0
    """net changes of stored keys that win every column (``_replaces_stored_row``)"""


def accounting(net: DataFrame, key_cols: list[str], columns: list[str] | None = None) -> Accounting:
    """Counts per bucket (every event is in exactly one), the batch's position
    range and the events without a key value, in one Spark job over
    ``fold_per_key``'s rows.  With the table's ``columns``, also
    ``partial_inserts``: inserts that leave columns out and inherited
    nothing (the delete half of their primary-key change is not in this
    batch), so those columns stay NULL (``fold_per_key``'s ``width``); and
    ``partial_rows`` (tables.PARTIAL_ROWS_PROPERTY)."""
    return _accounting_of(net.agg(*_accounting_columns(key_cols, columns)).collect()[0].asDict(), key_cols, columns)


def cache_counted(net: DataFrame, key_cols: list[str], columns: list[str] | None = None) -> tuple[DataFrame, Accounting]:
    """The net changes cached, and their ``accounting``.  On a classic
    session the counts are gathered by the job that builds the cache
    (``DataFrame.observe``), so no job reads the cache only to count it, and
    the per-key counts (``_COUNTS``) stay out of it.  The job is a ``noop``
    write: the counts are then taken in its result stage, where Spark applies
    each task's update once (a retried task's too).  On Spark Connect the
    counts keep a job of their own: PySpark 4.1's Connect client refuses a
    join of two frames that descend from one observed frame (SPARK-56322),
    which the reconciliation makes."""
    observation = None if session.is_remote(net.sparkSession) else session.classic_observation()
    if observation is None:
        cached = net.persist()
    else:
        cached = net.observe(observation, *_accounting_columns(key_cols, columns)).drop(*_COUNTS).persist()
    try:
        if observation is None:
            return cached, accounting(cached, key_cols, columns)
        cached.write.format("noop").mode("overwrite").save()
        return cached, _accounting_of(observation.get, key_cols, columns)
    except BaseException:  # the caller gets no frame to release
        cached.unpersist()
        raise


def _accounting_columns(key_cols: list[str], columns: list[str] | None) -> list[Column]:
    """``accounting``'s aggregates over ``fold_per_key``'s rows."""
    data_cols = [c for c in columns or [] if c not in key_cols]
    written = F.col("_cdc_events") > 0
    stored = written & F.col("_cdc_stored_pos").isNotNull()
    action = F.col("_cdc_action")

    def count(condition: Column, name: str) -> Column:
        return F.count(F.when(condition, 1)).alias(name)

    return [
        *[F.sum(c).alias(c) for c in ("_cdc_key_events", "_cdc_events", "_k_dups", "_k_conflicts", "_k_superseded", "_k_partial_inserts")],
        F.min("_k_lo").alias("lo"),
        F.max("_k_hi").alias("hi"),
        F.sum(F.when(null_key_filter(key_cols), F.col("_cdc_key_events"))).alias("null_keys"),
        count((action == "upsert") & ~F.col("_cdc_stored_live"), "inserted"),
        count((action == "upsert") & F.col("_cdc_stored_live"), "updated"),
        count((action == "delete") & F.col("_cdc_stored_live"), "deleted"),
        count((action == "delete") & ~F.col("_cdc_stored_live"), "noop_deletes"),
        count(action == "fill", "filled"),
        F.sum(F.when(written, F.col("_cdc_events") - 1)).alias("compacted"),
        count(written, "keys"),
        count(written & F.col("_cdc_stored_pos").isNull(), "_new_keys"),
        count(written & _writes_partial_row(data_cols), "_partial_rows"),
        count(written & _replaces_stored_row(data_cols), "_whole_rows"),
        *[F.min(F.when(stored, F.col(quote(k)))).alias(f"_lo{i}") for i, k in enumerate(key_cols)],
        *[F.max(F.when(stored, F.col(quote(k)))).alias(f"_hi{i}") for i, k in enumerate(key_cols)],
        *[F.min(F.when(written & ~stored, F.col(quote(k)))).alias(f"_lo_new{i}") for i, k in enumerate(key_cols)],
        *[F.max(F.when(written & ~stored, F.col(quote(k)))).alias(f"_hi_new{i}") for i, k in enumerate(key_cols)],
    ]


def _accounting_of(agg: dict[str, Any], key_cols: list[str], columns: list[str] | None) -> Accounting:
    """``Accounting`` from ``_accounting_columns``' values; raises when the
    buckets do not add up to the events."""
    n = {k: int(agg[k] or 0) for k in agg if not k.startswith(("_lo", "_hi")) and k not in ("lo", "hi")}
    key_ranges = {k: (agg[f"_lo{i}"], agg[f"_hi{i}"]) for i, k in enumerate(key_cols) if agg[f"_lo{i}"] is not None}
    new_ranges = {k: (agg[f"_lo_new{i}"], agg[f"_hi_new{i}"]) for i, k in enumerate(key_cols) if agg[f"_lo_new{i}"] is not None}
    counts = {k: n[k] for k in ("inserted", "updated", "deleted", "noop_deletes", "filled", "keys")}
    counts["duplicates"], counts["conflicts"] = n["_k_dups"], n["_k_conflicts"]
    if columns:
        counts["partial_inserts"] = n["_k_partial_inserts"]
    # folded-away events were superseded by a later event of their key in this batch
    counts["superseded"] = n["_k_superseded"] + n["compacted"]
    final = sum(counts[k] for k in ("inserted", "updated", "deleted", "noop_deletes", "filled"))
    buckets = counts["duplicates"] + counts["conflicts"] + counts["superseded"] + final
    if not n["null_keys"] and (n["_cdc_events"] != final + n["compacted"] or n["_cdc_key_events"] != buckets):
        raise AssertionError(f"accounting does not add up: {n['_cdc_key_events']} events, {n['_cdc_events']} applied, vs {counts}")
    return Accounting(
        counts, agg["lo"], agg["hi"], n["null_keys"], key_ranges, n["_new_keys"], new_ranges, n["_partial_rows"], n["_whole_rows"]
    )


def _writes_partial_row(data_cols: list[str]) -> Column:
    """A net change whose written row has inherited columns, or a column at
    ``NEVER_SET``: a new row (``merge.new_col_pos``) missing a data column
    with no delete of its key in the batch.  A stored row's columns keep
    their stored positions or take the batch's, never ``NEVER_SET``."""
    inherited = F.size(F.coalesce(F.col("_cdc_inh"), F.create_map().cast("map<string,string>"))) > 0
    if not data_cols:
        return inherited
    carried = F.size(F.array_intersect(F.map_keys("_cdc_vals"), F.array(*[F.lit(c) for c in data_cols])))
    return inherited | (F.col("_cdc_stored_pos").isNull() & F.col("_cdc_delpos").isNull() & (carried < len(data_cols)))


def _replaces_stored_row(data_cols: list[str]) -> Column:
    """A net change of a stored key (row or tombstone) that sets every data
    column at a position above the stored row's: it wins each column's
    contest in the MERGE (``merge.merge_sql``), since a stored column's
    position is never above its row's (``_cdc_col_pos`` keeps only lower
    ones).  The MERGE may then take the row whole from the batch without
    reading the stored values (``whole_rows``).  Each column's batch
    position is the MERGE's own (``batch_position``)."""
    stored = F.col("_cdc_stored_pos")
    wins = [stored.isNotNull(), F.col(META_POS) > stored]
    for c in data_cols:
        batch_pos = F.expr(batch_position(c, present="map_keys(_cdc_vals)"))
        wins.append(F.coalesce(batch_pos > stored, F.lit(False)))
    return functools.reduce(operator.and_, wins)
