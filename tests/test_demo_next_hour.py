"""``./dev demo --next-hour``: fresh demo data to trigger the DAG on after
``./dev demo`` (issue 22): one more hour after the newest, positions above
every earlier one, pending until applied."""

from __future__ import annotations

import datetime as dt
import gzip
import json


def test_each_call_adds_the_next_hour_with_higher_positions(tmp_path, monkeypatch):
    from cdc_apply.batch import pending_files
    from cdc_apply.config import Settings, get_source
    from cdc_apply.demo import write_demo_archive, write_next_demo_hour

    monkeypatch.setenv("CDC_HOME", str(tmp_path))
    settings = Settings.from_env()
    write_demo_archive(settings)
    first, second = write_next_demo_hour(settings), write_next_demo_hour(settings)
    assert "2026/01/01/03" in str(first) and "2026/01/01/04" in str(second)
    lsns = []
    for path in sorted(p for p in (tmp_path / "archive").rglob("*.jsonl.gz")):
        lsns += [json.loads(line)["payload"]["source"]["lsn"] for line in gzip.open(path, "rt")]
    assert lsns == sorted(lsns) and len(set(lsns)) == len(lsns)
    hours = [f.hour for f in pending_files(settings, get_source(settings, "pg_inventory"))]
    assert hours[-2:] == [dt.datetime(2026, 1, 1, h, tzinfo=dt.UTC) for h in (3, 4)]
