"""cdc_apply — apply archived change files to Iceberg, hourly.

turn (wait while another run applies the source: a backfill beside the hourly
runs, a manual trigger) -> discover (files of the interval not yet applied) -> apply (Spark: decode once,
order, compact, MERGE onto an audit branch per table, then the gate — Great
Expectations + CDC reconciliation on each branch — in the same warm session) ->
per table, mapped: validate (reports the table's gate verdict; a retry or a
cleared task runs the gate again in its own Spark job) -> publish (fast-forward
main, emit the table's Asset) -> finish (ledger) -> report.  A data failure fails its task without retry, and only its table;
main is untouched until publish.  Orchestration only: the work lives in
spark_jobs/cdc_apply and plugins/cdc_airflow.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG, Param, task, task_group

from cdc_airflow.assets import TABLES_ALIAS
from cdc_airflow.form import source_param
from cdc_airflow.spark import APPLICATION, CdcSparkSubmitOperator

with DAG(
    dag_id="cdc_apply",
    schedule="@hourly",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": pendulum.duration(minutes=1)},
    params={
        "source": source_param(os.environ.get("CDC_DEFAULT_SOURCE", "pg_inventory")),
        "table_filter": Param(".*", type="string", description="regular expression on source table names (.*: all)"),
        "max_files": Param(0, type="integer", minimum=0, description="apply at most this many files (0: all pending)"),
        "dry_run": Param(False, type="boolean", description="decode and count only; write nothing"),
        "override": Param(
            "none",
            enum=["none", "force", "skip"],
            description="for a batch that fails its gate: force = publish despite the failed checks; skip = mark its files applied without applying them",
        ),
        "override_reason": Param(None, type=["null", "string"], description="why (required with force or skip; recorded in the ledger)"),
    },
    tags=["cdc"],
    doc_md=__doc__,
) as dag:

    @task.sensor(poke_interval=20, timeout=6 * 3600, mode="reschedule")
    def turn(params=None, dag_run=None, ti=None):
        """One run applies a source at a time (cdc_airflow/lease.py); waits without holding a worker slot.
        Retried like any task (a try the executor loses must not fail the run); its timeout is not retried."""
        from cdc_airflow.tasks import take_turn

        return take_turn(params["source"], dag_run.dag_id, dag_run.run_id, ti)

    @task(multiple_outputs=True)  # a configuration error raises AirflowFailException: not retried
    def discover(params=None, data_interval_end=None, dag_run=None, ti=None):
        from airflow.sdk.exceptions import AirflowFailException

        from cdc_airflow.tasks import discover as _discover

        manual = dag_run is not None and str(dag_run.run_type).endswith("manual")
        try:
            return _discover(
                params["source"],
                None if manual else data_interval_end,
                dag_run.run_id,
                params["max_files"] or None,
                table_filter=params["table_filter"],
                dry_run=params["dry_run"],
                override=params["override"],
                override_reason=params["override_reason"],
                operator=getattr(dag_run, "triggering_user_name", None),
            )
        except AirflowFailException as exc:
            ti.xcom_push(key="error", value=str(exc))  # for the run note (cdc_airflow/notes.py)
            raise

    found = discover()
    turn() >> found

    apply = CdcSparkSubmitOperator(
        task_id="apply",
        conn_id="spark_default",
        application=APPLICATION,
        name="cdc_apply_{{ params.source }}",
        application_args=found["write_args"],
        result_file=found["result_file"],
        pending_files=found["pending"],
    )

    @task
    def tables(result_file):
        from cdc_airflow.tasks import written_tables

        return written_tables(result_file)

    @task_group(group_id="table")
    def gate(table):
        validate = CdcSparkSubmitOperator(
            task_id="validate",
            conn_id="spark_default",
            application=APPLICATION,
            name="cdc_validate_{{ params.source }}",
            application_args=["apply", "--stage", "validate", "--result-file", found["result_file"], "--table", table],
            result_file=found["result_file"],
            table=table,
        )

        @task(outlets=[TABLES_ALIAS])
        def publish(result_file, table, outlet_events=None):
            from cdc_airflow.tasks import publish_table

            return publish_table(result_file, table, outlet_events)

        validate >> publish(found["result_file"], table)

    @task(trigger_rule="all_done", retries=1)
    def finish(result_file):
        from cdc_airflow.tasks import finish as _finish

        return _finish(result_file)

    @task(trigger_rule="all_done")
    def report(params=None, dag_run=None, ti=None):
        """Summarises every run, a failed one too (with the next step), and gives the source's turn back."""
        from cdc_airflow.tasks import release_turn
        from cdc_airflow.tasks import report as _report

        try:
            _report(ti.xcom_pull(task_ids="discover"))
        finally:
            release_turn(params["source"], dag_run.dag_id, dag_run.run_id)

    written = tables(found["result_file"])
    apply >> written
    finished = finish(found["result_file"])
    gate.expand(table=written) >> finished
    apply >> finished
    finished >> report()
