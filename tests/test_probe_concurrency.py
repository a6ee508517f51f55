"""Issue 23 probe #9: two real `cdc apply` processes apply one batch at once.
Iceberg's optimistic commits are the concurrency control: a run that loses a
race fails *transient* with a clear message (never a raw ValidationException
or "Ref … already exists"), and a retry leaves the table exactly as one run
would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_probe_apply import _apply, _batch_rows, _file, _live, _msg, _sources

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[1]


def test_two_concurrent_applies_of_one_batch(spark, settings, tmp_path, monkeypatch, capsys):
    _sources(tmp_path, monkeypatch, "race")
    folder = tmp_path / "arch"
    _file(folder, 0, [_msg("public", "customers", i, 100 + i) for i in range(1, 51)] + [_msg("public", "customers", 7, 200, op="d")])
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'spark_jobs'}:{ROOT}", "CDC_SPARK_MASTER": "local[1]"}
    cmd = [sys.executable, "-m", "cdc_apply.cli", "apply", "--source", "race", "--dir", str(folder)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    codes = [p.returncode for p in procs]
    report = "\n".join(f"exit {c}\n{o[0][-3000:]}\n{o[1][-3000:]}" for c, o in zip(codes, outs))
    assert set(codes) <= {0, 1}, report  # never terminal: a retry must be allowed
    for code, (out, _err) in zip(codes, outs):
        if code == 1:  # the loser says what happened, in words, not a raw Iceberg exception
            message = json.loads(out)["message"]
            assert "another run is applying batch" in message or "main moved since branch" in message, report
    # the retry (Airflow's) finishes the batch; the table is exactly what one run makes
    code, res = _apply(capsys, "--source", "race", "--dir", str(folder))
    assert code == 0 and res["status"] in ("complete", "nothing-to-do"), res
    ident = f"{settings.catalog_name}.race.customers"
    assert _live(spark, ident) == set(range(1, 51)) - {7}
    assert spark.sql(f"SELECT count(*) FROM {ident}").collect()[0][0] == 50  # 49 live + 1 tombstone, nothing doubled
    batch = json.loads(outs[0][0])["batch_id"]
    assert "complete" in [r["status"] for r in _batch_rows(settings, "race", batch)]
