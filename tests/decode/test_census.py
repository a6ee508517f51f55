"""The decoded batch's census (``decode/census.py``) three ways: from the Arrow
table in the driver (``counted_here``, a small batch's), in one Spark pass
(``counted``, a large batch's), and as the two Spark queries the batch ran
before (rows per status and reason; ``table_meta``).  The last is the oracle:
Spark's own aggregates over the same rows, written separately."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import functions as F

from cdc_apply.decode import census
from cdc_apply.decode.debezium_common import UNTYPED_NOTE
from cdc_apply.decode.stage import OUTCOME_SCHEMA, outcomes_batch
from cdc_apply.model import ChangeEvent, Column, Held, Op, Quarantined, Skipped

pytestmark = pytest.mark.spark

TABLES = [("db", "public", "a"), ("db", "public", "b"), (None, "dbo", "a"), (None, None, "c")]
DECLS = [
    [Column("id", "int", False), Column("name", "string")],
    [Column("id", "int", False), Column("name", "string"), Column("amount", "decimal(10,2)")],
]


def normalized(rows: list) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Census tables by table, their sets sorted."""
    out = {}
    for r in rows:
        d = r.asDict(recursive=True)
        d["decl"] = sorted(map(repr, d["decl"]))
        d["keys"] = sorted(map(repr, d["keys"]))
        out[tuple(d[c] for c in census.TABLE)] = d
    return out


@st.composite
def outcomes(draw) -> list:
    out: list = []
    for i in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(["event"] * 6 + ["skipped", "held", "quarantined"]))
        f, line = f"/f{draw(st.integers(0, 2))}", i + 1
        if kind == "skipped":
            out.append(Skipped(reason=draw(st.sampled_from(["tombstone", "transaction marker"])), file=f, line=line))
        elif kind == "held":
            out.append(Held(reason="split event", file=f, line=line))
        elif kind == "quarantined":
            out.append(Quarantined(reason=draw(st.sampled_from(["bad json", "no key"])), raw="x", file=f, line=line))
        else:
            db, schema, table = draw(st.sampled_from(TABLES))
            op = draw(st.sampled_from([Op.INSERT, Op.UPDATE, Op.DELETE, Op.READ, Op.TRUNCATE]))
            after = {} if op in (Op.DELETE, Op.TRUNCATE) else {"id": "1", **({"name": "x"} if draw(st.booleans()) else {})}
            out.append(
                ChangeEvent(
                    format="debezium_postgres",
                    database=db,
                    schema=schema,
                    table=table,
                    op=op,
                    key_columns=draw(st.sampled_from([["id"], ["id", "name"]])),
                    after=after,
                    before={"id": "1"} if op == Op.DELETE else None,
                    position=f"{draw(st.integers(0, 99)):020d}",
                    columns=draw(st.sampled_from([None, *DECLS])),
                    commit_ts_us=draw(st.one_of(st.none(), st.integers(-(10**15), 10**17))),
                    notes=[UNTYPED_NOTE] if draw(st.integers(0, 4)) == 0 else [],
                    change_id=draw(st.sampled_from([None, "c1", "c2"])),
                    file=f,
                    line=line,
                )
            )
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(rows=outcomes())
def test_the_census_in_the_driver_and_in_one_spark_pass_equals_spark_s_two_queries(spark, rows):
    table = pa.Table.from_batches([outcomes_batch(rows)])
    frame = spark.createDataFrame(table, OUTCOME_SCHEMA)
    counts = {(r["status"], r["reason"]): r["n"] for r in frame.groupBy("status", "reason").agg(F.count(F.lit(1)).alias("n")).collect()}
    tables = normalized(census.table_meta(frame.where("status = 'event'")))
    here, spark_pass = census.counted_here(table), census.counted(frame)
    assert here.counts == counts and spark_pass.counts == counts
    assert normalized(here.tables) == tables and normalized(spark_pass.tables) == tables


def test_a_collected_commit_time_is_the_micros_the_events_carry(spark):
    """The latest commit time is microseconds since the epoch in every form
    (a timestamp collected to Python would be the driver's local time)."""
    rows = [
        ChangeEvent("debezium_postgres", "db", "public", "a", Op.INSERT, ["id"], {"id": "1"}, "1", commit_ts_us=us, line=i)
        for i, us in enumerate([1_700_000_000_000_001, 1_700_000_000_000_007, None])
    ]
    table = pa.Table.from_batches([outcomes_batch(rows)])
    frame = spark.createDataFrame(table, OUTCOME_SCHEMA)
    for found in (census.counted_here(table).tables, census.counted(frame).tables, census.table_meta(frame)):
        assert [m["max_commit_us"] for m in found] == [1_700_000_000_000_007]
