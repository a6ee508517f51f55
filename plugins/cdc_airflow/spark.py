"""Spark submission for the CDC job.

The job's code ships as a zip (``--py-files``) and its jars via ``--jars``,
so it runs unchanged on ``local[*]`` or a standalone cluster: only the
``spark_default`` connection changes.  A connection of type
``spark_connect`` runs the same job in the task's process against a
long-lived Spark Connect server (``cdc connect-server``) instead, which
saves each task a driver JVM's start.  A terminal failure of the job (exit
code 2: data or configuration) fails the task *without retry*.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk.exceptions import AirflowFailException

PROJECT_ROOT = Path(__file__).resolve().parents[2]
APPLICATION = str(PROJECT_ROOT / "spark_jobs" / "apply_batch.py")


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
        remote = self._spark_connect_url()
        try:
            if remote:
                self._run_on_spark_connect(remote)
            else:
                from cdc_apply.config import Settings
                from cdc_apply.runtime.submit import submit_spec

                own_conf = dict(self.conf or {})
                spec = submit_spec(Settings.from_env(), os.environ).with_conf(own_conf)
                self.jars = ",".join(spec.jars)
                self.py_files = spec.py_files
                self.env_vars = {**spec.env, **(self.env_vars or {})}
                with spec.job_conf() as conf:  # the driver's class archive (cdc_apply/runtime/class_archive.py)
                    self.conf = conf
                    try:
                        super().execute(context)
                    finally:
                        self.conf = own_conf
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

    def _spark_connect_url(self) -> str | None:
        """The Spark Connect server's URL when the connection is of type
        ``spark_connect`` (a long-lived driver), else None (spark-submit)."""
        from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
        from airflow.sdk import BaseHook

        if BaseHook.get_connection(self._conn_id).conn_type != SparkConnectHook.conn_type:
            return None
        return SparkConnectHook(self._conn_id).get_connection_url()

    def _run_on_spark_connect(self, url: str) -> None:
        """Run the job in this task's process as a client of the Spark Connect
        server: no JVM to start, the server's is warm.  Same arguments, exit
        codes and result file as the spark-submit job."""
        import dataclasses

        from airflow.sdk.exceptions import AirflowException

        from cdc_apply.cli import main
        from cdc_apply.config import Settings

        self.log.info("running %s on the Spark Connect server %s", " ".join(self.application_args), url.split(";")[0])
        settings = dataclasses.replace(Settings.from_env(), spark_remote=url)
        code = main([str(a) for a in self.application_args], settings)  # releases its session on the server
        if code != 0:
            raise AirflowException(f"the CDC job exited {code} on the Spark Connect server")

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
