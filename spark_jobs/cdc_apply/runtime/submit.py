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
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from cdc_apply.config import Settings, pip_spark_home, spark_home
from cdc_apply.runtime import class_archive
from cdc_apply.runtime.code_zip import build_code_zip
from cdc_apply.runtime.connect_daemon import IDLE_SECONDS_ENV
from cdc_apply.runtime.logs import jvm_options
from cdc_apply.runtime.spark_conf import DRIVER_JAVA_OPTIONS, driver_conf, jar_paths

CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_CONNECT_PORT = 15002
CONNECT_DAEMON_MODULE = "cdc_apply.runtime.connect_daemon"


@dataclass(frozen=True)
class SubmitSpec:
    """What the DAG's spark-submit of one job needs, from the settings: conf,
    jars, the code zip and the environment the job process reads its
    settings from (``CDC_*``, ``AWS_*``)."""

    conf: Mapping[str, str]
    jars: tuple[str, ...]
    py_files: str
    env: Mapping[str, str]
    class_archive_dir: Path
    jvm_logging: str = ""
    """extra driver JVM options with the class archive (logs.jvm_options)"""

    def with_conf(self, own: Mapping[str, str]) -> SubmitSpec:
        """The task's own conf wins (its Java options of its own mean no class archive)."""
        return replace(self, conf={**self.conf, **own})

    @contextlib.contextmanager
    def job_conf(self) -> Iterator[dict[str, str]]:
        """The conf of the job: its driver starts from the class archive of
        class_archive.py (or writes it)."""
        with class_archive.driver_with_archive(
            dict(self.conf), list(self.jars), self.class_archive_dir, DRIVER_JAVA_OPTIONS, self.jvm_logging
        ) as conf:
            yield conf


def submit_spec(settings: Settings, env: Mapping[str, str]) -> SubmitSpec:
    """The spark-submit of the DAG's job under ``settings``; ``env`` (the
    caller's environment) passes on its ``CDC_*`` and ``AWS_*`` variables."""
    return SubmitSpec(
        conf=driver_conf(settings),
        jars=tuple(str(p) for p in jar_paths(settings)),
        py_files=build_code_zip(settings.home / "dist"),
        env={k: v for k, v in env.items() if k.startswith(("CDC_", "AWS_"))},
        class_archive_dir=settings.home / "jvm",
        jvm_logging=jvm_options(settings.log_verbose),
    )


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
        "PYSPARK_PYTHON": base.get("CDC_PYSPARK_PYTHON") or sys.executable,
    }


def connect_server_command(settings: Settings, *, host: str = "127.0.0.1", port: int = DEFAULT_CONNECT_PORT) -> list[str]:
    """spark-submit of a Spark Connect server with the project's conf and jars:
    the long-lived driver that jobs attach to with ``CDC_SPARK_REMOTE``.

    It binds ``host`` only (Spark Connect has no authentication of its own:
    expose it on a private network, never publicly)."""
    cmd = [spark_submit_bin(), "--master", settings.spark_master, "--class", CONNECT_SERVER_CLASS, "--name", "cdc-connect"]
    cmd += ["--jars", ",".join(str(p) for p in jar_paths(settings))]
    conf = {
        # the cores shared fairly between pools (a pool per source: session.remote_session),
        # instead of each stage waiting for every stage submitted before it (CDC_SPARK_CONF_* may override)
        "spark.scheduler.mode": "FAIR",
        **driver_conf(settings, short_lived=False),
        "spark.connect.grpc.binding.address": host,
        "spark.connect.grpc.binding.port": str(port),
        # a daemon per session that ends once idle (Spark 4.1 keeps each until the server stops)
        "spark.python.daemon.module": CONNECT_DAEMON_MODULE,
    }
    if os.environ.get(IDLE_SECONDS_ENV):  # the executors' daemons (on a cluster) end after as long
        conf[f"spark.executorEnv.{IDLE_SECONDS_ENV}"] = os.environ[IDLE_SECONDS_ENV]
    for key, value in conf.items():
        cmd += ["--conf", f"{key}={value}"]
    return cmd
