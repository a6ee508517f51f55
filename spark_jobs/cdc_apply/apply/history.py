"""SCD type 2 history: ``<namespace>.<table>_history``, one row per version of
a key, for tables configured with ``history: scd2``.

Derived from the change log (``apply/changelog.py``), key by key: a batch
recomputes every version of the keys its events touch (and of the keys a
primary-key change links them to) from all of those keys' logged events in
log order, and MERGEs the result onto the batch's audit branch of the
history.  So a late event takes its place in the chain (the version it
belongs in is split, its neighbours closed again), a re-delivered one changes
nothing, and applying a batch twice writes the same rows.  The history keeps
its own ledger like the change log and is published by fast-forward after
the change log and before the table.

The versions follow the apply rules (docs/apply-semantics.md) as the
reference model states them: per key, events in (position, file, line)
order, one event per key and position; a delete or truncate ends a life, and
a later event begins a new one with the columns it carries; a column an
event leaves out keeps its value from the version before; the insert half of
a primary-key change takes the old key's columns it does not carry.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cdc_apply import ledger
from cdc_apply.apply import branches, changelog, merge, tables
from cdc_apply.apply.compact import quote, typed_value
from cdc_apply.archive.files import ArchiveFile
from cdc_apply.errors import ConfigError

SUFFIX = "_history"
PROPERTY = "cdc.history-of"
META_COLUMNS = {
    "_cdc_valid_from": "string",
    "_cdc_valid_to": "string",
    "_cdc_valid_from_ts": "timestamp",
    "_cdc_valid_to_ts": "timestamp",
    "_cdc_op": "string",
    "_cdc_closed_by": "string",
    "_cdc_current": "boolean",
    "_cdc_tx_id": "string",
    "_cdc_batch_id": "string",
}
"""``_cdc_valid_from`` / ``_cdc_valid_to``: the source positions that opened
and closed the version (``_cdc_valid_to`` NULL while current), ``_ts`` their
commit times; ``_cdc_op``: the op that opened it (c u r); ``_cdc_closed_by``:
the op that closed it (c u r: a newer version; d: a delete; t: a truncate);
``_cdc_tx_id``: the opening event's transaction; ``_cdc_batch_id``: the batch
that last wrote the row."""
_ENDS = ("d", "t")
_ORDER = ("position", "file", "line")


def identifier(table_identifier: str) -> str:
    return table_identifier + SUFFIX


def ensure_table(spark: SparkSession, ident: str, spec: tables.TableSpec, source: str) -> None:
    """Create the history, or give it the table's new columns and widenings.  A
    table of that name that is not a history is refused, terminally.  A
    history made before ``tables.ROW_GROUP_BYTES`` is given them."""
    if tables.table_exists(spark, ident):
        properties = tables.table_properties(spark, ident)
        if PROPERTY not in properties:
            raise ConfigError(
                f"{ident} is a table, not the history of {spec.identifier}: map one of them to another target "
                "(`tables: {<table>: {target: <name>}}`) or drop `history: scd2` from the table"
            )
        tables.keep_row_groups(spark, ident, properties)
        have = {f.name: f.dataType.simpleString() for f in spark.table(ident).schema.fields}
        for col, typ in spec.columns.items():
            if col not in have:
                spark.sql(f"ALTER TABLE {ident} ADD COLUMN {quote(col)} {typ}")
            elif (wide := tables.widen(have[col], typ, col)) != have[col]:
                spark.sql(f"ALTER TABLE {ident} ALTER COLUMN {quote(col)} TYPE {wide}")
        return
    cols = [f"{quote(c)} {t}" for c, t in spec.columns.items()] + [f"{c} {t}" for c, t in META_COLUMNS.items()]
    spark.sql(
        f"CREATE TABLE IF NOT EXISTS {ident} ({', '.join(cols)}) USING iceberg "
        f"TBLPROPERTIES ({tables.created_properties(source, **{PROPERTY: spec.identifier})})"
    )
    if not spark.sql(f"SELECT 1 FROM {ident}.refs WHERE name = 'main'").collect():
        spark.table(ident).limit(0).writeTo(ident).append()


def write(
    work: Any, spec: tables.TableSpec, files: list[ArchiveFile], changelog_head: int | None, truncated_before: str | None = None
) -> tuple[str, int] | None:
    """Recompute the versions of the keys the batch's files (not yet in the
    history) touch, onto the batch's audit branch; returns (identifier, branch
    head) for the publish, None when the history holds every file already.
    ``changelog_head``: the change log's audit-branch head of this batch (None:
    main holds the files already).  ``truncated_before``: the position of a
    truncate that came before the table was in the lake (its watermark in the
    source state): no change log holds it, and it still ends the lives of
    events older than it that arrive later."""
    spark, batch_id = work.spark, work.batch_id
    ident = identifier(spec.identifier)
    ensure_table(spark, ident, spec, work.source.name)
    hspec = tables.TableSpec(identifier=ident, key_columns=spec.key_columns, columns=spec.columns)
    led = ledger.Ledger(work.settings).table_ledger(hspec.short)
    new = ledger.not_yet_applied(files, led.files if led else {}, ident)
    if not new:
        return None
    log_ident = changelog.identifier(spec.identifier)
    if changelog_head is None:  # main holds the files: an earlier run published the change log, then died
        # read at main's snapshot, by id: the table itself, read inside the MERGE below, fails
        # Spark's planning ("No plan for TableReference", found by the nemesis's kill at its first fast-forward)
        changelog_head = branches.branch_snapshot(spark, changelog.table_spec(log_ident), "main")
    logged = spark.read.option("versionAsOf", changelog_head).table(log_ident)
    logged = logged.withColumn("_k", F.to_json("key"))
    if truncated_before is not None:
        mark = spark.createDataFrame(
            [(batch_id, "t", truncated_before, "", 0)], "batch_id string, op string, position string, file string, line bigint"
        )
        logged = logged.unionByName(mark, allowMissingColumns=True)
    paths = [f.path for f in new]
    mine = logged.where(F.col("file").isin(paths))
    if not (led and led.files) or mine.where("op = 't'").limit(1).count():  # a new history, or a truncate: every key
        touched = logged.where("op <> 't'").select("_k", "key").dropDuplicates(["_k"])
    else:
        touched = _linked_keys(spark, logged, mine.where("op <> 't'").select("_k", "key").dropDuplicates(["_k"]))
    rows = versions(
        logged.join(touched.select("_k"), "_k", "left_semi").unionByName(logged.where("op = 't'")), spec.key_columns, spec.columns
    )
    branch = ledger.audit_branch(batch_id)
    start = branches.reset_branch_for(spark, hspec, branch, new, led, work.settings, batch_id)
    props = ledger.summary_properties(
        batch_id, [f.as_dict() for f in new if f.path not in work.held_files], position_max=None, truncated_at=None, counts={}
    )
    attempt = props[branches.ATTEMPT_PROPERTY] = uuid.uuid4().hex
    with branches.snapshot_properties(spark, props):
        _merge_versions(spark, hspec, branch, rows.withColumn("_cdc_batch_id", F.lit(batch_id)), touched)
        if branches.branch_snapshot(spark, hspec, branch) == start:  # no version changed: the files still count as applied
            branches.ledger_commit(spark, hspec, branch)
    return ident, branches.own_head(spark, hspec, branch, attempt, batch_id, start)


def publish(led: ledger.Ledger, tr: Any) -> None:
    """Fast-forward the history of a validated table (``results.TableResult``)
    after its change log, before the table."""
    if tr.history:
        led.fast_forward(tr.history.split(".", 1)[1], tr.audit_branch, expected_head=tr.history_snapshot)


def _linked_keys(spark: SparkSession, logged: DataFrame, touched: DataFrame) -> DataFrame:
    """``touched`` and every key a primary-key change links to it, either way
    and down chains: their versions depend on each other.  Key changes are few;
    the links are collected and walked on the driver."""
    halves = logged.where("change_id IS NOT NULL")
    links = (
        halves.where("op = 'd'")
        .select(F.col("_k").alias("_old"), "change_id")
        .join(halves.where("op NOT IN ('d', 't')").select(F.col("_k").alias("_new"), "key", "change_id"), "change_id")
        .where("_old <> _new")
        .select("_old", "_new")
        .distinct()
        .collect()
    )
    if not links:
        return touched
    graph: dict[str, set[str]] = defaultdict(set)
    for old, new in links:
        graph[old].add(new)
        graph[new].add(old)
    start = [
        r[0] for r in touched.join(spark.createDataFrame([(k,) for k in graph], "_k string"), "_k", "left_semi").select("_k").collect()
    ]
    seen, todo = set(start), list(start)
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    extra = logged.where("op <> 't'").join(spark.createDataFrame([(k,) for k in seen] or [("",)], "_k string"), "_k", "left_semi")
    return touched.unionByName(extra.select("_k", "key")).dropDuplicates(["_k"])


def versions(logged: DataFrame, key_columns: list[str], columns: dict[str, str]) -> DataFrame:
    """Change-log rows (``changelog.COLUMNS`` plus ``_k``, the key as JSON) of
    some keys, and the log's truncates -> every version of those keys, typed
    like the table."""
    data_cols = [c for c in columns if c not in key_columns]
    events = _events(logged)
    heirs = _heirs(events)
    states = _states(events, data_cols)
    if heirs.limit(1).count():
        states = _inherit(events, heirs, states, data_cols)
    w = Window.partitionBy("_k").orderBy(*_ORDER)
    return (
        states.select(
            "*",
            F.lead("position").over(w).alias("_cdc_valid_to"),
            F.lead("commit_ts").over(w).alias("_cdc_valid_to_ts"),
            F.lead("op").over(w).alias("_cdc_closed_by"),
        )
        .where(~F.col("op").isin(*_ENDS))
        .select(
            *[typed_value(F.col("key")[k], columns[k]).alias(k) for k in key_columns],
            *[typed_value(F.col("_state")[c], columns[c]).alias(c) for c in data_cols],
            F.col("position").alias("_cdc_valid_from"),
            "_cdc_valid_to",
            F.col("commit_ts").alias("_cdc_valid_from_ts"),
            "_cdc_valid_to_ts",
            F.col("op").alias("_cdc_op"),
            "_cdc_closed_by",
            F.col("_cdc_valid_to").isNull().alias("_cdc_current"),
            F.col("tx_id").alias("_cdc_tx_id"),
        )
    )


def _events(logged: DataFrame) -> DataFrame:
    """One event per key and position (the first delivery by file and line),
    and every truncate as an event of each key."""
    cols = ["_k", "key", "op", "after", "present", "position", "commit_ts", "tx_id", "change_id", "file", "line"]
    ev = logged.where("op <> 't'")
    first = Window.partitionBy("_k", "position").orderBy("file", "line")
    ev = ev.withColumn("_n", F.row_number().over(first)).where("_n = 1").select(*cols)
    truncates = logged.where("op = 't'").dropDuplicates(["position"]).drop("_k", "key")
    per_key = ev.select("_k", "key").dropDuplicates(["_k"]).crossJoin(truncates)
    return ev.unionByName(per_key.select(*cols))


def _states(events: DataFrame, data_cols: list[str], moved: DataFrame | None = None) -> DataFrame:
    """Each event with ``_state``: its key's data columns after it (NULL for a
    delete or truncate).  ``moved`` (``_k``, ``_ord``, ``_moved``): the old
    key's row a key change's insert half takes before its own columns."""
    ev = events.withColumn("_ord", F.struct(*_ORDER))
    after, present = F.coalesce("after", F.create_map().cast("map<string,string>")), F.col("present")
    if moved is not None:
        ev = ev.join(moved, ["_k", "_ord"], "left")
        carried = F.map_filter("_moved", lambda k, _v: ~F.array_contains(F.map_keys(after), k))
        after = F.when(F.col("_moved").isNull(), after).otherwise(F.map_concat(carried, after))
        present = F.when(F.col("_moved").isNull(), present).otherwise(F.array(*[F.lit(c) for c in data_cols]))
    ev = ev.withColumn("_after", after).withColumn("_present", present)
    w = Window.partitionBy("_k").orderBy(*_ORDER)
    ends = F.col("op").isin(*_ENDS).cast("int")
    ev = ev.withColumn("_life", F.coalesce(F.sum(ends).over(w.rowsBetween(Window.unboundedPreceding, -1)), F.lit(0)))
    life = Window.partitionBy("_k", "_life").orderBy(*_ORDER).rowsBetween(Window.unboundedPreceding, Window.currentRow)

    def value(c: str) -> Column:
        cell = F.when(F.array_contains("_present", c), F.struct(F.col("_after")[c].alias("v")))
        return F.last(cell, ignorenulls=True).over(life)["v"]

    state = F.map_from_arrays(F.array(*[F.lit(c) for c in data_cols]), F.array(*[value(c) for c in data_cols]))
    kept = [c for c in events.columns] + ["_ord"]
    return ev.select(*kept, F.when(~F.col("op").isin(*_ENDS), state).cast("map<string,string>").alias("_state"))


def _heirs(events: DataFrame) -> DataFrame:
    """Insert halves of key changes: (``_k``, ``_ord``, ``_old``, ``_anchor``):
    the old key's row just before ``_anchor`` (the earlier of the two halves)
    is what the new key takes."""
    ev = events.withColumn("_ord", F.struct(*_ORDER)).where("change_id IS NOT NULL")
    deletes = ev.where("op = 'd'").select(F.col("_k").alias("_old"), "change_id", F.col("_ord").alias("_dord"))
    return (
        ev.where(~F.col("op").isin(*_ENDS))
        .join(deletes, "change_id")
        .where("_old <> _k")
        .select("_k", "_ord", "_old", F.when(F.col("_dord") < F.col("_ord"), F.col("_dord")).otherwise(F.col("_ord")).alias("_anchor"))
    )


def _inherit(events: DataFrame, heirs: DataFrame, states: DataFrame, data_cols: list[str]) -> DataFrame:
    """Give each insert half the old key's row, recomputing the states until
    nothing moves (a chain of key changes takes one round per link)."""
    rounds = heirs.count() + 1
    last: list[Any] | None = None
    for _ in range(rounds):
        prior = states.select(
            F.col("_k").alias("_old"), F.col("_ord").alias("_pord"), F.col("op").alias("_pop"), F.col("_state").alias("_pstate")
        )
        cand = heirs.join(prior, "_old").where(F.col("_pord") < F.col("_anchor"))
        pick = Window.partitionBy("_k", "_ord").orderBy(F.col("_pord").desc())
        moved = (
            cand.withColumn("_n", F.row_number().over(pick))
            .where("_n = 1")
            .select("_k", "_ord", F.when(~F.col("_pop").isin(*_ENDS), F.col("_pstate")).alias("_moved"))
            .localCheckpoint()
        )
        now = sorted((r[0], str(r[1]), r[2]) for r in moved.select("_k", "_ord", F.to_json("_moved")).collect())
        if now == last:
            break
        last = now
        states = _states(events, data_cols, moved).localCheckpoint()
    return states


def _merge_versions(spark: SparkSession, hspec: tables.TableSpec, branch: str, rows: DataFrame, touched: DataFrame) -> None:
    """Replace the history rows of the touched keys with ``rows``: one MERGE
    (matched on key and ``_cdc_valid_from``), deleting versions no longer in
    the chain."""
    keys = hspec.key_columns
    typed = touched.select(*[typed_value(F.col("key")[k], hspec.columns[k]).alias(k) for k in keys])
    stored = branches.read_branch(spark, hspec, branch).join(typed, keys, "left_semi")
    cols = [*hspec.columns, *META_COLUMNS]
    stale = stored.join(rows, [*keys, "_cdc_valid_from"], "left_anti").select(*cols)
    source = rows.select(*cols, F.lit(False).alias("_cdc_drop")).unionByName(stale.withColumn("_cdc_drop", F.lit(True)))
    on = " AND ".join(f"t.{quote(k)} = s.{quote(k)}" for k in [*keys, "_cdc_valid_from"])
    sets = ", ".join(f"t.{quote(c)} = s.{quote(c)}" for c in cols)
    names = ", ".join(quote(c) for c in cols)
    values = ", ".join(f"s.{quote(c)}" for c in cols)

    def sql(view: str) -> str:
        return (
            f"MERGE INTO {branches.branch_ref(hspec, branch)} t USING {view} s ON {on} "
            f"WHEN MATCHED AND s._cdc_drop THEN DELETE WHEN MATCHED THEN UPDATE SET {sets} "
            f"WHEN NOT MATCHED AND NOT s._cdc_drop THEN INSERT ({names}) VALUES ({values})"
        )

    merge.run_with_view(spark, source, f"_cdc_hist_{abs(hash((hspec.identifier, branch)))}", sql)
