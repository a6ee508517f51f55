"""What a decoded batch holds: its rows per (status, reason), and per source
table the facts the apply plans by (declarations, keys, truncates, key
changes, the latest commit time).

Both come from one pass over the decoded rows: a Spark aggregate for a batch
decoded by Spark's tasks (``counted``), and the same figures from the Arrow
table of a batch decoded in the driver (``counted_here``), which needs no
Spark job.  ``table_meta`` is the per-table part alone, for the batches whose
events are not all the decoded rows (lines held back, a table filter,
tables renamed).  ``tests/decode/test_census.py`` pins the three to one
another.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F

from cdc_apply.decode.debezium_common import UNTYPED_NOTE

TABLE = ("database", "schema_name", "table_name")
META_FIELDS = (
    "decl",
    "keys",
    "n",
    "only_truncates",
    "max_truncate",
    "truncates",
    "max_commit_us",
    "keyed_deletes",
    "min_keyed_after",
    "untyped",
)


class Census(NamedTuple):
    counts: dict[tuple[str, str | None], int]
    """decoded rows per (status, reason)"""
    tables: list[Row]
    """per source table with events: ``TABLE`` and ``META_FIELDS``"""


def _meta_aggregates(ev: Column) -> list[Column]:
    """The per-table facts of the rows where ``ev`` holds (the others only
    add their column declarations)."""
    keyed = ev & F.col("change_id").isNotNull()
    return [
        F.collect_set("columns").alias("decl"),
        F.collect_set(F.when(ev, F.col("key_columns"))).alias("keys"),
        F.count(F.when(ev, 1)).alias("n"),
        F.bool_and(F.when(ev, F.col("op") == "t")).alias("only_truncates"),
        F.max(F.when(ev & (F.col("op") == "t"), F.col("position"))).alias("max_truncate"),
        F.count(F.when(ev & (F.col("op") == "t"), 1)).alias("truncates"),
        # micros, not the timestamp: a collected timestamp is the driver's local wall time
        F.unix_micros(F.max(F.when(ev, F.col("commit_ts")))).alias("max_commit_us"),
        F.count(F.when(keyed & (F.col("op") == "d"), 1)).alias("keyed_deletes"),
        # the fewest columns an insert or update of a key change carries (compact.inherit_moved_columns)
        F.min(F.when(keyed & (F.col("op") != "d"), F.size("after"))).alias("min_keyed_after"),
        F.count(F.when(ev & F.array_contains("notes", UNTYPED_NOTE), 1)).alias("untyped"),
    ]


def table_meta(events: DataFrame, declared: DataFrame | None = None) -> list[Row]:
    """Per source table of ``events``: its facts (one Spark job).  A table's
    column declaration rides on its first event of each decode batch only
    (``stage.outcome_row``): ``declared`` (decoded events with a
    declaration, before held lines and lines applied earlier were set apart)
    still types the table's other events."""
    ev = F.col("_ev")
    rows = events.withColumn("_ev", F.lit(True))
    if declared is not None:
        rows = rows.unionByName(declared.withColumn("_ev", F.lit(False)))
    meta = rows.groupBy(*TABLE).agg(*_meta_aggregates(ev)).collect()
    return [m for m in meta if m["n"]]


def counted(decoded: DataFrame) -> Census:
    """The census of every decoded row, in one Spark job (the batch's first
    pass over them: with ``table_meta`` it was two).  Only events name a
    table, so the grouping by table adds a group per table, not per row."""
    rows = (
        decoded.groupBy("status", "reason", *TABLE)
        .agg(F.count(F.lit(1)).alias("_rows"), *_meta_aggregates(F.col("status") == "event"))
        .collect()
    )
    counts: dict[tuple[str, str | None], int] = {}
    for r in rows:
        counts[(r["status"], r["reason"])] = counts.get((r["status"], r["reason"]), 0) + r["_rows"]
    tables = [Row(**{f: r[f] for f in (*TABLE, *META_FIELDS)}) for r in rows if r["status"] == "event" and r["n"]]
    return Census(counts, tables)


def counted_here(table: pa.Table) -> Census:
    """``counted`` of outcome rows in an Arrow table (``stage.ARROW_SCHEMA``),
    in this process: no Spark job."""
    grouped = table.group_by(["status", "reason"]).aggregate([([], "count_all")]).to_pylist()
    counts = {(c["status"], c["reason"]): c["count_all"] for c in grouped}
    events = table.filter(pc.equal(table["status"], "event"))
    if not events.num_rows:
        return Census(counts, [])
    cols = {c: events[c].to_pylist() for c in (*TABLE, "op", "key_columns", "columns", "position", "change_id", "notes")}
    cols["commit_us"] = events["commit_ts"].cast(pa.int64()).to_pylist()
    cols["after_size"] = _map_sizes(events["after"])
    per: dict[tuple[Any, ...], dict[str, Any]] = {}
    for i in range(events.num_rows):
        t = tuple(cols[c][i] for c in TABLE)
        m = per.get(t)
        if m is None:
            m = per[t] = {"decl": [], "keys": [], "n": 0, "truncates": 0, "keyed_deletes": 0, "untyped": 0}
            m.update(only_truncates=True, max_truncate=None, max_commit_us=None, min_keyed_after=None)
        op, position, commit_us, notes = cols["op"][i], cols["position"][i], cols["commit_us"][i], cols["notes"][i]
        m["n"] += 1
        _add_distinct(m["decl"], cols["columns"][i])
        _add_distinct(m["keys"], cols["key_columns"][i])
        m["only_truncates"] = m["only_truncates"] and op == "t"
        if op == "t":
            m["truncates"] += 1
            m["max_truncate"] = _max(m["max_truncate"], position)
        m["max_commit_us"] = _max(m["max_commit_us"], commit_us)
        if cols["change_id"][i] is not None:
            if op == "d":
                m["keyed_deletes"] += 1
            elif cols["after_size"][i] is not None:
                size = cols["after_size"][i]
                m["min_keyed_after"] = size if m["min_keyed_after"] is None else min(m["min_keyed_after"], size)
        if notes and UNTYPED_NOTE in notes:
            m["untyped"] += 1
    return Census(counts, [Row(**dict(zip(TABLE, t, strict=True)), **{f: m[f] for f in META_FIELDS}) for t, m in per.items()])


def _map_sizes(maps: pa.ChunkedArray) -> list[int | None]:
    """Entries per map (Spark's ``size``; None for a null map): Arrow's
    ``list_value_length`` takes no maps."""
    out: list[int | None] = []
    for chunk in maps.chunks:
        sizes = np.diff(chunk.offsets.to_numpy()).tolist()
        valid = chunk.is_valid().to_pylist()
        out.extend(n if ok else None for n, ok in zip(sizes, valid, strict=True))
    return out


def _add_distinct(values: list[Any], value: Any) -> None:
    """``collect_set``: nulls left out, each value once."""
    if value is not None and value not in values:
        values.append(value)


def _max(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None else max(a, b)
