"""Regression tests of what the nemesis (issue 18, ``tests/nemesis/``) found,
one per defect, on real Spark + Iceberg."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

pytestmark = pytest.mark.spark


def test_two_runs_recording_one_batchs_quarantine_at_once_never_double_it(spark, settings):
    """Found by the race of two applies of one batch: both deleted the batch's
    quarantine rows (none yet), then both appended them: every row twice.
    The write is one MERGE now; Iceberg's commit check makes the later one
    retry, and the retry finds the rows there."""
    from cdc_apply import ledger
    from cdc_apply.batch import _record_quarantine
    from cdc_apply.config import SourceConfig

    source = SourceConfig(name="qrace", format="debezium_postgres", namespace="qrace")
    rows = [("quarantined", f"/a/f{i}.jsonl", i, f"DecodeError: bad {i}", f"raw {i}") for i in range(5)] + [
        ("event", "/a/g.jsonl", 1, None, "{}")
    ]
    decoded = spark.createDataFrame(rows, "status string, file string, line int, reason string, raw string")
    ledger.Ledger(settings).ensure_audit_tables()
    target = f"{settings.catalog_name}.{settings.audit_namespace}.{ledger.QUARANTINE_TABLE}"
    for attempt in range(3):
        batch = f"qrace_{attempt}"
        barrier, errors = threading.Barrier(2), []

        def write(barrier=barrier, batch=batch, errors=errors):
            barrier.wait()
            try:
                _record_quarantine(spark, settings, source, batch, decoded)
            except Exception as exc:  # a loser may fail (transient, clearly): never double
                errors.append(exc)

        threads = [threading.Thread(target=write) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        got = Counter((r["file"], r["line"]) for r in spark.sql(f"SELECT file, line FROM {target} WHERE batch_id = '{batch}'").collect())
        assert set(got) == {(f"/a/f{i}.jsonl", i) for i in range(5)} and set(got.values()) == {1}, (got, errors)
        assert all("another run is applying batch" in str(e) for e in errors), errors
    _record_quarantine(spark, settings, source, "qrace_0", decoded)  # a later retry of a batch replaces, never doubles
    assert spark.sql(f"SELECT count(*) FROM {target} WHERE batch_id = 'qrace_0'").collect()[0][0] == 5


def test_two_runs_quarantining_a_table_s_null_keys_at_once_never_double_them_nor_lose_them(spark, settings):
    """The null-key quarantine of a table (``table._quarantine_keyless``)
    was a delete then an append, the pattern the test above found doubling:
    two runs of one batch at once wrote every row twice.  It is the MERGE of
    ``quarantine.write`` now.  And a rewrite of the batch's decode quarantine
    (another run's, or a retry's) deleted the null-key rows, whose reasons
    fell in its scope: the batch then counted messages as quarantined that
    the quarantine table did not hold.  The scopes are disjoint now."""
    from cdc_apply import ledger
    from cdc_apply.apply import tables
    from cdc_apply.apply.table import TableWork, _quarantine_keyless
    from cdc_apply.batch import _record_quarantine
    from cdc_apply.config import SourceConfig
    from cdc_apply.decode.stage import outcomes_decoded
    from tests.apply_harness import event

    source = SourceConfig(name="krace", format="debezium_postgres", namespace="krace")
    evs = [event("c", i, {"name": "x"}, pos=i, file="/a/k.jsonl", line=i) for i in range(1, 6)]
    for e in evs[:3]:
        e.after = {"name": "x"}  # no value for the key column
    rows = outcomes_decoded(spark, evs).frame
    spec = tables.TableSpec(f"{settings.catalog_name}.krace.items", ["id"], {"id": "int", "name": "string"})
    ledger.Ledger(settings).ensure_audit_tables()
    target = f"{settings.catalog_name}.{settings.audit_namespace}.{ledger.QUARANTINE_TABLE}"

    def quarantined(batch: str) -> Counter:
        return Counter((r["file"], r["line"]) for r in spark.sql(f"SELECT file, line FROM {target} WHERE batch_id = '{batch}'").collect())

    for attempt in range(3):
        batch = f"krace_{attempt}"
        work = TableWork(spark, settings, source, batch, [], {})
        barrier, errors = threading.Barrier(2), []

        def write(barrier=barrier, work=work, errors=errors):
            barrier.wait()
            try:
                assert _quarantine_keyless(work, spec, rows) == 3
            except Exception as exc:  # a loser may fail (transient, clearly): never double
                errors.append(exc)

        threads = [threading.Thread(target=write) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        got = quarantined(batch)
        assert set(got) == {("/a/k.jsonl", i) for i in range(1, 4)} and set(got.values()) == {1}, (got, errors)
        assert all("another run is applying batch" in str(e) for e in errors), errors
    decoded = spark.createDataFrame(
        [("quarantined", "/a/f.jsonl", 9, "DecodeError: bad", "raw 9")], "status string, file string, line int, reason string, raw string"
    )
    _record_quarantine(spark, settings, source, "krace_0", decoded)  # the decode's rows, written again
    assert quarantined("krace_0") == Counter({("/a/k.jsonl", 1): 1, ("/a/k.jsonl", 2): 1, ("/a/k.jsonl", 3): 1, ("/a/f.jsonl", 9): 1})


def test_a_run_that_loses_the_race_to_create_the_audit_namespace_goes_on(settings, monkeypatch):
    """Found by the race of two applies of one batch at once (CI, stagger 0):
    pyiceberg's SQL catalog checks for the namespace and then inserts it, so
    the run that checked before the other's insert failed on the catalog's
    unique key.  Here the check is made to answer "absent" once, after the
    namespace exists, which is that interleaving without the timing."""
    from cdc_apply import ledger

    ledger.Ledger(settings).ensure_audit_tables()  # the winner
    loser = ledger.Ledger(settings)
    catalog = loser.catalog
    real_exists = catalog.namespace_exists
    canned = [False]  # the loser's own check ran before the winner's insert

    def exists(namespace):
        return canned.pop() if canned else real_exists(namespace)

    monkeypatch.setattr(catalog, "namespace_exists", exists)
    loser.ensure_audit_tables()
    assert not canned, "the race was not reproduced: the check was never asked"
    assert catalog.table_exists(loser.batches_table) and catalog.table_exists(loser.quarantine_table)


def _skip_race_source(tmp_path, monkeypatch, name: str):
    from cdc_apply.archive.listing import list_files
    from tests.test_probe_apply import _file, _msg, _sources

    _sources(tmp_path, monkeypatch, name)
    _file(tmp_path / name, 0, [_msg("public", "customers", i, 100 + i) for i in (1, 2, 3)])
    return list_files(tmp_path / name)


def test_a_skip_recorded_while_a_run_applies_the_batch_stops_its_publish(spark, settings, tmp_path, monkeypatch):
    """Found by the race of an apply and an operator's skip: the skip (no
    Spark, seconds) recorded the batch skipped while the apply was writing;
    the apply then published every table anyway and exited 0 — the ledger
    said 'skipped' over applied rows.  A publish now finds the skip and
    publishes nothing (transient: the rerun has nothing to do)."""
    from cdc_apply import ledger
    from cdc_apply.batch import finish_batch, publish_batch, run_batch, validate_batch
    from cdc_apply.config import Settings
    from cdc_apply.results import Override

    files = _skip_race_source(tmp_path, monkeypatch, "skiprace")
    s = Settings.from_env()
    skipped = run_batch(s, "skiprace", files, spark=spark, override=Override("skip", "nemesis", "op"))
    assert skipped.status == "skipped"
    result = run_batch(s, "skiprace", files, spark=spark, stages=("write",))  # files chosen before the skip
    assert result.tables[0].status == "written"
    validate_batch(s, result, spark)
    publish_batch(s, result)
    finish_batch(s, result)
    ident = result.tables[0].table
    assert result.tables[0].status == "failed" and not result.tables[0].terminal
    assert "skipped" in result.tables[0].message, result.tables[0].message
    assert spark.sql(f"SELECT count(*) FROM {ident} WHERE NOT _cdc_deleted").collect()[0][0] == 0
    assert ledger.Ledger(s).published_snapshot(ident.split(".", 1)[1], result.batch_id) is None
    assert [r["status"] for r in ledger.Ledger(s).batch_rows("skiprace") if r["table_name"] == "*"] == ["skipped"]


def test_a_batch_published_by_a_run_cannot_be_skipped(spark, settings, tmp_path, monkeypatch):
    """The other order: the apply published, the skip came before its finish:
    the skip is refused (the files are applied), the finish records complete."""
    from cdc_apply import ledger
    from cdc_apply.batch import finish_batch, publish_batch, run_batch, validate_batch
    from cdc_apply.config import Settings
    from cdc_apply.errors import TerminalError
    from cdc_apply.results import Override

    files = _skip_race_source(tmp_path, monkeypatch, "skiplate")
    s = Settings.from_env()
    result = run_batch(s, "skiplate", files, spark=spark, stages=("write",))
    validate_batch(s, result, spark)
    publish_batch(s, result)
    with pytest.raises(TerminalError, match="cannot be skipped"):
        run_batch(s, "skiplate", files, spark=spark, override=Override("skip", "nemesis", "op"))
    finish_batch(s, result)
    assert result.status == "complete"
    assert [r["status"] for r in ledger.Ledger(s).batch_rows("skiplate") if r["table_name"] == "*"] == ["complete"]
