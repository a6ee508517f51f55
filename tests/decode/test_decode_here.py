"""A small batch is decoded in the driver's Python (``stage.decode_here``),
a larger one by Spark's Python tasks: both must give the same outcome rows
and the same decoder state, for every format, hostile lines included.

The messages come from each format's test writer (not the decoders), the
hostile lines are written by hand, and one file is gzip: the comparison is
between the two ways of running the same decoders, so what it pins is the
driver pass (Qlik metadata, split SQL Server CES events), the order of the
files, the copies of the context and the hand-over to Spark.
"""

from __future__ import annotations

import datetime as dt
import gzip
import importlib
import json
from decimal import Decimal
from pathlib import Path

import pytest

from cdc_apply.decode import DecodeContext, census, stage
from tests.decode.test_census import normalized
from tests.formats.synthetic import SyntheticChange

pytestmark = pytest.mark.spark

WRITERS = {
    "debezium_postgres": "write_debezium_postgres",
    "debezium_sqlserver": "write_debezium_sqlserver",
    "sqlserver_ces": "write_sqlserver_ces",
    "qlik": "write_qlik",
    "cockroachdb": "write_cockroachdb",
}
HOSTILE = [b"not json at all", b'{"payload": 1}', b'{"truncated": ', b"\xff\xfe not UTF-8", b"[]"]


def _changes() -> list[SyntheticChange]:
    t0 = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)
    out, seq = [], 0
    for key in range(1, 7):
        for op in ("c", "u", "u", "d"):
            seq += 1
            row = {"id": key, "name": f"n{seq} ü", "amount": Decimal(seq * 101).scaleb(-2), "updated_at": t0 + dt.timedelta(seconds=seq)}
            after = None if op == "d" else row
            before = {"id": key} if op in ("u", "d") else None
            out.append(SyntheticChange(op, {"id": key}, after, before, seq, seq, t0 + dt.timedelta(seconds=seq)))
    return out


def _archive(fmt: str, tmp_path: Path) -> list[tuple[str, int]]:
    """Two files of the format's messages, duplicates and hostile lines: a
    plain one and a gzip one; the Qlik metadata message leads the first."""
    options = {"split_every": 2} if fmt == "sqlserver_ces" else {}  # split events: the driver pass
    written = importlib.import_module(f"tests.formats.{WRITERS[fmt]}").write_messages(_changes(), **options)
    lines = [line.encode() for line in written]
    head = 1 if fmt == "qlik" else 0
    mid = head + (len(lines) - head) // 2
    first = lines[:mid] + HOSTILE[:3] + [lines[-1]]
    second = lines[mid:] + HOSTILE[3:] + [lines[head]]
    plain, packed = tmp_path / f"{fmt}-a.jsonl", tmp_path / f"{fmt}-b.jsonl.gz"
    plain.write_bytes(b"\n".join(first) + b"\n")
    packed.write_bytes(gzip.compress(b"\n".join(second) + b"\n"))
    return [(str(p), p.stat().st_size) for p in (plain, packed)]


def _decoded(spark, files, fmt: str, local: bool, monkeypatch) -> tuple[list[str], dict[str, set[str]], dict]:
    """(rows without their ``columns``, sorted; the column declarations per
    table; the decoder state) of ``decode_batch`` run one way."""
    monkeypatch.setattr(stage, "LOCAL_DECODE_BYTES", 1 << 40 if local else -1)
    ctx = DecodeContext(source=f"here_{fmt}", primary_keys={"items": ["id"]})
    out = stage.decode_batch(spark, files, fmt, ctx)
    df, state, counts = out.frame, out.state, out.counts
    rows, declared = [], {}
    if local:  # the decode's own census is the frame's
        grouped = {(r["status"], r["reason"]): r["count"] for r in df.groupBy("status", "reason").count().collect()}
        assert counts == grouped
        assert normalized(out.tables) == normalized(census.table_meta(df.where("status = 'event'")))
    else:
        assert counts is None and out.tables is None
    for row in df.collect():
        d = row.asDict(recursive=True)
        columns = d.pop("columns")
        if columns is not None:
            declared.setdefault(f"{d['database']}.{d['schema_name']}.{d['table_name']}", set()).add(json.dumps(columns, sort_keys=True))
        rows.append(json.dumps(d, sort_keys=True, default=str))
    return sorted(rows), declared, state


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_a_batch_decoded_here_equals_the_spark_tasks_decode(fmt, spark, tmp_path, monkeypatch):
    files = _archive(fmt, tmp_path)
    in_spark = _decoded(spark, files, fmt, False, monkeypatch)
    here = _decoded(spark, files, fmt, True, monkeypatch)
    rows, declared, state = here
    statuses = {json.loads(r)["status"] for r in rows}
    assert {"event", "quarantined"} <= statuses, statuses  # the messages decoded, the hostile lines refused
    assert len(rows) >= len(_changes()) + len(HOSTILE)
    assert rows == in_spark[0]
    assert declared == in_spark[1]
    assert state == in_spark[2]


def test_the_batch_size_picks_the_way(spark, tmp_path, monkeypatch):
    """At most ``LOCAL_DECODE_BYTES`` of archive: decoded here (a local
    relation, no Python task); above: by Spark's Python tasks."""
    files = _archive("debezium_postgres", tmp_path)
    size = sum(s for _, s in files)
    ctx = DecodeContext(source="here_size", primary_keys={"items": ["id"]})
    monkeypatch.setattr(stage, "LOCAL_DECODE_BYTES", size)
    here = stage.decode_batch(spark, files, "debezium_postgres", ctx).frame
    monkeypatch.setattr(stage, "LOCAL_DECODE_BYTES", size - 1)
    tasks = stage.decode_batch(spark, files, "debezium_postgres", ctx).frame
    assert "MapInArrow" not in _plan(here) and "MapInArrow" in _plan(tasks)


def _plan(df) -> str:
    return df._jdf.queryExecution().executedPlan().toString()


def test_the_outcome_schema_is_the_outcome_ddl(spark):
    """The schema made from the Arrow one (no SQL parse) is the DDL's."""
    assert spark.createDataFrame([], stage.OUTCOME_DDL).schema == stage.OUTCOME_SCHEMA
