"""Time travel by source position (spark_jobs/cdc_apply/asof.py, ``cdc
as-of``) against the reference model, on real Spark + Iceberg: a workload
in several batches, read back as of positions across them."""

from __future__ import annotations

import datetime as dt
import json
import random

import pytest

from tests.apply_harness import apply_events, event
from tests.reference_model import apply_model

pytestmark = pytest.mark.spark
COLS = {"id": "int", "name": "string", "amount": "decimal(10,2)"}


def workload(ns: str, seed: int, n: int = 36, batches: int = 4) -> list[list]:
    """Inserts, partial updates, deletes and re-inserts of 6 keys at positions
    1..n, cut into ``batches`` batches at random points (in position order)."""
    rnd = random.Random(seed)
    live: set[int] = set()
    cuts = sorted(rnd.sample(range(2, n), batches - 1))
    out: list[list] = [[] for _ in range(batches)]
    for pos in range(1, n + 1):
        b = sum(pos > c for c in cuts)
        k = rnd.randint(1, 6)
        f = f"/virtual/{ns}/b{b}.jsonl"
        if k not in live:
            e, _ = event("c", k, {"name": f"n{pos}", "amount": f"{pos}.00"}, pos=pos, file=f), live.add(k)
        elif rnd.random() < 0.3:
            e, _ = event("d", k, pos=pos, file=f), live.discard(k)
        else:
            e = event("u", k, {"name": f"u{pos}"} if rnd.random() < 0.5 else {"amount": f"{pos}.50"}, pos=pos, file=f)
        out[b].append(e)
    return out


def rows_of(spark, sql: str) -> dict[tuple, dict]:
    cols = ", ".join(f"CAST(`{c}` AS string) AS `{c}`" for c in COLS)
    return {(r["id"],): r.asDict() for r in spark.sql(f"SELECT {cols} FROM ({sql})").collect()}


def model_upto(events: list, position: int) -> dict[tuple, dict]:
    model = apply_model([e for e in events if int(e.position) <= position], ["id"], list(COLS))
    return {k: {c: v.get(c) for c in COLS} for k, v in model.items()}


def test_as_of_positions_across_batches_match_the_reference_model(spark, settings, tmp_path, monkeypatch, capsys):
    from cdc_apply import asof, cli

    ns = "asof_1"
    batches = workload(ns, seed=11)
    for i, b in enumerate(batches):
        assert apply_events(spark, settings, ns, b, batch_tag=f"b{i}").status == "complete"
    events = [e for b in batches for e in b]
    marks = [max(int(e.position) for e in b) for b in batches]
    assert asof.table_as_of(settings, ns, "items", position=f"{marks[0] - 1:020d}") is None  # before the first publish
    # the table's snapshots are expired: the publish tags keep what as-of reads
    spark.sql(
        f"CALL {settings.catalog_name}.system.expire_snapshots(table => '{settings.catalog_name}.{ns}.items', "
        f"older_than => TIMESTAMP '{(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)):%Y-%m-%d %H:%M:%S}', retain_last => 1)"
    )
    for i, mark in enumerate(marks):
        for pos in {mark, mark + 1 if i + 1 < len(marks) and mark + 1 < marks[i + 1] else mark}:
            found = asof.table_as_of(settings, ns, "items", position=f"{pos:020d}")
            assert found is not None and int(found.watermark) == mark and found.batch_id == f"{ns}_b{i}", (pos, found)
            assert found.next_watermark == (f"{marks[i + 1]:020d}" if i + 1 < len(marks) else None)
            assert rows_of(spark, found.sql) == model_upto(events, mark), (pos, found)
        # by source commit time (the harness commits position p at 1.7e15 + p microseconds)
        when = dt.datetime.fromtimestamp((1_700_000_000_000_000 + mark) / 1e6, dt.UTC).isoformat()
        assert asof.table_as_of(settings, ns, "items", time=when).snapshot_id == found.snapshot_id
    # the CLI prints the snapshot and the SQL to read it
    (tmp_path / "sources.yaml").write_text(f"sources:\n  {ns}:\n    format: debezium_postgres\n    namespace: {ns}\n")
    monkeypatch.setenv("CDC_SOURCES_FILE", str(tmp_path / "sources.yaml"))
    capsys.readouterr()
    assert cli.main(["as-of", "--source", ns, "--table", "items", "--position", f"{marks[1] + 1:020d}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch_id"] == f"{ns}_b1" and f"VERSION AS OF {out['snapshot_id']}" in out["sql"]
    assert rows_of(spark, out["sql"]) == model_upto(events, marks[1])
    assert cli.main(["as-of", "--source", ns, "--table", "items", "--position", "0"]) == cli.EXIT_TERMINAL


@pytest.fixture
def driver_in_new_york():
    """The driver's Python process in a zone west of UTC, as an Airflow
    worker's may be (PySpark turns a collected timestamp into local time)."""
    import os
    import time

    before = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def test_the_commit_time_watermark_is_utc_whatever_the_driver_s_zone(spark, settings, driver_in_new_york):
    """``cdc.commit-ts-max`` is the latest source commit time in UTC, for a
    batch of new files and for one whose files are partly applied (whose
    commit times are read by another query); under a driver zone five hours
    west of UTC it was recorded five hours early."""
    from cdc_apply import asof, ledger

    ns = "asof_tz"
    first = [event("c", k, {"name": f"n{k}"}, pos=k, file=f"/virtual/{ns}/f0.jsonl") for k in (1, 2, 3)]
    assert apply_events(spark, settings, ns, first, batch_tag="b0").status == "complete"
    again = [event("c", k, {"name": f"n{k}"}, pos=k, file=f"/virtual/{ns}/f0.jsonl") for k in (1, 2, 3)]
    later = [event("u", 1, {"name": "later"}, pos=9, file=f"/virtual/{ns}/f1.jsonl")]
    assert apply_events(spark, settings, ns, again + later, batch_tag="b1").status == "complete"
    published = asof.publishes(ledger.Ledger(settings).catalog.load_table(f"{ns}.items"))
    utc = [dt.datetime.fromtimestamp((1_700_000_000_000_000 + pos) / 1e6, dt.UTC) for pos in (3, 9)]
    assert [p.commit_ts_max for p in published] == [f"{t:%Y-%m-%dT%H:%M:%S.%f}Z" for t in utc]
    found = asof.table_as_of(settings, ns, "items", time=utc[0].isoformat())
    assert found is not None and found.batch_id == f"{ns}_b0"
