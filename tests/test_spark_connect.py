"""Jobs on a long-lived Spark Connect server: a real server started by
`cdc connect-server` (the command docker-compose's spark-connect service
runs), the CLI's `cdc apply` as its client (CDC_SPARK_REMOTE), then the
server's own REST API shows that the Spark work ran there.  Also the two ways
attaching can go wrong: a server wired to another catalog (refused,
terminal) and no server (at once, retryable).  The DAG's tasks as clients
(a spark_connect spark_default): tests/test_e2e_dag_runner.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import requests

from tests.airflow_env import VENV_BIN, airflow_env
from tests.servers import free_port, running_connect_server
from tests.test_e2e_dag_runner import check_demo_table, table_rows

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def cdc(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "cdc"), *args], env=env, capture_output=True, text=True, timeout=300)


SLOTS_PROBE = """import sys
from pyspark.sql import SparkSession
from cdc_apply.decode.stage import planned_range_splits, range_partitions
spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
print(planned_range_splits(spark), range_partitions(spark))
"""


def test_jobs_run_on_a_spark_connect_server(tmp_path, monkeypatch):
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    ui = free_port()
    env = airflow_env(tmp_path / "airflow", tmp_path / "cdc", CDC_SPARK_CONF_spark__ui__port=str(ui))
    monkeypatch.setenv("CDC_HOME", env["CDC_HOME"])
    settings = Settings.from_env()
    write_demo_archive(settings)
    with running_connect_server(tmp_path / "connect.log", env=env) as url:
        client = {**env, "CDC_SPARK_REMOTE": url}
        result = tmp_path / "result.json"
        applied = cdc(client, "apply", "--source", "pg_inventory", "--result-file", str(result))
        assert applied.returncode == 0, applied.stderr[-3000:]
        assert json.loads(result.read_text())["status"] == "complete", result.read_text()[-3000:]
        table = check_demo_table(env)
        # the batch's ledger rode on the MERGE's snapshot (session conf of the Connect session)
        summary = table.current_snapshot().summary
        assert summary["cdc.batch-id"].startswith("pg_inventory_") and len(json.loads(summary["cdc.files"])) == 3, summary
        # the decode's task slots, read from the server's plan of a range (no Spark job), are the
        # partitions a range runs in
        slots = subprocess.run([str(VENV_BIN / "python"), "-c", SLOTS_PROBE, url], env=client, capture_output=True, text=True, timeout=120)
        planned, counted = slots.stdout.split()[-2:]
        assert planned == counted and int(counted) >= 1, slots.stdout + slots.stderr[-2000:]
        again = cdc(client, "apply", "--source", "pg_inventory", "--result-file", str(result))
        assert again.returncode == 0 and json.loads(result.read_text())["status"] == "nothing-to-do", again.stderr[-3000:]

        # the Spark work ran in the server (its one application), not in a driver of the client's own
        apps = requests.get(f"http://127.0.0.1:{ui}/api/v1/applications", timeout=10).json()
        assert [a["name"] for a in apps] == ["cdc-connect"], apps
        jobs = requests.get(f"http://127.0.0.1:{ui}/api/v1/applications/{apps[0]['id']}/jobs", timeout=10).json()
        assert len(jobs) > 10 and all(j["status"] == "SUCCEEDED" for j in jobs), [(j["jobId"], j["status"]) for j in jobs]
        # in the source's scheduler pool, which the server shares fairly with the other sources' pools
        stages = requests.get(f"http://127.0.0.1:{ui}/api/v1/applications/{apps[0]['id']}/stages", timeout=10).json()
        pools = [s["schedulingPool"] for s in stages]
        assert pools.count("pg_inventory") > len(pools) / 2 and set(pools) <= {"pg_inventory", "default"}, pools
        environment = requests.get(f"http://127.0.0.1:{ui}/api/v1/applications/{apps[0]['id']}/environment", timeout=10).json()
        assert dict(environment["sparkProperties"])["spark.scheduler.mode"] == "FAIR"

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
    assert f"cannot reach the Spark Connect server at CDC_SPARK_REMOTE={url}: [Errno 111] Connection refused" in gone.stderr, gone.stderr[
        -3000:
    ]


def test_spark_remote_must_be_a_connect_url(monkeypatch):
    from cdc_apply.config import Settings
    from cdc_apply.errors import ConfigError

    monkeypatch.setenv("CDC_SPARK_REMOTE", "spark://127.0.0.1:7077")
    with pytest.raises(ConfigError, match="sc://host:15002"):
        Settings.from_env()
    monkeypatch.setenv("CDC_SPARK_REMOTE", "sc://spark-connect:15002")
    assert Settings.from_env().spark_remote == "sc://spark-connect:15002"


def _daemons(tag: str) -> list[int]:
    """PIDs of the Python worker daemons (``python -m cdc_apply.runtime.connect_daemon``,
    not the JVM naming it in its conf) of the server whose environment holds ``tag``."""
    from cdc_apply.runtime.submit import CONNECT_DAEMON_MODULE

    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if CONNECT_DAEMON_MODULE.encode() in argv[1:3] and tag.encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


CLIENT = """
import sys

import pyarrow as pa
from pyspark.sql import SparkSession


def doubled(batches):
    for b in batches:
        yield pa.RecordBatch.from_arrays([pa.compute.multiply(b.column(0), 2)], names=["id"])


spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
for _ in range(2):  # the second time when the test says so (a line on stdin)
    print(sorted(r.id for r in spark.range(4, numPartitions=2).mapInArrow(doubled, "id long").collect()), flush=True)
    sys.stdin.readline()
spark.stop()
"""


def test_a_connect_session_s_python_daemon_ends_when_idle_and_comes_back_when_needed(tmp_path):
    """Spark 4.1 keeps one Python daemon per Connect session until the server
    stops: a server taking a batch an hour gained ~60 MB an hour. Ours ends
    once it has had no worker (here for 5 s; workers not reused, so a task's
    worker ends with it), and the same session's next Python task gets a new
    one.  The client is a process of its own, as a DAG task is (a test
    process may already hold a local session, which a remote one cannot join)."""
    import sys
    import time
    import uuid

    tag = f"cdc-test-{uuid.uuid4()}"
    env = airflow_env(
        tmp_path / "airflow",
        tmp_path / "cdc",
        CDC_CONNECT_DAEMON_IDLE_SECONDS="5",
        CDC_SPARK_CONF_spark__python__worker__reuse="false",
        CDC_TEST_SERVER_TAG=tag,
    )
    with running_connect_server(tmp_path / "connect.log", env=env) as url:
        # stderr to a file: a pipe nobody reads while the test waits could fill and stop the client
        errors = tmp_path / "client.err"
        with errors.open("w") as err:
            client = subprocess.Popen(
                [sys.executable, "-c", CLIENT, url], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
            )
        try:
            assert client.stdout.readline().strip() == "[0, 2, 4, 6]", errors.read_text()[-3000:]
            assert _daemons(tag), "the session's Python tasks ran without this project's daemon"
            deadline = time.time() + 90
            while _daemons(tag) and time.time() < deadline:
                time.sleep(0.5)
            assert not _daemons(tag), "the idle daemon did not end"
            client.stdin.write("\n")
            client.stdin.flush()
            # Spark starts the session's daemon again
            assert client.stdout.readline().strip() == "[0, 2, 4, 6]", errors.read_text()[-3000:]
            client.stdin.write("\n")
            client.stdin.flush()
            assert client.wait(timeout=120) == 0, errors.read_text()[-3000:]
        finally:
            client.kill()


def test_two_sources_apply_at_once_on_one_server(tmp_path, monkeypatch):
    """docker-compose's default deployment: two sources' tasks are clients of
    one server at the same moment (a session, a scheduler pool and a code zip
    each, from one CDC_HOME).  Both batches complete, and the second
    source's table holds what the first's does: the same archive, applied
    beside another batch."""
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    sources = tmp_path / "sources.yaml"
    sources.write_text(
        "sources:\n"
        + "".join(
            f"  {name}:\n    format: debezium_postgres\n    namespace: {name}\n"
            "    tables:\n      public.customers: {primary_key: [id], history: scd2}\n"
            for name in ("pg_inventory", "pg_twin")
        )
    )
    env = airflow_env(tmp_path / "airflow", tmp_path / "cdc", CDC_SOURCES_FILE=str(sources))
    monkeypatch.setenv("CDC_HOME", env["CDC_HOME"])
    monkeypatch.setenv("CDC_SOURCES_FILE", str(sources))
    settings = Settings.from_env()
    for name in ("pg_inventory", "pg_twin"):
        write_demo_archive(settings, name)
    with running_connect_server(tmp_path / "connect.log", env=env) as url:
        client = {**env, "CDC_SPARK_REMOTE": url}
        runs = {
            name: subprocess.Popen(
                [str(VENV_BIN / "cdc"), "apply", "--source", name, "--result-file", str(tmp_path / f"{name}.json")],
                env=client,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in ("pg_inventory", "pg_twin")
        }
        outs = {name: p.communicate(timeout=600) for name, p in runs.items()}
    for name, p in runs.items():
        assert p.returncode == 0, f"{name}: {outs[name][1][-3000:]}"
        assert json.loads((tmp_path / f"{name}.json").read_text())["status"] == "complete", name
    check_demo_table(env)

    def rows(table: str) -> list[tuple]:
        keep = ("id", "first_name", "balance", "email", "_cdc_op", "_cdc_deleted", "_cdc_position")
        return sorted(tuple(r[c] for c in keep) for r in table_rows(env, table)[1])

    assert rows("pg_twin.customers") == rows("pg_inventory.customers")
