"""The embedded default's warm driver (cdc_apply/runtime/warm_driver.py):
real Spark Connect servers started by jobs, shared, waited for, ended once
idle or superseded, and replaced after a crash, with no process left over.

A job is held attached by a small process that calls ``attach()`` and waits
on its stdin (what a DAG task does for the length of its Spark job)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from cdc_apply.runtime.spark_conf import DRIVER_JAVA_OPTIONS
from tests.airflow_env import VENV_BIN
from tests.test_e2e_dag_runner import check_demo_table

ROOT = Path(__file__).resolve().parents[1]
IDLE = 6

HOLD = """
import sys
from cdc_apply.config import Settings
from cdc_apply.runtime import warm_driver
print(warm_driver.attach(Settings.from_env()), flush=True)
sys.stdin.read()
"""

STRANGER = """
import sys
from pyspark.sql import SparkSession
try:
    print("accepted", SparkSession.builder.remote(f"sc://127.0.0.1:{sys.argv[1]}").create().range(3).count())
except Exception as exc:
    print("refused", type(exc).__name__)
"""

UNWATCHED = """
import sys
from cdc_apply.config import Settings
from cdc_apply.runtime import session, warm_driver
spark = session.remote_session(Settings.from_env())
while session._unwatch:  # no watch: the job's own call is the first to meet the dead server
    session._unwatch.pop()()
print(spark.range(3).count(), flush=True)
sys.stdin.readline()  # meanwhile the test kills the server's JVM
try:
    print("served", spark.range(5).count(), flush=True)
except Exception as exc:
    print("failed", type(exc).__name__, flush=True)
print("lost", warm_driver.lost() is not None, flush=True)
session.stop_remote_session()
print("stopped", flush=True)
"""


@pytest.fixture
def env(tmp_path) -> Iterator[dict[str, str]]:
    """Settings of a home of its own; every warm driver left is ended afterwards."""
    env = {
        **os.environ,
        "CDC_HOME": str(tmp_path / "cdc"),
        "CDC_JARS_DIR": os.environ.get("CDC_JARS_DIR", str(ROOT / ".cdc" / "jars")),
        "PYTHONPATH": str(ROOT / "spark_jobs"),
        "CDC_SPARK_DRIVER_MEMORY": "1g",
        "CDC_WARM_DRIVER_IDLE_SECONDS": str(IDLE),
        "CDC_SPARK_CONF_spark__ui__enabled": "false",
        "CDC_SPARK_CONF_spark__sql__shuffle__partitions": "2",
        "CDC_SPARK_CONF_spark__driver__extraJavaOptions": DRIVER_JAVA_OPTIONS,  # a test's server lives for a few batches
    }
    env.pop("CDC_SPARK_REMOTE", None)
    yield env
    cdc(env, "warm-driver", "stop", "--now", "--timeout", "60")


def cdc(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "python"), "-m", "cdc_apply.cli", *args], env=env, capture_output=True, text=True, timeout=600)


def status(env: dict[str, str]) -> list[dict]:
    out = cdc(env, "warm-driver", "status")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@contextmanager
def held(env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen]]:
    """A job attached to the home's warm driver until the block ends; yields its URL."""
    proc = subprocess.Popen(
        [str(VENV_BIN / "python"), "-c", HOLD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        client_url = proc.stdout.readline().strip()
        assert client_url.startswith("sc://localhost:"), proc.stderr.read()[-3000:] if proc.poll() is not None else client_url
        yield listening_at(client_url), proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def listening_at(client_url: str) -> str:
    """The server's URL as status shows it, from the one a job connects to
    (``sc://localhost:<port>/;token=<its token>``)."""
    port, _, token = client_url.removeprefix("sc://localhost:").partition("/;token=")
    assert port.isdigit() and len(token) >= 32, client_url
    return f"sc://127.0.0.1:{port}"


def wait_for(what: Callable[[], object], seconds: float, message: str) -> object:
    deadline = time.monotonic() + seconds
    while not (got := what()):
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.5)
    return got


def spark_servers(home: str) -> list[psutil.Process]:
    """The JVMs of Spark Connect servers wired to ``home`` (its catalog is on their command line)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "SparkConnectServer" in cmd and home in cmd and "java" in (p.info["cmdline"] or [""])[0]:
            found.append(p)
    return found


def server_jvm(supervisor_pid: int) -> psutil.Process:
    """The supervisor's server JVM (not the short-lived commands a starting
    JVM runs, such as Hadoop's shell probes)."""
    found = []
    for child in psutil.Process(supervisor_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "SparkConnectServer" in " ".join(child.cmdline()):
                found.append(child)
    assert len(found) == 1, found
    return found[0]


def log_of(entry: dict) -> str:
    return Path(entry["log"]).read_text(errors="replace")


@pytest.mark.spark
@pytest.mark.slow
def test_jobs_share_one_warm_driver_which_waits_for_them_and_ends_once_idle(env, monkeypatch):
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    monkeypatch.setenv("CDC_HOME", env["CDC_HOME"])
    write_demo_archive(Settings.from_env())
    assert status(env) == []
    with held(env) as (url, _):
        [server] = status(env)
        assert server["url"] == url and server["current"] and server["jobs_attached"] == 1, server
        # a job of the CLI attaches to the same server, and applies the demo archive on it
        applied = cdc(
            {**env, "CDC_SPARK_REMOTE": "local"}, "apply", "--source", "pg_inventory", "--result-file", env["CDC_HOME"] + "/r.json"
        )
        assert applied.returncode == 0, applied.stderr[-3000:]
        assert json.loads(Path(env["CDC_HOME"], "r.json").read_text())["status"] == "complete"
        check_demo_table(env)
        assert [s["url"] for s in status(env)] == [url]
        assert len(list(Path(env["CDC_HOME"], "warm-driver").glob("server-*.log"))) == 1  # one server started, ever
        # idle for longer than the idle time, but a job holds it: it stays
        time.sleep(IDLE + 4)
        assert [s["url"] for s in status(env)] == [url]
        assert len(spark_servers(env["CDC_HOME"])) == 1
    # the job ended: the server follows once idle, and takes its JVM and records with it
    wait_for(lambda: status(env) == [], IDLE + 90, "the idle warm driver did not end")
    wait_for(lambda: not spark_servers(env["CDC_HOME"]), 60, "the server's JVM outlived its supervisor")
    assert f"ending: no job for {IDLE}s" in log_of(server)
    assert sorted(p.name for p in Path(env["CDC_HOME"], "warm-driver").iterdir() if not p.name.endswith(".log")) == ["start.lock"]


@pytest.mark.spark
@pytest.mark.slow
def test_jobs_starting_together_share_the_one_server_the_first_starts(env):
    """Three jobs arrive at once with no server running (an hour's tasks of
    several sources): one starts it, the others wait for it under the lock."""
    procs = [
        subprocess.Popen(
            [str(VENV_BIN / "python"), "-c", HOLD],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        urls = {proc.stdout.readline().strip() for proc in procs}
        assert len(urls) == 1 and next(iter(urls)).startswith("sc://localhost:"), [p.stderr.read()[-2000:] for p in procs if p.poll()]
        [server] = status(env)
        assert server["jobs_attached"] == 3, server
        assert len(list(Path(env["CDC_HOME"], "warm-driver").glob("server-*.log"))) == 1
        assert len(spark_servers(env["CDC_HOME"])) == 1
        # only this user's jobs can use it: a client without the server's token is refused
        folder = Path(env["CDC_HOME"], "warm-driver")
        port = server["url"].rsplit(":", 1)[1]
        record = folder / f"server-{port}.json"
        token = json.loads(record.read_text())["token"]
        assert len(token) >= 32 and (folder.stat().st_mode & 0o777, record.stat().st_mode & 0o777) == (0o700, 0o600)
        assert all(token in url for url in urls) and token not in json.dumps(status(env))
        [jvm] = spark_servers(env["CDC_HOME"])
        assert token not in " ".join(jvm.cmdline())  # (its environment holds it)
        # and none of its ports (Connect's, the Spark UI's, RPC, block manager) is open beyond this host
        listening = {c.laddr.ip for c in jvm.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
        stranger = subprocess.run([str(VENV_BIN / "python"), "-c", STRANGER, port], env=env, capture_output=True, text=True, timeout=300)
        assert stranger.returncode == 0 and stranger.stdout.startswith("refused"), stranger.stdout + stranger.stderr[-2000:]
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=30)


@pytest.mark.spark
@pytest.mark.slow
def test_other_settings_get_a_server_of_their_own_and_the_old_one_finishes_its_jobs_first(env):
    with held(env) as (first_url, _first):
        with held({**env, "CDC_SPARK_DRIVER_MEMORY": "1100m"}) as (second_url, _second):
            assert second_url != first_url
            servers = {s["url"]: s for s in status(env)}
            assert servers.keys() == {first_url, second_url}
            assert servers[second_url]["current"] and not servers[first_url]["current"]
            time.sleep(IDLE)
            assert len(status(env)) == 2  # the first still has its job
            # stop lets running jobs finish: it times out while they run, and says so
            stopping = cdc(env, "warm-driver", "stop", "--timeout", "2")
            assert stopping.returncode == 1 and "still finishing their jobs" in stopping.stderr, stopping.stderr
            assert not any(s["current"] for s in status(env))
        wait_for(lambda: [s["url"] for s in status(env)] == [first_url], 90, "the second server did not end after its job")
        assert "ending: no longer current" in log_of(servers[second_url])
    stopped = cdc(env, "warm-driver", "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert status(env) == [] and not spark_servers(env["CDC_HOME"])


@pytest.mark.spark
@pytest.mark.slow
def test_a_dead_server_or_supervisor_is_replaced_and_leaves_no_orphan(env):
    with held(env) as (first_url, _):
        [server] = status(env)
        jvm = server_jvm(server["supervisor_pid"])
        jvm.kill()  # the server crashes: its supervisor notices, and takes it out of use
        wait_for(lambda: status(env) == [], 90, "the supervisor outlived its server")
        assert "ending: the server exited" in log_of(server)
        with held(env) as (second_url, _):
            assert second_url != first_url
            [server] = status(env)
            jvm = server_jvm(server["supervisor_pid"])
            os.kill(server["supervisor_pid"], signal.SIGKILL)  # the supervisor dies: its server goes with it
            wait_for(lambda: not jvm.is_running() or jvm.status() == psutil.STATUS_ZOMBIE, 60, "the server outlived its supervisor")
            assert status(env) == []
            with held(env) as (third_url, _):
                assert third_url not in (first_url, second_url)
                # stop --now ends a server with a job attached (the job fails, Airflow retries it)
                stopped = cdc(env, "warm-driver", "stop", "--now", "--timeout", "60")
                assert stopped.returncode == 0, stopped.stderr
                assert status(env) == [] and not spark_servers(env["CDC_HOME"])


@pytest.mark.spark
@pytest.mark.slow
def test_a_job_whose_warm_driver_dies_under_it_fails_at_once_and_its_retry_applies_once(env, monkeypatch):
    """The server's JVM dies in the middle of a `cdc apply` (as on running out
    of memory, or `stop --now`): the job fails within seconds, naming the
    server's log, where the Connect client alone retries for ten minutes; the
    retry starts a new server and applies the batch exactly once."""
    from cdc_apply.config import Settings
    from cdc_apply.demo import write_demo_archive

    monkeypatch.setenv("CDC_HOME", env["CDC_HOME"])
    write_demo_archive(Settings.from_env())
    # the retry's server must outlive the checks after it: with the home's 6 s idle time, on a loaded
    # machine it ended before `status` was read, and the test saw no server (the teardown stops it)
    job_env = {**env, "CDC_SPARK_REMOTE": "local", "CDC_WARM_DRIVER_IDLE_SECONDS": "600"}
    apply = [str(VENV_BIN / "python"), "-m", "cdc_apply.cli", "apply", "--source", "pg_inventory"]
    proc = subprocess.Popen(apply, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        wait_for(lambda: any("decoded and counted" in line for line in said) or proc.poll() is not None, 300, "the job did not decode")
        assert proc.poll() is None, "".join(said)[-3000:]
        [server] = status(env)
        server_jvm(server["supervisor_pid"]).kill()  # mid-batch: the batch's writes are under way
        proc.wait(timeout=180)  # seconds, not the Connect client's ten minutes of retries (a loaded CI machine is slow)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    text = "".join(said)
    assert proc.returncode == 1, text[-3000:]  # transient: the task is retried
    assert f"the warm driver {server['url']} ended during this job" in text and server["log"] in text, text[-3000:]
    retried = cdc(job_env, "apply", "--source", "pg_inventory")
    assert retried.returncode == 0, retried.stderr[-3000:]
    [second] = status(env)  # read before the table, while the retry's server still runs
    assert second["url"] != server["url"] and len(spark_servers(env["CDC_HOME"])) == 1
    check_demo_table(env)  # the batch once, whole: nothing lost or doubled by the crash


@pytest.mark.spark
def test_a_call_that_meets_its_dead_warm_driver_first_fails_at_once_and_the_client_closes(env):
    """The other order of the test above: the job's own call meets the dead
    server before the watch's next look.  The Connect client's default policy
    retried it for ten minutes, and closing the client waited as long for
    its result releases' retries; a job on a warm driver retries only while
    its server serves (``session._while_served``)."""
    job_env = {**env, "CDC_SPARK_REMOTE": "local", "CDC_WARM_DRIVER_IDLE_SECONDS": "600"}
    probe = [str(VENV_BIN / "python"), "-c", UNWATCHED]
    proc = subprocess.Popen(probe, env=job_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert first == "3", proc.stderr.read()[-3000:] if proc.poll() is not None else first  # type: ignore[union-attr]
        [server] = status(env)
        server_jvm(server["supervisor_pid"]).kill()
        wait_for(lambda: not spark_servers(env["CDC_HOME"]), 60, "the killed JVM is still listed")
        out, err = proc.communicate("go\n", timeout=180)  # seconds, not the client's ten minutes
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.split("\n")[:3] == ["failed SparkConnectGrpcException", "lost True", "stopped"], out + err[-3000:]


def test_settings_of_the_warm_driver(monkeypatch):
    from cdc_apply.config import Settings
    from cdc_apply.errors import ConfigError
    from cdc_apply.runtime.warm_driver import _server_command, fingerprint

    assert Settings.from_env().warm_driver_idle_seconds == 5400
    for bad, said in (("soon", "is not a number of seconds"), ("-1", "must be >= 0 seconds")):
        monkeypatch.setenv("CDC_WARM_DRIVER_IDLE_SECONDS", bad)
        with pytest.raises(ConfigError, match=f"CDC_WARM_DRIVER_IDLE_SECONDS.*{said}"):
            Settings.from_env()
    monkeypatch.setenv("CDC_WARM_DRIVER_IDLE_SECONDS", "0")
    monkeypatch.setenv("CDC_SPARK_REMOTE", "local")
    settings = Settings.from_env()
    assert settings.warm_driver_idle_seconds == 0 and settings.spark_remote == "local"

    # a server fits the jobs whose command and settings it was started with, whatever their idle time
    command, server_env = _server_command(settings)
    assert "spark.connect.grpc.binding.port={port}" in command
    same = fingerprint(command, {**server_env, "CDC_WARM_DRIVER_IDLE_SECONDS": "60", "CDC_SPARK_REMOTE": "sc://x:1"})
    assert same == fingerprint(command, server_env)
    assert fingerprint(command, {**server_env, "AWS_REGION": "eu-west-3"}) != fingerprint(command, server_env)
    monkeypatch.setenv("CDC_SPARK_DRIVER_MEMORY", "5g")
    assert fingerprint(*_server_command(Settings.from_env())) != fingerprint(command, server_env)
