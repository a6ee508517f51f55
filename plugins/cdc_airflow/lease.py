"""One DAG run applies a source at a time.

A run's stages (write, validate, publish, finish) are separate tasks.  Two
runs of one source that interleave them (an hourly run during a backfill, a
manual trigger beside either) cut their audit branches from the same ``main``:
the later publish cannot fast-forward, and the earlier publish drops the
other's branch.  Airflow's ``max_active_runs`` does not cover backfills (a
backfill has its own), so each run takes its source's lease before discovery
and gives it back in ``report``; a run that finds it held waits its turn (the
DAG's ``turn`` sensor, in reschedule mode: no worker slot is held meanwhile).

The lease is a JSON file ``$CDC_HOME/leases/<source>.json`` naming the run that
holds it.  ``$CDC_HOME`` is already shared by every task and Spark job of a
run (the batch result lives there).  Reads and writes of a lease happen under
an exclusive ``flock`` on ``<source>.lock``.  A lease whose run is no longer
queued or running (it was killed, marked failed by a person, or deleted) is
stale: the next run takes it over, and logs whose it was.  A lease is never
left for a person to remove.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holder:
    dag_id: str
    run_id: str
    taken_at: str = ""

    def same_run(self, other: Holder) -> bool:
        return (self.dag_id, self.run_id) == (other.dag_id, other.run_id)

    def describe(self) -> str:
        return f"run {self.run_id!r} of DAG {self.dag_id!r} (holding it since {self.taken_at or 'an unknown time'})"


def lease_path(home: Path, source: str) -> Path:
    return home / "leases" / f"{source}.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read(path: Path) -> Holder | None:
    try:
        data = json.loads(path.read_text())
        return Holder(str(data["dag_id"]), str(data["run_id"]), str(data.get("taken_at", "")))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:  # written by hand or cut short: no run can own it
        log.error("lease %s is unreadable (%s): taken over", path, exc)
        return None


def take(home: Path, source: str, me: Holder, alive: Callable[[Holder], bool]) -> Holder | None:
    """Take ``source``'s lease for run ``me``.  None when ``me`` holds it (now,
    or already: a retried sensor); else the live run that holds it."""
    path = lease_path(home, source)
    with _locked(path):
        holder = _read(path)
        if holder is not None and not holder.same_run(me):
            if alive(holder):
                return holder
            log.error("source %s: taking over the lease of %s: that run is no longer running", source, holder.describe())
        if holder is None or not holder.same_run(me):
            mine = Holder(me.dag_id, me.run_id, dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(mine)))
            os.replace(tmp, path)
    return None


def release(home: Path, source: str, me: Holder) -> bool:
    """Give the lease back if ``me`` holds it; whether it did."""
    path = lease_path(home, source)
    with _locked(path):
        holder = _read(path)
        if holder is None or not holder.same_run(me):
            return False
        path.unlink()
    return True


def airflow_run_alive(holder: Holder) -> bool:
    """Whether the holding DAG run is queued or running, asked of Airflow's
    execution API (from inside a task).  A run Airflow no longer knows is
    not alive; any other failure to ask counts as alive (wait, ask again)."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    try:
        state = RuntimeTaskInstance.get_dagrun_state(holder.dag_id, holder.run_id)
    except Exception as exc:
        if "not_found" in str(exc) or "not found" in str(exc).lower():
            return False
        log.warning("could not ask Airflow for the state of %s (%s): waiting", holder.describe(), exc)
        return True
    return str(state) in ("queued", "running", "DagRunState.QUEUED", "DagRunState.RUNNING")
