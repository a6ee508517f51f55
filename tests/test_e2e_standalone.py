"""End to end with a real scheduler and api-server (`airflow standalone` on a
temporary AIRFLOW_HOME with SQLite): a backfill over three hours, then a
trigger through the REST API with a conf, each waited on until success; the
Spark tasks on the home's warm driver, as the embedded default's."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.airflow_env import VENV_BIN, airflow, airflow_env, stop_warm_driver
from tests.test_e2e_dag_runner import check_demo_table, table_rows

pytestmark = [pytest.mark.airflow, pytest.mark.spark, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Standalone:
    def __init__(self, env: dict[str, str], home: Path, port: int):
        self.env, self.home, self.port = env, home, port
        self.base = f"http://127.0.0.1:{port}"
        self.restarts = 0
        self.scheduler_seen = False  # judged dead only once seen running
        self._start()

    def _start(self) -> None:
        self.log = open(self.home / "standalone.log", "a")
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "airflow"), "standalone"], env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.token = None

    def scheduler_alive(self) -> bool:
        """Whether standalone's ``airflow scheduler`` still runs: standalone
        keeps its other parts running when the scheduler dies."""
        import psutil

        try:
            parts = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return False
        for p in parts:
            try:
                if "scheduler" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:  # ended while looked at (a zombie's cmdline raises it too)
                pass
        return False

    def restart(self) -> None:
        """The README's remedy when Airflow's scheduler died (runs stay
        queued): restart ``airflow standalone`` on the same home."""
        self.stop()
        self.restarts += 1
        self.scheduler_seen = False
        self._start()
        self.wait_ready()

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                if requests.get(f"{self.base}/api/v2/monitor/health", timeout=5).ok:
                    pw_file = self.home / "simple_auth_manager_passwords.json.generated"
                    if pw_file.exists():
                        users = json.loads(pw_file.read_text())
                        user, password = next(iter(users.items()))
                        r = requests.post(f"{self.base}/auth/token", json={"username": user, "password": password}, timeout=10)
                        if r.ok:
                            self.token = r.json()["access_token"]
                            return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise AssertionError("airflow standalone did not become ready:\n" + self.tail())

    def api(self, method: str, path: str, **kw):
        r = requests.request(method, f"{self.base}/api/v2{path}", headers={"Authorization": f"Bearer {self.token}"}, timeout=30, **kw)
        assert r.ok, f"{method} {path}: {r.status_code} {r.text}"
        return r.json()

    def trigger(self, conf: dict, attempts: int = 5) -> dict:
        """A manual run with ``conf``, posted as the UI's trigger form does.
        On the embedded SQLite metadata database the insert can lose a race
        with the scheduler ("database is locked": a WAL snapshot upgrade, no
        busy wait applies) and the api-server answers 500 having written
        nothing; the user's remedy -- trigger again -- is what this does, only
        for that error and only when no manual run appeared."""
        body = {"logical_date": None, "conf": conf}
        for attempt in range(1, attempts + 1):
            manual_before = self._manual_runs()
            r = requests.post(
                f"{self.base}/api/v2/dags/cdc_apply/dagRuns", headers={"Authorization": f"Bearer {self.token}"}, json=body, timeout=90
            )
            if r.ok:
                return r.json()
            locked = r.status_code == 500 and "database is locked" in r.text
            assert locked and self._manual_runs() == manual_before and attempt < attempts, f"trigger {conf}: {r.status_code} {r.text}"
            time.sleep(2)
        raise AssertionError("unreachable")

    def _manual_runs(self) -> set[str]:
        runs = self.api("GET", "/dags/cdc_apply/dagRuns?limit=100&run_type=manual")["dag_runs"]
        return {r["dag_run_id"] for r in runs}

    def wait_runs(self, predicate, timeout: float = 900) -> list[dict]:
        deadline = time.time() + timeout
        runs = []
        while time.time() < deadline:
            runs = self.api("GET", "/dags/cdc_apply/dagRuns?limit=100")["dag_runs"]
            failed = [r for r in runs if r["state"] == "failed"]
            assert not failed, f"failed runs: {failed}\n{self.tail()}"
            if predicate(runs):
                return runs
            alive = self.scheduler_alive()
            self.scheduler_seen |= alive
            if self.scheduler_seen and not alive:
                # On SQLite, a backfill create that lost a race with the scheduler
                # deletes runs the scheduler may hold: it dies of it (StaleDataError /
                # ObjectDeletedError; Airflow's, README "backfill"). Once, as a user would.
                assert self.restarts == 0, f"the scheduler died again after a restart:\n{self.tail()}"
                self.restart()
                continue
            time.sleep(3)
        raise AssertionError(f"runs did not finish: {runs}\n{self.tail()}")

    def apply_span(self, run_id: str) -> tuple[dt.datetime, dt.datetime]:
        """When a run's discover started and its finish ended."""
        tis = {t["task_id"]: t for t in self.api("GET", f"/dags/cdc_apply/dagRuns/{run_id}/taskInstances")["task_instances"]}
        return dt.datetime.fromisoformat(tis["discover"]["start_date"]), dt.datetime.fromisoformat(tis["finish"]["end_date"])

    def tail(self) -> str:
        self.log.flush()
        return (self.home / "standalone.log").read_text()[-6000:]

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except Exception:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def create_backfill(sa: Standalone, env: dict[str, str], start: str, end: str, attempts: int = 5) -> None:
    """``airflow backfill create`` as a user runs it.  On the embedded SQLite
    metadata database a write racing the running scheduler can fail at once
    with "database is locked" (WAL snapshot upgrade: no busy wait applies);
    Airflow then removes the half-created backfill, so the user's remedy --
    run the command again -- is what this does.  Postgres (docker-compose)
    has no such race."""
    args = ("backfill", "create", "--dag-id", "cdc_apply", "--from-date", start, "--to-date", end, "--max-active-runs", "1")
    for attempt in range(1, attempts + 1):
        proc = airflow(env, *args, check=False)
        if proc.returncode == 0:
            return
        locked = "database is locked" in proc.stdout + proc.stderr
        backfills = sa.api("GET", "/backfills?dag_id=cdc_apply")["backfills"]
        assert locked and not backfills and attempt < attempts, (
            f"airflow {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\nbackfills: {backfills}"
        )
        time.sleep(2)


def test_backfill_then_rest_trigger(tmp_path, monkeypatch):
    from cdc_apply.archive.files import write_jsonl
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    home = tmp_path / "airflow"
    home.mkdir()
    port = free_port()
    env = airflow_env(
        home,
        tmp_path / "cdc",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
        AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL="5",
        AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
    )
    monkeypatch.setenv("CDC_HOME", env["CDC_HOME"])
    settings = Settings.from_env()
    airflow(env, "db", "migrate")
    airflow(env, "dags", "reserialize")
    sa = Standalone(env, home, port)
    try:
        sa.wait_ready()
        # the unpaused DAG starts its latest hourly run at once: on an empty archive it applies nothing
        sa.wait_runs(lambda rs: any(r["run_type"] == "scheduled" and r["state"] == "success" for r in rs))
        write_demo_archive(settings)
        # backfill hours 01:00..03:00: the runs at 01, 02 and 03 apply hours 00, 01 and 02;
        # beside it a manual run (every pending file), as an hourly run can start mid-backfill:
        # a backfill's runs do not count against the DAG's max_active_runs
        create_backfill(sa, env, "2026-01-01T01:00:00+00:00", "2026-01-01T03:00:00+00:00")
        sa.trigger({"source": "pg_inventory"})
        runs = sa.wait_runs(
            lambda rs: (
                len([r for r in rs if r["run_type"] == "backfill"]) == 3
                and any(r["run_type"] == "manual" for r in rs)
                and all(r["state"] == "success" for r in rs)
            )
        )
        check_demo_table(env)
        # one run applied the source at a time: no run's discover..finish overlaps another's
        spans = sorted(sa.apply_span(r["dag_run_id"]) for r in runs)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
        assert not (Path(env["CDC_HOME"]) / "leases" / "pg_inventory.json").exists()  # every run gave its turn back

        # a new hour lands; a manual trigger (no data interval) applies every pending file
        hour3 = dt.datetime(2026, 1, 1, 3, tzinfo=dt.UTC)
        from cdc_apply.demo import pg_message

        line = pg_message(
            "u",
            99_000_000,
            9000,
            hour3,
            {"id": 5},
            {
                "id": 5,
                "first_name": "Eve",
                "last_name": "Doe5",
                "email": "c5@example.com",
                "balance": __import__("decimal").Decimal("7.77"),
                "updated_at": hour3,
            },
        )
        write_jsonl(Path(settings.archive_dir) / "pg_inventory" / "2026/01/01/03" / "customers-0001.jsonl", [line])
        run = sa.trigger({"source": "pg_inventory", "max_files": 0})
        run_id = run["dag_run_id"]
        sa.wait_runs(lambda rs: any(r["dag_run_id"] == run_id and r["state"] == "success" for r in rs))
        _, rows = table_rows(env)
        eve = next(r for r in rows if r["id"] == 5)
        assert str(eve["balance"]) == "7.77"
        # every Spark task of the five runs attached to one warm driver (the embedded default),
        # started by the first and kept by the next ones: it outlives the task that started it
        started = list((Path(env["CDC_HOME"]) / "warm-driver").glob("server-*.log"))
        assert len(started) == 1, started
        assert "ending:" not in started[0].read_text(errors="replace")
    finally:
        sa.stop()
        stop_warm_driver(env)
