"""Real-source conformance: a real PostgreSQL captured by real Debezium
(``tests/realsource``), applied hour by hour with ``run_batch``, every table
compared row for row with the source's own state.

CI runs one small seed (3 hours).  The soak: ``CDC_CONFORMANCE_SEEDS=10``
(seeds 1..10), ``CDC_CONFORMANCE_SCALE=4`` (4x the statements per hour),
``CDC_CONFORMANCE_HOURS=6``; or from the command line
``python -m tests.realsource --seeds 10 --scale 4``.

Strict: any row difference or unaccounted line fails, reported by class
(primary-key change, late partial row, ...) with its count and the Debezium
messages of an example.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.apply_harness import state_read
from tests.realsource.capture import Capture
from tests.realsource.conformance import (
    VariantResult,
    apply_in_order,
    apply_late_hour,
    capture_seed,
    mismatch_classes,
    rebuild_differences,
    report,
    with_transactions,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SEEDS = list(range(1, int(os.environ.get("CDC_CONFORMANCE_SEEDS", "1")) + 1))
SCALE = float(os.environ.get("CDC_CONFORMANCE_SCALE", "1"))
HOURS = int(os.environ.get("CDC_CONFORMANCE_HOURS", "3"))


def _missing_prerequisite() -> str | None:
    if not Path(os.environ.get("CDC_PG_BIN", "/usr/lib/postgresql/15/bin"), "initdb").exists():
        return "PostgreSQL 15 server binaries are not installed (apt-get install postgresql-15, or set CDC_PG_BIN)"
    if shutil.which("java") is None:
        return "no JDK (java) on PATH for Debezium"
    return None


@pytest.fixture(scope="module")
def captures(tmp_path_factory) -> dict[int, Capture]:
    missing = _missing_prerequisite()
    if missing:
        pytest.fail(f"real-source suite cannot run: {missing}")
    root = tmp_path_factory.mktemp("realsource")
    scale = dict(hours=HOURS, ops=int(45 * SCALE), snapshot_rows=int(15 * SCALE))
    return {seed: capture_seed(seed, root / f"seed{seed}", **scale) for seed in SEEDS}


@pytest.fixture(scope="module")
def sources_folder(tmp_path_factory) -> Path:
    """Where the in-order variant's sources files (and archives) are."""
    return tmp_path_factory.mktemp("rs_sources")


@pytest.fixture(scope="module")
def in_order(captures, spark, settings, sources_folder) -> dict[int, VariantResult]:
    return {seed: apply_in_order(spark, settings, cap, f"rs_inorder_{seed}", sources_folder) for seed, cap in captures.items()}


def _judge(res: VariantResult, cap: Capture) -> None:
    assert res.rows_compared > 0, res.summary()
    text = report(res, cap, mismatch_classes(res, cap))
    print(text)
    if not res.ok:
        pytest.fail(text)


@pytest.mark.parametrize("seed", SEEDS)
def test_hourly_in_order_equals_source(seed, captures, in_order):
    """After every hour (but one whose end splits a transaction) every table equals the source."""
    res = in_order[seed]
    assert res.comparisons >= len(captures[seed].hours) - 1
    _judge(res, captures[seed])


@pytest.mark.parametrize("seed", [s for s in SEEDS if with_transactions(s)])
def test_a_transaction_torn_by_the_hours_end_is_held_whole(seed, captures, in_order):
    """With Debezium's transaction metadata (provide.transaction.metadata) the
    hour whose files end inside a transaction is compared too: its part of the
    transaction is held, so the tables equal the source before it; the next
    hour applies it whole (publish: transactions, the default)."""
    cap, res = captures[seed], in_order[seed]
    assert cap.transaction_metadata and any(h.torn for h in cap.hours)
    assert res.transactions_held > 0 and res.skipped_torn == 0, res.summary()
    assert res.comparisons == len(cap.hours)
    _judge(res, cap)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_rebuild_from_zero_equals_the_live_tables(seed, in_order, spark, settings, sources_folder):
    """``cdc rebuild`` of the real capture: its files replayed one batch per
    hour (transactions torn by an hour's end held and released again) equal
    the live tables and change logs."""
    assert in_order[seed].batches and rebuild_differences(spark, settings, f"rs_inorder_{seed}", sources_folder) == []


@pytest.mark.parametrize("seed", SEEDS)
def test_late_hour_equals_final_source(seed, captures, spark, settings, tmp_path):
    """An hour folder delivered after the later hours were applied: the end state equals the source.
    Its batches read the stored state by their key spans, as a small batch
    into a large table does (the in-order variant reads it whole): the late
    hour's older events must still meet the newer rows they lose to."""
    cap = captures[seed]
    with state_read("key spans"):
        res = apply_late_hour(spark, settings, cap, f"rs_late_{seed}", tmp_path, late=seed % (len(cap.hours) - 1))
    _judge(res, cap)


@pytest.mark.parametrize("seed", SEEDS)
def test_tombstone_lines_are_skipped(seed, in_order):
    """A sink's `null` line after a delete is a Kafka tombstone: skipped, never quarantined."""
    res = in_order[seed]
    assert res.tombstone_lines > 0
    assert res.tombstones_quarantined == 0, f"{res.tombstones_quarantined} of {res.tombstone_lines} tombstone lines quarantined"
