"""How a job's Spark driver is started: by ``spark-submit`` for one batch (the
DAG's default), or as a long-lived Spark Connect server that jobs attach to.

Both get the same conf (Iceberg catalog, shuffle sizing, worker Python) and
jars from the settings, so a job behaves the same whichever driver runs it.
The Airflow plugin (``cdc_airflow.spark``), the CLI's ``connect-server`` and
the benchmark all build their commands here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from . import class_archive
from .config import Settings, pip_spark_home, spark_home

PACKAGE_DIR = Path(__file__).resolve().parent
CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_CONNECT_PORT = 15002
# A spark-submit job's JVM lives for one batch (seconds to minutes) and shares
# few cores with the Python decode workers: the C2 compiler's threads compete
# with the work and its code arrives too late to pay off.  Measured on 2 cores
# (bench/README.md): a 1k-event hourly job 27.9 -> 22 s, a 200k-event job
# 58.6 -> 51.1 s.  A Connect server lives for days and keeps the default.
# To drop it: CDC_SPARK_CONF_spark__driver__extraJavaOptions= (empty).
DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"


def build_code_zip(dest_dir: Path) -> str:
    """Zip the cdc_apply package for Python workers (rebuilt when sources changed)."""
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    stamp = str(max((p.stat().st_mtime_ns for p in files), default=0))
    dest_dir.mkdir(parents=True, exist_ok=True)
    zpath = dest_dir / f"cdc_apply-{stamp}.zip"
    if not zpath.exists():
        tmp = zpath.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for p in files:
                z.write(p, p.relative_to(PACKAGE_DIR.parent).as_posix())
        tmp.replace(zpath)
    return str(zpath)


def worker_python(env: Mapping[str, str] | None = None) -> str:
    """The Python of the driver and its workers: ``CDC_PYSPARK_PYTHON`` of
    ``env`` (default: this process's; the executors' interpreter path on a
    cluster), else this interpreter."""
    return (os.environ if env is None else env).get("CDC_PYSPARK_PYTHON") or sys.executable


def driver_conf(settings: Settings, *, short_lived: bool = True) -> dict[str, str]:
    """Conf of a driver JVM the project starts: one batch's spark-submit
    (``short_lived``) or a Spark Connect server."""
    from .spark_session import iceberg_conf

    python = worker_python()
    conf = {
        "spark.sql.shuffle.partitions": "8",
        # the driver JVM (and, on local[*], the executors): Spark's 1 GB default
        # runs out of heap on an hour of large archive files (see bench/README.md)
        "spark.driver.memory": os.environ.get("CDC_SPARK_DRIVER_MEMORY", "3g"),
        "spark.ui.showConsoleProgress": "false",
        "spark.pyspark.python": python,
        "spark.pyspark.driver.python": python,
    }
    if short_lived:
        conf["spark.driver.extraJavaOptions"] = DRIVER_JAVA_OPTIONS
    from .logs import spark_conf as quiet_logs

    return {**conf, **quiet_logs(), **iceberg_conf(settings)}


def submit_settings() -> dict[str, Any]:
    """conf, jars, py-files and environment of the DAG's spark-submit job,
    from the environment settings; submit it with ``job_conf``'s conf."""
    settings = Settings.from_env()
    return {
        "conf": driver_conf(settings),
        "jars": ",".join(str(p) for p in settings.jar_paths()),
        "py_files": build_code_zip(settings.home / "dist"),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("CDC_", "AWS_"))},
        "class_archive_dir": settings.home / "jvm",
    }


@contextlib.contextmanager
def job_conf(s: Mapping[str, Any]) -> Iterator[dict[str, str]]:
    """The conf of one spark-submit job of ``submit_settings()`` ``s``: its
    driver starts from the class archive of class_archive.py (or writes it)."""
    jars = [j for j in s["jars"].split(",") if j]
    with class_archive.driver_with_archive(s["conf"], jars, s["class_archive_dir"], DRIVER_JAVA_OPTIONS) as conf:
        yield conf


def spark_submit_bin() -> str:
    """The spark-submit of the PySpark this interpreter runs."""
    cand = Path(sys.executable).parent / "spark-submit"
    if cand.exists():
        return str(cand)
    return str(pip_spark_home() / "bin" / "spark-submit")


def connect_server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of a Spark Connect server: SPARK_HOME of the pip-installed
    PySpark (its launcher scripts need it outside the venv's PATH), and the
    Python of its UDF workers (the server takes it from PYSPARK_PYTHON, not
    from spark.pyspark.python)."""
    base = os.environ if base is None else base
    return {
        **base,
        "SPARK_HOME": str(spark_home(base)),
        "PYSPARK_PYTHON": worker_python(base),
    }


def connect_server_command(settings: Settings, *, host: str = "127.0.0.1", port: int = DEFAULT_CONNECT_PORT) -> list[str]:
    """spark-submit of a Spark Connect server with the project's conf and jars:
    the long-lived driver that jobs attach to with ``CDC_SPARK_REMOTE``.

    It binds ``host`` only (Spark Connect has no authentication of its own:
    expose it on a private network, never publicly)."""
    cmd = [spark_submit_bin(), "--master", settings.spark_master, "--class", CONNECT_SERVER_CLASS, "--name", "cdc-connect"]
    cmd += ["--jars", ",".join(str(p) for p in settings.jar_paths())]
    conf = {
        **driver_conf(settings, short_lived=False),
        "spark.connect.grpc.binding.address": host,
        "spark.connect.grpc.binding.port": str(port),
    }
    for key, value in conf.items():
        cmd += ["--conf", f"{key}={value}"]
    return cmd


@contextlib.contextmanager
def running_connect_server(log: Path, *, port: int | None = None, env: Mapping[str, str] | None = None,
                           timeout: float = 180) -> Iterator[str]:
    """``cdc connect-server`` on 127.0.0.1 (``port``, or a free one) with the
    settings of ``env`` (default: this process's) until the block ends; yields
    its sc:// URL once it listens.  For the tests and the benchmark: a
    deployment runs the command as a service (docker-compose's spark-connect)."""
    from .spark_session import _check_listening

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    url = f"sc://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cdc_apply.cli", "connect-server", "--port", str(port)],
                                env=dict(os.environ if env is None else env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.time() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"connect-server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
                try:
                    _check_listening(url, timeout=1)
                    break
                except OSError:
                    if time.time() > deadline:
                        raise RuntimeError(f"connect-server never listened:\n{log.read_text()[-3000:]}") from None
                    time.sleep(0.5)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
