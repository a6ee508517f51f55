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
    rows = [("quarantined", f"/a/f{i}.jsonl", i, f"DecodeError: bad {i}", f"raw {i}") for i in range(5)] + [("event", "/a/g.jsonl", 1, None, "{}")]
    decoded = spark.createDataFrame(rows, "status string, file string, line int, reason string, raw string")
    ledger.ensure_audit_tables(settings)
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
