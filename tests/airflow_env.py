"""A throw-away Airflow installation for end-to-end tests: its own
AIRFLOW_HOME on SQLite, this project's dags/ and plugins/, the spark_default
connection on local[*] (so the DAG's Spark tasks attach to the home's warm
driver, as the embedded default's do; ``stop_warm_driver`` ends it), and the
CDC settings of the test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cdc_apply.runtime.spark_conf import DRIVER_JAVA_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def airflow_env(airflow_home: Path, cdc_home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "AIRFLOW_HOME": str(airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__PARALLELISM": "2",
            "AIRFLOW_CONN_SPARK_DEFAULT": '{"conn_type": "spark", "host": "local[2]"}',
            "CDC_HOME": str(cdc_home),
            "CDC_JARS_DIR": os.environ.get("CDC_JARS_DIR", str(ROOT / ".cdc" / "jars")),
            "CDC_SOURCES_FILE": str(ROOT / "include" / "sources.yaml"),
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": f"{ROOT / 'spark_jobs'}{os.pathsep}{ROOT / 'plugins'}",
            "CDC_SPARK_CONF_spark__sql__shuffle__partitions": "2",
            # a test home's servers live for a few batches: C1 only, as a short-lived driver (tests/conftest.py's
            # ``spark``); the DAG's spark-submit jobs get the same options as without it (and their class archive)
            "CDC_SPARK_CONF_spark__driver__extraJavaOptions": DRIVER_JAVA_OPTIONS,
            # a test's warm driver ends after its last job, should its teardown not stop it; not sooner than a
            # slow machine's pause between two of a test's DAG runs (at 120 s a backfill's next run met a new one)
            "CDC_WARM_DRIVER_IDLE_SECONDS": "600",
            # a 500 from the api-server carries the database's own error, so a
            # test can tell SQLite's "database is locked" race from a real fault
            "AIRFLOW__API__EXPOSE_STACKTRACE": "True",
        }
    )
    env.update(extra)
    return env


def stop_warm_driver(env: dict[str, str]) -> None:
    """End the warm driver of env's home now (``cdc warm-driver stop --now``)."""
    cmd = [str(VENV_BIN / "python"), "-m", "cdc_apply.cli", "warm-driver", "stop", "--now", "--timeout", "60"]
    subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True)


def airflow(env: dict[str, str], *args: str, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(VENV_BIN / "airflow"), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"airflow {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}")
    return proc
