"""The cdc_apply DAG on a Spark standalone cluster, by changing only the
spark_default connection: a native master and worker on 127.0.0.1 (from the
pip-installed pyspark), `airflow dags test`, then the master's and worker's
JSON show that executors on the worker ran the job's applications.  And the
Spark Connect server on the same kind of cluster, as docker-compose runs it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest
import requests

from tests.airflow_env import VENV_BIN, airflow, airflow_env
from tests.servers import free_port, running_connect_server
from tests.test_e2e_dag_runner import check_demo_table

pytestmark = [pytest.mark.airflow, pytest.mark.spark, pytest.mark.slow]


def start(args, log):
    from cdc_apply.config import pip_spark_home

    env = {**os.environ, "SPARK_HOME": str(pip_spark_home()), "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.Popen([str(VENV_BIN / "spark-class"), *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)


def wait_json(url, predicate, timeout=120):
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        try:
            last = requests.get(url, timeout=5).json()
            if predicate(last):
                return last
        except (requests.RequestException, ValueError):
            pass
        time.sleep(1)
    raise AssertionError(f"{url} never satisfied the condition; last answer: {last}")


@contextlib.contextmanager
def standalone_cluster(tmp_path):
    """A native master and one worker (2 cores) on 127.0.0.1; yields
    (master URL, master UI port, worker UI port)."""
    port, ui, worker_ui = free_port(), free_port(), free_port()
    log = open(tmp_path / "spark.log", "w")
    master = start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui)], log)
    worker = None
    try:
        wait_json(f"http://127.0.0.1:{ui}/json/", lambda j: j.get("status") == "ALIVE")
        worker = start(
            [
                "org.apache.spark.deploy.worker.Worker",
                f"spark://127.0.0.1:{port}",
                "--host",
                "127.0.0.1",
                "--webui-port",
                str(worker_ui),
                "--cores",
                "2",
                "--memory",
                "2g",
            ],
            log,
        )
        wait_json(f"http://127.0.0.1:{ui}/json/", lambda j: len([w for w in j.get("workers", []) if w["state"] == "ALIVE"]) == 1)
        yield f"spark://127.0.0.1:{port}", ui, worker_ui
    finally:
        if worker:
            stop(worker)
        stop(master)
        log.close()


def ran_on_the_worker(worker_ui: int, apps: set[str]) -> set[str]:
    """The applications among ``apps`` whose executors ran on the worker."""
    work = requests.get(f"http://127.0.0.1:{worker_ui}/json/", timeout=5).json()
    return apps & {e["appid"] for e in work.get("finishedexecutors", []) + work.get("executors", [])}


def test_dag_runs_on_a_standalone_cluster(tmp_path, monkeypatch):
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    with standalone_cluster(tmp_path) as (master, ui, worker_ui):
        host, port = master.rsplit(":", 1)
        conn = json.dumps({"conn_type": "spark", "host": host, "port": int(port)})
        env = airflow_env(tmp_path / "airflow", tmp_path / "cdc", AIRFLOW_CONN_SPARK_DEFAULT=conn)
        monkeypatch.setenv("CDC_HOME", env["CDC_HOME"])
        write_demo_archive(Settings.from_env())
        airflow(env, "db", "migrate")
        airflow(env, "dags", "test", "cdc_apply", "2026-01-01T03:00:00+00:00", timeout=900)
        check_demo_table(env)

        state = wait_json(f"http://127.0.0.1:{ui}/json/", lambda j: len(j.get("completedapps", [])) >= 1)
        names = [a["name"] for a in state["completedapps"]]
        assert names == ["cdc_apply_pg_inventory"], names  # the gate ran in the apply job: no validate job of its own
        apps = {a["id"] for a in state["completedapps"]}
        assert ran_on_the_worker(worker_ui, apps) == apps  # the job's executors ran on the worker


def test_spark_connect_server_on_a_standalone_cluster(tmp_path, monkeypatch):
    """docker-compose's spark-connect service natively: `cdc connect-server`
    with the cluster as its master; a client's batch is decoded by Python
    workers of the executors on the worker, which get the job's code as the
    session's artifact."""
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    with standalone_cluster(tmp_path) as (master, ui, worker_ui):
        env = airflow_env(tmp_path / "airflow", tmp_path / "cdc", CDC_SPARK_MASTER=master)
        monkeypatch.setenv("CDC_HOME", env["CDC_HOME"])
        write_demo_archive(Settings.from_env())
        with running_connect_server(tmp_path / "connect.log", env=env) as url:
            result = tmp_path / "result.json"
            proc = subprocess.run(
                [str(VENV_BIN / "cdc"), "apply", "--source", "pg_inventory", "--result-file", str(result)],
                env={**env, "CDC_SPARK_REMOTE": url},
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert proc.returncode == 0, proc.stderr[-5000:]
            assert json.loads(result.read_text())["status"] == "complete"
            check_demo_table(env)
            state = wait_json(f"http://127.0.0.1:{ui}/json/", lambda j: any(a["name"] == "cdc-connect" for a in j.get("activeapps", [])))
            apps = {a["id"] for a in state["activeapps"] if a["name"] == "cdc-connect"}
            assert ran_on_the_worker(worker_ui, apps) == apps  # the server's executors ran on the worker
