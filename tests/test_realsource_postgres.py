"""Real-source conformance: a real PostgreSQL captured by real Debezium
(``tests/realsource``), applied hour by hour with ``run_batch``, every table
compared row for row with the source's own state.

CI runs one small seed.  The soak: ``CDC_CONFORMANCE_SEEDS=10`` (seeds 1..10)
and ``CDC_CONFORMANCE_SCALE=4`` (4x the statements per hour), or from the
command line ``python -m tests.realsource --seeds 10 --scale 4``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.realsource.capture import Capture
from tests.realsource.conformance import apply_in_order, apply_late_hour, capture_seed

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SEEDS = list(range(1, int(os.environ.get("CDC_CONFORMANCE_SEEDS", "1")) + 1))
SCALE = float(os.environ.get("CDC_CONFORMANCE_SCALE", "1"))
HOURS = int(os.environ.get("CDC_CONFORMANCE_HOURS", "4"))


def _real_source_available() -> str | None:
    if not Path("/usr/lib/postgresql/15/bin/initdb").exists() and not os.environ.get("CDC_PG_BIN"):
        return "PostgreSQL 15 server binaries are not installed"
    if shutil.which("java") is None:
        return "no JDK (java) on PATH for Debezium"
    return None


@pytest.fixture(scope="module")
def captures(tmp_path_factory) -> dict[int, Capture]:
    missing = _real_source_available()
    if missing:
        pytest.fail(f"real-source suite cannot run: {missing}")
    root = tmp_path_factory.mktemp("realsource")
    return {seed: capture_seed(seed, root / f"seed{seed}", hours=HOURS, ops=int(60 * SCALE), snapshot_rows=int(20 * SCALE)) for seed in SEEDS}


@pytest.mark.parametrize("seed", SEEDS)
def test_hourly_in_order_equals_source(seed, captures, spark, settings, tmp_path):
    cap = captures[seed]
    res = apply_in_order(spark, settings, cap, f"rs_inorder_{seed}", tmp_path)
    print(res.summary())
    assert res.comparisons >= len(cap.hours) - 1 and res.rows_compared > 0
    assert res.ok, res.summary()


@pytest.mark.parametrize("seed", SEEDS)
def test_late_hour_equals_final_source(seed, captures, spark, settings, tmp_path):
    cap = captures[seed]
    res = apply_late_hour(spark, settings, cap, f"rs_late_{seed}", tmp_path, late=seed % (len(cap.hours) - 1))
    print(res.summary())
    assert res.rows_compared > 0
    assert res.ok, res.summary()
