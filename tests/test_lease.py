"""The source lease that lets one DAG run apply a source at a time
(plugins/cdc_airflow/lease.py): taken once, held against live runs, taken
over from dead ones, given back only by its holder; and under a real race of
processes, exactly one taker wins."""

from __future__ import annotations

import multiprocessing as mp

from cdc_airflow.lease import Holder, lease_path, release, take

A, B = Holder("cdc_apply", "scheduled__07"), Holder("cdc_apply", "backfill__01")


def alive(_holder: Holder) -> bool:
    return True


def dead(_holder: Holder) -> bool:
    return False


def test_a_live_holder_keeps_the_lease_and_only_it_gives_it_back(tmp_path):
    assert take(tmp_path, "pg", A, alive) is None
    assert take(tmp_path, "pg", A, alive) is None  # the sensor's next poke, or its retry
    held = take(tmp_path, "pg", B, alive)
    assert held is not None and held.same_run(A) and held.taken_at
    assert "scheduled__07" in held.describe()
    assert take(tmp_path, "other_source", B, alive) is None  # leases are per source
    assert not release(tmp_path, "pg", B)
    assert take(tmp_path, "pg", B, alive) is not None
    assert release(tmp_path, "pg", A)
    assert not lease_path(tmp_path, "pg").exists()
    assert take(tmp_path, "pg", B, alive) is None


def test_the_lease_of_a_run_that_is_no_longer_running_is_taken_over(tmp_path, caplog):
    assert take(tmp_path, "pg", A, alive) is None
    asked = []
    assert take(tmp_path, "pg", B, lambda h: asked.append(h) or False) is None
    assert [h.run_id for h in asked] == ["scheduled__07"]
    assert "taking over the lease of run 'scheduled__07'" in caplog.text
    assert take(tmp_path, "pg", A, alive) is not None  # B holds it now
    assert not release(tmp_path, "pg", A) and release(tmp_path, "pg", B)


def test_an_unreadable_lease_file_is_taken_over(tmp_path):
    path = lease_path(tmp_path, "pg")
    path.parent.mkdir(parents=True)
    path.write_text('{"dag_id": "cdc_ap')  # cut short
    assert take(tmp_path, "pg", A, alive) is None
    assert take(tmp_path, "pg", B, alive) is not None


def _contend(home: str, n: int, start, out) -> None:
    start.wait()
    out.put((n, take(__import__("pathlib").Path(home), "pg", Holder("cdc_apply", f"run{n}"), alive) is None))


def test_racing_processes_one_wins(tmp_path):
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(tmp_path), n, start, out)) for n in range(8)]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    winners = [n for n, won in results if won]
    assert len(winners) == 1
    held = take(tmp_path, "pg", Holder("cdc_apply", "late"), alive)
    assert held is not None and held.run_id == f"run{winners[0]}"
