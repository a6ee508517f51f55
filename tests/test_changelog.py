"""The change log (``<table>_changes``, apply/changelog.py) on real Spark +
Iceberg: every decoded change once, published only with its table."""

from __future__ import annotations

import itertools
import json

import pytest

from cdc_apply import ledger
from cdc_apply.apply import changelog
from tests.apply_harness import apply_events, event, live_rows
from tests.reference_model import apply_model

pytestmark = pytest.mark.spark
COLS = {"id": "int", "name": "string", "amount": "decimal(10,2)"}
_ns = itertools.count()


@pytest.fixture
def ns():
    return f"changelog_{next(_ns)}"


def changes(spark, settings, ns):
    ident = f"{settings.catalog_name}.{ns}.items_changes"
    if not spark.catalog.tableExists(ident):
        return []
    return spark.sql(f"SELECT * FROM {ident} ORDER BY file, line").collect()


def _batch1(ns):
    f = f"/virtual/{ns}/h1.jsonl"
    return [
        event("c", 1, {"name": "a", "amount": "1.00"}, pos=1, file=f, line=1),
        event("c", 2, {"name": "b", "amount": "2.00"}, pos=2, file=f, line=2),
        event("u", 1, {"name": "a2"}, pos=3, file=f, line=3),  # partial: amount not present
        event("c", 2, {"name": "b", "amount": "2.00"}, pos=2, file=f, line=4),  # delivered twice
    ]


def _batch2(ns):
    f = f"/virtual/{ns}/h2.jsonl"
    return [event("d", 2, pos=5, file=f, line=1), event("u", 1, {"name": "a3", "amount": None}, pos=6, file=f, line=2)]


def test_every_decoded_change_is_logged_once_with_its_images(spark, settings, ns):
    b1, b2 = _batch1(ns), _batch2(ns)
    r1 = apply_events(spark, settings, ns, b1, batch_tag="one")
    r2 = apply_events(spark, settings, ns, b2, batch_tag="two")
    assert r1.status == r2.status == "complete", (r1.message, r2.message)
    rows = changes(spark, settings, ns)
    assert [(r["file"].rsplit("/", 1)[1], r["line"], r["op"], r["key"]) for r in rows] == [
        ("h1.jsonl", 1, "c", {"id": "1"}),
        ("h1.jsonl", 2, "c", {"id": "2"}),
        ("h1.jsonl", 3, "u", {"id": "1"}),
        ("h1.jsonl", 4, "c", {"id": "2"}),  # the re-delivery is a decoded change too: logged, not applied
        ("h2.jsonl", 1, "d", {"id": "2"}),
        ("h2.jsonl", 2, "u", {"id": "1"}),
    ]
    assert [r["batch_id"] for r in rows] == [f"{ns}_one"] * 4 + [f"{ns}_two"] * 2
    assert rows[2]["present"] == ["id", "name"] and rows[2]["after"] == {"id": "1", "name": "a2"}
    assert rows[5]["present"] == ["amount", "id", "name"] and rows[5]["after"]["amount"] is None
    assert rows[4]["before"] == {"id": "2"} and rows[4]["position"] == f"{5:020d}"
    assert str(rows[0]["commit_ts"]).startswith("2023-11-14")
    # applying a batch again adds nothing (the table and the change log skip its files)
    again = apply_events(spark, settings, ns, _batch1(ns), batch_tag="one")
    assert again.status == "complete"
    assert len(changes(spark, settings, ns)) == 6
    # the change log replays to the table (the reference model of its events)
    model = apply_model(b1 + b2, ["id"], list(COLS))
    got = live_rows(spark, settings, ns, "items", ["id"], COLS)
    assert {tuple(k): v for k, v in got.items()} == {k: {c: v.get(c) for c in COLS} for k, v in model.items()}


def test_the_change_log_s_commits_carry_its_own_ledger_and_none_of_the_table_s(spark, settings, ns):
    """The table's MERGE carries its ledger (files, counts, positions) as
    session conf (``branches.snapshot_properties``), and Iceberg puts a
    session's snapshot properties on every commit of the session, a
    DataFrame append's too.  The change log's append, on a thread beside
    the labelling, commits before that span opens: its snapshots name its
    own files and none of the table's counts or positions."""
    r = apply_events(spark, settings, ns, _batch1(ns), batch_tag="one")
    assert r.status == "complete", r.message
    table = f"{settings.catalog_name}.{ns}.items"

    def ledger_summaries(ident: str) -> list[dict]:
        rows = spark.sql(f"SELECT summary FROM {ident}.snapshots").collect()
        return [s["summary"] for s in rows if (s["summary"] or {}).get("cdc.batch-id")]

    table_only = {"cdc.position-max", "cdc.watermark", "cdc.commit-ts-max"}
    assert any(table_only <= set(s) and s["cdc.counts"] != "{}" for s in ledger_summaries(table))  # what could leak
    logged = ledger_summaries(changelog.identifier(table))
    assert logged and all(s["cdc.counts"] == "{}" and not table_only & set(s) for s in logged), logged
    assert {f["path"] for s in logged for f in json.loads(s["cdc.files"])} == {f"/virtual/{ns}/h1.jsonl"}


def test_killed_between_the_change_log_and_the_table_publish_logs_each_change_once(spark, settings, ns):
    """The publish fast-forwards the change log, then dies before the table's:
    the files come back in a batch formed with a later file (another batch
    id); the table applies them, the change log only the later file."""
    b1, b2 = _batch1(ns), _batch2(ns)
    r = apply_events(spark, settings, ns, b1, batch_tag="one", stages=("validate",))
    tr = r.tables[0]
    assert tr.status == "validated" and tr.changelog.endswith(".items_changes")
    changelog.publish(ledger.Ledger(settings), tr)  # the kill lands after this
    assert len(changes(spark, settings, ns)) == 4
    assert live_rows(spark, settings, ns, "items", ["id"], COLS) == {}
    r2 = apply_events(spark, settings, ns, _batch1(ns) + b2, batch_tag="onetwo")
    assert r2.status == "complete", r2.message
    rows = changes(spark, settings, ns)
    assert sorted((r["file"], r["line"]) for r in rows) == sorted((e.file, e.line) for e in b1 + b2)
    assert {r["batch_id"] for r in rows if r["file"].endswith("h2.jsonl")} == {f"{ns}_onetwo"}
    model = apply_model(b1 + b2, ["id"], list(COLS))
    got = live_rows(spark, settings, ns, "items", ["id"], COLS)
    assert {tuple(k): v for k, v in got.items()} == {k: {c: v.get(c) for c in COLS} for k, v in model.items()}


def test_a_batch_failing_its_gate_logs_nothing_and_changelog_false_writes_no_table(spark, settings, ns):
    good = [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)]
    assert apply_events(spark, settings, ns, good).status == "complete"
    conflict = [event("u", 1, {"name": "x"}, pos=7), event("u", 1, {"name": "y"}, pos=7)]  # one key, one position, two contents
    r = apply_events(spark, settings, ns, conflict)
    assert r.status == "failed" and "equal_position_conflict" in r.tables[0].message
    assert len(changes(spark, settings, ns)) == 1  # its branch was written, main holds only the good batch
    off = f"{ns}_off"
    assert apply_events(spark, settings, off, good, changelog=False).status == "complete"
    assert not spark.catalog.tableExists(f"{settings.catalog_name}.{off}.items_changes")


def test_a_source_table_named_like_a_change_log_is_refused_not_appended_to(spark, settings, ns):
    assert (
        apply_events(spark, settings, ns, [event("c", 1, {"name": "a"}, pos=1, table="items_changes")], changelog=False).status
        == "complete"
    )
    r = apply_events(spark, settings, ns, [event("c", 1, {"name": "b"}, pos=2)])
    assert r.status == "failed" and r.tables[0].terminal and "is a table, not the change log" in r.tables[0].message
    assert spark.table(f"{settings.catalog_name}.{ns}.items_changes").count() == 1
    # the change log's write runs beside the table's labelling: its failure stops the table before its MERGE
    written = spark.sql(f"SELECT * FROM {settings.catalog_name}.{ns}.items.snapshots").where("summary['added-records'] > 0")
    assert written.count() == 0


def test_a_batch_spanning_days_logs_each_change_in_its_day(spark, settings, ns):
    """The change log is partitioned by day of commit time: changes of three
    days, interleaved in the batch, each land in their day's partition, all
    of them once."""
    f = f"/virtual/{ns}/days.jsonl"
    day_us = 86_400_000_000
    evs = []
    for i in range(12):
        e = event("c", i + 1, {"name": f"n{i}", "amount": "1.00"}, pos=i + 1, file=f, line=i + 1)
        e.commit_ts_us += (i % 3) * day_us
        evs.append(e)
    r = apply_events(spark, settings, ns, evs)
    assert r.status == "complete", r.message
    ident = f"{settings.catalog_name}.{ns}.items_changes"
    rows = spark.sql(f"SELECT line, to_date(commit_ts) AS day, _partition.commit_ts_day AS part FROM {ident}").collect()
    assert sorted(r["line"] for r in rows) == list(range(1, 13))
    assert len({r["day"] for r in rows}) == 3
    assert all(r["part"] == r["day"] for r in rows), rows


@pytest.mark.parametrize("task_bytes, several", [(1 << 10, True), (1 << 30, False)])
def test_a_large_batchs_day_is_written_by_tasks_of_the_asked_size(spark, settings, ns, monkeypatch, task_bytes, several):
    """The change log's write asks Spark for tasks of
    ``SHUFFLE_BYTES_PER_WRITE_TASK`` shuffled bytes: a batch large enough to
    run adaptive (not a small batch) has its one day's rows split among
    several write tasks, each writing its own file, instead of one task
    writing them all (Iceberg's own size, derived from its 512 MB target
    file); every change is logged once either way."""
    from cdc_apply.runtime import spark_conf

    monkeypatch.setattr(spark_conf, "SMALL_BATCH_MESSAGES", 0)
    monkeypatch.setattr(changelog, "SHUFFLE_BYTES_PER_WRITE_TASK", task_bytes)
    evs = []
    for part in range(2):  # two files of 400 changes, every one of the same day
        f = f"/virtual/{ns}/h{part}.jsonl"
        evs += [
            event("c", 500 * part + i, {"name": "n" * 200, "amount": "1.00"}, pos=500 * part + i, file=f, line=i + 1) for i in range(1, 401)
        ]
    r = apply_events(spark, settings, ns, evs)
    assert r.status == "complete", r.message
    ident = f"{settings.catalog_name}.{ns}.items_changes"
    assert spark.sql(f"SELECT count(*) AS n, count(DISTINCT file, line) AS d FROM {ident}").collect()[0].asDict() == {"n": 800, "d": 800}
    files = spark.sql(f"SELECT count(*) AS n, count(DISTINCT partition) AS days FROM {ident}.files").collect()[0]
    assert files["days"] == 1
    assert (files["n"] > 1) == several, files


@pytest.mark.parametrize("raced", ["items_changes", "items_history", "items"])
def test_a_run_whose_branch_starts_after_another_run_published_the_batch_writes_nothing_twice(spark, settings, ns, monkeypatch, raced):
    """Two runs of one batch, the interleaving of the nemesis's two-applies
    race that logged 12 changes twice (CI, f4dc804): run B reads main's
    ledger (the batch's files not applied yet), run A publishes the batch,
    then B cuts its audit branch from main, now past A's commit.  B must
    not write the files again on top of A's: for the change log (an append)
    that would log every change twice; for the history and the table it
    would record the files and their accounting twice.  B refuses (a
    transient ConcurrentApply) and its retry finds the batch applied."""
    from cdc_apply.apply import branches, history
    from cdc_apply.batch import publish_batch

    options = {"changelog": raced != "items", "history": {"items": "scd2"} if raced == "items_history" else None}
    a = apply_events(spark, settings, ns, _batch1(ns), batch_tag="one", stages=("validate",), **options)
    assert a.tables[0].status == "validated", a.tables[0].message
    reset, published = branches.reset_branch, []

    def run_a_publishes_first(session, spec, branch):
        if spec.short == f"{ns}.{raced}" and not published:  # after B read that table's ledger
            published.append(spec.identifier)
            if raced == "items":
                assert publish_batch(settings, a).tables[0].status == "published"
            else:  # that table's alone: B's earlier writes have moved A's other branches
                (changelog if raced == "items_changes" else history).publish(ledger.Ledger(settings), a.tables[0])
        return reset(session, spec, branch)

    monkeypatch.setattr(branches, "reset_branch", run_a_publishes_first)
    b = apply_events(spark, settings, ns, _batch1(ns), batch_tag="one", **options)
    monkeypatch.undo()
    assert published
    assert b.status == "failed" and not b.tables[0].terminal and "another run applied" in b.tables[0].message, b.tables[0].message
    retry = apply_events(spark, settings, ns, _batch1(ns), batch_tag="one", **options)
    assert retry.status == "complete", retry.tables[0].message
    ident = f"{settings.catalog_name}.{ns}.{raced}"
    main = {h["snapshot_id"] for h in spark.sql(f"SELECT snapshot_id FROM {ident}.history WHERE is_current_ancestor").collect()}
    holding = [
        r["snapshot_id"]
        for r in spark.sql(f"SELECT snapshot_id, summary FROM {ident}.snapshots").collect()
        if r["snapshot_id"] in main and f"/virtual/{ns}/h1.jsonl" in r["summary"].get("cdc.files", "")
    ]
    assert len(holding) == 1, f"main's history applies the batch's file {len(holding)} times"
    if raced == "items_changes":
        assert sorted((r["file"], r["line"]) for r in changes(spark, settings, ns)) == sorted((e.file, e.line) for e in _batch1(ns))
    model = apply_model(_batch1(ns), ["id"], list(COLS))
    got = live_rows(spark, settings, ns, "items", ["id"], COLS)
    assert {tuple(k): v for k, v in got.items()} == {k: {c: v.get(c) for c in COLS} for k, v in model.items()}
