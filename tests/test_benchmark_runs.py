"""The benchmark (issue #4) runs end to end at toy size and reports every figure
of the sections it runs (CI's sample leaves the timing-only ones out: ``TIMING_ONLY``).

Only presence and positivity are checked: timings are never asserted here
(targets are reported PASS / MISS by the benchmark itself).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sample import FULL

ROOT = Path(__file__).resolve().parents[1]


def bench_env(**extra: str) -> dict[str, str]:
    """The environment of a ``bench.run`` subprocess: none of this process's
    ``CDC_*`` settings (the run makes its own home), the project importable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "spark_jobs"), env.get("PYTHONPATH", "")])
    return env | extra


TIMING_ONLY = ["table_size", "hourly", "hourly_connect", "project_next", "warm_round", "rss", "decode"]
"""Sections CI's sample leaves out (``tests/sample.py``): each times code that
the other sections or other tests run too (a batch into a larger table, the
DAG's spark-submit job, a Connect client's job, a second batch of the
session, both main contenders again on fresh tables, a 5x batch, the exact
decoder beside the fast path)."""


@pytest.mark.slow
def test_benchmark_tiny_reports_every_figure(tmp_path):
    out = tmp_path / "results.json"
    skipped = set() if FULL else set(TIMING_ONLY)
    skips = [a for name in sorted(skipped) for a in ("--skip", name)]
    env = bench_env(CDC_JARS_DIR=str(ROOT / ".cdc" / "jars"))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--scale", "tiny", "--out", str(out), "--workdir", str(tmp_path / "work"), *skips],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())

    machine = res["machine"]
    for key in ("cores", "memory_gb", "python", "pyspark", "pyiceberg", "iceberg_jar", "java"):
        assert machine[key], key

    for name in ("project", "project_next", "project_steady", "textbook", "pyiceberg", "orjson_limit"):
        if name.replace("_steady", "_next") in skipped:
            assert name not in res["contenders"], name
            continue
        c = res["contenders"][name]
        for key in ("events", "bytes", "seconds", "events_per_s", "mb_per_s"):
            assert c[key] > 0, (name, key, c)

    for name, section in (
        ("project_vs_textbook", "textbook"),
        ("project_vs_textbook_warm", "warm_round"),
        ("project_vs_pyiceberg", "pyiceberg"),
        ("project_vs_limit", "project"),
        ("table_size_ratio", "table_size"),
        ("hourly_overhead_ratio", "hourly"),
        ("hourly_connect_ratio", "hourly_connect"),
        ("hourly_connect_mor_ratio", "hourly_connect"),
        ("hourly_warm_ratio", "hourly_warm"),
        ("rss_ratio", "rss"),
        ("project_vs_python_pipeline", "pyiceberg"),
        ("project_next_vs_python_pipeline", "project_next"),
        ("project_steady_vs_python_pipeline", "project_next"),
        ("decode_speedup", "decode"),
        ("decode_vs_payload_limit", "decode"),
    ):
        if section in skipped:
            assert name not in res["ratios"], name
        else:
            assert res["ratios"][name] > 0, name
    if "project_next" not in skipped:
        # the next batch continues the main batch's history, as large as the Python-only pipeline's
        assert (
            abs(res["workload"]["main_next"]["events"] - res["contenders"]["pyiceberg"]["events"]) <= 1
        )  # a key change may end a batch one event late
    assert {t["name"] for t in res["targets"]} == set(res["ratios"])
    assert all(t["status"] in ("PASS", "MISS") for t in res["targets"])

    if "table_size" not in skipped:
        ts = res["table_size"]
        assert ts["small_seconds"] > 0 and ts["large_seconds"] > 0 and ts["large_rows"] > ts["small_rows"]
    hw = res["hourly_warm"]
    assert hw["job_seconds"] > 0 and hw["first_batch_seconds"] > 0 and hw["bare_seconds"] > 0 and len(hw["job_runs"]) >= 1
    assert "CDC_SPARK_REMOTE=local" in hw["measured"]
    if "hourly" not in skipped:
        h = res["hourly"]
        assert h["job_seconds"] > 0 and h["bare_seconds"] > 0 and h["first_batch_seconds"] > 0 and hw["events"] == h["events"]
        # the first DAG job wrote the driver's class archive, and the timed one started from it
        assert (h["first_batch_class_archive"], h["class_archive"]) == ("written", "used")
    if "hourly_connect" not in skipped:
        hc = res["hourly_connect"]
        assert hc["job_seconds"] > 0 and hc["first_batch_seconds"] > 0 and hc["events"] == hw["events"]
        hm = res["hourly_connect_mor"]
        assert hm["job_seconds"] > 0 and hm["switch_batch_seconds"] > 0 and hm["events"] == hw["events"]
        # pinned merge-on-read switches a copy-on-write table; `auto` may have chosen merge-on-read already
        # (an hourly batch's stored keys are ~9 % of the toy table's rows, MERGE_ON_READ_MAX_SHARE is 10 %)
        assert hm["switch_batch_schema_changes"] in ([], ["write.merge.mode copy-on-write -> merge-on-read"])
    if "rss" not in skipped:
        r = res["rss"]
        assert r["peak_rss_1x_mb"] > 0 and r["peak_rss_5x_mb"] > 0 and r["events_5x"] >= 4 * r["events_1x"]
        # the tiny preset's one RSS run: its 1x batch is the hourly batch (reused, not run again)
        assert len(r["runs_1x_mb"]) == len(r["runs_5x_mb"]) == r["runs"] == 1 and "the 1x batch is the hourly batch" in r["measured"]
    # a section's own record is there exactly when it ran
    for record, section in (
        ("table_size",) * 2,
        ("warm_round",) * 2,
        ("hourly",) * 2,
        ("hourly_connect",) * 2,
        ("hourly_connect_mor", "hourly_connect"),
        ("rss",) * 2,
        ("decode_stage", "decode"),
    ):
        assert (record in res) == (section not in skipped), record

    # the printed table carries the same figures
    assert "project run_batch" in proc.stdout and ("PASS" in proc.stdout or "MISS" in proc.stdout)


def test_each_rss_run_gets_a_batch_of_its_own(tmp_path):
    """With several RSS runs (the small and full presets), every run's 1x and
    5x batches are files of their own that continue one history; only the
    tiny preset's single run reuses the hourly batch as its 1x one."""
    from bench import run
    from bench import workload as wl

    args = run.parse_args(["--scale", "tiny", "--rss-runs", "2", "--rss-events", "40", "--hourly-events", "40", "--events-per-file", "20"])
    w = wl.Workload(seed=1, base_rows=100, insert_slot=1)
    hourly = w.write(tmp_path / "hourly", 40, 20)
    reuse, batches = run.rss_plan(w, tmp_path, args, hourly)
    assert not reuse and len(batches) == 2
    files = [f for one, five in batches for f in (one, five)]
    assert [f.events for f in files] == [40, 200, 40, 200]
    assert len({p for f in files for p in f.paths} | set(hourly.paths)) == sum(len(f.paths) for f in [*files, hourly])
    assert all(a.lsn_last < b.lsn_first for a, b in itertools.pairwise([hourly, *files]))  # one history, in order

    reuse, batches = run.rss_plan(
        w, tmp_path / "one", run.parse_args(["--scale", "tiny", "--rss-events", "40", "--hourly-events", "40"]), hourly
    )
    assert reuse and batches[0][0] is hourly


def test_a_benchmark_stopped_with_sigterm_removes_its_work_folder(tmp_path):
    """A full run's work folder holds ~12 GB; a run killed by SIGTERM (a
    timeout, an operator's kill) must not leave it behind to fill ``/tmp``."""
    env = bench_env(TMPDIR=str(tmp_path))  # where the run's mkdtemp puts its folder
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.run", "--scale", "tiny", "--out", str(tmp_path / "results.json")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # the workload's files are being written: the folder has content to lose
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("cdc-bench-*/data")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
        assert list(tmp_path.glob("cdc-bench-*/data"))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert not list(tmp_path.glob("cdc-bench-*")), out[-3000:]
