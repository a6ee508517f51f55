"""Rebuild from zero (spark_jobs/cdc_apply/rebuild.py, ``cdc rebuild``) on
real Spark + Iceberg: a Debezium PostgreSQL workload applied in random batch
splits, replayed one batch per hour beside it, compared row for row; the
documented exception (tombstones purged by maintenance) and nothing else."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import random
from decimal import Decimal
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark
SOURCE = "rebuild_pg"


def _archive(root, seed: int, hours: int = 3, files_per_hour: int = 2, per_file: int = 7) -> None:
    """Inserts, updates, deletes and re-inserts of 8 customers; LSNs rise
    through the hours and files."""
    from cdc_apply.archive.files import write_jsonl
    from cdc_apply.demo import pg_message

    rnd = random.Random(seed)
    live: dict[int, dict] = {}
    lsn, tx = 10_000, 100
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    for h in range(hours):
        for f in range(files_per_hour):
            lines = []
            for n in range(per_file):
                lsn, tx = lsn + 64, tx + 1
                ts = start + dt.timedelta(hours=h, minutes=f * 20 + n)
                i = rnd.randint(1, 8)
                row = {
                    "id": i,
                    "first_name": f"n{lsn}",
                    "last_name": "Doe",
                    "email": f"c{i}@example.com",
                    "balance": Decimal(f"{rnd.randint(0, 999)}.25"),
                    "updated_at": ts,
                }
                if i not in live:
                    op, before, after = "c", None, row
                elif rnd.random() < 0.35:
                    op, before, after = "d", {"id": i}, None
                else:
                    op, before, after = "u", {"id": i}, row
                if after is None:
                    live.pop(i)
                else:
                    live[i] = after
                lines.append(pg_message(op, lsn, tx, ts, before, after))
            write_jsonl(root / f"{start + dt.timedelta(hours=h):%Y/%m/%d/%H}" / f"part{f}.jsonl", lines, compress=f == 1)


def test_rebuild_in_other_batches_equals_the_live_tables_but_for_purged_tombstones(spark, settings, tmp_path, monkeypatch, capsys):
    from cdc_apply import cli, rebuild
    from cdc_apply.archive.listing import list_files
    from cdc_apply.batch import run_batch
    from cdc_apply.config import Retention, Settings, get_source
    from cdc_apply.maintenance import maintain_table

    (tmp_path / "sources.yaml").write_text(
        f"sources:\n  {SOURCE}:\n    format: debezium_postgres\n    namespace: {SOURCE}\n    tables:\n      public.customers: {{primary_key: [id], history: scd2}}\n"
    )
    monkeypatch.setenv("CDC_SOURCES_FILE", str(tmp_path / "sources.yaml"))
    s = Settings.from_env()
    source = get_source(s, SOURCE)
    _archive(Path(source.archive_path(s)), seed=5)
    files = list_files(source.archive_path(s))
    rnd = random.Random(3)
    cuts = sorted(rnd.sample(range(1, len(files)), 2))  # three live batches, cut at random files
    for part in (files[: cuts[0]], files[cuts[0] : cuts[1]], files[cuts[1] :]):
        r = run_batch(s, SOURCE, part, spark=spark)
        assert r.status == "complete", r.to_json()
    capsys.readouterr()
    assert cli.main(["rebuild", "--source", SOURCE]) == 0
    reports = {r["table"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(reports) == {"customers", "customers_changes", "customers_history"}  # change log and history too
    assert all(r["equal"] and r["purged_tombstones"] == 0 for r in reports.values()), reports
    live = spark.table(f"{s.catalog_name}.{SOURCE}.customers")
    rebuilt = spark.table(f"{s.catalog_name}.{SOURCE}_rebuild.customers")
    tombstones = {r["id"] for r in live.where("_cdc_deleted").collect()}
    assert tombstones and live.count() == rebuilt.count() > len(tombstones)

    # maintenance purges the live tombstones: the one documented exception, counted
    ident = f"{s.catalog_name}.{SOURCE}.customers"
    maintain_table(spark, s, ident, dataclasses.replace(Retention(), tombstone_days=0))
    assert live.where("_cdc_deleted").count() == 0
    assert rebuild.maintenance_purged(spark, ident)
    report = rebuild.compare(spark.table(ident), rebuilt, ["id"], purge_ran=True)
    assert report["equal"] and report["purged_tombstones"] == len(tombstones), report
    # ... and only when maintenance purged: otherwise the same rows are a difference
    report = rebuild.compare(spark.table(ident), rebuilt, ["id"], purge_ran=False)
    assert not report["equal"] and {json.loads(r)["id"] for r in report["only_rebuilt"]} <= tombstones

    # a live row lost (not a tombstone) is a difference even after a purge
    lost = spark.table(ident).orderBy("id").first()["id"]
    spark.sql(f"DELETE FROM {ident} WHERE id = {lost}")
    report = rebuild.compare(spark.table(ident), rebuilt, ["id"], purge_ran=True)
    assert not report["equal"] and [json.loads(r)["id"] for r in report["only_rebuilt"]] == [lost]
    # a changed value too
    spark.sql(f"UPDATE {ident} SET balance = balance + 1 WHERE id = (SELECT min(id) FROM {ident})")
    report = rebuild.compare(spark.table(ident), rebuilt, ["id"], purge_ran=True)
    assert not report["equal"] and report["only_live"] and report["fingerprint_live"] != report["fingerprint_rebuilt"]


def test_rebuild_table_takes_the_source_name_bare_or_qualified_or_the_mapped_target():
    import re

    from cdc_apply.config import SourceConfig
    from cdc_apply.rebuild import table_filter

    source = SourceConfig(name="s", format="debezium_postgres", namespace="s", targets={"public.order": "orders_t"})
    for arg, matches, misses in (
        ("customers", ["customers"], ["customers2", "x_customers"]),
        ("public.customers", ["customers"], ["public"]),
        ("orders_t", ["order", "orders_t"], ["orders"]),
    ):
        pattern = table_filter(source, arg)
        assert all(re.search(pattern, m) for m in matches), (arg, pattern)
        assert not any(re.search(pattern, m) for m in misses), (arg, pattern)


@pytest.mark.full  # CI's sample: test_realsource_postgres.py's rebuild of a real capture, transactions torn by the hour
def test_rebuild_of_a_source_whose_transactions_are_torn_across_hours_equals_the_live_tables(
    spark, settings, tmp_path, monkeypatch, capsys
):
    """Transactions torn by the hour's end: the live source holds their lines
    and reads the file again with the next hour's; one never ends, so its
    file stays partly applied.  The rebuild replays one batch per hour and
    must do the same: the held files read again, the partly applied file too."""
    from cdc_apply import cli
    from cdc_apply.archive.listing import list_files
    from cdc_apply.batch import run_batch
    from cdc_apply.config import Settings, get_source
    from tests.nemesis.workload import sources_yaml, write_workload

    name = "rebuild_torn"
    (tmp_path / "sources.yaml").write_text(sources_yaml(name, name))
    monkeypatch.setenv("CDC_SOURCES_FILE", str(tmp_path / "sources.yaml"))
    s = Settings.from_env()
    source = get_source(s, name)
    write_workload(Path(source.archive_path(s)), seed=21, hours=3, per_hour=6)
    held_before = []
    for hour in range(3):  # the hourly DAG: each run takes what is pending, held files included
        until = dt.datetime(2026, 1, 1, hour + 1, tzinfo=dt.UTC)
        from cdc_apply.batch import pending_files

        r = run_batch(s, name, pending_files(s, source, until=until), spark=spark)
        assert r.status == "complete", r.to_json()
        held_before.append(r.held_files)
    assert held_before[0] and held_before[-1], held_before  # the workload tears a transaction at hour 0 and never ends the last
    assert len(list_files(source.archive_path(s))) == 6
    capsys.readouterr()
    code = cli.main(["rebuild", "--source", name])
    reports = {r["table"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 0 and all(r["equal"] for r in reports.values()), reports


def test_rebuild_lets_through_the_transaction_an_operator_forced_on_the_live_source(spark, settings, tmp_path, monkeypatch, capsys):
    """A transaction that never ends, held past the source's limit and forced
    through by an operator: the replay, whose own clock would hold it again
    (it is minutes old there), lets it through as the live source did."""
    import time

    from cdc_apply import cli
    from cdc_apply.apply.transactions import FORCED_KEY
    from cdc_apply.batch import pending_files, run_batch
    from cdc_apply.config import Settings, get_source
    from cdc_apply.ledger import Ledger
    from cdc_apply.results import Override
    from tests.nemesis.workload import sources_yaml, write_workload

    name = "rebuild_forced"
    # a second's hold is too long here: the hourly runs hold it, the next fails on it
    (tmp_path / "sources.yaml").write_text(sources_yaml(name, name) + "    transaction_max_hold_hours: 0.0003\n")
    monkeypatch.setenv("CDC_SOURCES_FILE", str(tmp_path / "sources.yaml"))
    s = Settings.from_env()
    source = get_source(s, name)
    write_workload(Path(source.archive_path(s)), seed=21, hours=3, per_hour=6)
    for hour in range(3):
        r = run_batch(s, name, pending_files(s, source, until=dt.datetime(2026, 1, 1, hour + 1, tzinfo=dt.UTC)), spark=spark)
        assert r.status == "complete", r.to_json()
    assert r.held_files  # the last hour's last orders transaction never ends
    time.sleep(2)
    late = run_batch(s, name, pending_files(s, source), spark=spark)
    assert late.status == "failed" and late.failed_checks[0].startswith("transaction_hold_age"), late.to_json()
    forced = run_batch(s, name, pending_files(s, source), spark=spark, override=Override("force", "its END is lost", "ops"))
    assert forced.status == "complete" and not forced.held_files, forced.to_json()
    assert len(Ledger(s).latest_decoder_state(name)[FORCED_KEY]) == 1
    capsys.readouterr()
    code = cli.main(["rebuild", "--source", name])
    reports = {r["table"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 0 and all(r["equal"] for r in reports.values()), reports
