"""The cdc_apply DAG on a long-lived Spark Connect server, by changing only the
spark_default connection to type spark_connect: a real server started by
`cdc connect-server` (the command docker-compose's spark-connect service
runs), `airflow dags test`, then the server's own REST API shows that the
tasks' Spark work ran there.  Also the two ways attaching can go wrong: a
server wired to another catalog (refused, terminal) and no server (at once,
retryable)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from tests.airflow_env import VENV_BIN, airflow, airflow_env
from tests.test_e2e_dag_runner import check_demo_table
from tests.test_e2e_standalone import free_port

pytestmark = [pytest.mark.airflow, pytest.mark.spark, pytest.mark.slow]


@contextlib.contextmanager
def connect_server(env: dict[str, str], port: int, log: Path):
    """`cdc connect-server` on 127.0.0.1:port until the block ends."""
    with log.open("w") as out:
        proc = subprocess.Popen([str(VENV_BIN / "cdc"), "connect-server", "--port", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 180
            while True:
                assert proc.poll() is None, f"connect-server exited {proc.returncode}:\n{log.read_text()[-3000:]}"
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                assert time.time() < deadline, f"connect-server never listened:\n{log.read_text()[-3000:]}"
                time.sleep(0.5)
            yield f"sc://127.0.0.1:{port}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def cdc(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "cdc"), *args], env=env, capture_output=True, text=True, timeout=300)


def test_dag_runs_on_a_spark_connect_server(tmp_path, monkeypatch):
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    port, ui = free_port(), free_port()
    env = airflow_env(tmp_path / "airflow", tmp_path / "cdc", CDC_SPARK_CONF_spark__ui__port=str(ui))
    monkeypatch.setenv("CDC_HOME", env["CDC_HOME"])
    settings = Settings.from_env()
    write_demo_archive(settings)
    with connect_server(env, port, tmp_path / "connect.log") as url:
        env["AIRFLOW_CONN_SPARK_DEFAULT"] = json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1", "port": port})
        airflow(env, "db", "migrate")
        airflow(env, "dags", "test", "cdc_apply", "2026-01-01T03:00:00+00:00", timeout=900)
        table = check_demo_table(env)
        # the batch's ledger rode on the MERGE's snapshot (session conf of the Connect session)
        summary = table.current_snapshot().summary
        assert summary["cdc.batch-id"].startswith("pg_inventory_") and json.loads(summary["cdc.files"]), summary

        # the tasks' Spark work ran in the server (its one application), not in drivers of their own
        apps = requests.get(f"http://127.0.0.1:{ui}/api/v1/applications", timeout=10).json()
        assert [a["name"] for a in apps] == ["cdc-connect"], apps
        jobs = requests.get(f"http://127.0.0.1:{ui}/api/v1/applications/{apps[0]['id']}/jobs", timeout=10).json()
        assert len(jobs) > 10 and all(j["status"] == "SUCCEEDED" for j in jobs), [(j["jobId"], j["status"]) for j in jobs]

        # a job whose settings name another catalog is refused before it writes anything: terminal
        other = {**env, "CDC_HOME": str(tmp_path / "other"), "CDC_SPARK_REMOTE": url}
        refused = cdc(other, "apply", "--source", "pg_inventory", "--dir", str(Path(settings.archive_dir) / "pg_inventory"))
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "wired to another catalog" in refused.stderr and "spark.sql.catalog.lake.uri" in refused.stderr, refused.stderr[-3000:]

    # no server: the job says so from its own check (the Connect client alone retries a refused
    # connection for minutes) and exits 1, so Airflow retries it
    other["CDC_HOME"] = str(tmp_path / "third")
    gone = cdc(other, "apply", "--source", "pg_inventory", "--dir", str(Path(settings.archive_dir) / "pg_inventory"))
    assert gone.returncode == 1, gone.stderr[-3000:]
    assert f"cannot reach the Spark Connect server at CDC_SPARK_REMOTE={url}: [Errno 111] Connection refused" in gone.stderr, gone.stderr[-3000:]


def test_spark_remote_must_be_a_connect_url(monkeypatch):
    from cdc_apply.config import Settings
    from cdc_apply.errors import ConfigError

    monkeypatch.setenv("CDC_SPARK_REMOTE", "spark://127.0.0.1:7077")
    with pytest.raises(ConfigError, match="sc://host:15002"):
        Settings.from_env()
    monkeypatch.setenv("CDC_SPARK_REMOTE", "sc://spark-connect:15002")
    assert Settings.from_env().spark_remote == "sc://spark-connect:15002"
