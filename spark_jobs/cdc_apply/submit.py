"""How a job's Spark driver is started: by ``spark-submit`` for one batch (the
DAG's default), or as a long-lived Spark Connect server that jobs attach to.

Both get the same conf (Iceberg catalog, shuffle sizing, worker Python) and
jars from the settings, so a job behaves the same whichever driver runs it.
The Airflow plugin (``cdc_airflow.spark``), the CLI's ``connect-server`` and
the benchmark all build their commands here.
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

from .config import Settings

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


def driver_conf(settings: Settings, *, python: str | None = None, short_lived: bool = True) -> dict[str, str]:
    """Conf of a driver JVM the project starts: one batch's spark-submit
    (``short_lived``) or a Spark Connect server."""
    from .spark_session import iceberg_conf

    python = python or os.environ.get("CDC_PYSPARK_PYTHON", sys.executable)
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
    return {**conf, **iceberg_conf(settings)}


def spark_submit_bin() -> str:
    """The spark-submit of the PySpark this interpreter runs."""
    cand = Path(sys.executable).parent / "spark-submit"
    if cand.exists():
        return str(cand)
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-submit")


def connect_server_env(settings: Settings) -> dict[str, str]:
    """Environment of a Spark Connect server: SPARK_HOME of the pip-installed
    PySpark (its launcher scripts need it outside the venv's PATH), and the
    Python of its UDF workers (the server takes it from PYSPARK_PYTHON, not
    from spark.pyspark.python)."""
    import pyspark

    return {
        **os.environ,
        "SPARK_HOME": os.environ.get("SPARK_HOME") or str(Path(pyspark.__file__).parent),
        "PYSPARK_PYTHON": driver_conf(settings)["spark.pyspark.python"],
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
