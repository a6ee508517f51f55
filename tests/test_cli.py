"""The `cdc` CLI in-process, on the test session's Spark: applying a
directory of archives without Airflow, then again (nothing new)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

pytestmark = pytest.mark.spark


def test_apply_a_directory_then_nothing_to_do(spark, settings, tmp_path, monkeypatch, capsys):
    from cdc_apply import cli
    from cdc_apply.archive import write_jsonl
    from cdc_apply.demo import demo_changes

    sources = tmp_path / "sources.yaml"
    sources.write_text("sources:\n  cli_dir:\n    format: debezium_postgres\n    namespace: cli_dir\n    tables:\n      public.customers: {primary_key: [id]}\n")
    monkeypatch.setenv("CDC_SOURCES_FILE", str(sources))
    folder = tmp_path / "archives"
    for hour, lines in demo_changes(dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)).items():
        write_jsonl(folder / f"{hour:%Y/%m/%d/%H}" / "customers.jsonl", lines)

    assert cli.main(["apply", "--source", "cli_dir", "--dir", str(folder)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "complete" and len(result["files"]) == 3
    assert [(t["table"], t["status"]) for t in result["tables"]] == [(f"{settings.catalog_name}.cli_dir.customers", "published")]
    live = spark.sql(f"SELECT id FROM {settings.catalog_name}.cli_dir.customers WHERE NOT _cdc_deleted").collect()
    assert sorted(r["id"] for r in live) == [1, 2, 4, 5, 6]

    assert cli.main(["apply", "--source", "cli_dir", "--dir", str(folder)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "nothing-to-do"
