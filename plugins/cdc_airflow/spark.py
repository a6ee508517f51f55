"""Spark submission for the CDC job.

The job's code ships as a zip (``--py-files``) and its jars via ``--jars``,
so it runs unchanged on ``local[*]`` or a standalone cluster: only the
``spark_default`` connection changes.  A connection of type
``spark_connect`` runs the same job in the task's process against a
long-lived Spark Connect server (``cdc connect-server``) instead, which
saves each task a driver JVM's start; so does a ``spark`` connection on a
local master (the embedded default), against this home's warm driver,
started on first use (CDC_WARM_DRIVER_IDLE_SECONDS=0: spark-submit).  A
terminal failure of the job (exit code 2: data or configuration) fails the
task *without retry*.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

PROJECT_ROOT = Path(__file__).resolve().parents[2]
APPLICATION = str(PROJECT_ROOT / "spark_jobs" / "apply_batch.py")


class CdcSparkSubmitOperator(SparkSubmitOperator):
    """SparkSubmitOperator that ships the project's code and jars, then reads
    the job's result file (the batch's, or one table's with ``table``) to
    tell a terminal failure (data / configuration: no retry) from others."""

    template_fields = tuple(SparkSubmitOperator.template_fields) + ("result_file", "table", "pending_files")

    def __init__(self, *, result_file: str | None = None, table: str | None = None, pending_files: Any = None, **kwargs: Any) -> None:
        """``pending_files``: how many files the batch is about (discovery's
        ``pending``: new files, or held files gone from the archive); 0 writes a
        nothing-to-do result without starting Spark (an hour with no new files
        costs no JVM)."""
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
        if self._gate_ran_in_write_job(context):
            return self._report(context, self._result() or {})
        remote = self._spark_connect_url()
        try:
            if remote:
                self._run_on_spark_connect(remote)
            else:
                from cdc_apply.runtime.submit import submit_spec

                own_conf = dict(self.conf or {})
                spec = submit_spec(_settings(), os.environ).with_conf(own_conf)
                self.jars = ",".join(spec.jars)
                self.py_files = spec.py_files
                self.env_vars = {**spec.env, **(self.env_vars or {})}
                with spec.job_conf() as conf:  # the driver's class archive (cdc_apply/runtime/class_archive.py)
                    self.conf = conf
                    try:
                        super().execute(context)
                    finally:
                        self.conf = own_conf
        except Exception:
            result = self._result()
            if result and result.get("status") == "failed" and _terminal(result):
                # from None: the provider's error repeats the job's output (logged above) and hides the next step
                raise self._terminal_failure(context, result) from None
            raise
        return self._report(context, self._result() or {})

    def _gate_ran_in_write_job(self, context: Any) -> bool:
        """A table's validate task, first try: the write job ran the gate in
        its warm session (``--stage write+validate``), so its verdict is
        reported without starting Spark again.  A retry or a cleared task runs
        the gate again (a suite fixed meanwhile is read)."""
        if not (self.table and self.result_file and Path(self.result_file).is_file()):
            return False
        ti = context.get("ti")
        if ti is not None and int(getattr(ti, "try_number", 1) or 1) > 1:
            return False
        from cdc_apply.results import load_result, save_table_result

        tr = load_result(self.result_file).table(self.table)
        if tr.gate is None:
            return False
        save_table_result(self.result_file, tr)  # what this stage's job would have written
        self.log.info("the gate of %s ran in the write job: %s", self.table, tr.gate)
        return True

    def _terminal_failure(self, context: Any, result: dict[str, Any]) -> AirflowFailException:
        from cdc_airflow.guidance import next_steps

        steps = next_steps(context["params"].get("source", ""), result.get("batch_id"))
        self.log.error("terminal failure, not retried: %s", result.get("message"))
        self.log.error("%s", steps)
        return AirflowFailException(f"terminal failure, not retried: {result.get('message')}\n{steps}")

    def _report(self, context: Any, result: dict[str, Any]) -> Any:
        """The task's return value from the job's result (a table's failed
        gate verdict, reported without a job, fails the task terminally)."""
        if self.table and result.get("status") == "failed":
            if _terminal(result):
                raise self._terminal_failure(context, result)
            raise AirflowException(f"{self.table}: {result.get('message')}")
        self._log_result(result)
        if self.table:
            return {k: result.get(k) for k in ("table", "status", "counts", "failed_expectations", "data_docs", "override")}
        return {k: result.get(k) for k in ("batch_id", "status", "messages")} | {
            "tables": [{k: t.get(k) for k in ("table", "status", "counts", "snapshot_id", "data_docs")} for t in result.get("tables", [])]
        }

    def _get_hook(self):
        """The provider's hook, its spark-submit output logged at each line's level."""
        hook = super()._get_hook()
        hook._log = LevelByLine(hook.log)
        return hook

    def _log_result(self, result: dict[str, Any]) -> None:
        """A short human summary (the job printed its result JSON on one line)."""
        from cdc_airflow.guidance import summary, table_line

        if self.table:
            self.log.info("%s", table_line(result))
        elif result:
            self.log.info("%s", summary(result))
        if self._spark_connect_url():  # in-process: the job's own output is not in this log
            self.log.info("CDC result: %s", json.dumps(result, default=str, separators=(",", ":"))[:20000])

    def _spark_connect_url(self) -> str | None:
        """Where the job runs in this task's process as a Spark Connect client:
        the server of a ``spark_connect`` connection; ``local``, this home's
        warm driver (cdc_apply/runtime/warm_driver.py), for a ``spark``
        connection on a local master while CDC_WARM_DRIVER_IDLE_SECONDS is
        above 0 (the embedded default), unless the task has Spark conf of its
        own (the warm driver's is the project's); None: a spark-submit job."""
        from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection(self._conn_id)
        if conn.conn_type == SparkConnectHook.conn_type:
            return SparkConnectHook(self._conn_id).get_connection_url()
        if _local_master(conn.host) and not self.conf and _settings().warm_driver_idle_seconds > 0:
            return WARM_DRIVER
        return None

    def _run_on_spark_connect(self, url: str) -> None:
        """Run the job in this task's process as a client of the Spark Connect
        server: no JVM to start, the server's is warm.  Same arguments, exit
        codes and result file as the spark-submit job."""
        import dataclasses

        from airflow.sdk import BaseHook

        from cdc_apply.cli import main

        settings = dataclasses.replace(_settings(), spark_remote=url)
        if url == WARM_DRIVER:  # on the connection's master, as its spark-submit would be
            settings = dataclasses.replace(settings, spark_master=BaseHook.get_connection(self._conn_id).host)
            self.log.info("running %s on this home's warm driver (`cdc warm-driver status`)", " ".join(self.application_args))
        else:
            self.log.info("running %s on the Spark Connect server %s", " ".join(self.application_args), url.split(";")[0])
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


_LEVEL = re.compile(r"^(?:\S+ \S+|\d\d/\d\d/\d\d \d\d:\d\d:\d\d)[ ,.\d]* (DEBUG|INFO|WARN|WARNING|ERROR|CRITICAL|FATAL)\b")
"""the level of a job line: ours (``2026-01-01 03:00:00,123 WARNING name: ...``,
cdc_apply/runtime/logs.py) or log4j's (``26/01/01 03:00:00 WARN Class: ...``)"""
_LEVELS = {
    "DEBUG": "debug",
    "INFO": "info",
    "WARN": "warning",
    "WARNING": "warning",
    "ERROR": "error",
    "CRITICAL": "critical",
    "FATAL": "critical",
}
_CHATTER = re.compile(
    r"^(?:\d\d/\d\d/\d\d \d\d:\d\d:\d\d (?:INFO \w+|WARN (?:Utils: (?:Your hostname|Set SPARK_LOCAL_IP|Service 'SparkUI' could not bind)|NativeCodeLoader|SparkStringUtils: Truncated))"
    r"|WARNING: Using incubator modules|Using Spark's default log4j profile|Setting Spark log level to)"
)
"""Spark's start-up lines (before its log level applies) and its warnings that
ask nothing of an operator: DEBUG (CDC_LOG_VERBOSE=1 keeps them)"""


class LevelByLine:
    """The hook's logger, its ``info(line)`` sent at the level the line names:
    the job's ERROR and WARNING lines reach the task log (and the UI's level
    filter) as errors and warnings, not as INFO.  A traceback is an error,
    and so is what follows an error up to the next line with a level."""

    def __init__(self, inner: Any, verbose: bool | None = None) -> None:
        self._inner = inner
        self._level = "info"
        self._verbose = _verbose() if verbose is None else verbose

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        text = str(msg)
        m = _LEVEL.match(text) if not args else None
        if m:
            self._level = _LEVELS[m.group(1)]
        elif args or text.startswith("{"):  # the hook's own lines; the job's result JSON
            self._level = "info"
        elif text.startswith("Traceback"):
            self._level = "error"
        elif self._level == "warning" and not text.startswith(("at ", "File ", "Caused by", "...")):
            self._level = "info"
        level = "debug" if not args and not self._verbose and _CHATTER.match(text) else self._level
        getattr(self._inner, level)(msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


WARM_DRIVER = "local"
"""``CDC_SPARK_REMOTE``'s value for this home's warm driver (warm_driver.LOCAL)"""


def _local_master(host: str | None) -> bool:
    return (host or "").strip().startswith("local")


def _settings() -> Any:
    from cdc_apply.config import Settings

    return Settings.from_env()


def _verbose() -> bool:
    return bool(_settings().log_verbose)


def _terminal(result: dict[str, Any]) -> bool:
    if "tables" not in result:  # one table's result
        return bool(result.get("terminal", True))
    tables = [t for t in result.get("tables", []) if t.get("status") == "failed"]
    return all(t.get("terminal", True) for t in tables)
