"""cdc_maintenance — Iceberg table maintenance per source, daily unless
``CDC_MAINTENANCE_SCHEDULE`` says otherwise (a cron expression or preset).

Compacts small files, rewrites position deletes, expires snapshots older than
the retention, removes orphan files and purges old tombstones, with Iceberg's
own Spark procedures (spark_jobs/cdc_apply/maintenance.py).  Per table it
holds the branch `cdc_maintenance` while it works: a table with an open audit
branch (cdc_apply between write and publish) is skipped, and a batch that
starts meanwhile waits (its write is retried), so maintenance and cdc_apply
never commit to the same table at once.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG, Param

from cdc_airflow.form import source_param
from cdc_airflow.spark import APPLICATION, CdcSparkSubmitOperator

with DAG(
    dag_id="cdc_maintenance",
    schedule=os.environ.get("CDC_MAINTENANCE_SCHEDULE") or "@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": pendulum.duration(minutes=5)},
    params={
        "source": source_param(os.environ.get("CDC_DEFAULT_SOURCE", "pg_inventory")),
        "snapshot_retention_days": Param(7, type="number", minimum=0),
        "tombstone_retention_days": Param(7, type="number", minimum=0),
    },
    tags=["cdc"],
    doc_md=__doc__,
) as dag:
    CdcSparkSubmitOperator(
        task_id="maintain",
        conn_id="spark_default",
        application=APPLICATION,
        name="cdc_maintain_{{ params.source }}",
        application_args=[
            "maintain",
            "--source",
            "{{ params.source }}",
            "--snapshot-retention-days",
            "{{ params.snapshot_retention_days }}",
            "--tombstone-retention-days",
            "{{ params.tombstone_retention_days }}",
        ],
    )
