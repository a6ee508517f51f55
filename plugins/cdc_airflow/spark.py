"""Spark submission for the CDC job.

The job's code ships as a zip (``--py-files``) and its jars via ``--jars``,
so it runs unchanged on ``local[*]`` or a standalone cluster: only the
``spark_default`` connection changes.  A terminal failure of the job (exit
code 2: data or configuration) fails the task *without retry*.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowFailException
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

PROJECT_ROOT = Path(__file__).resolve().parents[2]
APPLICATION = str(PROJECT_ROOT / "spark_jobs" / "apply_batch.py")
# A job's JVM lives for one batch (seconds to minutes) and shares few cores
# with the Python decode workers: the C2 compiler's threads compete with the
# work and its code arrives too late to pay off.  Measured on 2 cores
# (bench/README.md): a 1k-event hourly job 27.9 -> 22 s, a 200k-event job
# 58.6 -> 51.1 s.  Long-lived sessions (tests, notebooks) keep the default.
# To drop it: CDC_SPARK_CONF_spark__driver__extraJavaOptions= (empty).
DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"


def build_code_zip(dest_dir: Path) -> str:
    """Zip the cdc_apply package for executors (rebuilt when sources changed)."""
    src = PROJECT_ROOT / "spark_jobs" / "cdc_apply"
    dest_dir.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in src.rglob("*.py"))
    stamp = str(max((p.stat().st_mtime_ns for p in files), default=0))
    zpath = dest_dir / f"cdc_apply-{stamp}.zip"
    if not zpath.exists():
        tmp = zpath.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for p in files:
                z.write(p, p.relative_to(src.parent).as_posix())
        tmp.replace(zpath)
    return str(zpath)


def submit_settings() -> dict[str, Any]:
    """conf, jars and py-files for spark-submit, from the environment settings."""
    from cdc_apply.config import Settings
    from cdc_apply.spark_session import iceberg_conf

    settings = Settings.from_env()
    python = os.environ.get("CDC_PYSPARK_PYTHON", sys.executable)
    conf = {
        "spark.sql.shuffle.partitions": "8",
        # the driver JVM (and, on local[*], the executors): Spark's 1 GB default
        # runs out of heap on an hour of large archive files (see bench/README.md)
        "spark.driver.memory": os.environ.get("CDC_SPARK_DRIVER_MEMORY", "3g"),
        "spark.driver.extraJavaOptions": DRIVER_JAVA_OPTIONS,
        "spark.ui.showConsoleProgress": "false",
        "spark.pyspark.python": python,
        "spark.pyspark.driver.python": python,
        **iceberg_conf(settings),
    }
    return {
        "conf": conf,
        "jars": ",".join(str(p) for p in settings.jar_paths()),
        "py_files": build_code_zip(settings.home / "dist"),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("CDC_", "AWS_"))},
    }


class CdcSparkSubmitOperator(SparkSubmitOperator):
    """SparkSubmitOperator that ships the project's code and jars, then reads
    the job's result file (the batch's, or one table's with ``table``) to
    tell a terminal failure (data / configuration: no retry) from others."""

    template_fields = tuple(SparkSubmitOperator.template_fields) + ("result_file", "table", "pending_files")

    def __init__(self, *, result_file: str | None = None, table: str | None = None, pending_files: Any = None, **kwargs: Any) -> None:
        """``pending_files``: how many files discovery found; 0 writes a nothing-to-do
        result without starting Spark (an hour with no new files costs no JVM)."""
        super().__init__(**kwargs)
        self.result_file = result_file
        self.table = table
        self.pending_files = pending_files

    def execute(self, context: Any) -> Any:
        if self.pending_files is not None and int(self.pending_files) == 0 and self.result_file:
            from cdc_apply.results import BatchResult, save_result

            source = context["params"].get("source", "")
            save_result(self.result_file, BatchResult(batch_id=None, source=source, status="nothing-to-do", message="no pending files"))
            self.log.info("no pending files for source %s: nothing to submit", source)
            return {"batch_id": None, "status": "nothing-to-do", "messages": {}, "tables": []}
        s = submit_settings()
        self.conf = {**s["conf"], **(self.conf or {})}
        self.jars = s["jars"]
        self.py_files = s["py_files"]
        self.env_vars = {**s["env"], **(self.env_vars or {})}
        try:
            super().execute(context)
        except Exception as exc:
            result = self._result()
            if result and result.get("status") == "failed" and _terminal(result):
                raise AirflowFailException(f"terminal failure, not retried: {result.get('message')}") from exc
            raise
        result = self._result() or {}
        self.log.info("CDC result: %s", json.dumps(result, default=str)[:20000])
        if self.table:
            return {k: result.get(k) for k in ("table", "status", "counts", "failed_expectations", "data_docs", "override")}
        return {k: result.get(k) for k in ("batch_id", "status", "messages")} | {
            "tables": [{k: t.get(k) for k in ("table", "status", "counts", "snapshot_id", "data_docs")} for t in result.get("tables", [])]
        }

    def _result(self) -> dict[str, Any] | None:
        if not self.result_file:
            return None
        if self.table:
            from cdc_apply.results import table_result_path

            p = table_result_path(self.result_file, self.table)
        else:
            p = Path(self.result_file)
        return json.loads(p.read_text()) if p.is_file() else None


def _terminal(result: dict[str, Any]) -> bool:
    if "tables" not in result:  # one table's result
        return bool(result.get("terminal", True))
    tables = [t for t in result.get("tables", []) if t.get("status") == "failed"]
    return all(t.get("terminal", True) for t in tables)
