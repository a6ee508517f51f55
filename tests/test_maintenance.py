"""Maintenance with Iceberg's procedures: compaction, snapshot expiry,
orphan removal, tombstone purge — and never under an open audit branch."""

from __future__ import annotations

import time

import pytest

from cdc_apply import ledger
from cdc_apply.config import SourceConfig
from cdc_apply.maintenance import Retention, maintain_audit, maintain_source, maintain_table
from tests.apply_harness import apply_events, event

pytestmark = pytest.mark.spark


def test_maintenance_compacts_expires_and_purges(spark, settings):
    ns = "maint_1"
    for i in range(3):
        apply_events(spark, settings, ns, [event("c", 10 + i, {"name": "x", "amount": "1.00"}, pos=10 + i)])
    apply_events(spark, settings, ns, [event("d", 10, pos=50)])
    ident = f"{settings.catalog_name}.{ns}.items"
    files_before = spark.sql(f"SELECT count(*) FROM {ident}.files").collect()[0][0]
    time.sleep(1.1)  # expiry's cut-off is in whole seconds: every batch's commit strictly before it
    started = spark.sql("SELECT current_timestamp()").collect()[0][0]
    unreferenced = (
        f"SELECT count(*) FROM {ident}.snapshots WHERE snapshot_id NOT IN (SELECT snapshot_id FROM {ident}.refs) "
        f"AND committed_at < TIMESTAMP '{started:%Y-%m-%d %H:%M:%S.%f}'"
    )
    report = maintain_source(
        spark,
        settings,
        SourceConfig(name=ns, format="debezium_postgres", namespace=ns),
        Retention(snapshot_days=0, tombstone_days=0, retain_last=1),
    )
    assert [r["table"] for r in report] == [ident, f"{ident}_changes"]  # the change log is maintained too
    assert spark.sql(f"SELECT count(*) FROM {ident} WHERE _cdc_deleted").collect()[0][0] == 0  # tombstone purged
    assert sorted(r["id"] for r in spark.table(ident).collect()) == [11, 12]
    assert spark.sql(f"SELECT count(*) FROM {ident}.files").collect()[0][0] < files_before  # compacted
    # expired: every batch's commit that neither main nor a publish tag (as-of) keeps (the maintenance's own
    # commits are younger than the cut-off, taken in whole seconds, and may stay)
    assert spark.sql(unreferenced).collect()[0][0] == 0


def test_maintenance_skips_a_table_with_an_open_audit_branch(spark, settings):
    ns = "maint_2"
    apply_events(spark, settings, ns, [event("c", 1, {"name": "x", "amount": "1.00"}, pos=1)])
    ident = f"{settings.catalog_name}.{ns}.items"
    spark.sql(f"ALTER TABLE {ident} CREATE BRANCH audit_inflight")
    main = spark.sql(f"SELECT snapshot_id FROM {ident}.refs WHERE name = 'main'").collect()[0][0]
    report = maintain_table(spark, settings, ident, Retention(snapshot_days=0, tombstone_days=0))
    assert "audit_inflight" in report["skipped"]
    assert spark.sql(f"SELECT snapshot_id FROM {ident}.refs WHERE name = 'main'").collect()[0][0] == main


def test_a_batch_waits_while_maintenance_holds_the_table(spark, settings):
    import os

    from cdc_apply.apply.maintenance_lock import MAINTENANCE_BRANCH, lock_key

    ns = "maint_3"
    apply_events(spark, settings, ns, [event("c", 1, {"name": "x", "amount": "1.00"}, pos=1)])
    ident = f"{settings.catalog_name}.{ns}.items"
    owner = lock_key(pid=os.getppid())  # a live process of this host holds it (a lock without owner is a killed one's)
    spark.sql(f"ALTER TABLE {ident} SET TBLPROPERTIES ('{owner}'='{{\"expires_at\": \"2999-01-01T00:00:00+00:00\"}}')")
    spark.sql(f"ALTER TABLE {ident} CREATE BRANCH {MAINTENANCE_BRANCH}")  # maintenance is running
    r = apply_events(spark, settings, ns, [event("u", 1, {"name": "y"}, pos=2)])
    t = r.tables[0]
    assert r.status == "failed" and not t.terminal and "maintenance is running" in t.message  # retried, not terminal
    branches = {x[0] for x in spark.sql(f"SELECT name FROM {ident}.refs WHERE type = 'BRANCH'").collect()}  # not the publish tags
    assert branches == {"main", MAINTENANCE_BRANCH}  # the batch left no audit branch behind
    # the held table is skipped by a second maintenance too, and left as it was
    assert "exists" in maintain_table(spark, settings, ident, Retention(snapshot_days=0, tombstone_days=0))["skipped"]
    spark.sql(f"ALTER TABLE {ident} DROP BRANCH {MAINTENANCE_BRANCH}")  # maintenance done
    r2 = apply_events(spark, settings, ns, [event("u", 1, {"name": "y"}, pos=2)])
    assert r2.status == "complete"
    report = maintain_table(spark, settings, ident, Retention(snapshot_days=0, tombstone_days=0))
    assert "skipped" not in report and "rewrite_data_files" in report
    assert {x[0] for x in spark.sql(f"SELECT name FROM {ident}.refs WHERE type = 'BRANCH'").collect()} == {"main"}  # lock released


def test_audit_tables_are_compacted_and_keep_every_row(spark, settings):
    """One small commit per batch would make every hourly run read more than
    the last: maintenance compacts the ledger, and loses no row of it."""
    ns = "maint_audit"
    for i in range(3):
        apply_events(spark, settings, ns, [event("c", i, {"name": "x", "amount": "1.00"}, pos=10 + i)])
    ident = f"{settings.catalog_name}.{settings.audit_namespace}.batches"

    def ledger_rows():
        return sorted(tuple(r) for r in spark.sql(f"SELECT batch_id, table_name, status, to_json(files) FROM {ident}").collect())

    rows, applied = ledger_rows(), ledger.Ledger(settings).applied_files(ns)
    assert len(applied) == 3
    assert spark.sql(f"SELECT count(*) FROM {ident}.files").collect()[0][0] >= 3
    snaps_before = spark.sql(f"SELECT count(*) FROM {ident}.snapshots").collect()[0][0]
    [report, *_] = maintain_audit(spark, settings, Retention(snapshot_days=0, retain_last=1))
    assert report["table"] == ident and report["rewrite_data_files"]["rewritten_data_files_count"] >= 3
    assert spark.sql(f"SELECT count(*) FROM {ident}.files").collect()[0][0] == 1
    assert spark.sql(f"SELECT count(*) FROM {ident}.snapshots").collect()[0][0] < snaps_before  # expired (rows kept)
    assert ledger_rows() == rows and ledger.Ledger(settings).applied_files(ns) == applied  # Spark and pyiceberg read the same rows
    r = apply_events(spark, settings, ns, [event("c", 9, {"name": "y", "amount": "2.00"}, pos=20)])  # and the ledger goes on
    assert r.status == "complete" and len(ledger.Ledger(settings).applied_files(ns)) == 4


def test_maintenance_folds_the_delete_files_of_a_merge_on_read_source(spark, settings):
    """A source with ``merge_mode: merge-on-read`` gathers position delete files
    (Iceberg keeps one per data file, folding a data file's earlier deletes
    into it); maintenance leaves none to merge at read time and every row as
    it was."""
    ns = "maint_mor"
    mor = dict(merge_mode="merge-on-read")
    apply_events(spark, settings, ns, [event("c", k, {"name": "x", "amount": "1.00"}, pos=k) for k in range(1, 7)], **mor)
    for i, k in enumerate((1, 3, 5, 3)):
        apply_events(spark, settings, ns, [event("u", k, {"name": f"v{i}"}, pos=100 + i)], **mor)
    apply_events(spark, settings, ns, [event("d", 6, pos=200)], **mor)
    ident = f"{settings.catalog_name}.{ns}.items"

    def delete_files():
        """Position deletes that point at a live data file (merged at read time)."""
        live = f"SELECT file_path FROM {ident}.files WHERE content = 0"
        return spark.sql(f"SELECT count(*) FROM {ident}.position_deletes WHERE file_path IN ({live})").collect()[0][0]

    def table():
        return sorted(tuple(r) for r in spark.table(ident).drop("_cdc_applied_at").collect())

    before = table()
    assert delete_files() >= 2  # against the first batch's data file, and against the row key 3's first update wrote
    maintain_source(
        spark,
        settings,
        SourceConfig(name=ns, format="debezium_postgres", namespace=ns, merge_mode="merge-on-read"),
        Retention(snapshot_days=0, retain_last=1),
    )
    assert delete_files() == 0
    assert table() == before
    assert [(r["id"], r["name"]) for r in spark.table(f"{ident}_live").orderBy("id").collect()] == [
        (1, "v0"),
        (2, "x"),
        (3, "v3"),
        (4, "x"),
        (5, "v2"),
    ]
