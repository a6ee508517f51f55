"""The quality gate: write-audit-publish with Great Expectations and CDC
reconciliation. Failing data never reaches main."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cdc_apply import ledger
from cdc_apply.apply import branches, merge
from cdc_apply.apply.gate import GateAhead
from cdc_apply.model import Quarantined
from tests.apply_harness import apply_events, event, live_rows
from tests.sample import FULL

pytestmark = pytest.mark.spark
_ns = itertools.count()
COLS = {"id": "int", "name": "string", "amount": "decimal(10,2)"}
SPARK_JOBS = Path(__file__).resolve().parents[1] / "spark_jobs"


@pytest.fixture
def ns():
    return f"gate_{next(_ns)}"


def main_snapshot(spark, settings, ns):
    return spark.sql(f"SELECT snapshot_id FROM {settings.catalog_name}.{ns}.items.refs WHERE name = 'main'").collect()[0][0]


def refs(spark, settings, ns):
    """The table's branches (each publish also tags its snapshot ``cdc_<batch>`` for as-of)."""
    return {r[0] for r in spark.sql(f"SELECT name FROM {settings.catalog_name}.{ns}.items.refs WHERE type = 'BRANCH'").collect()}


def ledger_rows(settings, ns, batch_id):
    return [r for r in ledger.Ledger(settings).batch_rows(ns) if r["batch_id"] == batch_id]


def test_passing_batch_is_published_with_ledger_rows_and_data_docs(spark, settings, ns):
    r = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    assert r.status == "complete"
    t = r.tables[0]
    assert t.status == "published" and t.snapshot_id == main_snapshot(spark, settings, ns)
    assert refs(spark, settings, ns) == {"main"}  # the audit branch is gone
    assert (t.data_docs and open(t.data_docs).read().startswith("<!DOCTYPE html>")) or "html" in open(t.data_docs).read()[:200].lower()
    rows = ledger_rows(settings, ns, r.batch_id)
    assert {x["table_name"]: x["status"] for x in rows} == {f"{settings.catalog_name}.{ns}.items": "published", "*": "complete"}
    table_row = next(x for x in rows if x["table_name"] != "*")
    assert table_row["counts"] and dict(table_row["counts"])["inserted"] == 1
    assert table_row["files"][0]["sha256"] and table_row["snapshot_id"] == t.snapshot_id


def test_duplicate_key_in_branch_fails_keeps_main_and_branch_then_fix_publishes_once(spark, settings, ns, monkeypatch):
    apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    before = main_snapshot(spark, settings, ns)
    real_merge = merge.merge_changes

    def merge_and_corrupt(spark_, spec, branch, source, batch_id, key_ranges=None, **split):
        real_merge(spark_, spec, branch, source, batch_id, key_ranges, **split)
        spark_.sql(f"INSERT INTO {branches.branch_ref(spec, branch)} SELECT * FROM {spec.identifier} VERSION AS OF '{branch}' WHERE id = 2")

    monkeypatch.setattr(merge, "merge_changes", merge_and_corrupt)
    batch = [event("c", 2, {"name": "b", "amount": "2.00"}, pos=2)]
    r = apply_events(spark, settings, ns, batch, batch_tag="dup")
    assert r.status == "failed" and r.terminal
    t = r.tables[0]
    assert any(f.startswith("expect_column_values_to_be_unique") for f in t.failed_expectations), t.failed_expectations
    assert any(f.startswith("reconcile_live_row_count") for f in t.failed_expectations)
    assert main_snapshot(spark, settings, ns) == before  # main untouched
    assert f"audit_{r.batch_id}" in refs(spark, settings, ns)  # branch kept for inspection
    assert t.branch in t.message and t.data_docs
    failed_row = next(x for x in ledger_rows(settings, ns, r.batch_id) if x["table_name"] != "*")
    assert failed_row["status"] == "failed" and failed_row["failed_expectations"]
    assert batch[0].file not in ledger.Ledger(settings).applied_files(ns)  # not marked applied

    monkeypatch.setattr(merge, "merge_changes", real_merge)  # the operator fixed the cause
    r2 = apply_events(spark, settings, ns, batch, batch_tag="dup")
    assert r2.status == "complete" and r2.tables[0].status == "published"
    r3 = apply_events(spark, settings, ns, batch, batch_tag="dup")
    assert r3.tables[0].status == "skipped"
    assert set(live_rows(spark, settings, ns, "items", ["id"], COLS)) == {("1",), ("2",)}
    assert refs(spark, settings, ns) == {"main"}


def test_the_suites_started_at_the_write_judge_that_branch_head_only(spark, settings, ns):
    """The write starts each table's GX suites as soon as its branch is written
    (``GateAhead``): their verdict is the gate's for that head only, and a run
    that broke is raised to the gate, not taken for a verdict."""
    r = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)], stages=("write",))
    t = r.tables[0]
    head = spark.sql(f"SELECT * FROM {t.table} VERSION AS OF {t.branch_snapshot}")
    ahead = GateAhead(settings, r.id)
    ahead.start(t, head)
    assert ahead.result(t.table, t.branch_snapshot + 1) is None  # another head: the gate runs the suites itself
    ahead.start(t, head)
    passed = ahead.result(t.table, t.branch_snapshot)
    assert passed is not None and passed.success and passed.checks > 0 and not passed.failed
    ahead.start(t, head.unionByName(head))  # the key twice
    failed = ahead.result(t.table, t.branch_snapshot)
    assert failed is not None and not failed.success and any("unique" in f for f in failed.failed)
    ahead.start(t, spark.range(1))  # not a branch at all
    with pytest.raises(Exception, match="_cdc_batch_id"):
        ahead.result(t.table, t.branch_snapshot)
    ahead.close()


def test_user_suite_violation_fails_the_batch(spark, settings, ns, tmp_path):
    settings = dataclasses.replace(settings, expectations_dir=tmp_path)
    (tmp_path / f"{ns}.items.json").write_text(
        json.dumps({"expectations": [{"type": "expect_column_values_to_be_between", "kwargs": {"column": "amount", "min_value": 0}}]})
    )
    apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    before = main_snapshot(spark, settings, ns)
    r = apply_events(spark, settings, ns, [event("c", 2, {"name": "neg", "amount": "-1.00"}, pos=2)])
    t = r.tables[0]
    assert (
        r.status == "failed"
        and t.failed_expectations[0].startswith('expect_column_values_to_be_between({"column": "amount"')
        and len(t.failed_expectations) == 1
    )
    assert main_snapshot(spark, settings, ns) == before
    assert t.data_docs
    # the failing suite ran again for its detail: the stored validation result names the unexpected value
    stored = Path(t.data_docs).parents[2] / "validations"
    unexpected = [
        r["result"].get("partial_unexpected_list")
        for f in stored.rglob("*.json")
        for r in json.loads(f.read_text())["results"]
        if r["expectation_config"]["type"] == "expect_column_values_to_be_between"
    ]
    assert sorted(unexpected, key=str) == [None, [-1.0]], unexpected  # the verdict alone, then the detail


def test_a_batch_leaves_nothing_cached_in_the_session(spark, settings, ns, tmp_path):
    """A long-lived session (the Spark Connect server) runs batch after batch:
    what a batch caches (its decode, its net changes, and the
    frames the GX suites validate, which GX's Spark engine would cache and
    never release) is released when it ends, whether its gate passes or a
    user suite fails it (and runs again for the detail).  Compared as the
    session's cached RDDs before and after: a batch adds none, while other
    tests' frames may be released meanwhile."""
    settings = dataclasses.replace(settings, expectations_dir=tmp_path)
    (tmp_path / f"{ns}.items.json").write_text(
        json.dumps({"expectations": [{"type": "expect_column_values_to_be_between", "kwargs": {"column": "amount", "min_value": 0}}]})
    )
    jsc = spark.sparkContext._jsc

    def cached() -> set[int]:
        return {int(i) for i in jsc.getPersistentRDDs().keySet()}

    before = cached()
    ok = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    assert ok.status == "complete", ok.message
    assert cached() - before == set()
    failed = apply_events(spark, settings, ns, [event("c", 2, {"name": "neg", "amount": "-1.00"}, pos=2)])
    assert failed.status == "failed" and failed.tables[0].failed_expectations, failed.message
    assert cached() - before == set()


@pytest.mark.parametrize("small", [True, False], ids=["small-batch", "large-batch"])
def test_the_reconciliation_reads_a_small_batch_s_net_changes_cut_off_from_their_plan(spark, settings, ns, monkeypatch, small):
    """A small batch's net changes are a local checkpoint by the time the
    reconciliation (and the MERGE) read them: their plan is the kept rows,
    not the decode, windows, join and fold under them, which every later
    query would analyse again (``session.cut_off``).  A batch past
    ``SMALL_BATCH_MESSAGES`` reads them from the cache, as before.  Either
    way the batch publishes the same rows, and leaves nothing kept
    (``test_a_batch_leaves_nothing_cached_in_the_session``)."""
    from cdc_apply.apply import gate
    from cdc_apply.runtime import spark_conf

    if not small:
        monkeypatch.setattr(spark_conf, "SMALL_BATCH_MESSAGES", 1)
    plans = []
    reconcile = gate.reconcile

    def watched(branch, base_live, live_after, folded, *args, **kwargs):
        plans.append(folded._jdf.queryExecution().optimizedPlan().toString())
        return reconcile(branch, base_live, live_after, folded, *args, **kwargs)

    monkeypatch.setattr(gate, "reconcile", watched)
    r = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1), event("u", 1, {"name": "b"}, pos=2)])
    assert r.status == "complete", r.message
    assert live_rows(spark, settings, ns, "items", ["id"], COLS) == {("1",): {"id": "1", "name": "b", "amount": "1.00"}}
    [plan] = plans
    assert ("LogicalRDD" in plan) is small and ("InMemoryRelation" in plan) is not small, plan
    if small:  # a cached frame's plan prints the plan under it
        assert "Window" not in plan and "Join" not in plan, plan


def test_a_later_batch_s_gate_compiles_no_template_and_parses_no_config_variables(spark, settings, ns, monkeypatch):
    """The gate's fixed cost per batch.  GX gives each page view its own
    Jinja environment; the process's views share one cache of compiled
    templates (``gx_import.share_compiled_templates``), so a batch after the
    first compiles none.  A file context parses its ``config_variables.yml``
    on every configuration lookup; the gate's projects have none once made
    (``gate.without_config_variables``).  The batch still writes its pages."""
    import jinja2
    from great_expectations.core import config_provider

    from cdc_apply.apply import gate

    first = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    assert first.status == "complete", first.message
    compiled, parsed, made = [], [], []
    compile_ = jinja2.Environment.compile
    load = config_provider.yaml.load
    without = gate.without_config_variables

    def project_made(ctx):
        without(ctx)
        made.append(ctx)

    def counted(self, *args, **kwargs):
        compiled.append(args[1] if len(args) > 1 else kwargs.get("name"))
        return compile_(self, *args, **kwargs)

    def parsing(*args, **kwargs):
        if made:  # (making the project parses the file it writes)
            parsed.append(args)
        return load(*args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "compile", counted)
    monkeypatch.setattr(config_provider.yaml, "load", parsing)
    monkeypatch.setattr(gate, "without_config_variables", project_made)
    second = apply_events(spark, settings, ns, [event("u", 1, {"name": "b"}, pos=2)])
    assert second.status == "complete", second.message
    docs = second.tables[0].data_docs
    assert docs and docs != first.tables[0].data_docs and "html" in Path(docs).read_text()[:200].lower()
    assert compiled == [], compiled
    assert made and parsed == [], f"{len(parsed)} parse(s) of config variables after the project was made"
    assert not list(Path(docs).parents[3].rglob("config_variables.yml"))


def test_a_passing_suite_runs_once_for_its_verdict_alone(spark, settings, ns, monkeypatch):
    from cdc_apply.apply.gx_import import import_great_expectations

    gx = import_great_expectations()
    formats = []
    run = gx.Checkpoint.run

    def watched(self, *args, **kwargs):
        formats.append(str(getattr(self.result_format, "value", self.result_format)))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(gx.Checkpoint, "run", watched)
    r = apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    assert r.status == "complete", r.message
    assert formats == ["BOOLEAN_ONLY"]


def test_quarantine_share_over_limit_fails_before_any_write(spark, settings, ns):
    apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    before = main_snapshot(spark, settings, ns)
    bad = [Quarantined(reason="malformed JSON", raw="{oops", file="", line=i) for i in range(3)]
    r = apply_events(spark, settings, ns, [event("c", 2, {"name": "b", "amount": "2.00"}, pos=2)] + bad, quarantine_max_share=0.5)
    assert r.status == "failed" and r.failed_checks == ["quarantine_share(max=0.5, got=0.7500)"] and r.tables == []
    assert main_snapshot(spark, settings, ns) == before
    q = spark.sql(
        f"SELECT reason, raw FROM {settings.catalog_name}.{settings.audit_namespace}.quarantine WHERE batch_id = '{r.batch_id}'"
    ).collect()
    assert len(q) == 3 and q[0]["raw"] == "{oops"


def test_force_override_publishes_a_failing_batch_and_records_it(spark, settings, ns, tmp_path, monkeypatch):
    from cdc_apply.results import Override

    settings = dataclasses.replace(settings, expectations_dir=tmp_path)
    (tmp_path / f"{ns}.items.json").write_text(
        json.dumps({"expectations": [{"type": "expect_column_values_to_be_between", "kwargs": {"column": "amount", "min_value": 0}}]})
    )
    batch = [event("c", 2, {"name": "neg", "amount": "-1.00"}, pos=2)]
    failed = apply_events(spark, settings, ns, batch, batch_tag="neg")
    assert failed.status == "failed" and f"audit_{failed.batch_id}" in refs(spark, settings, ns)

    with pytest.raises(Exception, match="needs a reason"):
        Override.parse("force", "  ")
    force = Override.parse("force", "refund rows are negative by design, suite fixed in PR 12", operator="oncall")
    r = apply_events(spark, settings, ns, batch, batch_tag="neg", override=force)
    t = r.tables[0]
    assert r.status == "complete" and t.status == "published" and t.override.startswith("FORCE by oncall: refund rows")
    assert t.failed_expectations and t.failed_expectations[0].startswith("expect_column_values_to_be_between")
    assert set(live_rows(spark, settings, ns, "items", ["id"], COLS)) == {("2",)}
    assert refs(spark, settings, ns) == {"main"}  # the failed attempt's branch went with the publish
    row = [x for x in ledger_rows(settings, ns, r.batch_id) if x["table_name"] != "*" and x["status"] == "forced"]
    assert len(row) == 1 and "refund rows" in row[0]["message"] and row[0]["failed_expectations"]
    assert batch[0].file in ledger.Ledger(settings).applied_files(ns)


def test_skip_override_marks_files_applied_without_applying(spark, settings, ns):
    from cdc_apply.archive.files import ArchiveFile
    from cdc_apply.batch import batch_id_for, skip_batch
    from cdc_apply.config import SourceConfig
    from cdc_apply.results import BatchResult, Override

    apply_events(spark, settings, ns, [event("c", 1, {"name": "a", "amount": "1.00"}, pos=1)])
    before = main_snapshot(spark, settings, ns)
    import datetime as dt

    f = ArchiveFile(hour=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), path=f"/virtual/{ns}/bad.jsonl", size=3, sha256="ab" * 32)
    bid = batch_id_for(ns, [f])
    spark.sql(f"ALTER TABLE {settings.catalog_name}.{ns}.items CREATE BRANCH audit_{bid}")  # what a failed attempt leaves
    skip = Override.parse("skip", "upstream replayed garbage, re-snapshot requested", operator="oncall")
    result = BatchResult(batch_id=bid, source=ns, status="complete", files=[f.as_dict()], override=skip.__dict__)
    r = skip_batch(settings, SourceConfig(name=ns, format="debezium_postgres", namespace=ns), result)
    assert r.status == "skipped" and "SKIP by oncall" in r.message
    assert main_snapshot(spark, settings, ns) == before  # nothing applied
    assert refs(spark, settings, ns) == {"main"}  # the failed attempt's branch is dropped
    assert ledger.Ledger(settings).applied_files(ns)[f.path] == f.sha256  # discovery will not offer it again
    (row,) = [x for x in ledger_rows(settings, ns, bid)]
    assert row["table_name"] == "*" and row["status"] == "skipped" and "re-snapshot" in row["message"]


def test_force_override_lets_a_quarantine_share_through(spark, settings, ns):
    from cdc_apply.results import Override

    bad = [Quarantined(reason="malformed JSON", raw="{oops", file="", line=i) for i in range(3)]
    force = Override.parse("force", "known bad lines from the 02:00 connector crash", operator="oncall")
    r = apply_events(
        spark, settings, ns, [event("c", 2, {"name": "b", "amount": "2.00"}, pos=2)] + bad, quarantine_max_share=0.5, override=force
    )
    assert r.status == "complete" and r.failed_checks == ["quarantine_share(max=0.5, got=0.7500)"]
    assert "FORCE by oncall" in r.message
    (row,) = [x for x in ledger_rows(settings, ns, r.batch_id) if x["table_name"] == "*"]
    assert row["status"] == "complete" and row["failed_expectations"] == r.failed_checks


RECONCILE_CASES = {
    # name: (branch rows (id, position, deleted), folded batch (id, action, position), failed checks)
    "consistent": ([(1, "05", False), (2, "06", True), (3, "01", False)], [(1, "upsert", "05"), (2, "delete", "06")], []),
    "position went backwards": (
        [(1, "02", False), (2, "06", True), (3, "01", False)],
        [(1, "upsert", "02"), (2, "delete", "06")],
        ["reconcile_no_position_regression"],
    ),
    "deleted key still live": (
        [(1, "05", False), (2, "06", False), (3, "01", False)],
        [(1, "upsert", "05"), (2, "delete", "06")],
        ["reconcile_deleted_keys_absent", "reconcile_live_row_count"],
    ),
    "upserted key missing": (
        [(2, "06", True), (3, "01", False)],
        [(1, "upsert", "05"), (2, "delete", "06")],
        ["reconcile_live_row_count", "reconcile_upserted_keys_present"],
    ),
    "upsert not at the batch's position": (
        [(1, "04", False), (2, "06", True), (3, "01", False)],
        [(1, "upsert", "05"), (2, "delete", "06")],
        ["reconcile_upserted_keys_present"],
    ),
    "key twice": (
        [(1, "05", False), (1, "05", False), (2, "06", True), (3, "01", False)],
        [(1, "upsert", "05"), (2, "delete", "06")],
        ["reconcile_key_unique", "reconcile_live_row_count"],
    ),
}


@pytest.mark.parametrize("broadcast", [True, False], ids=["keys-broadcast", "keys-shuffled"])
@pytest.mark.parametrize("case", sorted(RECONCILE_CASES))
def test_reconciliation_names_what_is_wrong(spark, monkeypatch, case, broadcast):
    """Each reconciliation check on hand-made frames: main holds ids 1
    (position 03), 2 (04) and 3 (01), all live; the batch updates 1 and
    deletes 2, so 2 rows stay live.  The batch's keys are broadcast, or
    shuffled as a batch with more keys than compact.BROADCAST_ROWS_MAX's."""
    from cdc_apply.apply import compact, gate

    monkeypatch.setattr(compact, "BROADCAST_ROWS_MAX", 10**9 if broadcast else 0)

    branch_rows, folded_rows, expected = RECONCILE_CASES[case]
    schema = "id int, _cdc_position string, _cdc_deleted boolean"
    branch = spark.createDataFrame(branch_rows, schema)
    main = spark.createDataFrame([(1, "03", False), (2, "04", False), (3, "01", False)], schema)
    folded = spark.createDataFrame(folded_rows, "id int, _cdc_action string, _cdc_pos string")
    counts = {"inserted": 0, "deleted": 1, "keys": len(folded_rows)}
    failed = gate.reconcile(branch, 3, branch.where("NOT _cdc_deleted").count(), folded, ["id"], counts, main)
    assert sorted(f.split("(")[0] for f in failed) == expected, failed


def _reconcile_oracle(branch_rows, main_rows, folded_rows) -> set[str]:
    """The reconciliation checks in plain Python, row by row, with their
    counts: the batch's keys' rows in the branch and in main against its net
    changes."""
    found = collections.Counter()
    for key, action, pos in folded_rows:
        held = [(p, d) for k, p, d in branch_rows if k == key]
        before = [p for k, p, _ in main_rows if k == key]
        found["reconcile_key_unique(keys"] += len(held) > 1
        found["reconcile_no_position_regression(rows"] += sum(1 for p, _ in held if any(p < m for m in before))
        if action == "delete":
            found["reconcile_deleted_keys_absent(rows"] += sum(1 for _, d in held if d is False)
        if action == "upsert":
            found["reconcile_upserted_keys_present(rows"] += sum(1 for p, d in held if d or p != pos) if held else 1
    return {f"{check}={n})" for check, n in found.items() if n}


_POS = st.sampled_from(["01", "03", "05"])


_KEY = st.tuples(
    st.one_of(st.none(), st.tuples(st.sampled_from(["upsert", "delete", "fill"]), _POS)),  # the batch's net change, if any
    st.lists(st.tuples(_POS, st.booleans()), max_size=2),  # the branch's rows (position, deleted)
    st.one_of(st.none(), _POS),  # main's row
)


@hsettings(max_examples=40 if FULL else 12, deadline=None, suppress_health_check=list(HealthCheck))  # CI: tests/sample.py
@given(st.lists(_KEY, min_size=1, max_size=3), st.booleans())
@example([(("upsert", "03"), [("03", True)], None)], True)  # held at the batch's position, but as a tombstone
@example([(("delete", "05"), [("05", False)], "03"), (None, [("01", False), ("01", False)], None)], True)  # a twin outside the batch
@example([(("upsert", "05"), [("01", False), ("05", True)], "03"), (("delete", "05"), [("05", False)], None)], False)
def test_reconciliation_agrees_with_a_row_by_row_reading(spark, keys, broadcast):
    """Random keys: in the batch or not, held by the branch zero to two times,
    deleted or not, at the batch's position or another, and in main or not;
    the batch's keys broadcast or shuffled.  The checks that fail, and what
    they count, are the ones a row-by-row reading finds."""
    from unittest import mock

    from cdc_apply.apply import compact, gate

    schema = "id int, _cdc_position string, _cdc_deleted boolean"
    folded_rows = [(k, *change) for k, (change, _, _) in enumerate(keys) if change]
    branch = [(k, pos, deleted) for k, (_, held, _) in enumerate(keys) for pos, deleted in held]
    main_rows = [(k, pos, False) for k, (_, _, pos) in enumerate(keys) if pos]
    counts = {"inserted": 0, "deleted": 0, "keys": len(folded_rows)}
    live = sum(1 for r in branch if not r[2])
    with mock.patch.object(compact, "BROADCAST_ROWS_MAX", 10**9 if broadcast else 0):
        failed = gate.reconcile(
            spark.createDataFrame(branch, schema),
            live,
            live,
            spark.createDataFrame(folded_rows, "id int, _cdc_action string, _cdc_pos string"),
            ["id"],
            counts,
            spark.createDataFrame(main_rows, schema),
        )
    assert set(failed) == _reconcile_oracle(branch, main_rows, folded_rows)


def _in_fresh_interpreter(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a new Python with the jobs' package importable, as a spark-submit driver starts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SPARK_JOBS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_great_expectations_is_imported_beside_the_write_and_a_job_ending_first_waits_for_it():
    """A fresh interpreter, as a spark-submit job starts: the preload imports
    GX on a thread of its own while the main thread goes on, and an exit
    before the gate waits for the import instead of tearing it down."""
    code = (
        "import sys, threading\n"
        "from cdc_apply.apply import gate\n"
        "assert 'great_expectations' not in sys.modules\n"
        "gate.preload_great_expectations()\n"
        "t = next(t for t in threading.enumerate() if t.name == 'preload-great-expectations')\n"
        "assert not t.daemon and 'great_expectations.expectations.registry' not in sys.modules\n"
        "import atexit\n"
        "atexit.register(lambda: print('loaded' if 'great_expectations.expectations.registry' in sys.modules else 'missing'))\n"
    )
    done = _in_fresh_interpreter(code)
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr


def test_the_live_rows_before_a_batch_are_the_ones_the_last_reconciliation_counted(spark, settings, ns):
    """Reconciliation's count before a batch is taken from the last batch's
    count (``cdc.live-rows``: snapshot and rows) when the batch starts from
    that snapshot, instead of a scan of the table; a start from any other
    snapshot counts again.  A wrong kept count fails the batch's live-row
    check: the kept count is what the check uses, and it is checked."""
    from cdc_apply.apply import tables

    ident = f"{settings.catalog_name}.{ns}.items"

    def kept():
        return tables.table_properties(spark, ident).get(tables.LIVE_ROWS_PROPERTY)

    def apply(*events):
        r = apply_events(spark, settings, ns, list(events))
        return r, r.tables[0]

    r, t = apply(*[event("c", i, {"name": f"n{i}", "amount": "1.00"}, pos=i) for i in range(1, 6)])
    assert r.status == "complete" and "live_rows" in t.seconds  # a new table: counted
    assert kept() == f"{main_snapshot(spark, settings, ns)}:5"
    r, t = apply(event("d", 1, pos=10), event("c", 9, {"name": "n9", "amount": "2.00"}, pos=11))
    assert r.status == "complete" and not t.failed_expectations and "live_rows" not in t.seconds  # carried
    assert kept() == f"{main_snapshot(spark, settings, ns)}:5"

    spark.table(ident).limit(0).writeTo(ident).append()  # another writer's commit: main moves on
    r, t = apply(event("u", 2, {"name": "m2", "amount": "3.00"}, pos=12))
    assert r.status == "complete" and not t.failed_expectations and "live_rows" in t.seconds  # counted again

    spark.sql(f"ALTER TABLE {ident} SET TBLPROPERTIES ('{tables.LIVE_ROWS_PROPERTY}'='{main_snapshot(spark, settings, ns)}:99')")
    r, t = apply(event("u", 3, {"name": "m3", "amount": "3.00"}, pos=13))
    assert r.status == "failed" and any(f.startswith("reconcile_live_row_count(expected=99") for f in t.failed_expectations), t
    r, t = apply(event("u", 4, {"name": "m4", "amount": "3.00"}, pos=14))  # the failed batch's count named its own branch
    assert r.status == "complete" and not t.failed_expectations and "live_rows" in t.seconds
    assert kept() == f"{main_snapshot(spark, settings, ns)}:5"
    assert live_rows(spark, settings, ns, "items", ["id"], {"id": "int"}).keys() == {(str(k),) for k in (2, 3, 4, 5, 9)}


def test_great_expectations_is_imported_without_the_libraries_only_some_user_expectations_need():
    """A fresh interpreter: GX's import leaves altair and scipy.stats unloaded
    (the KL-divergence expectation imports them at module level, ~0.8 s of
    every batch), every expectation is still registered, and the libraries
    load whole when the gate asks (``load_deferred``)."""
    code = (
        "import sys\n"
        "from cdc_apply.apply import gx_import\n"
        "gx = gx_import.import_great_expectations()\n"
        "from great_expectations.expectations.registry import get_expectation_impl\n"
        "get_expectation_impl('expect_column_kl_divergence_to_be_less_than')\n"
        "assert 'scipy.stats._stats_py' not in sys.modules and 'altair.vegalite' not in sys.modules\n"
        "gx_import.load_deferred()\n"
        "import scipy.stats, altair\n"
        "assert 'scipy.stats._stats_py' in sys.modules and 'altair.vegalite' in sys.modules\n"
        "print(round(float(scipy.stats.entropy([0.5, 0.5], [0.9, 0.1])), 4), altair.Chart.__name__)\n"
    )
    done = _in_fresh_interpreter(code)
    assert done.returncode == 0 and done.stdout.strip() == "0.5108 Chart", done.stderr


def test_a_user_expectation_built_on_the_deferred_libraries_judges_the_batch(spark, settings, ns, tmp_path):
    """The KL-divergence expectation computes with scipy.stats, which the
    gate's GX import defers: a user suite with it still judges the table,
    passing the batch that fits the distribution (an error inside the
    expectation would fail it) and failing the one that does not."""
    settings = dataclasses.replace(settings, expectations_dir=tmp_path)
    kl = {"column": "amount", "partition_object": {"bins": [0, 10, 1000], "weights": [0.9, 0.1]}, "threshold": 0.1}
    (tmp_path / f"{ns}.items.json").write_text(
        json.dumps({"expectations": [{"type": "expect_column_kl_divergence_to_be_less_than", "kwargs": kl}]})
    )
    fits = [event("c", i, {"name": "a", "amount": "5.00" if i < 10 else "500.00"}, pos=i) for i in range(1, 11)]
    assert apply_events(spark, settings, ns, fits).status == "complete"
    r = apply_events(spark, settings, ns, [event("u", i, {"name": "a", "amount": "500.00"}, pos=10 + i) for i in range(1, 10)])
    t = r.tables[0]
    assert r.status == "failed" and [f.split("(")[0] for f in t.failed_expectations] == ["expect_column_kl_divergence_to_be_less_than"]
